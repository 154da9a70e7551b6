"""Evaluation tasks: a YAML task file parsed once into frozen dataclasses, its examples loaded from local
JSONL, a dataset (local directory or Hugging Face id) or lm-evaluation-harness, and turned into token
requests. Three task types: perplexity (text), multiple_choice (context, choices, answer) and generate
(prompt, reference; greedy decoding, exact match after an optional extraction regex).

No torch here: a tokenizer is passed in, so the task file can be validated without loading a model.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Sequence

from qtk.bounds import MAX_YAML_BYTES, bounded_lines, format_problem, load_yaml, parse_json, pattern_problem, read_text
from qtk.bounds import search as bounded_search
from qtk.errors import UsageError
from qtk.validation import check_keys

TYPES = ("perplexity", "multiple_choice", "generate")
# the fields every example of a type has after the field mapping
TYPE_FIELDS = {"perplexity": ("text",), "multiple_choice": ("context", "choices", "answer"), "generate": ("prompt", "reference")}
# primary metric of each type, and the others it may gate on instead
METRICS = {"perplexity": ("perplexity",), "multiple_choice": ("acc", "acc_norm"), "generate": ("exact_match",)}
LIMIT_KEYS = ("max_drop", "min_recovery")
AGREEMENT_KEYS = ("max_kl", "min_top1", "max_ppl_ratio")


def _num(d: Mapping, key: str, where: str, kind=float, positive=False):
    v = d.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not isinstance(v, int)):
        raise UsageError(f"{where}.{key}: expected a number, got {v!r}", f"set {key} to a {'whole ' if kind is int else ''}number")
    if positive and v <= 0:
        raise UsageError(f"{where}.{key}: must be > 0 (got {v})", f"set {key} to a positive number")
    return kind(v)


@dataclass(frozen=True)
class Limit:
    """A task's pass condition: the candidate may lose at most `max_drop` points of the metric (percentage
    points for accuracies, perplexity units for perplexity) and/or keep at least `min_recovery` of it."""

    max_drop: float | None = None
    min_recovery: float | None = None

    @classmethod
    def parse(cls, d: Any, where: str) -> "Limit":
        if d is None:
            return cls()
        check_keys(d, LIMIT_KEYS, where)
        lim = cls(max_drop=_num(d, "max_drop", where), min_recovery=_num(d, "min_recovery", where))
        if lim.max_drop is not None and not 0 <= lim.max_drop < float("inf"):
            raise UsageError(f"{where}.max_drop: must be >= 0 (got {lim.max_drop})", "a drop limit is a non-negative number of points")
        if lim.min_recovery is not None and not 0 < lim.min_recovery <= 1:
            hint = f" (for {lim.min_recovery:g}% write {lim.min_recovery / 100:g})" if 1 < lim.min_recovery <= 100 else ""
            raise UsageError(f"{where}.min_recovery: must be a fraction in (0, 1], got {lim.min_recovery:g}{hint}",
                             "write the share of the baseline the candidate must keep, e.g. min_recovery: 0.98")
        return lim

    @property
    def empty(self) -> bool:
        return self.max_drop is None and self.min_recovery is None


@dataclass(frozen=True)
class TaskSpec:
    """One task of a task file. Exactly one source: `data` (local .jsonl), `dataset` (a dataset directory
    written by datasets.save_to_disk, or a Hugging Face id) or `lm_eval` (an lm-evaluation-harness task)."""

    name: str
    type: str
    data: str | None = None
    dataset: str | None = None
    config: str | None = None
    split: str = "test"
    lm_eval: str | None = None
    fields: tuple[tuple[str, Any], ...] = ()  # target field -> column name or "{col}" template (choices: a list)
    num_fewshot: int = 0
    fewshot_data: str | None = None  # local .jsonl of few-shot examples (default: drawn from the task's data)
    fewshot_split: str | None = None  # for `dataset`: split to draw few-shot examples from
    fewshot_delimiter: str = "\n"
    target_delimiter: str = ""
    limit: int | None = None
    seed: int = 1234
    shuffle: bool = False
    metric: str = ""
    max_new_tokens: int | None = None
    stop: tuple[str, ...] = ("\n",)
    regex: str | None = None
    ignore_case: bool = False
    gate: Limit = Limit()
    base_dir: str = "."  # directory of the task file: relative paths are resolved against it

    @property
    def higher_is_better(self) -> bool:
        return self.metric != "perplexity"

    def identity(self) -> dict:
        """What determines the task's results (not its gate limits): part of the baseline cache key."""
        d = asdict(self)
        d.pop("gate")
        d.pop("base_dir")
        return d


