"""Per-layer calibration on one materialised decoder layer: smoothing (SmoothQuant, AWQ scales), static
activation ranges, and the weight solvers (RTN, GPTQ from one Hessian pass or true-sequential, AWQ clip + RTN).

The math lives in qtk.algorithms (pure functions); this module feeds them the layer's inputs and folds
their results into the layer. The layer runs in the model dtype (bf16 matmuls are several times faster on
CPUs than fp32); statistics and Hessians are accumulated in fp32, and the weights being quantized are kept
in fp32 (`master`) while smoothing folds scales into them, so only the forward passes see rounded weights.
"""

from __future__ import annotations

import logging

import torch

from qtk.algorithms.awq import apply_clip, awq_search_clip, awq_search_scales
from qtk.algorithms.gptq import accumulate_hessian, gptq_quantize_shared
from qtk.algorithms.smooth import (
    fold_into_linear_rows,
    fold_into_norm,
    scale_linear_columns,
)
from qtk.algorithms.smoothquant import smoothquant_scales
from qtk.model.simulate import QLinear, engine_weight, replace_module
from qtk.quant.qparams import (
    fake_quant_activation,
    quantize_weight,
    static_scale,
    weight_qparams,
)
from qtk.quant.qtensor import QTensor
from qtk.recipe import Recipe

AWQ_MAX_TOKENS = 4096  # tokens of a Linear's input kept for the AWQ searches (evenly spaced)

log = logging.getLogger(__name__)


class _Captured(Exception):
    """Stops a layer's forward once the input of interest has been seen."""


def capture_inputs(layer: torch.nn.Module, batches, module: str, fn, stop: bool = True) -> None:
    """Run every batch through the layer and call fn(x) with the input of `module`; the rest of the
    layer is skipped (stop=True), so statistics of early sub-blocks cost a fraction of a forward."""
    capture_many(layer, batches, {module: fn}, stop_after=module if stop else None)


def capture_many(layer: torch.nn.Module, batches, fns: dict, stop_after: str | None = None,
                 stop_when_all: bool = False) -> None:
    """One forward per batch calling fns[m](x) with the input of each module m (a hook that never fires, e.g.
    an MoE expert no token reached, is not called); the forward stops once `stop_after`'s input was seen, or
    with stop_when_all once every module's input was seen in this batch (so the last module, often down_proj,
    and whatever follows it are skipped, whatever the architecture's order)."""
    fired: set = set()

    def hook(mod, args, name):
        fns[name](args[0].detach())
        fired.add(name)
        if name == stop_after or (stop_when_all and len(fired) == len(fns)):
            raise _Captured

    hs_ = [layer.get_submodule(m).register_forward_pre_hook(lambda mod, args, m=m: hook(mod, args, m)) for m in fns]
    try:
        with torch.no_grad():
            for hs, kw in batches:
                fired.clear()
                try:
                    layer(hs, **kw)
                except _Captured:
                    pass
    finally:
        for h in hs_:
            h.remove()


def sequential_groups(arch, targets: list[str]) -> list[tuple[str, ...]]:
    """Targets grouped by shared input, in data-flow order: (q, k, v), (o,), (gate, up), (down,)."""
    out, seen = [], set()
    for lin in arch.linears:
        if lin in targets and lin not in seen:
            g = tuple(m for m in arch.fusion_group_of(lin) if m in targets)
            out.append(g)
            seen.update(g)
    return out


def _token_sample(xs: list[torch.Tensor], limit: int) -> torch.Tensor:
    x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).float()
    if x.shape[0] > limit:
        x = x[torch.linspace(0, x.shape[0] - 1, limit).round().long()]
    return x


