"""Recipes: what to quantize and how, as frozen dataclasses parsed and validated once at the edge.

A recipe is a YAML document (qtk.recipe.load reads the file). Every error names the key and the fix; nothing
downstream re-validates.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from qtk.errors import UsageError
from qtk.quant.scheme import (FP8_MAX, INT_BITS, LOCAL, OBSERVERS, SCALE_DTYPES, STRATEGIES, TYPES,  # noqa: F401
                              QuantScheme)
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


def _validate_float(s: QuantScheme, where: str, role: str) -> None:
    """Float schemes: fp8 e4m3 per tensor / channel / token, in 128x128 blocks or per token group (FP8 block);
    fp4 e2m1 as NVFP4 (tensor_group 16) or MXFP4 (group 32, e8m0); MXFP8 (fp8, group 32, e8m0)."""
    if s.num_bits not in (4, 8):
        raise UsageError(f"{where}.num_bits: float quantization is fp8 (e4m3) or fp4 (e2m1), got {s.num_bits}",
                         "set num_bits: 8 or 4")
    if not s.symmetric:
        raise UsageError(f"{where}.symmetric: float formats have no zero point, asymmetric {s.describe().split()[0]} is impossible",
                         "set symmetric: true")
    if s.scale_dtype == "e8m0":  # MXFP4 / MXFP8
        if s.strategy != "group" or s.group_size != 32:
            raise UsageError(f"{where}: MX formats (scale_dtype e8m0) scale blocks of 32", "use strategy: group, group_size: 32")
        return
    if s.num_bits == 4:
        if s.strategy != "tensor_group" or s.group_size != 16:
            raise UsageError(f"{where}: fp4 is NVFP4 (groups of 16 under a global scale) or MXFP4 (groups of 32, e8m0 scales)",
                             "use 'strategy: tensor_group, group_size: 16' (NVFP4) or "
                             "'strategy: group, group_size: 32, scale_dtype: e8m0' (MXFP4)")
        return
    if s.strategy == "tensor_group":
        raise UsageError(f"{where}.strategy: tensor_group is NVFP4's (fp4)", "set num_bits: 4 or use strategy: block / channel")
    if s.strategy == "group" and not (role == "activations" and s.dynamic is True):
        raise UsageError(f"{where}.strategy: group-wise fp8 is not supported by the target engines (except dynamic "
                         "per-token-group activations of FP8 block)", "use strategy: channel, tensor or block")


def validate_scheme(s: QuantScheme, where: str, role: str) -> None:
    """Refuse a scheme its role cannot have, naming the key and the fix."""
    if s.type not in TYPES:
        raise UsageError(f"{where}.type: {s.type!r} is not a quantization type", "use 'int' or 'float'")
    if s.strategy not in STRATEGIES:
        raise UsageError(f"{where}.strategy: unknown strategy {s.strategy!r}", f"use one of {', '.join(STRATEGIES)}")
    if s.observer not in OBSERVERS:
        raise UsageError(f"{where}.observer: unknown observer {s.observer!r}", f"use one of {', '.join(OBSERVERS)}")
    if s.scale_dtype is not None and s.type != "float":
        raise UsageError(f"{where}.scale_dtype: e8m0 scales are for the MX float formats", "drop scale_dtype or set type: float")
    if s.strategy == "block":
        if s.block_structure is None:
            raise UsageError(f"{where}.block_structure: strategy 'block' needs the block shape", "add 'block_structure: [128, 128]'")
        if not s.is_fp8 or role != "weights":
            raise UsageError(f"{where}.strategy: 'block' is for fp8 weights (FP8 block)", "use type: float, num_bits: 8 on weights")
    elif s.block_structure is not None:
        raise UsageError(f"{where}.block_structure: only meaningful with strategy 'block'", "remove block_structure or set strategy: block")
    if s.dynamic == LOCAL and not (s.is_nvfp4 and role == "activations"):
        raise UsageError(f"{where}.dynamic: 'local' (run-time group scales under a static global scale) is for NVFP4 activations",
                         "use dynamic: true or false")
    if s.type == "float":
        _validate_float(s, where, role)
        if s.observer == "mse" and (s.num_bits == 4 or s.strategy == "block"):
            raise UsageError(f"{where}.observer: the mse observer searches int / fp8 per-channel grids only",
                             "use observer: minmax")
    elif s.num_bits not in INT_BITS:
        raise UsageError(f"{where}.num_bits: int{s.num_bits} is not supported", f"use one of {', '.join(map(str, INT_BITS))}")
    elif s.strategy == "tensor_group":
        raise UsageError(f"{where}.strategy: tensor_group is NVFP4's (fp4)", "use strategy: group for int weights")
    if s.strategy in ("group", "tensor_group"):
        if not s.group_size or s.group_size <= 0:
            raise UsageError(f"{where}.group_size: strategy 'group' needs a positive group_size", "add e.g. 'group_size: 128'")
    elif s.group_size is not None:
        raise UsageError(f"{where}.group_size: only meaningful with strategy 'group'", "remove group_size or set strategy: group")
    if s.strategy == "token" and s.dynamic is not True:
        raise UsageError(f"{where}.strategy: per-token scales are computed at run time", "set dynamic: true")
    if role == "weights":
        if s.dynamic:
            raise UsageError(f"{where}.dynamic: weights are quantized ahead of time", "set dynamic: false")
        if s.strategy == "token":
            raise UsageError(f"{where}.strategy: 'token' is for activations", "use channel, group or tensor for weights")
    if role == "activations":
        fp4_act = s.is_nvfp4 and s.dynamic == LOCAL
        group_act = s.is_fp8 and s.strategy == "group" and s.dynamic is True and s.scale_dtype is None
        if s.is_nvfp4 and not fp4_act:
            raise UsageError(f"{where}.dynamic: NVFP4 activations take group scales at run time under a calibrated global "
                             "scale", "set dynamic: local")
        mx_act = s.is_mx and s.num_bits == 8 and s.dynamic is True
        if s.is_mx and not mx_act:
            raise UsageError(f"{where}: MX activations are MXFP8 (num_bits 8) with block scales taken at run time; "
                             f"qtk's targets write no {s.describe()} activations",
                             "use the mxfp8 recipe's activations (num_bits: 8, dynamic: true) or drop them (mxfp4-a16)")
        group_act = group_act or mx_act
        if s.strategy not in ("tensor", "token") and not (fp4_act or group_act):
            raise UsageError(f"{where}.strategy: activations are quantized per tensor or per token (or per token "
                             "group: NVFP4, FP8 block)", "use strategy: tensor or token")
        if s.num_bits != 8 and not fp4_act:
            raise UsageError(f"{where}.num_bits: {s.num_bits}-bit activations have no kernel in vLLM or TensorRT-LLM", "use num_bits: 8 or drop activations")
        if not s.symmetric and s.is_fp8:
            raise UsageError(f"{where}.symmetric: fp8 activations are symmetric", "set symmetric: true")
        if not s.symmetric:
            raise UsageError(f"{where}.symmetric: asymmetric activations are not supported by qtk's targets", "set symmetric: true")
    if role == "kv_cache":
        if s.num_bits != 8 or s.strategy != "tensor" or s.dynamic or not s.symmetric:
            raise UsageError(f"{where}: the KV cache is quantized to 8 bits, per tensor, static, symmetric",
                             "use 'kv_cache: {num_bits: 8, type: float}' (or type: int for TensorRT-LLM INT8 KV)")
        if s.observer != "minmax":
            raise UsageError(f"{where}.observer: KV scales use the min-max observer", "remove observer")


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
    def gptq_actorder(self) -> str | None:
        """The GPTQ step's activation ordering ("static" | "group"), None without GPTQ or ordering."""
        s = self.step("gptq")
        return None if s is None else s.params.actorder

    @property
    def writes_g_idx(self) -> bool:
        """GPTQ with actorder group on group-wise weights: each Linear carries a g_idx (groups in permuted order)."""
        return self.gptq_actorder == "group" and any(m.weights.strategy in ("group", "tensor_group") for m in self.schemes)

    def summary(self) -> str:
        parts = [f"W: {self.weights.describe()}"]
        parts.append(f"A: {self.activations.describe()}" if self.activations else "A: bf16")
        parts.append(f"KV: {'fp8' if self.kv_cache.is_fp8 else 'int8'}" if self.kv_cache else "KV: bf16")
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
        if p.startswith("re:"):
            import re

            try:
                re.compile(p[3:])
            except (re.error, OverflowError, RecursionError) as e:
                raise UsageError(f"{origin}: ignore pattern {p!r} is not a valid regex ({e})", "fix the pattern") from None

    calib = doc.get("calibration")
    calibration = Calibration.parse(calib, f"{origin}: calibration") if calib is not None else Calibration()

    _check_pair(weights, activations, origin)
    overrides = _parse_overrides(doc.get("overrides"), activations, origin)
    description = typed(doc, "description", str, origin, "") or ""
    return Recipe(name=name, description=description.strip(), weights=weights, activations=activations,
                  kv_cache=kv_cache, algorithm=tuple(steps), ignore=tuple(ignore), calibration=calibration,
                  overrides=overrides, text=text)


