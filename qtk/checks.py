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
from qtk.model.config_check import text_config

if TYPE_CHECKING:
    from qtk.pipeline.result import Measured  # what the data-free stream measured (its self-check takes it)

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
RECIPE_AGREES = "qtk.json's recipe matches the config"


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
    from qtk.model.source import config_from_dict, meta_skeleton

    try:
        model = meta_skeleton(config_from_dict(cfg))
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


def layer_records(records: dict | None) -> dict:
    """A layer's step records from its manifest JSON (qtk.steps.records), those of steps this qtk knows: a newer
    writer's others change no frame this qtk could rebuild."""
    from qtk.steps.records import RECORDS, records_from_json

    return records_from_json({k: v for k, v in (records or {}).items() if k in RECORDS})


def frame_unknown(records: dict | None) -> bool:
    """A step changed this layer's frame but its records cannot rebuild it (a checkpoint written before qtk recorded
    what it needs): the weights cannot be compared with the source."""
    return not all(r.frame_known() for r in layer_records(records).values())


def reference_weight(source, module: str, arch, layer_records_json: dict | None):
    """float32 [out, in]: the source weight of `module` as the quantizer saw it (model dtype, in the frame its layer's
    steps left it in: each record's reframe, qtk.steps.records.in_frame)."""
    from qtk.pipeline import compute_dtype
    from qtk.steps.records import in_frame

    W = source.tensor(f"{module}.weight").to(compute_dtype(source)).float()
    i = layer_of(module, arch)
    if i is None:
        return W
    return in_frame(W, module[len(f"{arch.layers}.{i}."):], arch.at(i), layer_records(layer_records_json))


# ---- the checks ----

