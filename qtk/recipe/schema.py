"""Recipes: what to quantize and how, as frozen dataclasses parsed and validated once at the edge.

A recipe is a YAML document (qtk.recipe.load reads the file). Every error names the key and the fix; nothing
downstream re-validates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from qtk.errors import UsageError
from qtk.quant.formats import FORMATS, format_claiming
from qtk.quant.scheme import (FP8_MAX, INT_BITS, LOCAL, OBSERVERS, SCALE_DTYPES, STRATEGIES, TYPES,  # noqa: F401
                              QuantScheme, Strategy)
from qtk.recipe.rules import ModuleScheme, Override, matches
from qtk.validation import check_keys, suggest_key, typed  # noqa: F401 (re-exported)

def _dynamic(d: Mapping, where: str) -> bool | str:
    v = d.get("dynamic", False)
    if v is None:
        return False
    if isinstance(v, bool) or v == LOCAL:
        return v
    raise UsageError(f"{where}.dynamic: expected true, false or 'local', got {v!r}",
                     "use dynamic: true (run-time scales), false (calibrated) or 'local' (NVFP4 activations)")


def _block_structure(d: Mapping, where: str) -> tuple[int, int] | None:
    v = d.get("block_structure")
    if v is None:
        return None
    if not (isinstance(v, (list, tuple)) and len(v) == 2 and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in v)):
        raise UsageError(f"{where}.block_structure: expected [rows, cols] of positive integers, got {v!r}",
                         "use block_structure: [128, 128]")
    return (v[0], v[1])


def _scale_dtype(d: Mapping, where: str) -> str | None:
    v = typed(d, "scale_dtype", str, where)
    if v in (None, "e8m0", "torch.uint8", "uint8"):  # compressed-tensors spells MX scales torch.uint8
        return None if v is None else "e8m0"
    raise UsageError(f"{where}.scale_dtype: {v!r} is not a scale dtype qtk writes",
                     "use scale_dtype: e8m0 (MX formats) or drop it (the format's own scale dtype)")


def parse_scheme(d: Mapping, where: str, role: str) -> QuantScheme:
    """A QuantScheme from a recipe mapping, validated for its role (weights | activations | kv_cache)."""
    check_keys(d, {f.name for f in fields(QuantScheme)}, where)
    if d.get("num_bits") is None:
        raise UsageError(f"{where}: missing key 'num_bits'", "add e.g. 'num_bits: 8'")
    s = QuantScheme(
        num_bits=typed(d, "num_bits", int, where),
        type=typed(d, "type", str, where, "int"),
        symmetric=typed(d, "symmetric", bool, where, True),
        strategy=typed(d, "strategy", str, where, "tensor" if role == "kv_cache" else "channel"),
        group_size=typed(d, "group_size", int, where),
        dynamic=_dynamic(d, where),
        observer=typed(d, "observer", str, where, "minmax"),
        block_structure=_block_structure(d, where),
        scale_dtype=_scale_dtype(d, where),
    )
    validate_scheme(s, where, role)
    return s


def validate_scheme(s: QuantScheme, where: str, role: str) -> None:
    """Refuse a scheme its role cannot have, naming the key and the fix: the vocabulary every scheme shares here, the
    rest by the number format whose family the scheme is (Format.validate, qtk.quant.formats)."""
    if s.type not in TYPES:
        raise UsageError(f"{where}.type: {s.type!r} is not a quantization type", "use 'int' or 'float'")
    if s.strategy not in STRATEGIES:
        raise UsageError(f"{where}.strategy: unknown strategy {s.strategy!r}", f"use one of {', '.join(STRATEGIES)}")
    if s.observer not in OBSERVERS:
        raise UsageError(f"{where}.observer: unknown observer {s.observer!r}", f"use one of {', '.join(OBSERVERS)}")
    if s.observer == "full_range" and not (role == "weights" and s.has_full_range_grid):
        raise UsageError(f"{where}.observer: full_range is a grid of symmetric int weights per channel or group",
                         "use observer: minmax, or symmetric int weights with strategy channel or group")
    fmt = format_claiming(s)
    if s.strategy == Strategy.BLOCK:
        if s.block_structure is None:
            raise UsageError(f"{where}.block_structure: strategy 'block' needs the block shape", "add 'block_structure: [128, 128]'")
        if fmt is None or not fmt.accepts(s) or role != "weights":
            raise UsageError(f"{where}.strategy: 'block' is for fp8 weights (FP8 block)", "use type: float, num_bits: 8 on weights")
    elif s.block_structure is not None:
        raise UsageError(f"{where}.block_structure: only meaningful with strategy 'block'", "remove block_structure or set strategy: block")
    if s.dynamic == LOCAL and not (fmt is not None and fmt.run_time_local and role == "activations"):
        raise UsageError(f"{where}.dynamic: 'local' (run-time group scales under a static global scale) is for NVFP4 activations",
                         "use dynamic: true or false")
    if fmt is None:
        _unknown_format(s, where)
    fmt.validate(s, where, role)
    if s.strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP):
        if not s.group_size or s.group_size <= 0:
            raise UsageError(f"{where}.group_size: strategy 'group' needs a positive group_size", "add e.g. 'group_size: 128'")
    elif s.group_size is not None:
        raise UsageError(f"{where}.group_size: only meaningful with strategy 'group'", "remove group_size or set strategy: group")
    if s.strategy == Strategy.TOKEN and s.dynamic is not True:
        raise UsageError(f"{where}.strategy: per-token scales are computed at run time", "set dynamic: true")
    if role == "weights":
        if s.dynamic:
            raise UsageError(f"{where}.dynamic: weights are quantized ahead of time", "set dynamic: false")
        if s.strategy == Strategy.TOKEN:
            raise UsageError(f"{where}.strategy: 'token' is for activations", "use channel, group or tensor for weights")
    if role == "activations":
        if s.strategy not in (Strategy.TENSOR, Strategy.TOKEN) and not fmt.activation_strategies(s):
            raise UsageError(f"{where}.strategy: activations are quantized per tensor or per token (or per token "
                             "group: NVFP4, FP8 block)", "use strategy: tensor or token")
        if s.num_bits != 8 and not fmt.activation_bits(s):
            raise UsageError(f"{where}.num_bits: {s.num_bits}-bit activations have no kernel in vLLM or TensorRT-LLM", "use num_bits: 8 or drop activations")
        if not s.symmetric:
            raise UsageError(f"{where}.symmetric: asymmetric activations are not supported by qtk's targets", "set symmetric: true")
    if role == "kv_cache":
        if s.num_bits != 8 or s.strategy != Strategy.TENSOR or s.dynamic or not s.symmetric:
            raise UsageError(f"{where}: the KV cache is quantized to 8 bits, per tensor, static, symmetric",
                             "use 'kv_cache: {num_bits: 8, type: float}' (or type: int for TensorRT-LLM INT8 KV)")
        if s.observer != "minmax":
            raise UsageError(f"{where}.observer: KV scales use the min-max observer", "remove observer")


def checked_scheme(weights: QuantScheme, activations: QuantScheme | None = None, where: str = "scheme", *,
                   together: bool = True) -> ModuleScheme:
    """A ModuleScheme built in code (a reader's table, a checkpoint's config) refused as a recipe's would be: each
    scheme for its role, and (together) the two as one kernel runs them."""
    validate_scheme(weights, f"{where}: weights", "weights")
    if activations is not None:
        validate_scheme(activations, f"{where}: activations", "activations")
    if together:
        _check_pair(weights, activations, where)
    return ModuleScheme(weights, activations)


def _unknown_format(s: QuantScheme, where: str) -> None:
    """A scheme of no registered format's family: its scale dtype, element type or width names no format."""
    if s.scale_dtype is not None and s.type != "float":
        raise UsageError(f"{where}.scale_dtype: e8m0 scales are for the MX float formats", "drop scale_dtype or set type: float")
    if s.type == "float":
        raise UsageError(f"{where}.num_bits: float quantization is fp8 (e4m3) or fp4 (e2m1), got {s.num_bits}",
                         "set num_bits: 8 or 4")
    raise UsageError(f"{where}.num_bits: int{s.num_bits} is not supported", f"use one of {', '.join(map(str, INT_BITS))}")