def _check_pair(weights: QuantScheme, activations: QuantScheme | None, where: str) -> None:
    """Weights and activations that one kernel can run together: W8A8 (int with int, fp8 with fp8), NVFP4 with NVFP4
    (W4A4), FP8 blocks with per-token-group FP8, int4 groups with FP8 (W4A8-FP8) or dynamic per-token INT8 (W4A8-INT8)
    activations."""
    if activations is None:
        return
    w, a = weights, activations
    if w.is_nvfp4 or a.is_nvfp4:
        if not (w.is_nvfp4 and a.is_nvfp4):
            raise UsageError(f"{where}: NVFP4 weights and activations go together (W4A4) or the weights alone (W4A16)",
                             "use the nvfp4 or nvfp4-a16 recipe as a template")
        return
    if w.is_mx or a.is_mx:  # W8A8-MX: vLLM's CompressedTensorsW8A8Mxfp8 (FlashInfer CUTLASS on Blackwell)
        if not (w.is_mx and a.is_mx and w.num_bits == 8 and a.num_bits == 8):
            raise UsageError(f"{where}: MX weights run with quantized activations only as MXFP8 with MXFP8 activations "
                             f"(W8A8-MX), not {w.describe()} weights with {a.describe()} activations",
                             "use the mxfp8 recipe as a template, or drop activations (mxfp4-a16, mxfp8-a16)")
        return
    a_group = a.strategy == "group"
    if w.strategy == "block" or a_group:
        if not (w.strategy == "block" and a_group and a.is_fp8):
            raise UsageError(f"{where}: FP8 block weights run with dynamic FP8 activations per token group of 128, and "
                             "only they", "use the fp8-block recipe as a template")
        if a.group_size != w.block_structure[1]:
            raise UsageError(f"{where}: activation groups of {a.group_size} do not match weight blocks of "
                             f"{w.block_structure[1]} input columns", f"set activations group_size: {w.block_structure[1]}")
        return
    if w.type == "int" and w.num_bits == 4 and w.strategy == "group" and a.is_fp8:  # W4A8-FP8
        # per token, dynamic: vLLM's CompressedTensorsW4A8Fp8; per tensor, static: TensorRT-LLM's W4A8_AWQ
        per_token = a.strategy == "token" and a.dynamic is True
        per_tensor = a.strategy == "tensor" and not a.dynamic
        if not ((per_token or per_tensor) and w.symmetric and w.group_size == 128):
            raise UsageError(f"{where}: int4 group weights run with 8-bit activations only as W4A8-FP8: symmetric "
                             "groups of 128, FP8 activations per token, dynamic (vLLM's CompressedTensorsW4A8Fp8) or "
                             "per tensor, static (TensorRT-LLM's W4A8_AWQ)", "use the w4a8-fp8 recipe as a template")
        return
    if w.type == "int" and w.num_bits == 4 and a.type == "int" and a.num_bits == 8:  # W4A8-INT8
        # vLLM's CompressedTensorsW4A8Int (_is_dynamic_token_w4a8_int): symmetric int4 weights, int8 per token, dynamic
        if not (w.strategy == "group" and w.symmetric and a.strategy == "token" and a.dynamic is True and a.symmetric):
            raise UsageError(f"{where}: 4-bit weights with 8-bit int activations (W4A8) run only as W4A8-INT8: symmetric "
                             "int4 groups with symmetric INT8 activations per token, dynamic (vLLM's CompressedTensorsW4A8Int)",
                             "use the w4a8-int8 recipe as a template, or drop activations for weight-only (W4A16)")
        return
    if activations.type != weights.type:
        raise UsageError(f"{where}: activations are {activations.type} but weights are {weights.type}",
                         "use int weights with int activations (W8A8) or fp8 with fp8")
    if weights.num_bits != 8:
        raise UsageError(f"{where}: {weights.num_bits}-bit weights with 8-bit activations (W{weights.num_bits}A8) is not supported",
                         "drop activations for weight-only (WnA16) or use 8-bit weights")
    if weights.strategy == "group":
        raise UsageError(f"{where}: group-wise weights with quantized activations have no kernel",
                         "use strategy: channel or tensor for W8A8")


def _check_patterns(patterns: list, where: str, what: str, example: str) -> tuple[str, ...]:
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise UsageError(f"{where}: {what} must be a non-empty list of module names or 're:' patterns", f"e.g. '{what}: {example}'")
    for p in patterns:
        if p.startswith("re:"):
            import re

            try:
                re.compile(p[3:])
            except (re.error, OverflowError, RecursionError) as e:
                raise UsageError(f"{where}: {what} pattern {p!r} is not a valid regex ({e})", "fix the pattern") from None
    return tuple(patterns)


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