def expected_quantized(ck, arch, recipe) -> list[str]:
    """Linears of every decoder layer per the architecture table, less the recipe's ignore (when known) or else
    the checkpoint's own exclusions."""
    from qtk.recipe import matches

    ignore = list(recipe.ignore) if recipe is not None else ck.ignore_patterns()
    n = int(text_config(ck.hf_config)["num_hidden_layers"])
    return [f"{arch.layers}.{i}.{lin}" for i in range(n) for lin in arch.at(i).linears
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


@dataclass
class _Findings:
    """What the checks of one checkpoint find, Linear by Linear and tensor by tensor, before they are reported."""

    structure: list[str] = field(default_factory=list)  # tensors against the config
    static_act: list[str] = field(default_factory=list)  # modules whose scheme has static activation scales
    bad_scale: list[str] = field(default_factory=list)
    constant: list[str] = field(default_factory=list)
    off_grid: list[str] = field(default_factory=list)
    implausible: list[str] = field(default_factory=list)
    compare: list[str] = field(default_factory=list)
    act: list[str] = field(default_factory=list)
    uncompared: list[str] = field(default_factory=list)
    scale_checks: dict[str, list[str]] = field(default_factory=dict)  # a format's own scale check -> problems
    shared: dict[str, float] = field(default_factory=dict)  # module -> the value its fusion group must share
    rownorm: dict[str, float] = field(default_factory=dict)  # k/v projections' largest row norm (the KV bound)
    stats: dict[str, float] = field(default_factory=dict)  # norm weights' max |value|, biases' max |b|
    dense_seen: set[str] = field(default_factory=set)
    nonfinite: list[str] = field(default_factory=list)


@dataclass
class _Linear:
    """One quantized Linear read back: its QTensor, its ModuleScheme, the decoded weight (None when the bytes decode
    to what the conversion measured: `known`), its static input scale."""

    qt: object
    scheme: object
    w: object
    known: object
    in_scale: object


def check_checkpoint(ck, *, source=None, recipe=None, source_note: str = "",
                     measured: dict[str, Measured] | None = None, finite: set[str] = frozenset()) -> CheckReport:
    """Judge the checkpoint `ck` (a reader from qtk.export.open_checkpoint) from its bytes.

    source: the model it was converted from (qtk.model.source.ModelSource), for the per-Linear comparison; without
    it that check is reported as skipped, with `source_note` saying why. recipe: the recipe it was converted with
    (default: the one qtk.json records), for the set of Linears that must be quantized. measured: module -> what the
    conversion measured of it against `source` (the convert self-check of a data-free run): a Linear whose decoded
    QTensor has the measured digest takes the measured error and range instead of re-reading the source; any other
    is compared in full. finite: dense tensors whose bytes in ck's files were already scanned for NaN/Inf where they
    lie (the convert self-check: the writer's scan of what it copied), not read again.

    In order: the config's sizes (nothing else is read when they are wrong), each quantized Linear
    (_check_linears), each dense tensor (_check_dense), then the report: structure, coverage, scales, values, the
    comparison with the source (_report_linears), KV and activation scales and dense values (_report_scales)."""
    rep = CheckReport()
    cfg_problems = config_problems(text_config(ck.hf_config))  # a vision-language model's: its language model's
    rep.add("config.json sizes are sane", cfg_problems)
    if cfg_problems:
        return rep
    if ck.manifest_error:
        rep.add("qtk.json readable", [ck.manifest_error])
    recipe_problem = None
    if recipe is None and ck.manifest:
        recipe, recipe_problem = _manifest_recipe(ck.manifest)
    shapes, tied = expected_parameters(ck.hf_config)
    found = _Findings(structure=list(ck.format_problems()))
    try:
        mods = ck.modules()
    except QtkError as e:
        rep.add(STRUCTURE, [str(e.problem)])
        return rep
    _check_linears(ck, mods, shapes, source, measured or {}, found, rep)
    _check_dense(ck, shapes, tied, set(mods), finite, found)
    rep.add(STRUCTURE, found.structure, f"{len(mods)} quantized Linears, {len(found.dense_seen)} dense tensors")
    _report_linears(ck, mods, recipe, recipe_problem, source, source_note, found, rep)
    _report_scales(ck, found, rep)
    _check_transforms(ck, mods, shapes, rep)
    return rep


def _check_transforms(ck, mods: list[str], shapes: dict, rep: CheckReport) -> None:  # noqa: C901
    """The online transforms the engine applies (a compressed-tensors transform_config), from the bytes: each
    declared module's matrix present, square, of an order that tiles its input, ±1 and orthogonal (M Mᵀ = b I), one
    matrix for every module of a group (vLLM keeps one); and the modules and rotation qtk.json records for the
    rotate_online step, which the config must declare and the stored matrix equal. Reported only where either
    exists."""
    import torch

    from qtk.quant.hadamard import RepeatedRotation, orthogonality_error

    transforms, problems = ck.input_transforms()
    problems = list(problems)
    arch = ck.arch
    recorded: dict[str, dict] = {}
    for layer, recs in (((ck.manifest or {}).get("stats") or {}).get("algorithm") or {}).items():
        r = (recs or {}).get("rotate_online")
        if r and arch is not None:
            for rel in r.get("modules") or []:
                recorded[f"{arch.layers}.{layer}.{rel}"] = r.get("rotation") or {}
    if not transforms and not problems and not recorded:
        return
    quantized = set(mods)
    first: dict[tuple[str, int], "torch.Tensor"] = {}  # (group, order): vLLM shares one per scheme and size
    for m, t in sorted(transforms.items()):
        shape = shapes.get(f"{m}.weight")
        width = shape[1] if shape else None
        if m not in quantized:
            problems.append(f"{m}: an input transform on a Linear that is not quantized")
        name = ck.transform_tensor(m, width)
        if name is None:
            problems.append(f"{t.tensor}: missing, and no other module of {t.group} stores a matrix of its order "
                            f"(the transform_config applies {t.group} to {m})")
            continue
        stored = ck.tensor(name)
        b = stored.shape[0] if stored.dim() == 2 else None
        if b is None or stored.shape[1] != b or (t.block is not None and b != t.block) or (
                width is not None and (width % b or (t.block is None and b != width))):
            problems.append(f"{name}: shape {list(stored.shape)}, the transform needs "
                            f"[{t.block or width}, {t.block or width}] for an input of {width}")
            continue
        m64 = stored.to(torch.float64)
        if not bool((m64.abs() == 1).all()):
            problems.append(f"{name}: entries other than ±1, not a Hadamard matrix the engine divides by √{b}")
            continue
        err = orthogonality_error(m64)
        if err > 1e-9:
            problems.append(f"{name}: not orthogonal (max |M Mᵀ/{b} − I| = {err:.3g}): the rotated weight no "
                            "longer computes the source")
            continue
        ref = first.setdefault((t.group, b), m64)
        if not torch.equal(ref, m64):
            problems.append(f"{name}: differs from the group's first matrix of order {b}, but vLLM loads one "
                            f"matrix per transform group ({t.group}) and order for the whole model")
        if m in recorded:
            try:
                want = RepeatedRotation.from_json(recorded[m]).unit().stored(torch.float64)
            except (KeyError, TypeError, ValueError) as e:
                problems.append(f"{m}: qtk.json's rotate_online record is malformed ({e})")
                continue
            if not torch.equal(want, m64):
                problems.append(f"{name}: not the rotation qtk.json records for {m} ({recorded[m]})")
    for m in sorted(set(recorded) - set(transforms)):
        problems.append(f"{m}: qtk.json records an online rotation, but the config's transform_config does not apply "
                        "one (its weight is stored rotated: served without it, the layer computes something else)")
    groups = sorted({t.group for t in transforms.values()})
    rep.add("online transforms", problems,
            f"{len(transforms)} Linears with an input rotation ({', '.join(groups)}), matrices ±1 and orthogonal")


def _check_linears(ck, mods: list[str], shapes: dict, source, measured: dict, found: _Findings,
                   rep: CheckReport) -> None:
    """Every quantized Linear, one at a time: read back (its tensors against its scheme, decoded), its values and
    scales judged by its format, its input scale, its k/v row norms, its error against the source."""
    manifest = ck.manifest or {}
    recorded = (manifest.get("stats") or {}).get("weight_error") or {}
    algo_records = (manifest.get("stats") or {}).get("algorithm") or {}
    arch = ck.arch
    for m in mods:
        lin = _read_linear(ck, m, shapes.get(f"{m}.weight"), measured, found)
        if lin is None:
            continue
        fmt = lin.qt.format
        _judge_values(m, lin, fmt, found, rep)
        _judge_input_scale(m, lin, found)
        if arch is not None and m.rsplit(".", 1)[-1] in ("k_proj", "v_proj", "qkv_proj") and (lin.w is not None or ck.kv_cache):
            if lin.w is None:  # only the KV check uses the row norms
                lin.w = ck.written_weight(m, lin.qt)
            found.rownorm[m] = float(lin.w.norm(dim=1).max())
        if source is not None and arch is not None:
            _compare_with_source(source, ck, m, lin, fmt.error_bound(lin.qt.scheme), recorded,
                                 algo_records.get(str(layer_of(m, arch))), found, rep)
        del lin


def _read_linear(ck, m: str, shape, measured: dict, found: _Findings) -> _Linear | None:
    """Module m's tensors checked against its scheme and decoded; None (and a structure problem) when they cannot be."""
    from qtk.quant.qtensor import qtensor_digest

    if shape is None or len(shape) != 2:
        found.structure.append(f"{m}: quantized tensors for a module the config does not have")
        return None
    try:
        problems = ck.check_module(m, tuple(shape))
        if problems:
            found.structure.extend(problems)
            return None
        qt = ck.qtensor(m)
        if tuple(qt.shape) != tuple(shape):
            found.structure.append(f"{m} decodes to {list(qt.shape)}, the config implies {shape}")
            return None
        known = measured.get(m)
        if known is not None and qtensor_digest(qt) != known.digest:
            known = None
        w = None if known is not None else ck.written_weight(m, qt)
        scheme = ck.scheme_for(m)
        act = scheme.activations if scheme is not None else None
        in_scale = ck.input_scale(m) if (act is not None and act.has_static_scale) else None
    except QtkError as e:
        found.structure.append(f"{m}: {e.problem}")
        return None
    except (KeyError, ValueError, RuntimeError, TypeError, IndexError) as e:  # tensors that do not fit together
        found.structure.append(f"{m} cannot be decoded ({e.__class__.__name__}: {' '.join(str(e).split())[:120]})")
        return None
    return _Linear(qt, scheme, w, known, in_scale)


def _judge_values(m: str, lin: _Linear, fmt, found: _Findings, rep: CheckReport) -> None:
    """Scales finite and positive, values not collapsed and on the format's grid, the format's own scale checks, and
    a decoded weight a trained model could have."""
    import torch

    qt = lin.qt
    s = qt.scheme  # the scheme the config gives this module: its bound, its grid
    rep.modules[m] = f"{str(qt.values.dtype).replace('torch.', '')} {list(qt.shape)} {s.describe()}"
    # finite and positive in one pass: NaN propagates through aminmax, so a NaN scale fails too; an int grid may
    # store negative scales (Format.signed_scales: the full-range grid): their magnitude is held positive
    scale = qt.scale.float().abs() if fmt.signed_scales(s) else qt.scale.float()
    lo_s, hi_s = (float(x) for x in torch.aminmax(scale)) if qt.scale.numel() else (1.0, 1.0)
    if not (lo_s > 0 and hi_s < math.inf):
        found.bad_scale.append(m)
    v = qt.values.reshape(-1)
    collapsed, off = fmt.value_problems(m, v, s)
    if collapsed:
        found.constant.append(f"{m}: every quantized value is {v[0].item()} (collapsed)")
    found.off_grid.extend(off)
    if fmt.scale_checks:
        found.scale_checks.setdefault(fmt.scale_checks, []).extend(fmt.scale_problems(m, qt))
        shared = fmt.shared_value(qt)
        if shared is not None:
            found.shared[m] = shared
    amax = lin.known.amax if lin.known is not None else (float(lin.w.abs().max()) if lin.w.numel() else 0.0)
    if not math.isfinite(amax) or amax > WEIGHT_RANGE[1] or 0 < amax < WEIGHT_RANGE[0]:
        found.implausible.append(f"{m} decodes to weights up to {amax:.3g} (scale {float(qt.scale.abs().max()):.3g}), "
                                 f"outside {WEIGHT_RANGE[0]:g}..{WEIGHT_RANGE[1]:g}")


def _judge_input_scale(m: str, lin: _Linear, found: _Findings) -> None:
    """A static input scale implies an activation range (its format's static_amax) a trained model could have."""
    from qtk.quant.formats import format_for

    act = lin.scheme.activations if lin.scheme is not None else None
    if act is None or not act.has_static_scale:
        return
    found.static_act.append(m)
    if lin.in_scale is not None:
        a = format_for(act).static_amax(float(lin.in_scale.reshape(-1)[0]), act)
        if not (math.isfinite(a) and ACT_RANGE[0] < a < ACT_RANGE[1]):
            found.act.append(f"{m}.input_scale implies activations up to {a:.3g}")


def _compare_with_source(source, ck, m: str, lin: _Linear, bound: float, recorded: dict, records_json,
                         found: _Findings, rep: CheckReport) -> None:
    """Module m's error against the source weight in its frame, in rep.errors, held to its format's bound and to the
    figure qtk.json recorded; a Linear whose frame cannot be rebuilt is counted as not compared."""
    from qtk.quant.error import relative_error

    if frame_unknown(records_json):
        found.uncompared.append(m)
        return
    if lin.known is not None:  # these bytes decode to exactly what was measured against the source
        err = lin.known.error
    else:
        try:
            ref = reference_weight(source, m, ck.arch, records_json)
        except QtkError as e:
            found.compare.append(f"{m}: the source has no such weight ({e.problem})")
            return
        if list(ref.shape) != list(lin.w.shape):
            found.compare.append(f"{m}: the source weight is {list(ref.shape)}, the checkpoint's {list(lin.w.shape)} "
                                 "(is the source the model it was converted from?)")
            return
        err = relative_error(lin.w, ref)
    rep.errors[m] = err
    s = lin.qt.scheme
    if not err <= bound:
        found.compare.append(f"{m}: error {err:.3f} against the source exceeds {bound} for {s.describe()}")
    elif m in recorded and not abs(err - float(recorded[m])) <= MANIFEST_TOLERANCE:
        found.compare.append(f"{m}: error {err:.4f} on disk, qtk.json recorded {float(recorded[m]):.4f}")
    elif recorded and m not in recorded:
        found.compare.append(f"{m}: qtk.json records no error for it")


def _check_dense(ck, shapes: dict, tied: list, quantized: set[str], finite: set[str], found: _Findings) -> None:
    """Every dense tensor, one at a time: a tensor of this model in its shape, a float, finite; the values the KV
    bounds need (norm weights, biases, dense k/v row norms); every tied group stored once."""
    from qtk.io.safetensors import as_tensor
    from qtk.quant.finite import all_finite

    arch = ck.arch
    one_plus = bool(arch is not None and arch.norm_one_plus)
    try:
        for name, t in ck.iter_dense_stored():  # an embedding unread: scanned from disk in chunks
            found.dense_seen.add(name)
            want = shapes.get(name)
            if want is None:
                found.structure.append(f"{name} is not a tensor of this model (config: {ck.hf_config.get('model_type')})")
                continue
            if list(t.shape) != want:
                found.structure.append(f"{name} has shape {list(t.shape)}, the config implies {want}")
                continue
            if not t.is_floating_point():
                found.structure.append(f"{name} is stored as {str(t.dtype).replace('torch.', '')}, not a float tensor")
                continue
            values = name.endswith(("norm.weight", ".bias")) or (
                arch is not None and name.endswith(("k_proj.weight", "v_proj.weight", "qkv_proj.weight")))
            if values:  # small tensors whose values the bounds need
                t = as_tensor(t)
            if name not in finite and not all_finite(t):
                found.nonfinite.append(name)
                continue
            if name.endswith("norm.weight"):
                found.stats[name] = float(((1 + t.float()) if one_plus else t.float()).abs().max())
            elif name.endswith(".bias"):
                found.stats[name] = float(t.float().abs().max())
            elif arch is not None and name.endswith(("k_proj.weight", "v_proj.weight", "qkv_proj.weight")):
                found.rownorm[name[: -len(".weight")]] = float(t.float().norm(dim=1).max())
            del t
    except QtkError as e:
        found.structure.append(str(e.problem))
    for group in tied:
        names = sorted(group)
        if any(n in found.dense_seen or (n.endswith(".weight") and n[: -len(".weight")] in quantized) for n in names):
            continue
        found.structure.append(f"{names[0]} is missing (the config's model needs it)")


def _report_linears(ck, mods: list[str], recipe, recipe_problem: str | None, source, source_note: str, found: _Findings,
                    rep: CheckReport) -> None:
    """Coverage (what the recipe quantizes is quantized, and the config says so), the recipe qtk.json records against
    the config (recipe_problem: why it could not be read), scales, the formats' own scale checks, collapsed and
    implausible weights, and the comparison with the source."""
    arch = ck.arch
    if arch is not None:
        expected = expected_quantized(ck, arch, recipe)
        quantized = set(mods)
        missing = [m for m in expected if m not in quantized]
        hidden = [m for m in mods if _ignored(m, ck)]
        problems = [f"not quantized: {', '.join(missing[:5])}"] if missing else []
        problems += [f"the config's ignore covers {m}, which holds quantized tensors" for m in hidden[:3]]
        rep.add("every targeted Linear is quantized", problems, f"{len(mods)} quantized")
    if recipe is not None or recipe_problem:
        rep.add(RECIPE_AGREES, [recipe_problem] if recipe_problem else _recipe_disagreements(ck, mods, recipe),
                f"{len(mods)} quantized Linears as the recipe says")
    rep.add("weight scales finite and positive (an int grid's in magnitude)", found.bad_scale)
    for name, problems in found.scale_checks.items():
        rep.add(name, problems + _fused_shared_problems(found.shared, arch))
    rep.add("quantized weights not constant", found.constant)
    rep.add("weights decode to plausible values", found.off_grid + found.implausible)
    if source is not None and arch is not None:
        recorded = ((ck.manifest or {}).get("stats") or {}).get("weight_error") or {}
        detail = f"{len(rep.errors)} Linears, max error {max(rep.errors.values(), default=0):.4f}"
        if recorded:
            detail += f", within {MANIFEST_TOLERANCE:g} of qtk.json"
        if found.uncompared:
            detail += (f"; {len(found.uncompared)} not compared (their layers' records in qtk.json cannot rebuild the "
                       "frame they were quantized in: an older qtk wrote it)")
        rep.add("written weights match the source", found.compare, detail)
    else:
        rep.checks.append(Check("written weights match the source", True,
                                f"skipped: {source_note or 'no source model given'}", skipped=True))


def _report_scales(ck, found: _Findings, rep: CheckReport) -> None:
    """KV scales, static activation scales, dense tensors finite."""
    n_layers = int(text_config(ck.hf_config)["num_hidden_layers"])
    if ck.kv_cache:
        _check_kv(ck, ck.arch, n_layers, found.rownorm, found.stats, rep)
    if found.static_act:
        no_in = [m for m in found.static_act if ck.input_scale(m) is None]
        rep.add("static activation scales present and plausible",
                [f"{m}.input_scale is missing" for m in no_in[:3]] + found.act)
    rep.add("dense tensors finite", [f"{n} has NaN/Inf" for n in found.nonfinite])


def _fused_shared_problems(shared: dict[str, float], arch) -> list[str]:
    """Linears the engines fuse (q/k/v, gate/up) must carry one tensor-wide value (NVFP4's global scale): vLLM keeps
    one per fused layer and TensorRT-LLM asserts they are equal."""
    if arch is None:
        return []
    out = []
    for m, g in shared.items():
        for group in arch.fusion_groups:
            if m.endswith("." + group[0]):
                prefix = m[: -len(group[0])]
                vals = {x: shared.get(prefix + x) for x in group}
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
    """(the recipe qtk.json records, None) or (None, why it cannot be read). The recipe text is read as any recipe
    file is (bounded: its aliases, its patterns); coverage then falls back to the checkpoint's own ignore."""
    from qtk.recipe import parse_recipe_text

    rec = manifest.get("recipe")
    text = rec.get("text") if isinstance(rec, dict) else None
    if not text:
        return None, None
    if not isinstance(text, str):
        return None, "qtk.json's recipe text is not text"
    try:
        return parse_recipe_text(text, "qtk.json"), None
    except QtkError as e:
        return None, f"qtk.json's recipe cannot be read ({e.problem})"


def _weights_key(s) -> tuple:
    """What a weight scheme fixes about the stored tensors in every format: type, bits, granularity, block, scale
    dtype. Not the symmetry: a format may store symmetric weights with zero points (AWQ's GEMM layout always has
    them), which its reader reports as asymmetric."""
    grouped = s.strategy in ("group", "tensor_group")
    return (s.type, s.num_bits, s.strategy, s.group_size if grouped else None,
            tuple(s.block_structure) if s.strategy == "block" and s.block_structure else None, s.scale_dtype)


def _recipe_disagreements(ck, mods: list[str], recipe) -> list[str]:
    """Quantized Linears whose weight scheme in the config (the one their tensors were checked against) is not the one
    the recipe gives them: a qtk.json that says 8-bit over int4 tensors describes another checkpoint."""
    out = []
    for m in mods:
        want, got = recipe.scheme_for(m), ck.scheme_for(m)
        if want is None or got is None:  # ignored by the recipe, or no config part: the coverage checks report them
            continue
        if _weights_key(want.weights) != _weights_key(got.weights):
            out.append(f"{m}: the recipe says {want.weights.describe()}, the config and tensors {got.weights.describe()}")
    return out