@dataclass(frozen=True)
class Agreement:
    """Model-level limits on the perplexity texts, judged on the point estimates."""

    max_kl: float | None = None
    min_top1: float | None = None  # percent of tokens whose top-1 prediction agrees with the baseline
    max_ppl_ratio: float | None = None
    kl_topk: int = 256  # baseline log-probs kept per token; KL is exact when the vocabulary is not larger


@dataclass(frozen=True)
class TaskFile:
    path: Path
    tasks: tuple[TaskSpec, ...]
    agreement: Agreement = Agreement()

    def select(self, names) -> "TaskFile":
        names = list(names)
        known = {t.name for t in self.tasks}
        bad = [n for n in names if n not in known]
        if bad:
            raise UsageError(f"unknown task(s) {', '.join(bad)} in {self.path}", f"tasks in the file: {', '.join(sorted(known))}")
        return TaskFile(self.path, tuple(t for t in self.tasks if t.name in names), self.agreement)


TASK_KEYS = {f.name for f in fields(TaskSpec)} - {"base_dir"}


def parse_task(d: Any, where: str, defaults: Mapping, base_dir: Path) -> TaskSpec:
    check_keys(d, TASK_KEYS, where)
    merged = {**defaults, **d}
    if "gate" in defaults and "gate" in d and isinstance(defaults["gate"], Mapping) and isinstance(d["gate"], Mapping):
        merged["gate"] = {**defaults["gate"], **d["gate"]}
    if merged.get("type") == "perplexity" and isinstance(merged.get("gate"), Mapping) and "max_drop" in merged["gate"]:
        # max_drop counts points of an accuracy; a perplexity's scale depends on the tokenizer and the text, so a number
        # of perplexity units means nothing portable: its limit is min_recovery (a ratio). A default applies to the
        # accuracy tasks only; one written on the task itself is refused.
        if isinstance(d.get("gate"), Mapping) and d["gate"].get("max_drop") is not None:
            task = f"task {d['name']!r}" if isinstance(d.get("name"), str) and d["name"] else where
            raise UsageError(f"{task}.gate.max_drop: perplexity tasks are limited by min_recovery "
                             "(baseline/candidate perplexity), not by a drop in points",
                             "replace it with e.g. 'gate: {min_recovery: 0.98}', or agreement.max_ppl_ratio")
        merged["gate"] = {k: v for k, v in merged["gate"].items() if k != "max_drop"}
    name = merged.get("name")
    if not isinstance(name, str) or not name or not re.fullmatch(r"[A-Za-z0-9_.\-]+", name):
        raise UsageError(f"{where}.name: expected a name of letters, digits, '_', '-', '.' (got {name!r})", "add e.g. 'name: arithmetic'")
    where = f"task '{name}'"
    typ = merged.get("type")
    if typ not in TYPES:
        raise UsageError(f"{where}.type: expected one of {', '.join(TYPES)} (got {typ!r})", "add e.g. 'type: generate'")
    sources = [k for k in ("data", "dataset", "lm_eval") if merged.get(k)]
    if len(sources) != 1:
        raise UsageError(f"{where}: needs exactly one of data, dataset, lm_eval (got {', '.join(sources) or 'none'})",
                         "e.g. 'data: tasks/add.jsonl' or 'dataset: gsm8k' with 'config: main'")
    for k in ("data", "dataset", "config", "split", "lm_eval", "fewshot_data", "fewshot_split", "fewshot_delimiter",
              "target_delimiter", "metric", "regex"):
        if merged.get(k) is not None and not isinstance(merged[k], str):
            raise UsageError(f"{where}.{k}: expected text, got {merged[k]!r}", f"quote the value of {k}")
    flds = merged.get("fields") or {}
    if not isinstance(flds, Mapping):
        raise UsageError(f"{where}.fields: expected a mapping target -> column", "e.g. fields: {prompt: question, reference: answer}")
    check_keys(flds, TYPE_FIELDS[typ], f"{where}.fields")
    for k, v in flds.items():
        ok = isinstance(v, str) or (k == "choices" and isinstance(v, list) and all(isinstance(x, str) for x in v))
        if not ok:
            raise UsageError(f"{where}.fields.{k}: expected a column name or '{{column}}' template, got {v!r}",
                             "write e.g. 'prompt: \"Question: {question}\\nAnswer:\"'")
        for src in v if isinstance(v, list) else [v]:
            problem = format_problem(src) if "{" in src else None
            if problem:  # filled once per row: '{prompt:>1500000000}' asks for 1.5 GB of padding per example
                raise UsageError(f"{where}.fields.{k}: {problem}", "use plain '{column}' fields in templates")
    metric = merged.get("metric") or METRICS[typ][0]
    if metric not in METRICS[typ]:
        raise UsageError(f"{where}.metric: '{metric}' is not a {typ} metric", f"choose one of {', '.join(METRICS[typ])}")
    regex = merged.get("regex")
    if regex is not None:
        if typ != "generate":
            raise UsageError(f"{where}.regex: only generate tasks extract answers", "remove regex")
        try:
            re.compile(regex)
        except (re.error, OverflowError, RecursionError) as e:
            raise UsageError(f"{where}.regex: invalid regular expression ({e})",
                             "fix the pattern; its first group (or whole match) is the answer") from None
        problem = pattern_problem(regex)
        if problem:  # it is searched in every generated text
            raise UsageError(f"{where}.regex: the pattern is refused: {problem}",
                             "extract the answer without nested repetition, e.g. '(-?\\d+)'")
    stop = merged.get("stop", ["\n"])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise UsageError(f"{where}.stop: expected a list of non-empty strings", "e.g. stop: [\"\\n\"]")
    n_shot = _num(merged, "num_fewshot", where, int) or 0
    if n_shot < 0:
        raise UsageError(f"{where}.num_fewshot: must be >= 0", "set num_fewshot: 0 for zero-shot")
    if n_shot and typ == "perplexity":
        raise UsageError(f"{where}.num_fewshot: perplexity tasks take no few-shot prefix", "remove num_fewshot")
    for k in ("shuffle", "ignore_case"):
        if k in merged and not isinstance(merged[k], bool):
            raise UsageError(f"{where}.{k}: expected true or false, got {merged[k]!r}", f"set {k}: true or false")
    return TaskSpec(
        name=name, type=typ, data=merged.get("data"), dataset=merged.get("dataset"), config=merged.get("config"),
        split=merged.get("split") or "test", lm_eval=merged.get("lm_eval"),
        fields=tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in flds.items())),
        num_fewshot=n_shot, fewshot_data=merged.get("fewshot_data"), fewshot_split=merged.get("fewshot_split"),
        fewshot_delimiter=merged.get("fewshot_delimiter", "\n"), target_delimiter=merged.get("target_delimiter", ""),
        limit=_num(merged, "limit", where, int, positive=True), seed=1234 if merged.get("seed") is None else _num(merged, "seed", where, int),
        shuffle=bool(merged.get("shuffle", False)), metric=metric,
        max_new_tokens=_num(merged, "max_new_tokens", where, int, positive=True), stop=tuple(stop), regex=regex,
        ignore_case=bool(merged.get("ignore_case", False)), gate=Limit.parse(merged.get("gate"), f"{where}.gate"),
        base_dir=str(base_dir),
    )


