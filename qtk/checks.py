"""Checks of a written checkpoint, judged from the bytes on disk: every tensor's dtype and shape against the scheme
its config declares, the config against the tensors, and every quantized Linear decoded through the target's own
reader and compared with the source weights (its error within the scheme's bound and equal to the figure qtk.json
recorded). One implementation serves `qtk inspect`, the self-check `qtk convert` runs on each temporary output
before renaming it into place, and `qtk eval` at load. Memory stays O(one tensor): Linears and dense tensors are
read, judged and dropped one at a time."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qtk.errors import QtkError

if TYPE_CHECKING:
    from qtk.pipeline.result import Measured  # what the data-free stream measured (its self-check takes it)

# relative Frobenius error ||W - Q(W)|| / ||W|| that a sane quantizer stays far below (RTN on Gaussian
# weights gives ~0.01 at int8, ~0.15 at int4, ~0.04 at fp8); a broken one (wrong scale, collapsed
# packing, swapped layout) lands at or above 1.
MAX_REL_ERROR = {("int", 8): 0.1, ("int", 4): 0.7, ("int", 2): 1.5, ("float", 8): 0.2, ("float", 4): 0.7}
MANIFEST_TOLERANCE = 1e-3  # |error measured on disk - error qtk.json recorded|
WEIGHT_RANGE = (1e-8, 1e4)  # a decoded weight's largest magnitude outside this is no trained LLM's
ACT_RANGE = (1e-6, 1e6)  # the activation range a static input scale implies
KV_SLACK = 1.05  # the K/V bound is exact math; the engine computes K and V in 16 bits
KV_FLOOR_RATIO = 1e-6  # a K/V range this far below the bound the weights allow is a broken scale
CONFIG_LIMITS = {"hidden_size": 1 << 20, "num_hidden_layers": 1 << 12, "vocab_size": 1 << 24,
                 "num_attention_heads": 1 << 12, "num_key_value_heads": 1 << 12, "intermediate_size": 1 << 22,
                 "head_dim": 1 << 14, "max_position_embeddings": 1 << 26}
CONFIG_REQUIRED = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads")
STRUCTURE = "tensors match the config (dtypes, shapes, scheme)"


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    skipped: bool = False


@dataclass
class CheckReport:
    checks: list[Check] = field(default_factory=list)
    modules: dict[str, str] = field(default_factory=dict)  # module -> "int8 [out, in] int8 channel sym"
    errors: dict[str, float] = field(default_factory=dict)  # module -> ||W_disk - W_source|| / ||W_source||
    kv_amax: dict[int, list[float]] = field(default_factory=dict)  # layer -> K, V range the written scales imply

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]

    def add(self, name: str, problems: list[str], detail: str = "") -> None:
        shown = "; ".join(problems[:3]) + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
        self.checks.append(Check(name, not problems, shown if problems else detail))


# ---- config and expected tensors ----

def config_problems(cfg: dict) -> list[str]:
    """Sizes in config.json: positive integers, within reason, consistent with each other (checked before any
    skeleton is built: a hidden_size of 1e9 would otherwise allocate gigabytes of rotary tables)."""
    out = []
    for k in CONFIG_REQUIRED:
        if k not in cfg:
            out.append(f"config.json has no {k}")
    for k, limit in CONFIG_LIMITS.items():
        if k not in cfg or cfg[k] is None:
            continue
        v = cfg[k]
        if not isinstance(v, int) or isinstance(v, bool):
            out.append(f"config.json {k} is {v!r}, not an integer")
        elif not 0 < v <= limit:
            out.append(f"config.json {k} is {v}, outside 1..{limit}")
    if out:
        return out
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    if heads % kv:
        out.append(f"config.json num_key_value_heads {kv} does not divide num_attention_heads {heads}")
    if not cfg.get("head_dim") and cfg["hidden_size"] % heads:
        out.append(f"config.json num_attention_heads {heads} does not divide hidden_size {cfg['hidden_size']}")
    return out


def expected_parameters(hf_config: dict) -> tuple[dict[str, list[int]], list[set[str]]]:
    """{parameter name: shape} of the model the config describes, and the groups of names that share one tensor
    (tied embeddings: one of each group must be stored). From config.json alone where it says every size
    (qtk.model.layout), else from a meta-device skeleton (no memory)."""
    from qtk.model.arch import ARCHS, arch_for
    from qtk.model.layout import layout_from_config

    cfg = dict(hf_config)
    cfg.pop("quantization_config", None)
    layout = None
    if cfg.get("model_type") in ARCHS:
        try:
            layout = layout_from_config(cfg, arch_for(cfg["model_type"], cfg))
        except QtkError:
            layout = None  # the skeleton's reading of the config decides (and names what is wrong)
    if layout is not None:
        shapes = {k: list(v) for k, v in layout.shapes().items()}
        return shapes, [set(g) for g in layout.groups()]
    from transformers import AutoConfig

    from qtk.model.source import meta_skeleton

    model_type = cfg.pop("model_type", None)
    try:
        config = AutoConfig.for_model(model_type, **cfg)
        model = meta_skeleton(config)
    except QtkError:
        raise
    except Exception as e:  # transformers' config validation raises many types
        from qtk.errors import CheckFailed

        raise CheckFailed(f"config.json cannot be read by transformers ({e.__class__.__name__}: {' '.join(str(e).split())[:160]})",
                          "the checkpoint is damaged or was edited: re-run qtk convert") from None
    shapes, groups = {}, {}
    for name, p in model.named_parameters(remove_duplicate=False):
        shapes[name] = list(p.shape)
        groups.setdefault(id(p), set()).add(name)
    return shapes, list(groups.values())


# ---- the reference a written weight is compared with ----

def layer_of(module: str, arch) -> int | None:
    prefix = arch.layers + "."
    if not module.startswith(prefix):
        return None
    head = module[len(prefix):].partition(".")[0]
    return int(head) if head.isdigit() else None


def smoothing_scales(records: dict | None) -> dict[str, list[float]]:
    """A layer's smoothing scales from its manifest records (JSON): {prev: s}, as the pipeline folded them."""
    from qtk.steps.records import RECORDS, folded_scales, records_from_json

    # records of steps this qtk does not know (a newer writer) fold nothing it could undo
    return folded_scales(records_from_json({k: v for k, v in (records or {}).items() if k in RECORDS}))


