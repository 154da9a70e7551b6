"""Bounds on what reading user input may cost, shared by every parser of it.

A recipe, a task file, a calibration file, a model's config.json, chat template and tokenizer, a checkpoint's
qtk.json: each is data anyone can hand qtk, and a few hundred bytes of it can ask for unbounded memory or time (YAML
aliases that expand a billion-fold, JSON nested past the parser's stack, a regex that backtracks exponentially, a
template that multiplies a string by three billion or nests three loops of 100k). Every parser goes through the
helpers here, so such input ends in one line instead of a MemoryError traceback or a hang:

- files: `read_text` / `check_size` refuse a file over the size its kind needs, before reading it;
- JSON: `parse_json` reports nesting the parser cannot follow as a ValueError (the json module raises
  RecursionError);
- YAML: `load_yaml` counts the nodes a document expands to through its aliases and refuses more than
  MAX_YAML_NODES (or an alias that contains itself) before anything is built from it;
- regular expressions: `pattern_problem` refuses a repetition of something that can itself match in several ways
  (`(a+)+`, `(a|b)*`: exponential backtracking); `fullmatch` / `search` match with the `regex` engine under a time
  budget (REGEX_BUDGET_S) and refuse a pattern that exceeds it;
- str.format templates: `format_problem` refuses field widths beyond MAX_FIELD_WIDTH and widths taken from the data;
- Jinja chat templates: `ChatTemplateRenderer` renders in transformers' sandbox with a budget of steps (loop
  iterations and calls) and of characters produced (every string, list or number an operation makes is charged
  before it is made), so neither nested loops nor string multiplication can run away.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any

from qtk.errors import UsageError

MAX_YAML_BYTES = 1 << 20  # recipes and task files are a few KB; the built-in recipes < 2 KB
MAX_YAML_NODES = 100_000  # values a YAML document may hold once its aliases are expanded
MAX_FIELD_WIDTH = 1 << 16  # widths and precisions in format specs, numeric arguments of padding filters
MAX_PATTERN_CHARS = 4096
REGEX_BUDGET_S = 1.0  # per match; module names are short and task answers a few hundred characters


class BudgetExceeded(Exception):
    """A chat template's render went past its budget (the message says which)."""


def _mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


# ---- files ----

def check_size(path, limit: int, what: str, fix: str) -> int:
    """The size of `path`, refused (UsageError) above `limit` bytes; `what` names the file in the message."""
    import os

    size = os.stat(path).st_size
    if size > limit:
        raise UsageError(f"{what} is {size:,} bytes, more than the {_mib(limit)} qtk reads for it", fix)
    return size


def read_text(path, limit: int, what: str, fix: str) -> str:
    """The UTF-8 text of `path`, refused above `limit` bytes (checked before reading, and again while reading: a
    file that grows meanwhile is not read past it). UnicodeDecodeError is the caller's to report."""
    check_size(path, limit, what, fix)
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UsageError(f"{what} is more than the {_mib(limit)} qtk reads for it", fix)
    return data.decode("utf-8")


# ---- JSON ----

class JSONTooDeep(ValueError):
    pass


def parse_json(data: str | bytes) -> Any:
    """json.loads, where nesting deeper than the parser's stack (the json module's RecursionError) is a ValueError
    like every other way JSON can be bad (JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise JSONTooDeep("nested deeper than the JSON parser follows") from None


# ---- YAML ----

def _children(node) -> list:
    import yaml

    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [x for pair in node.value for x in pair]
    return []


def yaml_expansion_problem(root, limit: int = MAX_YAML_NODES) -> str | None:
    """Why the composed YAML node graph `root` is too large once its aliases are expanded, or None. Each node is
    counted as often as aliases reach it (memoised per node, so the count costs the nodes that are there, not the
    expansion); an alias inside its own anchor has no expansion at all."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        k = id(node)
        if done:
            on_path.discard(k)
            total = 1 + sum(sizes[id(c)] for c in _children(node))
            if total > limit:
                return f"its aliases (&anchor, *alias) expand to more than {limit:,} values"
            sizes[k] = total
            continue
        if k in sizes:
            continue
        if k in on_path:
            return "an alias (*alias) refers to a value that contains it"
        on_path.add(k)
        stack.append((node, True))
        stack.extend((c, False) for c in _children(node) if id(c) not in sizes)
    return None