def load_task_file(path: str | Path) -> TaskFile:
    """Parse and validate a task file; every error names the key and the fix."""
    import yaml

    p = Path(path)
    if not p.is_file():
        raise UsageError(f"task file {p} does not exist", "give a YAML task file (see docs/eval.md), e.g. --tasks examples/tasks.yaml")
    try:
        doc = load_yaml(read_text(p, MAX_YAML_BYTES, f"task file {p}", "a task file describes tasks; their examples go in "
                                  "data files (data: x.jsonl)"), f"task file {p.name}")
    except UnicodeDecodeError as e:
        raise UsageError(f"task file {p} is not UTF-8 text (byte {e.start})", "re-save it as UTF-8 YAML") from None
    except yaml.YAMLError as e:
        raise UsageError(f"task file {p} is not valid YAML ({str(e).splitlines()[0]})", "fix the YAML syntax") from None
    check_keys(doc, ("version", "defaults", "agreement", "tasks"), p.name)
    if doc.get("version", 1) != 1:
        raise UsageError(f"{p.name}: version {doc.get('version')} is not supported", "this qtk reads task files of version 1")
    defaults = doc.get("defaults") or {}
    check_keys(defaults, TASK_KEYS - {"name"}, f"{p.name}: defaults")
    raw = doc.get("tasks")
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"{p.name}: 'tasks' must be a non-empty list", "add e.g. 'tasks: [{name: ppl, type: perplexity, data: ppl.jsonl}]'")
    tasks = tuple(parse_task(t, f"{p.name}: tasks[{i}]", defaults, p.resolve().parent) for i, t in enumerate(raw))
    names = [t.name for t in tasks]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise UsageError(f"{p.name}: task name(s) used twice: {', '.join(dup)}", "give every task its own name")
    ag = doc.get("agreement") or {}
    check_keys(ag, (*AGREEMENT_KEYS, "kl_topk"), f"{p.name}: agreement")
    agreement = Agreement(max_kl=_num(ag, "max_kl", "agreement"), min_top1=_num(ag, "min_top1", "agreement"),
                          max_ppl_ratio=_num(ag, "max_ppl_ratio", "agreement", positive=True),
                          kl_topk=_num(ag, "kl_topk", "agreement", int, positive=True) or 256)
    if any(getattr(agreement, k) is not None for k in AGREEMENT_KEYS) and not any(t.type == "perplexity" for t in tasks):
        raise UsageError(f"{p.name}: agreement limits need a perplexity task (they are measured on its texts)",
                         "add a task with 'type: perplexity' or remove the agreement limits")
    return TaskFile(p, tasks, agreement)