def frame_unknown(records: dict | None) -> bool:
    """AWQ rescaled this layer but its records hold only the chosen ratio, not the scales (a checkpoint written
    before qtk recorded them): the frame its weights were quantized in cannot be rebuilt from the source."""
    awq = (records or {}).get("awq") or {}
    return any(r is not None for r in (awq.get("scales") or {}).values()) and not awq.get("s")


def reference_weight(source, module: str, arch, layer_records: dict | None):
    """float32 [out, in]: the source weight of `module` as the quantizer saw it (model dtype, smoothing folded)."""
    from qtk.pipeline import compute_dtype
    from qtk.steps.smoothing import smoothed_weight

    W = source.tensor(f"{module}.weight").to(compute_dtype(source)).float()
    i = layer_of(module, arch)
    scales = smoothing_scales(layer_records)
    if i is None or not scales:
        return W
    return smoothed_weight(W, module[len(f"{arch.layers}.{i}."):], arch, scales)


# ---- the checks ----

def expected_quantized(ck, arch, recipe) -> list[str]:
    """Linears of every decoder layer per the architecture table, less the recipe's ignore (when known) or else
    the checkpoint's own exclusions."""
    from qtk.recipe import matches

    ignore = list(recipe.ignore) if recipe is not None else ck.ignore_patterns()
    n = int(ck.hf_config["num_hidden_layers"])
    return [f"{arch.layers}.{i}.{lin}" for i in range(n) for lin in arch.linears
            if not matches(f"{arch.layers}.{i}.{lin}", ignore)]


