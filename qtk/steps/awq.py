"""The AWQ step (TRANSFORM): activation-aware scales per smoothing pair, folded in, then the clip search per Linear
(not q/k), applied to the fp32 master weights. The searches (qtk.algorithms.awq) quantize each Linear with its own
scheme; the weights are rounded afterwards by the recipe's solver (round-to-nearest)."""

from __future__ import annotations

import torch

from qtk.algorithms.awq import apply_clip, awq_search_clip, awq_search_scales
from qtk.recipe.params import AWQParams
from qtk.steps.capture import capture_inputs, sequential_groups
from qtk.steps.context import LayerContext
from qtk.steps.records import AWQRecord
from qtk.steps.registry import register_step
from qtk.steps.smoothing import fold, smoothing_pairs
from qtk.steps.stats import SearchLosses, TokenSample

AWQ_MAX_TOKENS = 4096  # tokens of a Linear's input kept for the AWQ searches (evenly spaced)


def token_sample(layer, batches, module: str) -> torch.Tensor | None:
    """Up to AWQ_MAX_TOKENS inputs of `module`; None when it saw none (an MoE expert no token was routed to)."""
    acc = TokenSample(AWQ_MAX_TOKENS, len(batches))
    capture_inputs(layer, batches, module, acc.update)
    return acc.sample()


@register_step("awq")
def run(ctx: LayerContext, params: AWQParams) -> AWQRecord:
    layer, arch, master = ctx.layer, ctx.arch, ctx.master
    combine = SearchLosses.combiner(ctx.reducer)
    record = AWQRecord()
    for pair in smoothing_pairs(layer, arch, ctx.targets):
        x = token_sample(layer, ctx.batches, pair.observed)
        if x is None:  # an MoE expert that no calibration token reached: s = 1
            record.ratios[pair.prev] = None
            continue
        weights = [master[n] for n in pair.nexts]
        x_mean = None
        if ctx.reducer.world_size > 1:  # the grid's candidates from every process's tokens (a token-weighted mean)
            x_mean = combine(x.reshape(-1, x.shape[-1]).float().abs().mean(0), x.reshape(-1, x.shape[-1]).shape[0])
        s, info = awq_search_scales(x, weights, [ctx.scheme(n).weights for n in pair.nexts], params, ctx.dtype, combine,
                                    x_mean=x_mean)
        fold(layer, arch, pair, s, master)
        record.ratios[pair.prev] = info.get("ratio")
        if info.get("ratio") is not None:  # the scales themselves: the frame the weights were quantized in
            record.scales[pair.prev] = s.float().tolist()
    if params.clip:
        for group in sequential_groups(arch, ctx.targets):
            clip_targets = [t for t in group if t not in arch.clip_skip]
            if not clip_targets:
                continue
            x = token_sample(layer, ctx.batches, group[0])
            if x is None:  # no tokens reached this expert: keep the full range
                continue
            for t in clip_targets:
                max_val = awq_search_clip(x, master[t], ctx.scheme(t).weights, params, ctx.dtype, combine)
                master[t] = apply_clip(master[t], max_val)
                with torch.no_grad():
                    layer.get_submodule(t).weight.copy_(master[t])
                record.clip[t] = float(max_val.mean())
    return record