# ---------------------------------------------------------------------------------------------- sources

class _JsonlRows(Sequence):
    """The rows of a .jsonl data file, indexed by their byte offsets and read back one at a time: a task that
    evaluates 5 examples of a large file holds those 5 (and an offset per row), not every row as a dict.
    Every row is parsed once while indexing and handed to `check`, so a bad row anywhere is still refused."""

    def __init__(self, path: Path, where: str, check=None):
        from array import array

        from qtk.calib import MAX_ROW_BYTES

        if not path.is_file():
            raise UsageError(f"{where}: data file {path} does not exist", "paths are relative to the task file's directory")
        self.path, self.where = path, where
        self._starts, self._ends = array("q"), array("q")
        def too_long(n):
            return UsageError(f"{where}: {path.name} line {n} is longer than {MAX_ROW_BYTES // 2**20} MiB",
                              "an example is a few KB: split the file's rows")

        with open(path, "rb") as f:
            for offset, n, line in bounded_lines(f, MAX_ROW_BYTES, too_long):
                if line.strip():
                    row = self._parse(line, n)
                    if check is not None:
                        check(row, len(self._starts))
                    self._starts.append(offset)
                    self._ends.append(offset + len(line))

    def _parse(self, line: bytes, n: int) -> dict:
        try:
            row = parse_json(line.decode("utf-8"))
        except ValueError:  # JSONDecodeError, not UTF-8, nested past the parser's stack
            raise UsageError(f"{self.where}: {self.path.name} line {n} is not valid JSON", "write one JSON object per line") from None
        if not isinstance(row, dict):
            raise UsageError(f"{self.where}: {self.path.name} line {n} is not a JSON object", "write one JSON object per line")
        return row

    def __len__(self) -> int:
        return len(self._starts)

    def __getitem__(self, i: int) -> dict:
        with open(self.path, "rb") as f:
            f.seek(self._starts[i])
            return self._parse(f.read(self._ends[i] - self._starts[i]), i + 1)