def _kv_bounds(ck, arch, layer: int, rownorm: dict, dense_stats: dict) -> tuple[float, float] | None:
    """Upper bounds of |K after RoPE| and |V| in layer `layer` from its weights alone (Cauchy-Schwarz): an RMS-normed
    input x has ||x|| <= sqrt(hidden) * max|norm weight|, so |k_r| <= ||W_k row r|| ||x|| + |b_r|, and RoPE rotates
    pairs, which grows one component by at most sqrt(2). A per-head k_norm bounds it by sqrt(head_dim) max|its weight|."""
    cfg = ck.hf_config
    p = f"{arch.layers}.{layer}."
    gamma = dense_stats.get(f"{p}input_layernorm.weight")
    if gamma is None:
        return None
    x_norm = math.sqrt(int(cfg["hidden_size"])) * gamma
    out = []
    for which in ("k_proj", "v_proj"):
        src = next((f"{p}{arch.attn}.{n}" for n in (which, "qkv_proj") if f"{arch.attn}.{n}" in arch.linears), None)
        if src is None or src not in rownorm:
            return None
        b = dense_stats.get(f"{src}.bias", 0.0)
        bound = rownorm[src] * x_norm + b
        if which == "k_proj":
            bound *= math.sqrt(2)
            kn = dense_stats.get(f"{p}{arch.attn}.k_norm.weight")
            if kn is not None:
                hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
                bound = min(bound, math.sqrt(hd) * kn)
        out.append(bound)
    return out[0], out[1]