@dataclass(frozen=True)
class Step:
    """One algorithm step (rtn, gptq, awq, smoothquant) and its validated parameters."""

    name: str
    params: Any = None  # a frozen params dataclass from qtk.recipe.params


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
            dataset=typed(d, "dataset", str, where, "default"),
            num_samples=typed(d, "num_samples", int, where, 64),
            seq_len=typed(d, "seq_len", int, where, 256),
            seed=typed(d, "seed", int, where, 0),
            text_field=typed(d, "text_field", str, where, "text"),
            min_expert_tokens=typed(d, "min_expert_tokens", int, where, 64),
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
    overrides: tuple[Override, ...] = ()  # per-module schemes, first match wins (see qtk.recipe.rules)
    text: str = field(default="", compare=False, repr=False)

    @property
    def default_scheme(self) -> ModuleScheme:
        return ModuleScheme(self.weights, self.activations)

    def scheme_for(self, module: str) -> ModuleScheme | None:
        """The scheme of the Linear named `module` (its full name): None when `ignore` keeps it unquantized, else the
        first override whose targets match it, else the default. Every consumer asks this, not `weights`."""
        if matches(module, self.ignore):
            return None
        for o in self.overrides:
            if matches(module, o.targets):
                return o.scheme
        return self.default_scheme

    @property
    def schemes(self) -> tuple[ModuleScheme, ...]:
        """Every scheme a module can get: the default first, then each override's (duplicates removed)."""
        return tuple(dict.fromkeys([self.default_scheme, *(o.scheme for o in self.overrides)]))

    @property
    def mixed(self) -> bool:
        """More than one scheme: a mixed-precision recipe."""
        return len(self.schemes) > 1

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
        """Some module's activations use a static (calibrated) scale."""
        return any(m.static_activations for m in self.schemes)

    @property
    def needs_calibration(self) -> bool:
        """Whether any part of the recipe looks at data (otherwise weights stream without forward passes)."""
        from qtk.recipe.params import STEP_PARAMS

        return (
            self.static_activations
            or self.kv_cache is not None
            or any(STEP_PARAMS[s.name].needs_data for s in self.algorithm)
        )

    @property
    def online_steps(self) -> list[str]:
        """The listed steps the engine applies part of at run time (an online rotation)."""
        from qtk.recipe.params import STEP_PARAMS

        return [s.name for s in self.algorithm if getattr(STEP_PARAMS[s.name], "online", False)]

    @property
    def gptq_actorder(self) -> str | None:
        """The GPTQ step's activation ordering ("static" | "group"), None without GPTQ or ordering."""
        s = self.step("gptq")
        return None if s is None else s.params.actorder

    @property
    def writes_g_idx(self) -> bool:
        """GPTQ with actorder group on group-wise weights: each Linear carries a g_idx (groups in permuted order)."""
        return self.gptq_actorder == "group" and any(m.weights.strategy in (Strategy.GROUP, Strategy.TENSOR_GROUP) for m in self.schemes)

    def summary(self) -> str:
        parts = [f"W: {self.weights.describe()}"]
        parts.append(f"A: {self.activations.describe()}" if self.activations else "A: bf16")
        parts.append(f"KV: {'fp8' if self.kv_cache.type == 'float' else 'int8'}" if self.kv_cache else "KV: bf16")
        if self.overrides:
            n = len(self.overrides)
            parts.append(f"+{n} override{'s' if n > 1 else ''} ({'; '.join(o.scheme.weights.describe() for o in self.overrides)})")
        return ", ".join(parts)