class _Mapped(Sequence):
    """Rows mapped to a task's fields (`_map_row`) when they are read: only the examples drawn are kept."""

    def __init__(self, rows, spec: "TaskSpec", origin: str):
        self.rows, self.spec, self.origin = rows, spec, origin

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return _map_row(dict(self.rows[i]), self.spec, i, self.origin)


def _data_rows(path: Path, spec: "TaskSpec", where: str) -> _Mapped:
    """A .jsonl data file's rows as the task's examples, every row checked while indexing, none kept."""
    rows = _JsonlRows(path, where, check=lambda row, i: _map_row(row, spec, i, path.name))
    return _Mapped(rows, spec, path.name)


def _read_dataset(spec: TaskSpec, split: str):
    import datasets

    p = Path(spec.dataset)
    if not p.is_absolute() and (Path(spec.base_dir) / p).is_dir():
        p = Path(spec.base_dir) / p
    where = f"task '{spec.name}'"
    try:
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
            if isinstance(ds, datasets.DatasetDict):
                if split not in ds:
                    raise UsageError(f"{where}: dataset {p} has no split '{split}' (it has: {', '.join(ds)})", "set split: to one of those")
                ds = ds[split]
        else:
            ds = datasets.load_dataset(spec.dataset, spec.config, split=split)
    except UsageError:
        raise
    except Exception as e:  # datasets raises many types for unreachable hubs, bad ids and bad splits
        raise UsageError(f"{where}: cannot load dataset '{spec.dataset}' split '{split}' ({e.__class__.__name__}: "
                         f"{str(e).splitlines()[0][:200] if str(e) else ''})",
                         "check the id, config and split and the network, or save it locally with save_to_disk") from None
    return ds  # rows are read (and mapped) as they are drawn: a dataset on disk stays on disk


def _lm_eval_rows(spec: TaskSpec) -> tuple[list[dict], list[dict]]:
    """Examples of an lm-evaluation-harness task, converted to qtk's fields (and its few-shot pool)."""
    try:
        from lm_eval.tasks import TaskManager, get_task_dict
    except ImportError:
        raise UsageError(f"task '{spec.name}' uses lm_eval: {spec.lm_eval}, but lm-evaluation-harness is not installed",
                         "pip install 'qtk[eval]' (or lm-eval), or describe the task with data:/dataset: instead") from None
    try:
        task = get_task_dict([spec.lm_eval], TaskManager())[spec.lm_eval]
    except Exception as e:
        raise UsageError(f"task '{spec.name}': lm-eval cannot load '{spec.lm_eval}' ({e.__class__.__name__}: {str(e)[:200]})",
                         "check the task name with `lm-eval --tasks list`") from None
    if isinstance(task, dict):
        raise UsageError(f"task '{spec.name}': '{spec.lm_eval}' is an lm-eval group of {len(task)} tasks",
                         "list its member tasks one by one in the task file")
    kind = {"multiple_choice": "multiple_choice", "generate_until": "generate", "loglikelihood_rolling": "perplexity"}.get(task.OUTPUT_TYPE)
    if kind != spec.type:
        raise UsageError(f"task '{spec.name}': lm-eval task '{spec.lm_eval}' is {task.OUTPUT_TYPE}, not {spec.type}",
                         f"set type: {kind}" if kind else "use a multiple_choice, generate_until or loglikelihood_rolling task")

    def convert(doc) -> dict:
        if kind == "perplexity":
            return {"text": task.doc_to_target(doc)}
        ctx = task.doc_to_text(doc)
        if kind == "multiple_choice":
            choices = list(task.doc_to_choice(doc))
            ans = task.doc_to_target(doc)
            ans = choices.index(ans) if isinstance(ans, str) else int(ans)
            delim = getattr(task.config, "target_delimiter", " ")
            return {"context": ctx, "choices": [delim + c for c in choices], "answer": ans}
        ref = task.doc_to_target(doc)
        return {"prompt": ctx, "reference": str(ref[0] if isinstance(ref, list) else ref)}

    evals = task.test_docs() if task.has_test_docs() else task.validation_docs()
    pool = task.fewshot_docs() if hasattr(task, "fewshot_docs") and task.fewshot_docs() is not None else []
    return [convert(d) for d in evals], [convert(d) for d in pool]


