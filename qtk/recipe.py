"""Recipes: what to quantize and how, as frozen dataclasses parsed and validated once at the edge.

A recipe is a YAML file (``recipes/NAME.yaml`` for built-ins, or any path). Every error names the
key and the fix; nothing downstream re-validates.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from qtk.errors import UsageError

RECIPES_DIR = Path(__file__).resolve().parent.parent / "recipes"

STRATEGIES = ("tensor", "channel", "group", "token")
TYPES = ("int", "float")
OBSERVERS = ("minmax", "mse")
INT_BITS = (2, 4, 8)  # packable into int32 words without straddling; engines run 4 and 8
FP8_MAX = 448.0  # float8_e4m3fn


def suggest_key(key: str, valid) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"did you mean '{close[0]}'?" if close else f"valid keys: {', '.join(sorted(valid))}"


def check_keys(d: Mapping, valid, where: str) -> None:
    """Refuse a non-mapping or a key outside `valid`, suggesting the closest valid key (shared by task files)."""
    if not isinstance(d, Mapping):
        raise UsageError(f"{where}: expected a mapping, got {type(d).__name__}", "write it as 'key: value' lines")
    for k in d:
        if not isinstance(k, str) or k not in valid:
            raise UsageError(f"{where}: unknown key {k!r}", suggest_key(str(k), valid))


def _typed(d: Mapping, key: str, kind, where: str, default=None):
    v = d.get(key)
    if v is None:  # absent or an explicit null ('key:' with no value): the default, never None in its place
        return default
    ok = isinstance(v, kind) and not (kind is int and isinstance(v, bool))
    if kind is float and isinstance(v, int) and not isinstance(v, bool):
        v, ok = float(v), True
    if not ok:
        name = kind.__name__ if isinstance(kind, type) else "/".join(k.__name__ for k in kind)
        raise UsageError(f"{where}.{key}: expected {name}, got {v!r}", f"set {key} to a {name}")
    return v


@dataclass(frozen=True)
class QuantScheme:
    """How one kind of tensor is quantized. Mirrors compressed-tensors' QuantizationArgs on purpose."""

    num_bits: int
    type: str = "int"
    symmetric: bool = True
    strategy: str = "channel"
    group_size: int | None = None
    dynamic: bool = False
    observer: str = "minmax"

    @property
    def is_fp8(self) -> bool:
        return self.type == "float"

    @property
    def qmin(self) -> int:
        return -(2 ** (self.num_bits - 1))

    @property
    def qmax(self) -> int:
        return 2 ** (self.num_bits - 1) - 1

    @property
    def is_static_per_tensor(self) -> bool:
        return self.strategy == "tensor" and not self.dynamic

    def describe(self) -> str:
        t = f"fp{self.num_bits}" if self.is_fp8 else f"int{self.num_bits}"
        s = f"group{self.group_size}" if self.strategy == "group" else self.strategy
        parts = [t, s, "sym" if self.symmetric else "asym"]
        if self.dynamic:
            parts.append("dynamic")
        return " ".join(parts)

    def to_ct_args(self, actorder: str | None = None) -> dict:
        """compressed-tensors QuantizationArgs keys (only those it accepts). actorder: "weight" for GPTQ's static
        activation ordering (the only one compressed-tensors 0.20 accepts), else None."""
        return {
            "num_bits": self.num_bits,
            "type": self.type,
            "symmetric": self.symmetric,
            "group_size": self.group_size,
            "strategy": self.strategy,
            "block_structure": None,
            "dynamic": self.dynamic,
            "actorder": actorder,
            "observer": None if self.dynamic else ("mse" if self.observer == "mse" else "minmax"),
            "observer_kwargs": {},
        }

    @classmethod
    def parse(cls, d: Mapping, where: str, role: str) -> "QuantScheme":
        check_keys(d, {f.name for f in fields(cls)}, where)
        if d.get("num_bits") is None:
            raise UsageError(f"{where}: missing key 'num_bits'", "add e.g. 'num_bits: 8'")
        s = cls(
            num_bits=_typed(d, "num_bits", int, where),
            type=_typed(d, "type", str, where, "int"),
            symmetric=_typed(d, "symmetric", bool, where, True),
            strategy=_typed(d, "strategy", str, where, "tensor" if role == "kv_cache" else "channel"),
            group_size=_typed(d, "group_size", int, where),
            dynamic=_typed(d, "dynamic", bool, where, False),
            observer=_typed(d, "observer", str, where, "minmax"),
        )
        s._validate(where, role)
        return s

    def _validate(self, where: str, role: str) -> None:
        if self.type not in TYPES:
            raise UsageError(f"{where}.type: {self.type!r} is not a quantization type", "use 'int' or 'float'")
        if self.strategy not in STRATEGIES:
            raise UsageError(f"{where}.strategy: unknown strategy {self.strategy!r}", f"use one of {', '.join(STRATEGIES)}")
        if self.observer not in OBSERVERS:
            raise UsageError(f"{where}.observer: unknown observer {self.observer!r}", f"use one of {', '.join(OBSERVERS)}")
        if self.is_fp8:
            if self.num_bits != 8:
                raise UsageError(f"{where}.num_bits: float quantization is fp8 (e4m3) only, got {self.num_bits}", "set num_bits: 8")
            if not self.symmetric:
                raise UsageError(f"{where}.symmetric: fp8 has no zero point, asymmetric fp8 is impossible", "set symmetric: true")
            if self.strategy == "group":
                raise UsageError(f"{where}.strategy: group-wise fp8 is not supported by the target engines", "use strategy: channel or tensor")
        elif self.num_bits not in INT_BITS:
            raise UsageError(f"{where}.num_bits: int{self.num_bits} is not supported", f"use one of {', '.join(map(str, INT_BITS))}")
        if self.strategy == "group":
            if not self.group_size or self.group_size <= 0:
                raise UsageError(f"{where}.group_size: strategy 'group' needs a positive group_size", "add e.g. 'group_size: 128'")
        elif self.group_size is not None:
            raise UsageError(f"{where}.group_size: only meaningful with strategy 'group'", "remove group_size or set strategy: group")
        if self.strategy == "token" and not self.dynamic:
            raise UsageError(f"{where}.strategy: per-token scales are computed at run time", "set dynamic: true")
        if role == "weights":
            if self.dynamic:
                raise UsageError(f"{where}.dynamic: weights are quantized ahead of time", "set dynamic: false")
            if self.strategy == "token":
                raise UsageError(f"{where}.strategy: 'token' is for activations", "use channel, group or tensor for weights")
        if role == "activations":
            if self.strategy not in ("tensor", "token"):
                raise UsageError(f"{where}.strategy: activations are quantized per tensor or per token", "use strategy: tensor or token")
            if self.num_bits != 8:
                raise UsageError(f"{where}.num_bits: {self.num_bits}-bit activations have no kernel in vLLM or TensorRT-LLM", "use num_bits: 8 or drop activations")
            if not self.symmetric and self.is_fp8:
                raise UsageError(f"{where}.symmetric: fp8 activations are symmetric", "set symmetric: true")
            if not self.symmetric:
                raise UsageError(f"{where}.symmetric: asymmetric activations are not supported by qtk's targets", "set symmetric: true")
        if role == "kv_cache":
            if self.num_bits != 8 or self.strategy != "tensor" or self.dynamic or not self.symmetric:
                raise UsageError(f"{where}: the KV cache is quantized to 8 bits, per tensor, static, symmetric",
                                 "use 'kv_cache: {num_bits: 8, type: float}' (or type: int for TensorRT-LLM INT8 KV)")
            if self.observer != "minmax":
                raise UsageError(f"{where}.observer: KV scales use the min-max observer", "remove observer")