TOP_KEYS = {"name", "description", "weights", "activations", "kv_cache", "algorithm", "ignore", "calibration", "overrides"}
OVERRIDE_KEYS = ("targets", "weights", "activations")


def parse_recipe(doc: Any, text: str = "", origin: str = "recipe") -> Recipe:
    """Validate a parsed YAML document into a Recipe; every error names the key and the fix."""
    from qtk.recipe.params import STEP_PARAMS, check_steps, parse_step_params

    if not isinstance(doc, Mapping):
        raise UsageError(f"{origin}: a recipe is a YAML mapping, got {type(doc).__name__}", "start with 'name:' and 'weights:' keys")
    check_keys(doc, TOP_KEYS, origin)
    name = typed(doc, "name", str, origin)
    if not name:
        raise UsageError(f"{origin}: missing key 'name'", "add 'name: my-recipe'")
    if "weights" not in doc or doc["weights"] is None:
        raise UsageError(f"{origin}: missing key 'weights'", "add e.g. 'weights: {num_bits: 8, type: int, strategy: channel}'")
    weights = parse_scheme(doc["weights"], f"{origin}: weights", "weights")
    acts = doc.get("activations")
    activations = parse_scheme(acts, f"{origin}: activations", "activations") if acts is not None else None
    kv = doc.get("kv_cache")
    kv_cache = parse_scheme(kv, f"{origin}: kv_cache", "kv_cache") if kv is not None else None

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
    check_steps([s.name for s in steps], origin)

    ignore = doc.get("ignore", ["lm_head"])
    if isinstance(ignore, str):
        ignore = [ignore]
    if not isinstance(ignore, list) or not all(isinstance(p, str) and p for p in ignore):
        raise UsageError(f"{origin}: ignore must be a list of module names or 're:' patterns", "e.g. 'ignore: [lm_head]'")
    for p in ignore:
        _check_regex(p, origin, "ignore")

    calib = doc.get("calibration")
    calibration = Calibration.parse(calib, f"{origin}: calibration") if calib is not None else Calibration()

    _check_pair(weights, activations, origin)
    overrides = _parse_overrides(doc.get("overrides"), activations, origin)
    description = typed(doc, "description", str, origin, "") or ""
    recipe = Recipe(name=name, description=description.strip(), weights=weights, activations=activations,
                    kv_cache=kv_cache, algorithm=tuple(steps), ignore=tuple(ignore), calibration=calibration,
                    overrides=overrides, text=text)
    for s in steps:  # a step that solves only some schemes refuses the others before any work (autoround: int)
        check = getattr(s.params, "check_recipe", None)
        if check is not None:
            check(recipe, origin)
    return recipe