# ---------------------------------------------------------------------------------------------- examples

def _map_row(row: dict, spec: TaskSpec, i: int, origin: str) -> dict:
    mapping = dict(spec.fields)
    where = f"task '{spec.name}': {origin} row {i}"

    def get(target):
        src = mapping.get(target, target)
        if isinstance(src, tuple):  # choices from several columns
            return [get_one(s, target) for s in src]
        return get_one(src, target)

    def get_one(src, target):
        if "{" in src:
            try:
                return src.format_map(row)
            except (KeyError, IndexError, ValueError) as e:
                raise UsageError(f"{where}: template for '{target}' cannot be filled ({e})",
                                 f"columns available: {', '.join(sorted(row))}") from None
        if src not in row:
            raise UsageError(f"{where} has no field '{src}' (it has: {', '.join(sorted(row))})",
                             f"map it with fields: {{{target}: COLUMN}}")
        return row[src]

    out = {k: get(k) for k in TYPE_FIELDS[spec.type]}
    if spec.type == "multiple_choice":
        ch = out["choices"]
        if not isinstance(ch, (list, tuple)) or len(ch) < 2 or not all(isinstance(c, str) and c for c in ch):
            raise UsageError(f"{where}: choices must be a list of at least two non-empty strings", "fix the data or the field mapping")
        out["choices"] = list(ch)
        a = out["answer"]
        if isinstance(a, str):
            if a in ch:
                a = ch.index(a)
            elif a.strip().isdigit():
                a = int(a)
            elif len(a.strip()) == 1 and a.strip().isalpha():
                a = ord(a.strip().upper()) - ord("A")
        if isinstance(a, bool) or not isinstance(a, int) or not 0 <= a < len(ch):
            raise UsageError(f"{where}: answer {out['answer']!r} is not an index into its {len(ch)} choices",
                             "give the answer as a 0-based index, a letter, or the text of a choice")
        out["answer"] = a
    else:
        for k in TYPE_FIELDS[spec.type]:
            v = out[k]
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                v = out[k] = str(v)
            if not isinstance(v, str) or (k != "reference" and not v):
                raise UsageError(f"{where}: '{k}' must be non-empty text (got {v!r})", "fix the data or the field mapping")
    return out


@dataclass
class PreparedTask:
    """A task's evaluation examples (after few-shot selection and the limit) and its few-shot prefix."""

    spec: TaskSpec
    examples: list[dict]
    prefix: str = ""
    notes: list[str] = field(default_factory=list)

    def context(self, ex: dict) -> str:
        return self.prefix + (ex["context"] if self.spec.type == "multiple_choice" else ex["prompt"])

    def full_text(self, ex: dict) -> str:
        """The evaluated example as one text, without the few-shot prefix (for the contamination check)."""
        t = self.spec.type
        if t == "perplexity":
            return ex["text"]
        if t == "multiple_choice":
            return ex["context"] + ex["choices"][ex["answer"]]
        return ex["prompt"] + self.spec.target_delimiter + ex["reference"]