def check_checkpoint(ck, *, source=None, recipe=None, source_note: str = "",
                     measured: dict[str, Measured] | None = None, finite: set[str] = frozenset()) -> CheckReport:
    """Judge the checkpoint `ck` (a reader from qtk.export.open_checkpoint) from its bytes.

    source: the model it was converted from (qtk.model.source.ModelSource), for the per-Linear comparison; without
    it that check is reported as skipped, with `source_note` saying why. recipe: the recipe it was converted with
    (default: the one qtk.json records), for the set of Linears that must be quantized. measured: module -> what the
    conversion measured of it against `source` (the convert self-check of a data-free run): a Linear whose decoded
    QTensor has the measured digest takes the measured error and range instead of re-reading the source; any other
    is compared in full. finite: dense tensors whose bytes in ck's files were already scanned for NaN/Inf where they
    lie (the convert self-check: the writer's scan of what it copied), not read again."""
    from qtk.quant.qtensor import qtensor_digest

    import torch

    from qtk.io.safetensors import as_tensor
    from qtk.quant.finite import all_finite
    from qtk.quant.error import relative_error

    rep = CheckReport()
    cfg_problems = config_problems(ck.hf_config)
    rep.add("config.json sizes are sane", cfg_problems)
    if cfg_problems:
        return rep
    manifest = ck.manifest
    if ck.manifest_error:
        rep.add("qtk.json readable", [ck.manifest_error])
    if recipe is None and manifest:
        recipe = _manifest_recipe(manifest)
    shapes, tied = expected_parameters(ck.hf_config)
    arch = ck.arch
    structure: list[str] = list(ck.format_problems())
    try:
        mods = ck.modules()
    except QtkError as e:
        rep.add(STRUCTURE, [str(e.problem)])
        return rep

    # ---- every quantized Linear, one at a time
    recorded = ((manifest or {}).get("stats") or {}).get("weight_error") or {}
    algo_records = ((manifest or {}).get("stats") or {}).get("algorithm") or {}
    static_act: list[str] = []  # modules whose scheme has static activation scales
    bad_scale, constant, off_grid, implausible, compare, act, uncompared = [], [], [], [], [], [], []
    bad_global: list[str] = []  # NVFP4 global scales not finite / positive, E8M0 codes out of range
    global_scales: dict[str, float] = {}  # module -> NVFP4 weight global scale, for the fused-group check
    fp4_mx = False  # some module is NVFP4 or MX: their scale checks are reported
    rownorm: dict[str, float] = {}

    def judge(m: str, err: float, bound: float, s) -> None:
        """Module m's error against the source, in rep.errors, held to the scheme's bound and qtk.json's figure."""
        rep.errors[m] = err
        if not err <= bound:
            compare.append(f"{m}: error {err:.3f} against the source exceeds {bound} for {s.describe()}")
        elif m in recorded and not abs(err - float(recorded[m])) <= MANIFEST_TOLERANCE:
            compare.append(f"{m}: error {err:.4f} on disk, qtk.json recorded {float(recorded[m]):.4f}")
        elif recorded and m not in recorded:
            compare.append(f"{m}: qtk.json records no error for it")

    for m in mods:
        shape = shapes.get(f"{m}.weight")
        if shape is None or len(shape) != 2:
            structure.append(f"{m}: quantized tensors for a module the config does not have")
            continue
        try:
            problems = ck.check_module(m, tuple(shape))
            if problems:
                structure.extend(problems)
                continue
            qt = ck.qtensor(m)
            if tuple(qt.shape) != tuple(shape):
                structure.append(f"{m} decodes to {list(qt.shape)}, the config implies {shape}")
                continue
            known = (measured or {}).get(m)
            same = known is not None and qtensor_digest(qt) == known.digest
            w = None if same else ck.written_weight(m, qt)
            scheme = ck.scheme_for(m)
            act_scheme = scheme.activations if scheme is not None else None
            in_scale = ck.input_scale(m) if (act_scheme is not None and act_scheme.has_static_scale) else None
        except QtkError as e:
            structure.append(f"{m}: {e.problem}")
            continue
        except (KeyError, ValueError, RuntimeError, TypeError, IndexError) as e:  # tensors that do not fit together
            structure.append(f"{m} cannot be decoded ({e.__class__.__name__}: {' '.join(str(e).split())[:120]})")
            continue
        s = qt.scheme  # the scheme the config gives this module: its bound, its grid
        bound = MAX_REL_ERROR.get((s.type, s.num_bits), math.inf)
        rep.modules[m] = f"{str(qt.values.dtype).replace('torch.', '')} {list(qt.shape)} {s.describe()}"
        # finite and positive in one pass: NaN propagates through aminmax, so a NaN scale fails too
        lo_s, hi_s = (float(x) for x in torch.aminmax(qt.scale.float())) if qt.scale.numel() else (1.0, 1.0)
        if not (lo_s > 0 and hi_s < math.inf):
            bad_scale.append(m)
        v = qt.values.reshape(-1)
        # ints and FP4's uint8 codes: one min/max pass tells both a collapsed weight and codes off the grid
        codes = (s.type == "int" or s.is_fp4) and not v.is_floating_point()
        lo, hi = (int(x) for x in torch.aminmax(v)) if codes and v.numel() else (0, 0)
        if v.numel() > 1 and (lo == hi if codes else _constant(v)):
            constant.append(f"{m}: every quantized value is {v[0].item()} (collapsed)")
        if s.type == "int" and v.numel() and (lo < s.qmin or hi > s.qmax):
            off_grid.append(f"{m} holds values {lo}..{hi}, outside int{s.num_bits}'s {s.qmin}..{s.qmax}")
        elif s.is_fp4 and v.numel() and (top := hi if codes else int(v.max())) > 15:
            off_grid.append(f"{m} holds codes up to {top}, outside FP4's 0..15")
        bad_global.extend(_format_scale_problems(m, qt, global_scales))
        fp4_mx = fp4_mx or s.is_nvfp4 or s.is_mx
        if same:
            amax = known.amax
        else:
            amax = float(w.abs().max()) if w.numel() else 0.0
        if not math.isfinite(amax) or amax > WEIGHT_RANGE[1] or 0 < amax < WEIGHT_RANGE[0]:
            implausible.append(f"{m} decodes to weights up to {amax:.3g} (scale {float(qt.scale.abs().max()):.3g}), "
                               f"outside {WEIGHT_RANGE[0]:g}..{WEIGHT_RANGE[1]:g}")
        if act_scheme is not None and act_scheme.has_static_scale:
            static_act.append(m)
        if in_scale is not None:
            if act_scheme.is_nvfp4:  # a global input scale multiplies: 448·6 / amax
                a = 448.0 * 6.0 / float(in_scale.reshape(-1)[0])
            else:
                qmax = 448.0 if act_scheme.is_fp8 else float(act_scheme.qmax)
                a = float(in_scale.reshape(-1)[0]) * qmax
            if not (math.isfinite(a) and ACT_RANGE[0] < a < ACT_RANGE[1]):
                act.append(f"{m}.input_scale implies activations up to {a:.3g}")
        if arch is not None and m.rsplit(".", 1)[-1] in ("k_proj", "v_proj", "qkv_proj") and (w is not None or ck.kv_cache):
            if w is None:  # only the KV check uses the row norms
                w = ck.written_weight(m, qt)
            rownorm[m] = float(w.norm(dim=1).max())
        if source is not None and arch is not None:
            layer_records = algo_records.get(str(layer_of(m, arch)))
            if frame_unknown(layer_records):
                uncompared.append(m)
                continue
            if same:  # these bytes decode to exactly what was measured against the source
                judge(m, known.error, bound, s)
                del qt
                continue
            try:
                ref = reference_weight(source, m, arch, layer_records)
            except QtkError as e:
                compare.append(f"{m}: the source has no such weight ({e.problem})")
                continue
            if list(ref.shape) != list(w.shape):
                compare.append(f"{m}: the source weight is {list(ref.shape)}, the checkpoint's {list(w.shape)} "
                               "(is the source the model it was converted from?)")
                continue
            judge(m, relative_error(w, ref), bound, s)
        del qt, w

    # ---- dense tensors, one at a time
    quantized = set(mods)
    dense_seen, nonfinite = set(), []
    stats: dict[str, float] = {}  # norm weights' max |effective value|, biases' max |b|, dense k/v row norms
    one_plus = bool(arch is not None and arch.norm_one_plus)
    try:
        for name, t in ck.iter_dense_stored():  # an embedding unread: scanned from disk in chunks
            dense_seen.add(name)
            want = shapes.get(name)
            if want is None:
                structure.append(f"{name} is not a tensor of this model (config: {ck.hf_config.get('model_type')})")
                continue
            if list(t.shape) != want:
                structure.append(f"{name} has shape {list(t.shape)}, the config implies {want}")
                continue
            if not t.is_floating_point():
                structure.append(f"{name} is stored as {str(t.dtype).replace('torch.', '')}, not a float tensor")
                continue
            values = name.endswith(("norm.weight", ".bias")) or (
                arch is not None and name.endswith(("k_proj.weight", "v_proj.weight", "qkv_proj.weight")))
            if values:  # small tensors whose values the bounds need
                t = as_tensor(t)
            if name not in finite and not all_finite(t):
                nonfinite.append(name)
                continue
            if name.endswith("norm.weight"):
                stats[name] = float(((1 + t.float()) if one_plus else t.float()).abs().max())
            elif name.endswith(".bias"):
                stats[name] = float(t.float().abs().max())
            elif arch is not None and name.endswith(("k_proj.weight", "v_proj.weight", "qkv_proj.weight")):
                rownorm[name[: -len(".weight")]] = float(t.float().norm(dim=1).max())
            del t
    except QtkError as e:
        structure.append(str(e.problem))
    for group in tied:
        names = sorted(group)
        if any(n in dense_seen or (n.endswith(".weight") and n[: -len(".weight")] in quantized) for n in names):
            continue
        structure.append(f"{names[0]} is missing (the config's model needs it)")
    rep.add(STRUCTURE, structure,
            f"{len(mods)} quantized Linears, {len(dense_seen)} dense tensors")

    # ---- coverage: what the recipe quantizes is quantized, and the config says so
    if arch is not None:
        expected = expected_quantized(ck, arch, recipe)
        missing = [m for m in expected if m not in quantized]
        hidden = [m for m in mods if _ignored(m, ck)]
        problems = [f"not quantized: {', '.join(missing[:5])}"] if missing else []
        problems += [f"the config's ignore covers {m}, which holds quantized tensors" for m in hidden[:3]]
        rep.add("every targeted Linear is quantized", problems, f"{len(mods)} quantized")
    rep.add("weight scales finite and positive", bad_scale)
    if fp4_mx:
        bad_global.extend(_fused_global_problems(global_scales, ck, arch))
        rep.add("NVFP4 global scales finite and shared in fused groups; E8M0 scales in range", bad_global)
    rep.add("quantized weights not constant", constant)
    rep.add("weights decode to plausible values", off_grid + implausible)
    if source is not None and arch is not None:
        detail = f"{len(rep.errors)} Linears, max error {max(rep.errors.values(), default=0):.4f}"
        if recorded:
            detail += f", within {MANIFEST_TOLERANCE:g} of qtk.json"
        if uncompared:
            detail += f"; {len(uncompared)} not compared (qtk.json holds no AWQ scales for their layers: an older qtk wrote it)"
        rep.add("written weights match the source", compare, detail)
    else:
        rep.checks.append(Check("written weights match the source", True,
                                f"skipped: {source_note or 'no source model given'}", skipped=True))

    # ---- KV cache and activation scales
    n_layers = int(ck.hf_config["num_hidden_layers"])
    if ck.kv_cache:
        _check_kv(ck, arch, n_layers, rownorm, stats, rep)
    if static_act:
        no_in = [m for m in static_act if ck.input_scale(m) is None]
        rep.add("static activation scales present and plausible", [f"{m}.input_scale is missing" for m in no_in[:3]] + act)
    rep.add("dense tensors finite", [f"{n} has NaN/Inf" for n in nonfinite])
    return rep