def _check_pair(weights: QuantScheme, activations: QuantScheme | None, where: str) -> None:
    """Weights and activations that one kernel can run together. The formats of the two say first (Format.pairs:
    NVFP4 with NVFP4 (W4A4), MXFP8 with MXFP8, FP8 blocks with per-token-group FP8, int4 groups with FP8 (W4A8-FP8) or
    dynamic per-token INT8 (W4A8-INT8) activations); otherwise W8A8, int with int, fp8 with fp8."""
    if activations is None:
        return
    for fmt in FORMATS:
        if (fmt.claims(weights) or fmt.claims(activations)) and fmt.pairs(weights, activations, where):
            return
    if activations.type != weights.type:
        raise UsageError(f"{where}: activations are {activations.type} but weights are {weights.type}",
                         "use int weights with int activations (W8A8) or fp8 with fp8")
    if weights.num_bits != 8:
        raise UsageError(f"{where}: {weights.num_bits}-bit weights with 8-bit activations (W{weights.num_bits}A8) is not supported",
                         "drop activations for weight-only (WnA16) or use 8-bit weights")
    if weights.strategy == Strategy.GROUP:
        raise UsageError(f"{where}: group-wise weights with quantized activations have no kernel",
                         "use strategy: channel or tensor for W8A8")


def _check_patterns(patterns: list, where: str, what: str, example: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise UsageError(f"{where}: {what} must be a non-empty list of module names or 're:' patterns", f"e.g. '{what}: {example}'")
    for p in patterns:
        _check_regex(p, where, what)
    return tuple(patterns)


def _check_regex(p: str, where: str, what: str) -> None:
    """A 're:' pattern must compile, and must not be able to backtrack exponentially: it is matched against every
    module name of the model (and by qtk inspect against every name of a checkpoint), with no time limit in re."""
    if not p.startswith("re:"):
        return
    import re

    from qtk.bounds import pattern_problem

    try:
        re.compile(p[3:])
    except (re.error, OverflowError, RecursionError) as e:
        raise UsageError(f"{where}: {what} pattern {p!r} is not a valid regex ({e})", "fix the pattern") from None
    problem = pattern_problem(p[3:])
    if problem:
        shown = p if len(p) <= 80 else p[:77] + "..."
        raise UsageError(f"{where}: {what} pattern '{shown}' is refused: {problem}",
                         "match module names without nested repetition, e.g. 're:.*self_attn\\..*' or a dotted "
                         "suffix such as 'mlp.down_proj'")


def _parse_overrides(raw, default_activations: QuantScheme | None, origin: str) -> tuple[Override, ...]:
    """`overrides`: a list of {targets, weights, activations}. An override without `activations` keeps the recipe's
    activations; `activations: null` makes its modules weight-only."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise UsageError(f"{origin}: overrides must be a list of rules",
                         "e.g. 'overrides: [{targets: [\"re:.*down_proj\"], weights: {num_bits: 8, strategy: channel}}]'")
    out = []
    for i, rule in enumerate(raw):
        where = f"{origin}: overrides[{i}]"
        check_keys(rule, OVERRIDE_KEYS, where)
        if rule.get("targets") is None:
            raise UsageError(f"{where}: missing key 'targets'", "add e.g. 'targets: [\"re:.*layers\\.0\\..*\"]'")
        if rule.get("weights") is None:
            raise UsageError(f"{where}: missing key 'weights'", "add the weight scheme these modules get, e.g. 'weights: {num_bits: 8}'")
        targets = _check_patterns(rule["targets"], where, "targets", '["re:.*down_proj"]')
        weights = parse_scheme(rule["weights"], f"{where}: weights", "weights")
        if "activations" in rule:
            a = rule["activations"]
            activations = None if a is None else parse_scheme(a, f"{where}: activations", "activations")
        else:
            activations = default_activations
        _check_pair(weights, activations, where)
        out.append(Override(targets, ModuleScheme(weights, activations)))
    return tuple(out)
