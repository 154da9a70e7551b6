"""qtk.bounds, the limits every parser of user input goes through: YAML alias expansion, JSON nesting, regular
expressions (nested repetition refused, a time budget per match), str.format widths, and the chat-template sandbox
(the same text as transformers' apply_chat_template, within a budget of steps and characters). The commands that use
them are tested end to end in tests/test_bad_inputs.py and tests/test_hardening.py."""

from __future__ import annotations

import time

import pytest
import yaml

from qtk import bounds
from qtk.errors import UsageError


def tower(levels: int, width: int = 9) -> str:
    towers = ["&a0 [" + ",".join(["x"] * width) + "]"]
    towers += [f"&a{k} [" + ",".join([f"*a{k - 1}"] * width) + "]" for k in range(1, levels)]
    return "[" + ", ".join(towers) + "]"


# ---- YAML ----

def test_yaml_aliases_are_counted_as_expanded():
    assert bounds.load_yaml("a: &x [1, 2]\nb: *x\n", "doc") == {"a": [1, 2], "b": [1, 2]}  # aliases still work
    assert len(bounds.load_yaml(tower(4), "doc")) == 4  # 9**4 = 6561 values: fine
    started = time.perf_counter()
    with pytest.raises(UsageError, match="expand to more than 100,000 values"):
        bounds.load_yaml(tower(30), "doc")  # 9**30 values, counted in the time the few nodes take
    assert time.perf_counter() - started < 1


def test_yaml_merge_keys_count_too():
    """'<<: [*a, *a]' doubles a mapping's entries at every level (PyYAML copies them): counted as aliases are."""
    doc = "a0: &a0 {k: 1}\n" + "".join(f"a{i}: &a{i} {{<<: [*a{i - 1}, *a{i - 1}], k{i}: 1}}\n" for i in range(1, 40))
    with pytest.raises(UsageError, match="expand to more than"):
        bounds.load_yaml(doc, "doc")


def test_yaml_alias_inside_itself_and_deep_nesting_refused():
    with pytest.raises(UsageError, match="refers to a value that contains it"):
        bounds.load_yaml("a: &x [1, *x]\n", "doc")
    with pytest.raises(UsageError, match="nested deeper than the YAML parser follows"):
        bounds.load_yaml("[" * 20_000 + "]" * 20_000, "doc")
    with pytest.raises(yaml.YAMLError):  # syntax errors stay the caller's to word
        bounds.load_yaml("a: [1, 2", "doc")


# ---- JSON ----

def test_json_nesting_is_a_value_error():
    with pytest.raises(ValueError, match="nested deeper"):
        bounds.parse_json("[" * 200_000 + "]" * 200_000)
    assert bounds.parse_json('{"a": [[1]]}') == {"a": [[1]]}


# ---- regular expressions ----

@pytest.mark.parametrize("pattern", [r"((\w|\.)+)+Z", r"(a+)+", r"(a|aa)*b", r"(?:x?)*y", r"(\w+\.?)+$", r"((ab)*c?)+"])
def test_nested_repetition_refused(pattern):
    assert "backtracks exponentially" in bounds.pattern_problem(pattern)


@pytest.mark.parametrize("pattern", [r".*self_attn.*", r"model\.layers\.(0|1|2)\..*", r".*layers\.\d+\.mlp\.(gate|up)_proj",
                                     r"(ab){3}", r"(\d+)?x", r"[a-z_.]+", r"(?:lm_head|embed_tokens)"])
def test_ordinary_patterns_pass(pattern):
    assert bounds.pattern_problem(pattern) is None


def test_matching_has_a_time_budget():
    """What the static check cannot see (a pattern from a checkpoint's config is matched unchecked) is stopped by
    the budget: a one-line UsageError naming the pattern, not a hang."""
    started = time.perf_counter()
    with pytest.raises(UsageError, match="takes more than 1 s to match"):
        bounds.fullmatch(r"(a|a)+Z", "a" * 40)
    assert time.perf_counter() - started < 10
    assert bounds.fullmatch(r".*\.q_proj", "model.layers.0.self_attn.q_proj")
    assert bounds.match(r"model\.layers", "model.layers.0.q_proj") and not bounds.fullmatch(r"model\.layers", "model.layers.0")
    assert bounds.search(r"(-?\d+)", "the answer is -12.").group(1) == "-12"


# ---- str.format and printf widths ----

def test_format_widths_bounded():
    assert bounds.format_problem("Question: {q}\nAnswer: {a!r:>10}") is None
    assert "1,500,000,000 characters" in bounds.format_problem("{prompt:>1500000000}")
    assert "from the data" in bounds.format_problem("{prompt:>{n}}")
    assert bounds.percent_problem("%s and %5d", ("a", 3)) is None
    assert bounds.percent_problem("%(x)999999999s", {"x": 1})
    assert bounds.percent_problem("%*s", (10**9, "x"))