def _constant(v) -> bool:
    """Whether every element of the 1-D float tensor `v` equals the first (as `(v == v[0]).all()`: +0 equals -0, NaN
    equals nothing). FP8's == has no vectorized kernel; its bytes are compared instead."""
    import torch

    if v.element_size() != 1:
        return bool((v == v[0]).all())
    u = v.view(torch.uint8)
    lo, hi = (int(x) for x in torch.aminmax(u))
    if not v.is_floating_point():  # FP4 codes are uint8: equal values are equal bytes
        return lo == hi
    if lo != hi:  # several bytes: equal values only if every one is +0 (0x00) or -0 (0x80), which needs lo 0, hi 0x80
        return lo == 0 and hi == 0x80 and int(torch.aminmax(u & 0x7F)[1]) == 0
    return not bool(torch.isnan(v[0].float()))


def _format_scale_problems(m: str, qt, global_scales: dict[str, float]) -> list[str]:
    """NVFP4: the weight global scale finite and positive (recorded for the fused-group check); MX: every E8M0 scale a
    finite power of two (code 255 is NaN)."""
    import torch

    out = []
    gs = qt.extra.get("global_scale")
    if gs is not None:
        g = float(gs.reshape(-1)[0])
        if not (math.isfinite(g) and g > 0):
            out.append(f"{m}.weight_global_scale is {g}")
        else:
            global_scales[m] = g
    if qt.scheme.is_mx:
        from qtk.quant.native.scan import count_not_pow2

        sc = qt.scale.float()
        n_bad = count_not_pow2(sc)
        if n_bad is None:  # a positive finite power of two (subnormal too) has mantissa 0.5; NaN, Inf, <= 0 fail
            n_bad = int((torch.frexp(sc).mantissa != 0.5).sum())
        if n_bad:
            out.append(f"{m}: {n_bad} E8M0 scales are NaN (code 255) or not powers of two")
    return out