def _shot(ex: dict, spec: TaskSpec) -> str:
    if spec.type == "multiple_choice":
        return ex["context"] + spec.target_delimiter + ex["choices"][ex["answer"]]
    return ex["prompt"] + spec.target_delimiter + ex["reference"]


def prepare(spec: TaskSpec, *, limit: int | None = None, seed: int | None = None) -> PreparedTask:
    """Load a task's examples, draw its few-shot examples with the seed, apply the example limit.

    Few-shot examples come from `fewshot_data`/`fewshot_split` when given, else from the task's own data;
    then they are removed from the evaluated examples. One prefix is shared by all examples, so baseline and
    candidate see exactly the same inputs."""
    seed = spec.seed if seed is None else seed
    limit = limit if limit is not None else spec.limit
    where = f"task '{spec.name}'"
    pool: list[dict] | None = None
    # rows and pools are sequences read on demand: the draws below pick indices, and only the picked rows are read
    # (the same draws, with the same seed, as on lists of every row)
    if spec.data:
        path = Path(spec.base_dir) / spec.data
        if path.suffix != ".jsonl":
            raise UsageError(f"{where}.data: {spec.data} is not a .jsonl file",
                             "use data: for .jsonl files and dataset: for dataset directories or ids")
        rows = _data_rows(path, spec, where)
    elif spec.dataset:
        rows = _checked(_Mapped(_read_dataset(spec, spec.split), spec, spec.dataset))
        if spec.fewshot_split:
            pool = _checked(_Mapped(_read_dataset(spec, spec.fewshot_split), spec, f"{spec.dataset}[{spec.fewshot_split}]"))
    else:
        rows, lm_pool = _lm_eval_rows(spec)
        pool = lm_pool or None
    if spec.fewshot_data:
        pool = _data_rows(Path(spec.base_dir) / spec.fewshot_data, spec, where)
    if not len(rows):
        raise UsageError(f"{where}: no examples", "check the data file or dataset split")
    rng = random.Random(f"{spec.name}:{seed}")
    evals = list(range(len(rows)))
    shots: list[dict] = []
    if spec.num_fewshot:
        if pool is None:  # draw from the task's own examples and keep them out of the evaluated ones
            if spec.num_fewshot >= len(rows):
                raise UsageError(f"{where}: num_fewshot {spec.num_fewshot} leaves no examples to evaluate ({len(rows)} in all)",
                                 "lower num_fewshot or give fewshot_data")
            picked = sorted(rng.sample(range(len(rows)), spec.num_fewshot))
            shots = [rows[i] for i in picked]
            chosen = set(picked)
            evals = [i for i in evals if i not in chosen]
        else:
            if spec.num_fewshot > len(pool):
                raise UsageError(f"{where}: num_fewshot {spec.num_fewshot} but the few-shot pool has {len(pool)} examples",
                                 "lower num_fewshot or give more few-shot examples")
            shots = [pool[i] for i in sorted(rng.sample(range(len(pool)), spec.num_fewshot))]
    if spec.shuffle:
        rng.shuffle(evals)
    if limit is not None:
        evals = evals[:limit]
    prefix = "".join(_shot(s, spec) + spec.fewshot_delimiter for s in shots)
    return PreparedTask(spec, [rows[i] for i in evals], prefix)


def _checked(rows: "_Mapped") -> "_Mapped":
    """Every row mapped once (a bad row anywhere refused, as for a data file), one at a time, none kept."""
    for i in range(len(rows)):
        rows[i]
    return rows


# ---------------------------------------------------------------------------------------------- scoring text