def _collect_tokens(layer, batches, module: str) -> torch.Tensor | None:
    """Up to AWQ_MAX_TOKENS inputs of `module`; None when it saw none (an MoE expert no token was routed to)."""
    xs = []
    per_batch = max(1, AWQ_MAX_TOKENS // max(1, len(batches)))

    def keep(x):
        x = x.reshape(-1, x.shape[-1])
        if x.shape[0] > per_batch:
            x = x[torch.linspace(0, x.shape[0] - 1, per_batch).round().long()]
        xs.append(x.float().clone())

    capture_inputs(layer, batches, module, keep)
    return _token_sample(xs, AWQ_MAX_TOKENS) if xs else None


def smoothing_pairs(layer, arch, targets: list[str]):
    """The architecture's smoothing pairs whose next Linears are all quantized and whose shapes chain
    (v_proj -> o_proj only without GQA)."""
    pairs = []
    for p in arch.smoothing:
        if not all(n in targets for n in p.nexts):
            continue
        if not p.prev_is_norm:
            width = layer.get_submodule(p.prev).weight.shape[0]
            if any(layer.get_submodule(n).weight.shape[1] != width for n in p.nexts):
                continue
        pairs.append(p)
    return pairs


def _fold(layer, arch, pair, s: torch.Tensor, master: dict[str, torch.Tensor]) -> None:
    """Fold s into the layer; weights in `master` (fp32 copies of the quantized Linears) are folded there and
    copied, rounded, into the layer, so repeated folds do not accumulate the model dtype's rounding."""
    def weight(name):
        return master[name] if name in master else layer.get_submodule(name).weight.detach().float()

    def store(name, w):
        if name in master:
            master[name] = w
        layer.get_submodule(name).weight.copy_(w)

    prev = layer.get_submodule(pair.prev)
    with torch.no_grad():
        if pair.prev_is_norm:
            prev.weight.copy_(fold_into_norm(prev.weight.float(), s, arch.norm_one_plus))
        else:
            w, b = fold_into_linear_rows(weight(pair.prev), None if prev.bias is None else prev.bias.float(), s)
            store(pair.prev, w)
            if b is not None:
                prev.bias.copy_(b)
        for n in pair.nexts + pair.dense:  # dense readers (an MoE router) too: their output stays the same
            store(n, scale_linear_columns(weight(n), s))


def apply_smoothquant(layer, arch, targets, batches, params, master: dict[str, torch.Tensor]) -> dict[str, list[float]]:
    """SmoothQuant: per pair, s from the channel maxima of the shared input, folded in; returns the scales.

    One forward observes every pair's input: smoothing leaves the float layer's function unchanged, so the
    maxima a later pair sees do not depend on the folds of earlier pairs (beyond the model dtype's rounding)."""
    pairs = smoothing_pairs(layer, arch, targets)
    stats, fns = {}, {}
    for pair in pairs:
        in_f = layer.get_submodule(pair.nexts[0]).weight.shape[1]
        if pair.observed in stats:
            continue
        amax, seen = torch.zeros(in_f), [0]
        stats[pair.observed] = (amax, seen)

        def obs(x, amax=amax, seen=seen, in_f=in_f):
            x = x.reshape(-1, in_f)
            seen[0] += x.shape[0]
            if x.shape[0]:
                torch.maximum(amax, x.abs().amax(0).float(), out=amax)

        fns[pair.observed] = obs
    capture_many(layer, batches, fns, stop_when_all=True)
    records = {}
    for pair in pairs:
        amax, seen = stats[pair.observed]
        if not seen[0]:  # an MoE expert that no calibration token reached: nothing to migrate, s = 1
            records[pair.prev] = None
            continue
        s = smoothquant_scales(amax, [master.get(n, layer.get_submodule(n).weight) for n in pair.nexts], params.alpha)
        _fold(layer, arch, pair, s, master)
        records[pair.prev] = s.tolist()
    return records


def apply_awq(layer, arch, targets, batches, recipe: Recipe, params, dtype, master: dict[str, torch.Tensor]) -> dict:
    """AWQ: activation-aware scales per pair (folded in), then the clip search per Linear (not q/k)."""
    records: dict = {"scales": {}, "clip": {}}
    for pair in smoothing_pairs(layer, arch, targets):
        x = _collect_tokens(layer, batches, pair.observed)
        if x is None:  # an MoE expert that no calibration token reached: s = 1
            records["scales"][pair.prev] = None
            continue
        weights = [master[n] for n in pair.nexts]
        s, info = awq_search_scales(x, weights, recipe.weights, params, dtype)
        _fold(layer, arch, pair, s, master)
        records["scales"][pair.prev] = info.get("ratio")
        if info.get("ratio") is not None:  # the scales themselves: the frame the weights were quantized in
            records.setdefault("s", {})[pair.prev] = s.float().tolist()
    if params.clip:
        for group in sequential_groups(arch, targets):
            clip_targets = [t for t in group if t not in arch.clip_skip]
            if not clip_targets:
                continue
            x = _collect_tokens(layer, batches, group[0])
            if x is None:  # no tokens reached this expert: keep the full range
                continue
            for t in clip_targets:
                max_val = awq_search_clip(x, master[t], recipe.weights, params, dtype)
                master[t] = apply_clip(master[t], max_val)
                with torch.no_grad():
                    layer.get_submodule(t).weight.copy_(master[t])
                records["clip"][t] = float(max_val.mean())
    return records


def observe_input_amax(layer, arch, targets, batches) -> dict[str, float]:
    """Per-tensor |x| max at the input of each fused group (one statistic per shared input), one forward that
    stops once every group's input was seen."""
    groups = sequential_groups(arch, targets)
    vals = {g[0]: 0.0 for g in groups}

    def observe(x, head):
        vals[head] = max(vals[head], float(x.abs().amax()))

    capture_many(layer, batches, {g[0]: (lambda x, h=g[0]: observe(x, h)) for g in groups}, stop_when_all=True)
    out = {t: vals[g[0]] for g in groups for t in g}
    for shared in arch.shared_input_scale:  # one static input scale for all experts, as vLLM's fused MoE uses
        members = [t for t in shared if t in out]
        if members:
            m = max(out[t] for t in members)
            out.update({t: m for t in members})
    return out


def rtn_weights(weights: dict[str, torch.Tensor], recipe: Recipe, arch, dtype) -> dict[str, QTensor]:
    """Round-to-nearest; per-tensor scales are shared inside fusion groups (the engines fuse q/k/v, gate/up)."""
    scheme = recipe.weights
    out: dict[str, QTensor] = {}
    if scheme.strategy == "tensor":
        for g in arch.fusion_groups:
            members = [m for m in g if m in weights]
            if len(members) > 1:
                joint = torch.cat([weights[m].float() for m in members], dim=0)
                scale, zero = weight_qparams(joint, scheme, None if scheme.is_fp8 else dtype)
                for m in members:
                    out[m] = QTensor(quantize_weight(weights[m], scale, zero, scheme), scale, scheme, zero, None, dtype)
    for name, w in weights.items():
        if name not in out:
            out[name] = QTensor.quantize(w, scheme, dtype)
    return out


def swap_in(layer, name: str, qt: QTensor, recipe: Recipe, amax: dict[str, float]) -> torch.Tensor:
    """Replace a Linear by its simulated quantized version; returns the engine-view weight."""
    act = recipe.activations
    lin = layer.get_submodule(name)
    w_hat = engine_weight(qt).to(lin.weight.dtype)  # int: exact (dequantized in the model dtype), as the engine
    in_scale = static_scale(amax[name], act) if (act is not None and not act.dynamic) else None
    replace_module(layer, name, QLinear(w_hat, None if lin.bias is None else lin.bias.detach(), act, in_scale))
    return w_hat


def gptq_weights(layer, arch, targets, batches, recipe: Recipe, params, dtype, prefix: str,
                 amax: dict[str, float], master: dict[str, torch.Tensor] | None = None) -> tuple[dict[str, QTensor], dict]:
    """GPTQ on every group of Linears sharing an input (one Hessian and one solve per group).

    params.true_sequential: each group's Hessian is taken on inputs produced by the already-quantized earlier
    sub-blocks, one partial forward per group. Otherwise (the default, as llm-compressor does) all Hessians come
    from one forward of the float layer, in as few passes as HESSIAN_PASS_BYTES allows, and the quantized groups
    are swapped in at the end. Either way inputs are quantized as the engine will quantize them, and the next
    layer sees the quantized layer's outputs. master: fp32 weights to quantize (else the layer's)."""
    master = master or {}
    out, info = {}, {}
    groups = sequential_groups(arch, targets)
    if params.true_sequential:
        for group in groups:
            H, n = _group_hessians(layer, [group], batches, recipe, amax)[group]
            _solve_group(layer, arch, group, H, n, recipe, params, dtype, prefix, master, out, info)
            for t in group:
                swap_in(layer, t, out[t], recipe, amax)
        return out, info
    for chunk in _hessian_passes(layer, groups):
        hessians = _group_hessians(layer, chunk, batches, recipe, amax)
        for group in chunk:
            H, n = hessians.pop(group)
            _solve_group(layer, arch, group, H, n, recipe, params, dtype, prefix, master, out, info)
            del H
    for t, qt in out.items():
        swap_in(layer, t, qt, recipe, amax)
    return out, info


HESSIAN_PASS_BYTES = 1 << 30  # Hessians held by one calibration forward (MoE layers with many experts take several)


def _hessian_passes(layer, groups):
    """Groups split into consecutive chunks whose fp32 Hessians together stay under HESSIAN_PASS_BYTES."""
    chunks, cur, size = [], [], 0
    for g in groups:
        b = 4 * layer.get_submodule(g[0]).weight.shape[1] ** 2
        if cur and size + b > HESSIAN_PASS_BYTES:
            chunks.append(cur)
            cur, size = [], 0
        cur.append(g)
        size += b
    return chunks + [cur] if cur else chunks


def _group_hessians(layer, groups, batches, recipe: Recipe, amax) -> dict:
    """{group: (H, tokens)} from one forward over the batches, H in fp32 on the inputs as the engine quantizes them."""
    act = recipe.activations
    state = {g: [None, 0] for g in groups}

    def acc(x, g):
        if act is not None:  # the engine multiplies W by the quantized activations
            x = fake_quant_activation(x, act, static_scale(amax[g[0]], act) if not act.dynamic else None)
        st = state[g]
        st[0], st[1] = accumulate_hessian(st[0], st[1], x, inplace=True)

    fns = {g[0]: (lambda x, g=g: acc(x, g)) for g in groups}
    capture_many(layer, batches, fns, stop_when_all=True)
    return {g: tuple(st) for g, st in state.items()}


def _solve_group(layer, arch, group, H, n, recipe: Recipe, params, dtype, prefix, master, out, info) -> None:
    weights = [master[t] if t in master else layer.get_submodule(t).weight.detach() for t in group]
    if n == 0:  # an MoE expert no calibration token reached: no Hessian, so round to nearest
        log.warning("GPTQ: %s received no calibration tokens; quantized with RTN instead (more calibration "
                    "samples would reach it)", ", ".join(prefix + t for t in group))
        for t, qt in rtn_weights(dict(zip(group, weights)), recipe, arch, dtype).items():
            out[t] = qt
            info[t] = {"fallback": "rtn", "reason": "no calibration tokens"}
        return
    solved = gptq_quantize_shared(weights, H, recipe.weights, params, dtype, names=[prefix + t for t in group])
    for t, (qt, i) in zip(group, solved):
        out[t] = qt
        info[t] = {k: v for k, v in i.items() if k in ("damp_percent", "retries", "dead_columns", "loss")}
