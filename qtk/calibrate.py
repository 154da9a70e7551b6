"""Per-layer calibration on one materialised decoder layer: smoothing (SmoothQuant, AWQ scales), static
activation ranges, and the weight solvers (RTN, GPTQ true-sequential, AWQ clip + RTN).

The math lives in qtk.algorithms (pure functions); this module feeds them the layer's inputs and folds
their results into the layer's private fp32 copy.
"""

from __future__ import annotations

import torch

from qtk.algorithms.awq import apply_clip, awq_search_clip, awq_search_scales
from qtk.algorithms.gptq import accumulate_hessian, gptq_quantize
from qtk.algorithms.smooth import fold_into_linear_rows, fold_into_norm, scale_linear_columns
from qtk.algorithms.smoothquant import smoothquant_scales
from qtk.model.simulate import QLinear, engine_weight, replace_module
from qtk.quant.qparams import fake_quant_activation, quantize_weight, static_scale, weight_qparams
from qtk.quant.qtensor import QTensor
from qtk.recipe import Recipe

AWQ_MAX_TOKENS = 4096  # tokens of a Linear's input kept for the AWQ searches (evenly spaced)


class _Captured(Exception):
    """Stops a layer's forward once the input of interest has been seen."""


def capture_inputs(layer: torch.nn.Module, batches, module: str, fn, stop: bool = True) -> None:
    """Run every batch through the layer and call fn(x) with the input of `module`; the rest of the
    layer is skipped (stop=True), so statistics of early sub-blocks cost a fraction of a forward."""
    def hook(mod, args):
        fn(args[0].detach())
        if stop:
            raise _Captured

    h = layer.get_submodule(module).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for hs, kw in batches:
                try:
                    layer(hs, **kw)
                except _Captured:
                    pass
    finally:
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


def _collect_tokens(layer, batches, module: str) -> torch.Tensor:
    xs = []
    per_batch = max(1, AWQ_MAX_TOKENS // max(1, len(batches)))

    def keep(x):
        x = x.reshape(-1, x.shape[-1])
        if x.shape[0] > per_batch:
            x = x[torch.linspace(0, x.shape[0] - 1, per_batch).round().long()]
        xs.append(x.float().clone())

    capture_inputs(layer, batches, module, keep)
    return _token_sample(xs, AWQ_MAX_TOKENS)


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


def _fold(layer, arch, pair, s: torch.Tensor) -> None:
    prev = layer.get_submodule(pair.prev)
    with torch.no_grad():
        if pair.prev_is_norm:
            prev.weight.copy_(fold_into_norm(prev.weight, s, arch.norm_one_plus))
        else:
            w, b = fold_into_linear_rows(prev.weight, prev.bias, s)
            prev.weight.copy_(w)
            if b is not None:
                prev.bias.copy_(b)
        for n in pair.nexts:
            lin = layer.get_submodule(n)
            lin.weight.copy_(scale_linear_columns(lin.weight, s))


def apply_smoothquant(layer, arch, targets, batches, params) -> dict[str, list[float]]:
    """SmoothQuant: per pair, s from the channel maxima of the shared input, folded in; returns the scales."""
    records = {}
    for pair in smoothing_pairs(layer, arch, targets):
        first = pair.nexts[0]
        in_f = layer.get_submodule(first).weight.shape[1]
        amax = torch.zeros(in_f)

        def obs(x, amax=amax):
            torch.maximum(amax, x.reshape(-1, in_f).abs().amax(0).float(), out=amax)

        capture_inputs(layer, batches, first, obs)
        s = smoothquant_scales(amax, [layer.get_submodule(n).weight for n in pair.nexts], params.alpha)
        _fold(layer, arch, pair, s)
        records[pair.prev] = s.tolist()
    return records


def apply_awq(layer, arch, targets, batches, recipe: Recipe, params, dtype) -> dict:
    """AWQ: activation-aware scales per pair (folded in), then the clip search per Linear (not q/k)."""
    records: dict = {"scales": {}, "clip": {}}
    for pair in smoothing_pairs(layer, arch, targets):
        x = _collect_tokens(layer, batches, pair.nexts[0])
        weights = [layer.get_submodule(n).weight.detach() for n in pair.nexts]
        s, info = awq_search_scales(x, weights, recipe.weights, params, dtype)
        _fold(layer, arch, pair, s)
        records["scales"][pair.prev] = info.get("ratio")
    if params.clip:
        for group in sequential_groups(arch, targets):
            clip_targets = [t for t in group if t not in arch.clip_skip]
            if not clip_targets:
                continue
            x = _collect_tokens(layer, batches, group[0])
            for t in clip_targets:
                lin = layer.get_submodule(t)
                max_val = awq_search_clip(x, lin.weight.detach(), recipe.weights, params, dtype)
                with torch.no_grad():
                    lin.weight.copy_(apply_clip(lin.weight, max_val))
                records["clip"][t] = float(max_val.mean())
    return records


def observe_input_amax(layer, arch, targets, batches) -> dict[str, float]:
    """Per-tensor |x| max at the input of each fused group (one statistic per shared input), one forward."""
    groups = sequential_groups(arch, targets)
    vals = {g[0]: 0.0 for g in groups}
    hooks = []
    for g in groups:
        def hook(mod, args, head=g[0]):
            vals[head] = max(vals[head], float(args[0].detach().abs().amax()))

        hooks.append(layer.get_submodule(g[0]).register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for hs, kw in batches:
                layer(hs, **kw)
    finally:
        for h in hooks:
            h.remove()
    return {t: vals[g[0]] for g in groups for t in g}


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
    w_hat = engine_weight(qt)
    in_scale = static_scale(amax[name], act) if (act is not None and not act.dynamic) else None
    replace_module(layer, name, QLinear(w_hat, None if lin.bias is None else lin.bias.detach(), act, in_scale))
    return w_hat


def gptq_weights(layer, arch, targets, batches, recipe: Recipe, params, dtype, prefix: str,
                 amax: dict[str, float]) -> tuple[dict[str, QTensor], dict]:
    """GPTQ, true sequential: each group's Hessian is taken on inputs produced by the already-quantized
    earlier sub-blocks (and quantized as the engine will quantize them), then the group is swapped in."""
    act = recipe.activations
    out, info = {}, {}
    for group in sequential_groups(arch, targets):
        state = [None, 0]

        def acc(x, state=state):
            if act is not None:  # the engine multiplies W by the quantized activations
                x = fake_quant_activation(x, act, static_scale(amax[group[0]], act) if not act.dynamic else None)
            state[0], state[1] = accumulate_hessian(state[0], state[1], x)

        capture_inputs(layer, batches, group[0], acc)
        for t in group:
            W = layer.get_submodule(t).weight.detach()
            qt, i = gptq_quantize(W, state[0], recipe.weights, params, dtype, name=prefix + t)
            out[t] = qt
            info[t] = {k: v for k, v in i.items() if k in ("damp_percent", "retries", "dead_columns", "loss")}
            swap_in(layer, t, qt, recipe, amax)
        del state
    return out, info