@dataclass(frozen=True)
class Step:
    """One algorithm step (rtn, gptq, awq, smoothquant) and its validated parameters."""

    name: str
    params: Any = None  # a frozen params dataclass from qtk.algorithms.params


@dataclass(frozen=True)
class Calibration:
    dataset: str = "default"
    num_samples: int = 64
    seq_len: int = 256
    seed: int = 0
    text_field: str = "text"
    # MoE: experts that receive fewer calibration tokens than this are reported (warning, manifest, notes)
    min_expert_tokens: int = 64

    @classmethod
    def parse(cls, d: Mapping, where: str) -> "Calibration":
        check_keys(d, {f.name for f in fields(cls)}, where)
        c = cls(
            dataset=_typed(d, "dataset", str, where, "default"),
            num_samples=_typed(d, "num_samples", int, where, 64),
            seq_len=_typed(d, "seq_len", int, where, 256),
            seed=_typed(d, "seed", int, where, 0),
            text_field=_typed(d, "text_field", str, where, "text"),
            min_expert_tokens=_typed(d, "min_expert_tokens", int, where, 64),
        )
        if c.num_samples <= 0:
            raise UsageError(f"{where}.num_samples: must be positive, got {c.num_samples}", "use e.g. 64")
        if c.seq_len < 2:
            raise UsageError(f"{where}.seq_len: must be at least 2, got {c.seq_len}", "use e.g. 256")
        if c.min_expert_tokens < 0:
            raise UsageError(f"{where}.min_expert_tokens: must be >= 0, got {c.min_expert_tokens}", "use e.g. 64")
        return c