def _fused_global_problems(global_scales: dict[str, float], ck, arch) -> list[str]:
    """Linears the engines fuse (q/k/v, gate/up) must carry one NVFP4 global scale: vLLM keeps one per fused layer
    and TensorRT-LLM asserts they are equal."""
    if arch is None:
        return []
    out = []
    for m, g in global_scales.items():
        for group in arch.fusion_groups:
            if m.endswith("." + group[0]):
                prefix = m[: -len(group[0])]
                vals = {x: global_scales.get(prefix + x) for x in group}
                if len({v for v in vals.values() if v is not None}) > 1:
                    out.append(f"{prefix}{{{','.join(group)}}} have different global scales "
                               f"({', '.join(f'{v:g}' for v in vals.values() if v is not None)}); the engines fuse them "
                               "with one")
    return out


def _ignored(module: str, ck) -> bool:
    from qtk.recipe import matches

    return matches(module, ck.ignore_patterns())


def _check_kv(ck, arch, n_layers: int, rownorm: dict, stats: dict, rep: CheckReport) -> None:
    qmax = 448.0 if ck.kv_cache == "fp8" else 127.0
    floor = getattr(ck, "kv_scale_floor", None)  # TensorRT-LLM's FP8 factors are clamped to >= 1.0
    absent, bad, implausible, vals = [], [], [], []
    for i in range(n_layers):
        try:
            sc = ck.kv_scales(i)
        except QtkError as e:
            absent.append(str(e.problem))
            continue
        if sc is None:
            absent.append(f"{ck.kv_tensor_names(i)} missing (the config declares an {ck.kv_cache} KV cache)")
            continue
        vals += list(sc)
        if not all(x > 0 and math.isfinite(x) for x in sc):
            bad.append(f"{ck.kv_tensor_names(i)} = {sc[0]:.3g}, {sc[1]:.3g}")
            continue
        rep.kv_amax[i] = [sc[0] * qmax, sc[1] * qmax]
        bounds = None if arch is None else _kv_bounds(ck, arch, i, rownorm, stats)
        if bounds is None:
            continue
        if ck.format == "trtllm":  # one factor for K and V
            bounds = (max(bounds), max(bounds))
        for what, s, b in (("K", sc[0], bounds[0]), ("V", sc[1], bounds[1])):
            implied = s * qmax
            if floor is not None and s <= floor:
                continue  # clamped up to the floor: says nothing about the calibrated range
            if implied > b * KV_SLACK:
                implausible.append(f"{ck.kv_tensor_names(i)}: {what} scale {s:.3g} implies |{what}| up to {implied:.3g}, "
                                   f"but the layer's weights bound it by {b:.3g}")
            elif implied < b * KV_FLOOR_RATIO:
                implausible.append(f"{ck.kv_tensor_names(i)}: {what} scale {s:.3g} implies |{what}| up to {implied:.3g}, "
                                   f"{b / implied:.1e} times below what the weights allow")
    rep.add("KV scales present for every layer", absent, f"{n_layers} layers")
    # scales floored at 1.0 by the format (TensorRT-LLM FP8 KV) cannot show calibration
    all_one = bool(vals) and all(abs(x - 1.0) < 1e-12 for x in vals) and floor != 1.0
    rep.add("KV scales calibrated (not all 1.0, finite, positive)",
            (["all k/v scales are 1.0: uncalibrated"] if all_one else []) + bad)
    rep.add("KV scales plausible against the weights", implausible)


def _manifest_recipe(manifest: dict):
    from qtk.recipe import parse_recipe

    text = ((manifest.get("recipe") or {}).get("text")) or ""
    if not text:
        return None
    try:
        import yaml

        return parse_recipe(yaml.safe_load(text), text=text, origin="qtk.json recipe")
    except Exception:  # a recipe this qtk cannot parse (another version): fall back to the checkpoint's own ignore
        return None