def load_yaml(text: str, where: str, loader=None, limit: int = MAX_YAML_NODES) -> Any:
    """The YAML document in `text`, read with yaml.SafeLoader (or `loader`, a subclass of it) after its alias
    expansion is checked (UsageError naming `where`). Syntax errors stay yaml.YAMLError, for the caller to report."""
    import yaml

    class Bounded(loader or yaml.SafeLoader):
        def construct_document(self, node):
            problem = yaml_expansion_problem(node, limit)
            if problem:
                raise UsageError(f"{where}: {problem}", "write the values out instead of repeating aliases")
            return super().construct_document(node)

    try:
        return yaml.load(text, Loader=Bounded)
    except RecursionError:
        raise UsageError(f"{where}: nested deeper than the YAML parser follows", "flatten the document") from None


# ---- regular expressions ----

def _parser():
    try:
        from re import _parser as p  # Python 3.11+
    except ImportError:  # pragma: no cover (3.10)
        import sre_parse as p
    return p


def _repeats(c) -> tuple:
    return tuple(x for x in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)) if x is not None)


def _sub_patterns(c, op, av) -> list:
    """The sub-patterns one parsed node holds (a repetition's body, a group's, an assertion's, each branch)."""
    if op in _repeats(c):
        return [av[2]]
    if op is c.BRANCH:
        return list(av[1])
    if op is c.SUBPATTERN:
        return [av[-1]]
    if op == getattr(c, "ATOMIC_GROUP", None):
        return [av]
    if op in (c.ASSERT, c.ASSERT_NOT):
        return [av[1]]
    if op is c.GROUPREF_EXISTS:
        return [av[1]] + ([av[2]] if av[2] is not None else [])
    return []


def _variable(p) -> bool:
    """Whether the parsed (sub)pattern `p` holds a repetition of variable count or an alternation: something that can
    match the same text in more than one way."""
    c = _parser()
    for op, av in p:
        if op is c.BRANCH or (op in _repeats(c) and av[0] != av[1]):
            return True
        if any(_variable(sub) for sub in _sub_patterns(c, op, av)):
            return True
    return False


def _nested(p) -> bool:
    """Whether `p` repeats (a variable number of times) something that is itself variable: the shape of
    exponential backtracking ('(a+)+', '(a|aa)*', '((\\w|\\.)+)+')."""
    c = _parser()
    for op, av in p:
        if op in _repeats(c):
            lo, hi, sub = av
            if hi > 1 and lo != hi and _variable(sub):
                return True
        if any(_nested(sub) for sub in _sub_patterns(c, op, av)):
            return True
    return False


def pattern_problem(pattern: str) -> str | None:
    """Why a (re-valid) regular expression is refused, or None: longer than MAX_PATTERN_CHARS, or a repetition of
    something that can itself match in several ways, whose backtracking on a near miss is exponential in the length
    of the text (the shape of 're:((\\w|\\.)+)+Z', which never finishes on a module name it does not match)."""
    if len(pattern) > MAX_PATTERN_CHARS:
        return f"it is {len(pattern):,} characters long (at most {MAX_PATTERN_CHARS:,})"
    try:
        parsed = _parser().parse(pattern)
    except Exception:  # re.compile reports it (the callers compile first)
        return None
    if _nested(parsed):
        return ("it repeats a group that can itself match in several ways (a quantifier or '|' inside a repeated "
                "group, as in '(a+)+' or '(a|b)*'), which backtracks exponentially on names it does not match")
    return None


def _variable_repeats(p) -> int:
    """How many repetitions of variable count the parsed pattern holds (each multiplies the ways to split a text)."""
    c = _parser()
    n = 0
    for op, av in p:
        subs = []
        if op in _repeats(c):
            n += av[0] != av[1]
            subs = [av[2]]
        elif op is c.BRANCH:
            subs = av[1]
        elif op is c.SUBPATTERN:
            subs = [av[-1]]
        elif op == getattr(c, "ATOMIC_GROUP", None):
            subs = [av]
        elif op in (c.ASSERT, c.ASSERT_NOT):
            subs = [av[1]]
        elif op is c.GROUPREF_EXISTS:
            subs = [x for x in av[1:] if x is not None]
        n += sum(_variable_repeats(x) for x in subs)
    return n


@lru_cache(maxsize=1024)
def _engine(pattern: str):
    """(compiled pattern, whether it needs the time budget). A pattern without nested repetition and with at most
    three variable repetitions matches a module name in polynomial time of low degree: Python's re, at its speed.
    Any other goes to the `regex` engine (re's syntax and semantics, VERSION0), whose matches can be given a
    timeout."""
    import re

    try:
        if pattern_problem(pattern) is None and _variable_repeats(_parser().parse(pattern)) <= 3:
            return re.compile(pattern), False
    except Exception:
        pass  # re refuses it: regex reports it below, or re does at the match
    import regex

    try:
        return regex.compile(pattern, regex.VERSION0), True
    except (regex.error, OverflowError, RecursionError, ValueError):
        return re.compile(pattern), False  # re accepts what regex does not: the static check is the only bound