# ---- chat templates ----

TEMPLATES = [
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if loop.last %}END{% endif %}\n{% endfor %}",
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim"
    " + ' [/INST]' }}{% else %}{% generation %}{{ message['content'] ~ eos_token }}{% endgeneration %}{% endif %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{{ m.content|tojson }}{{ '%d' % ns.n }}"
    "{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}</think>{% endif %}{% endfor %}{{ messages|length }}",
    "{% macro r(x) %}[{{ x|upper }}]{% endmacro %}{% for m in messages if m.role != 'system' %}{{ r(m.content) }}"
    "{{ '{}-{}'.format(m.role, loop.index) }}{% endfor %}{{ raise_exception('no') if false }}",
    "{%- for m in messages %}{%- if m.content is string %}{{ m.content|replace('a', 'A') }}{%- else %}"
    "{{ m.content|map(attribute='text')|join(' ') }}{%- endif %}{{ '\n' }}{%- endfor %}{{ ' '.join(['x', 'y']) }}"
    "{{ 'ab'.center(6, '*') }}{{ (messages|length) * 2 }}",
]
MESSAGES = [{"role": "system", "content": "be nice", "extra": None},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "a hello", "thinking": "hmm"}]


@pytest.mark.parametrize("template", TEMPLATES)
def test_chat_template_renders_as_transformers_does(tiny_llama, template):
    """The bounded renderer is what calibration uses instead of apply_chat_template: the same text, byte for byte
    (None-valued keys dropped, reasoning under each of its names, special tokens as variables, the {% generation %}
    tag, tojson, namespaces, macros, loop controls)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_llama))
    tok.chat_template = template
    try:
        want = tok.apply_chat_template(MESSAGES, tokenize=False)
    except Exception as e:  # a template transformers refuses must be refused too
        with pytest.raises(type(e)):
            bounds.ChatTemplateRenderer(template).render(MESSAGES, dict(tok.special_tokens_map))
        return
    assert bounds.ChatTemplateRenderer(template).render(MESSAGES, dict(tok.special_tokens_map)) == want


BAD_TEMPLATES = [
    ("{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}{% endfor %}{% endfor %}",
     "steps"),
    ("{{ 'x' * 3000000000 }}", "characters"),
    ("{{ (range(99999)|list) * 99999 }}", "characters"),
    ("{{ 'x'|center(3000000000) }}", "center filter"),
    ("{{ 'x'.ljust(3000000000) }}", "str.ljust"),
    ("{{ '{:>1500000000}'.format('a') }}", "1,500,000,000 characters"),
    ("{{ '%1500000000s' % 'a' }}", "1,500,000,000 characters"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "characters"),
    ("{% set ns = namespace(s='xx') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}{% endfor %}", "characters"),
    ("{% set ns = namespace(n=3) %}{% for i in range(100) %}{% set ns.n = ns.n * ns.n %}{% endfor %}", "4,096 bits"),
    ("{{ 7 ** 3000000000 }}", "4,096 bits"),
    ("{% macro f(n) %}{% if n %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}{{ f(60) }}", "steps"),
    ("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}", "recurses"),
    ("{% set x %}{% for i in range(99999) %}" + "y" * 1000 + "{% endfor %}{% endset %}{{ x|length }}", "characters"),
    ("{{ ('x' * 60000).replace('x', 'y' * 60000) }}", "characters"),
    ("{% set s = 'x' * 60000 %}{{ s|replace('x', s) }}", "characters"),
    ("{{ messages|tojson(indent=3000000000) }}", "tojson filter"),
    ("x" * (bounds.MAX_TEMPLATE_CHARS + 1), "characters long"),
]


@pytest.mark.parametrize("template,why", BAD_TEMPLATES, ids=range(len(BAD_TEMPLATES)))
def test_chat_template_budget(template, why):
    """Loops, recursion, repetition, padding and concatenation past the budget are refused before the memory is
    taken, in about a second at most."""
    started = time.perf_counter()
    with pytest.raises(bounds.BudgetExceeded, match=why):
        bounds.ChatTemplateRenderer(template).render([{"role": "user", "content": "hi"}], {})
    assert time.perf_counter() - started < 15


def test_chat_template_budget_scales_with_the_input():
    """A long conversation is not refused: the character budget grows with what the template is given."""
    long = "word " * 1_000_000  # 5 MB of content, output four times
    r = bounds.ChatTemplateRenderer("{% for m in messages %}{{ m.content }}{{ m.content|upper }}{{ m.content ~ '!' }}"
                                    "{{ m.content|trim }}{% endfor %}")
    assert len(r.render([{"role": "user", "content": long}], {})) == 4 * len(long)  # '!' added, a trailing space trimmed