def extract(text: str, spec: TaskSpec) -> str:
    """The answer in a generated (or reference) text: the regex's first group, or its whole match, or the
    stripped text; '[no match]' when the regex does not match (so no match never equals a reference)."""
    if spec.regex:
        m = bounded_search(spec.regex, text)
        if not m:
            return "[no match]"
        text = m.group(1) if m.groups() else m.group(0)
    text = text.strip()
    return text.lower() if spec.ignore_case else text


def cut_at_stop(text: str, stop) -> str:
    cut = len(text)
    for s in stop:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def sha256_json(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------- token requests

@dataclass
class Requests:
    """A prepared task as token ids: what an engine is asked to score or continue."""

    type: str
    seqs: list[list[int]] = field(default_factory=list)  # perplexity: BOS + text
    pairs: list[tuple[list[int], list[int]]] = field(default_factory=list)  # multiple_choice: (context, choice) per choice
    owner: list[tuple[int, int]] = field(default_factory=list)  # multiple_choice: (example, choice) of each pair
    choice_bytes: list[int] = field(default_factory=list)  # multiple_choice: UTF-8 length of each choice (acc_norm)
    prompts: list[list[int]] = field(default_factory=list)  # generate: BOS + few-shot prefix + prompt
    max_new_tokens: int = 0

    def digest(self) -> str:
        return sha256_json([self.type, self.seqs, self.pairs, self.owner, self.choice_bytes, self.prompts, self.max_new_tokens])


def encoder(tokenizer):
    """texts -> ids without special tokens (one batched tokenizer call), and the prefix every sequence starts with:
    BOS when the model has one (as qtk's calibration windows do, and as inference does)."""
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []

    def enc(texts: list[str]) -> list[list[int]]:
        return [list(ids) for ids in tokenizer(list(texts), add_special_tokens=False)["input_ids"]] if texts else []

    return enc, bos


def build_requests(task: PreparedTask, tokenizer) -> Requests:
    enc, bos = encoder(tokenizer)
    spec = task.spec
    r = Requests(spec.type)
    if spec.type == "perplexity":
        r.seqs = [bos + ids for ids in enc([ex["text"] for ex in task.examples])]
        if any(len(s) < 2 for s in r.seqs):
            raise UsageError(f"task '{spec.name}': a text has fewer than 2 tokens", "remove empty texts from the data")
    elif spec.type == "multiple_choice":
        parts = []  # (example, choice, context, continuation)
        for i, ex in enumerate(task.examples):
            ctx = task.context(ex)
            for j, choice in enumerate(ex["choices"]):
                c, cont = ctx, choice
                n_trail = len(c) - len(c.rstrip(" "))
                if n_trail:  # as lm-eval: a trailing space belongs to the continuation, where tokenizers put it
                    c, cont = c[:-n_trail], c[-n_trail:] + cont
                parts.append((i, j, c, cont))
        ctx_ids = enc([c for _, _, c, _ in parts])
        wholes = enc([c + cont for _, _, c, cont in parts])
        for (i, j, c, cont), cids, whole in zip(parts, ctx_ids, wholes):
            cont_ids = whole[len(cids):] if whole[: len(cids)] == cids else enc([cont])[0]
            if not cont_ids:
                raise UsageError(f"task '{spec.name}': example {i} choice {j} is empty after tokenization", "give non-empty choices")
            r.pairs.append((bos + cids, cont_ids))
            r.owner.append((i, j))
            r.choice_bytes.append(len(task.examples[i]["choices"][j].encode()))
    else:
        r.prompts = [bos + ids for ids in enc([task.context(ex) for ex in task.examples])]
        if spec.max_new_tokens:
            r.max_new_tokens = spec.max_new_tokens
        else:  # enough for the longest reference and a little more; the stop strings end it earlier
            refs = enc([spec.target_delimiter + ex["reference"] for ex in task.examples])
            r.max_new_tokens = min(512, max(len(x) for x in refs) + 8)
    return r