def _timed(pattern: str, text: str, how: str):
    rx, timed = _engine(pattern)
    if not timed:
        return getattr(rx, how)(text)
    try:
        return getattr(rx, how)(text, timeout=REGEX_BUDGET_S)
    except TimeoutError:
        shown = text if len(text) <= 80 else text[:77] + "..."
        raise UsageError(f"regular expression {pattern!r} takes more than {REGEX_BUDGET_S:g} s to match {shown!r} "
                         "(catastrophic backtracking)",
                         "simplify the pattern: no repetition of something that can itself match in several ways") from None


def fullmatch(pattern: str, text: str):
    """regex.fullmatch (re's semantics, VERSION0) under REGEX_BUDGET_S; UsageError past it."""
    return _timed(pattern, text, "fullmatch")


def match(pattern: str, text: str):
    """regex.match (anchored at the start, as compressed-tensors and GPTQ's dynamic rules match) under the budget."""
    return _timed(pattern, text, "match")


def search(pattern: str, text: str):
    """regex.search under the budget."""
    return _timed(pattern, text, "search")


# ---- str.format templates ----

def _spec_problem(spec: str) -> str | None:
    if "{" in spec:
        return f"the format spec {spec!r} takes a width or precision from the data"
    for digits in _digit_runs(spec):
        if int(digits) > MAX_FIELD_WIDTH:
            return f"the format spec {spec!r} asks for a field of {int(digits):,} characters (at most {MAX_FIELD_WIDTH:,})"
    return None


def _digit_runs(s: str) -> list[str]:
    import re

    return re.findall(r"\d+", s)


def format_problem(template: str) -> str | None:
    """Why a str.format template is refused, or None: a format spec whose width or precision exceeds MAX_FIELD_WIDTH
    ('{prompt:>1500000000}' asks for 1.5 GB per row), or one taken from the data ('{prompt:>{n}}')."""
    from string import Formatter

    try:
        parts = list(Formatter().parse(template))
    except ValueError:
        return None  # malformed: str.format reports it where the template is filled
    for _, field, spec, _ in parts:
        if field is not None and spec:
            problem = _spec_problem(spec)
            if problem:
                return problem
    return None