@dataclass(frozen=True)
class Recipe:
    name: str
    weights: QuantScheme
    description: str = ""
    activations: QuantScheme | None = None
    kv_cache: QuantScheme | None = None
    algorithm: tuple[Step, ...] = (Step("rtn"),)
    ignore: tuple[str, ...] = ("lm_head",)
    calibration: Calibration = Calibration()
    text: str = field(default="", compare=False, repr=False)

    @property
    def hash(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()[:16]

    @property
    def step_names(self) -> tuple[str, ...]:
        return tuple(s.name for s in self.algorithm)

    def step(self, name: str) -> Step | None:
        return next((s for s in self.algorithm if s.name == name), None)

    @property
    def static_activations(self) -> bool:
        return self.activations is not None and not self.activations.dynamic

    @property
    def needs_calibration(self) -> bool:
        """Whether any part of the recipe looks at data (otherwise weights stream without forward passes)."""
        from qtk.algorithms.params import STEP_PARAMS

        return (
            self.static_activations
            or self.kv_cache is not None
            or any(STEP_PARAMS[s.name].needs_data for s in self.algorithm)
        )

    @property
    def gptq_actorder(self) -> str | None:
        """The GPTQ step's activation ordering ("static" | "group"), None without GPTQ or ordering."""
        s = self.step("gptq")
        return None if s is None else s.params.actorder

    @property
    def writes_g_idx(self) -> bool:
        """GPTQ with actorder group on group-wise weights: each Linear carries a g_idx (groups in permuted order)."""
        return self.gptq_actorder == "group" and self.weights.strategy == "group"

    def summary(self) -> str:
        parts = [f"W: {self.weights.describe()}"]
        parts.append(f"A: {self.activations.describe()}" if self.activations else "A: bf16")
        parts.append(f"KV: {'fp8' if self.kv_cache.is_fp8 else 'int8'}" if self.kv_cache else "KV: bf16")
        return ", ".join(parts)


TOP_KEYS = {"name", "description", "weights", "activations", "kv_cache", "algorithm", "ignore", "calibration"}


def parse_recipe(doc: Any, text: str = "", origin: str = "recipe") -> Recipe:
    """Validate a parsed YAML document into a Recipe; every error names the key and the fix."""
    from qtk.algorithms.params import STEP_PARAMS, parse_step_params

    if not isinstance(doc, Mapping):
        raise UsageError(f"{origin}: a recipe is a YAML mapping, got {type(doc).__name__}", "start with 'name:' and 'weights:' keys")
    check_keys(doc, TOP_KEYS, origin)
    name = _typed(doc, "name", str, origin)
    if not name:
        raise UsageError(f"{origin}: missing key 'name'", "add 'name: my-recipe'")
    if "weights" not in doc or doc["weights"] is None:
        raise UsageError(f"{origin}: missing key 'weights'", "add e.g. 'weights: {num_bits: 8, type: int, strategy: channel}'")
    weights = QuantScheme.parse(doc["weights"], f"{origin}: weights", "weights")
    acts = doc.get("activations")
    activations = QuantScheme.parse(acts, f"{origin}: activations", "activations") if acts is not None else None
    kv = doc.get("kv_cache")
    kv_cache = QuantScheme.parse(kv, f"{origin}: kv_cache", "kv_cache") if kv is not None else None

    raw_steps = doc.get("algorithm", ["rtn"])
    if isinstance(raw_steps, (str, Mapping)):
        raw_steps = [raw_steps]
    if not isinstance(raw_steps, list) or not raw_steps:
        raise UsageError(f"{origin}: algorithm must be a non-empty list of steps", "e.g. 'algorithm: [rtn]' or '- gptq: {block_size: 128}'")
    steps = []
    for i, raw in enumerate(raw_steps):
        where = f"{origin}: algorithm[{i}]"
        if isinstance(raw, str):
            sname, sparams = raw, {}
        elif isinstance(raw, Mapping) and len(raw) == 1:
            sname, sparams = next(iter(raw.items()))
            sparams = {} if sparams is None else sparams
        else:
            raise UsageError(f"{where}: a step is a name or '{{name: {{params}}}}'", "e.g. '- gptq: {damp_percent: 0.01}'")
        if not isinstance(sname, str) or sname not in STEP_PARAMS:
            raise UsageError(f"{where}: unknown algorithm {sname!r}", f"use one of {', '.join(sorted(STEP_PARAMS))}")
        steps.append(Step(sname, parse_step_params(sname, sparams, f"{where}.{sname}")))
    names = [s.name for s in steps]
    if len(set(names)) != len(names):
        raise UsageError(f"{origin}: algorithm lists a step twice ({names})", "list each step once")
    solvers = [n for n in names if n in ("rtn", "gptq", "awq")]
    if len(solvers) != 1 or names[-1] != solvers[0]:
        raise UsageError(f"{origin}: algorithm must end with exactly one of rtn, gptq, awq (got {names})",
                         "e.g. [smoothquant, gptq] or [awq]")
    if "awq" in names and "smoothquant" in names:
        raise UsageError(f"{origin}: awq and smoothquant both rescale the same channels", "use one of them")

    ignore = doc.get("ignore", ["lm_head"])
    if isinstance(ignore, str):
        ignore = [ignore]
    if not isinstance(ignore, list) or not all(isinstance(p, str) and p for p in ignore):
        raise UsageError(f"{origin}: ignore must be a list of module names or 're:' patterns", "e.g. 'ignore: [lm_head]'")
    for p in ignore:
        if p.startswith("re:"):
            import re

            try:
                re.compile(p[3:])
            except (re.error, OverflowError, RecursionError) as e:
                raise UsageError(f"{origin}: ignore pattern {p!r} is not a valid regex ({e})", "fix the pattern") from None

    calib = doc.get("calibration")
    calibration = Calibration.parse(calib, f"{origin}: calibration") if calib is not None else Calibration()

    if activations is not None:
        if activations.type != weights.type:
            raise UsageError(f"{origin}: activations are {activations.type} but weights are {weights.type}",
                             "use int weights with int activations (W8A8) or fp8 with fp8")
        if weights.num_bits != 8:
            raise UsageError(f"{origin}: {weights.num_bits}-bit weights with 8-bit activations (W{weights.num_bits}A8) is not supported",
                             "drop activations for weight-only (WnA16) or use 8-bit weights")
        if weights.strategy == "group":
            raise UsageError(f"{origin}: group-wise weights with quantized activations have no kernel",
                             "use strategy: channel or tensor for W8A8")
    description = _typed(doc, "description", str, origin, "") or ""
    return Recipe(name=name, description=description.strip(), weights=weights, activations=activations,
                  kv_cache=kv_cache, algorithm=tuple(steps), ignore=tuple(ignore), calibration=calibration, text=text)


class _DuplicateKey(Exception):
    def __init__(self, key, line: int):
        self.key, self.line = key, line


def _strict_loader():
    """yaml.SafeLoader that refuses a key repeated in one mapping (SafeLoader keeps the last one silently)."""
    import yaml

    class Loader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # '<<: *anchor' may be overridden on purpose
                    continue
                key = self.construct_object(key_node, deep=deep)
                try:
                    if key in seen:
                        raise _DuplicateKey(key, key_node.start_mark.line + 1)
                    seen.add(key)
                except TypeError:  # unhashable key: SafeLoader reports it below
                    pass
            return super().construct_mapping(node, deep=deep)

    return Loader


def builtin_recipes() -> dict[str, Path]:
    return {p.stem: p for p in sorted(RECIPES_DIR.glob("*.yaml"))}


def load_recipe(name_or_path: str | Path) -> Recipe:
    """Load a built-in recipe by name, or any YAML file by path."""
    import yaml

    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml") or p.exists():
        if p.is_dir():
            raise UsageError(f"recipe {p} is a directory", "give a path to a YAML file or a built-in name (qtk recipes list)")
        if not p.is_file():
            raise UsageError(f"recipe file {p} does not exist", "give a path to a YAML file or a built-in name (qtk recipes list)")
        path = p
    else:
        known = builtin_recipes()
        if str(name_or_path) not in known:
            raise UsageError(f"unknown recipe {str(name_or_path)!r}", f"built-in recipes: {', '.join(known)}; or give a path to a YAML file")
        path = known[str(name_or_path)]
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"recipe {path.name} is not UTF-8 text (byte {e.start})", "re-save it as UTF-8 YAML") from None
    try:
        doc = yaml.load(text, Loader=_strict_loader())
    except _DuplicateKey as e:
        raise UsageError(f"recipe {path.name}: key {e.key!r} appears twice in one mapping (line {e.line})",
                         "keep one; YAML would silently use the last") from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}" if mark else ""
        raise UsageError(f"recipe {path.name}: not valid YAML{at}", "fix the syntax (indentation, colons, brackets)") from None
    return parse_recipe(doc, text=text, origin=path.name)