def percent_problem(fmt: str, args) -> str | None:
    """Why a printf-style ('%') format would be too large: a width or precision beyond MAX_FIELD_WIDTH, given in the
    format or as a '*' argument."""
    import re

    for m in re.finditer(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?", fmt):
        for g in m.groups():
            if g and g != "*" and int(g) > MAX_FIELD_WIDTH:
                return f"the format {fmt[:40]!r} asks for a field of {int(g):,} characters"
    values = args if isinstance(args, tuple) else (args,)
    if "*" in fmt and any(isinstance(v, int) and abs(v) > MAX_FIELD_WIDTH for v in values):
        return f"the format {fmt[:40]!r} takes a field width over {MAX_FIELD_WIDTH:,} from its arguments"
    return None


# ---- Jinja chat templates ----

MAX_TEMPLATE_CHARS = 1 << 20  # chat templates are a few KB to a few tens of KB
TEMPLATE_STEPS = 200_000  # loop iterations and calls in one render (a real template takes a few thousand)
TEMPLATE_CHARS_FLOOR = 16 << 20  # characters one render may produce, at the least
TEMPLATE_CHARS_PER_INPUT = 16  # ... and per character of its input (messages and special tokens)
MAX_INT_BITS = 4096

# methods of str whose result can be far larger than the string: their numeric arguments are bounded
_PADDING = {"center", "ljust", "rjust", "zfill", "expandtabs"}


def _size(x) -> int:
    """What a value costs to hold, in characters (bytes for numbers)."""
    if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(x)
    if isinstance(x, int) and not isinstance(x, bool):
        return x.bit_length() // 8 + 1
    return 1


class _Budget:
    def __init__(self, steps: int, chars: int):
        self.steps, self.chars = steps, chars
        self.total_steps, self.total_chars = steps, chars

    def step(self, n: int = 1) -> None:
        self.steps -= n
        if self.steps < 0:
            raise BudgetExceeded(f"it takes more than {self.total_steps:,} steps (loop iterations and calls)")

    def need(self, n: int) -> None:
        """Refuse, before it is made, a value of n characters that the budget cannot pay for."""
        if n > self.chars:
            raise BudgetExceeded(f"it produces more than {self.total_chars:,} characters")

    def charge(self, n: int) -> None:
        self.need(n)
        self.chars -= n

    def numbers(self, values, what: str) -> None:
        for v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not abs(v) <= MAX_FIELD_WIDTH:
                raise BudgetExceeded(f"{what} is given {str(v)[:24]}, more than {MAX_FIELD_WIDTH:,}")

    def binop(self, op: str, a, b) -> None:
        """Refuse `a op b` when what it would make is past the budget (checked before it is made)."""
        seq = (str, bytes, list, tuple)
        if op == "*":
            if isinstance(a, int) and isinstance(b, seq):
                a, b = b, a
            if isinstance(a, seq) and isinstance(b, int):
                self.need(len(a) * max(b, 0))
            elif isinstance(a, int) and isinstance(b, int):
                _bits(a.bit_length() + b.bit_length())
        elif op == "**":
            if isinstance(a, int) and isinstance(b, int) and b > 0 and abs(a) > 1:
                _bits(a.bit_length() * b)
        elif op == "+" and isinstance(a, seq) and isinstance(b, seq):
            self.need(len(a) + len(b))
        elif op == "%" and isinstance(a, str):
            problem = percent_problem(a, b)
            if problem:
                raise BudgetExceeded(problem)

    def call(self, fn, args, kwargs) -> None:
        """Refuse a call from the template whose result would be past the budget: padding methods of str by their
        widths, str.replace and str.join by the size of their result."""
        owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
        if not isinstance(owner, str):
            return
        if name in _PADDING:
            self.numbers((*args, *kwargs.values()), f"str.{name}")
        elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
            self.need(_replaced_size(owner, *args[:3]))
        elif name == "join" and args and isinstance(args[0], (list, tuple)):
            self.need(sum(_size(x) for x in args[0]) + len(owner) * len(args[0]))


def _bits(n: int) -> None:
    """Refuse an integer of more than MAX_INT_BITS: arithmetic on huge integers is slow long before they are large
    (a loop squaring a number never reaches the character budget in reasonable time), and no template needs one."""
    if n > MAX_INT_BITS:
        raise BudgetExceeded(f"it computes an integer of more than {MAX_INT_BITS:,} bits")


def _replaced_size(s: str, old: str, new: str, count=-1) -> int:
    n = s.count(old) if old else len(s) + 1
    if isinstance(count, int) and count >= 0:
        n = min(n, count)
    return len(s) + n * max(len(new) - len(old), 0)


# filters whose result grows with a numeric argument (a width, a count of pieces, an indent)
_GROWING_FILTERS = {"center", "indent", "wordwrap", "batch", "slice", "tojson", "truncate"}


def _bounded_filter(name: str, f, budget_of):
    from functools import wraps

    from jinja2.utils import _PassArg

    skip = 1 if _PassArg.from_obj(f) is not None else 0  # the context / eval context / environment comes first

    @wraps(f)
    def bounded(*args, **kwargs):
        budget = budget_of()
        budget.step()
        value, rest = (args[skip], args[skip + 1:]) if len(args) > skip else (None, ())
        if name in _GROWING_FILTERS:
            budget.numbers((*rest, *kwargs.values()), f"the {name} filter")
        elif name == "replace" and isinstance(value, str) and len(rest) >= 2 and all(isinstance(x, str) for x in rest[:2]):
            budget.need(_replaced_size(value, *rest[:3]))
        elif name == "join" and isinstance(value, (list, tuple)):
            budget.need(sum(_size(x) for x in value))
        elif name == "format" and isinstance(value, str):
            problem = percent_problem(value, tuple(rest)) or format_problem(value)
            if problem:
                raise BudgetExceeded(problem)
        rv = f(*args, **kwargs)
        budget.charge(_size(rv) if isinstance(rv, (str, list, tuple)) else 1)
        return rv

    return bounded


class ChatTemplateRenderer:
    """Renders a chat template as transformers' apply_chat_template(conversation, tokenize=False) does (its sandbox:
    jinja2's ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, loop controls, the {% generation %}
    tag, its tojson filter and raise_exception / strftime_now / dict / namespace globals; messages without their
    None-valued keys and with the reasoning field under each of its names; the tokenizer's special tokens as
    variables), with a budget: TEMPLATE_STEPS loop iterations and calls, and characters produced in proportion to
    the input. Every loop's items and every call count as steps; every output, concatenation, multiplication,
    filter and method result is charged before (where its size is known beforehand) or as it is made."""

    def __init__(self, template: str):
        if not isinstance(template, str):
            raise BudgetExceeded("it is not text")
        if len(template) > MAX_TEMPLATE_CHARS:
            raise BudgetExceeded(f"it is {len(template):,} characters long (at most {MAX_TEMPLATE_CHARS:,})")
        self.budget = _Budget(TEMPLATE_STEPS, TEMPLATE_CHARS_FLOOR)
        self.env = _environment(lambda: self.budget)
        self.template = self.env.from_string(_bounded_tree(self.env, template))

    def render(self, messages: list, variables: dict) -> str:
        inputs = sum(len(json.dumps(m, default=str)) for m in messages) + len(json.dumps(variables, default=str))
        self.budget = _Budget(TEMPLATE_STEPS, max(TEMPLATE_CHARS_FLOOR, TEMPLATE_CHARS_PER_INPUT * inputs))
        chat = [_aliased({k: v for k, v in m.items() if v is not None}) if isinstance(m, dict) else m for m in messages]
        out = []
        try:
            for piece in self.template.generate(**variables, messages=chat, tools=None, documents=None,
                                                add_generation_prompt=False):
                out.append(piece)
        except RecursionError:
            raise BudgetExceeded("it recurses deeper than Python's stack") from None
        except MemoryError:
            raise BudgetExceeded("it ran out of memory") from None
        return "".join(out)


_REASONING = ("reasoning_content", "thinking", "reasoning")  # transformers' _REASONING_FIELDS


def _aliased(message: dict) -> dict:
    """transformers' _alias_reasoning_fields: a message's reasoning under 'thinking' and 'reasoning_content' too."""
    reasoning = next((message[k] for k in _REASONING if message.get(k) is not None), None)
    if reasoning is not None:
        return {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _environment(budget_of):
    import json as _json
    from datetime import datetime

    import jinja2
    import jinja2.ext
    from jinja2 import nodes
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' {% generation %}...{% endgeneration %} (it marks the assistant's tokens): renders its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Sandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset(["*", "**", "+", "%"])

        def call_binop(self, context, operator, left, right):
            budget = budget_of()
            budget.binop(operator, left, right)
            rv = super().call_binop(context, operator, left, right)
            budget.charge(_size(rv))
            return rv

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja2's own signature)
            budget = budget_of()
            budget.step()
            budget.call(__obj, args, kwargs)
            rv = super().call(__context, __obj, *args, **kwargs)
            budget.charge(_size(rv))
            return rv

        def wrap_str_format(self, value):
            fn = super().wrap_str_format(value)
            if fn is None:
                return None
            problem = format_problem(value.__self__)
            if problem:
                raise BudgetExceeded(problem)

            def bounded(*args, **kwargs):
                rv = fn(*args, **kwargs)
                budget_of().charge(len(rv))
                return rv

            return bounded

        # called from the rewritten tree (_bounded_tree): not reachable by name from a template
        def qtk_loop(self, iterable):
            budget = budget_of()
            for item in iterable:
                budget.step()
                yield item

        def qtk_out(self, value):
            budget_of().charge(_size(value) if isinstance(value, str) else len(str(value)))
            return value

        def qtk_concat(self, *parts):
            texts = [str(p) for p in parts]
            budget_of().charge(sum(len(t) for t in texts))
            return "".join(texts)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return _json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")

    env = Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(name, f, budget_of) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


def _bounded_tree(env, source: str):
    """The template's syntax tree with every loop's iterable, every output and every '~' concatenation routed
    through the sandbox's counters (environment attributes, which no template can name or rebind)."""
    from jinja2 import nodes

    tree = env.parse(source)

    def through(name: str, node, *args):
        call = nodes.Call(nodes.EnvironmentAttribute(f"qtk_{name}"), list(args), [], None, None)
        return call.set_lineno(node.lineno) if node.lineno is not None else call

    def rewrite(node):
        for field in node.fields:
            value = getattr(node, field, None)
            if isinstance(value, list):
                setattr(node, field, [rewrite(v) if isinstance(v, nodes.Node) else v for v in value])
            elif isinstance(value, nodes.Node):
                setattr(node, field, rewrite(value))
        if isinstance(node, nodes.For):
            node.iter = through("loop", node, node.iter)
        elif isinstance(node, nodes.Output):
            node.nodes = [through("out", n, n) for n in node.nodes]
        elif isinstance(node, nodes.Concat):
            return through("concat", node, *node.nodes)
        return node

    return rewrite(tree)


def bounded_lines(f, max_bytes: int, too_long):
    """(byte offset, line number, line) of each line of a binary file, refusing a line longer than max_bytes before
    it is read whole: too_long(line number) is the UsageError raised."""
    offset, n = 0, 0
    while line := f.readline(max_bytes + 1):
        n += 1
        if len(line) > max_bytes:
            raise too_long(n)
        yield offset, n, line
        offset += len(line)
