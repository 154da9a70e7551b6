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
from qtk.steps.stats import TokenSample

AWQ_MAX_TOKENS = 4096  # tokens of a Linear's input kept for the AWQ searches (evenly spaced)


def token_sample(ctx: LayerContext, module: str) -> torch.Tensor | None:
    """Up to AWQ_MAX_TOKENS inputs of `module`, sampled from every process's micro-batches (each process holds the
    whole sample, the one a single process takes); None when it saw none (an MoE expert no token was routed to)."""
    batches = len(ctx.batches)
    if ctx.reducer.world_size > 1:  # the per-batch share is the whole calibration's
        batches = int(ctx.reducer.sum_(torch.tensor([batches], dtype=torch.int64))[0])
    acc = TokenSample(AWQ_MAX_TOKENS, batches, ctx.device)
    capture_inputs(ctx.layer, ctx.batches, module, acc.update)
    return acc.reduce(ctx.reducer).sample()


@register_step("awq")
def run(ctx: LayerContext, params: AWQParams) -> AWQRecord:
    """Every process searches on the same sample (token_sample) and so chooses the same scales and clips."""
    layer, arch, master = ctx.layer, ctx.arch, ctx.master
    record = AWQRecord()
    for pair in smoothing_pairs(layer, arch, ctx.targets):
        x = token_sample(ctx, pair.observed)
        if x is None:  # an MoE expert that no calibration token reached: s = 1
            record.ratios[pair.prev] = None
            continue
        weights = [master[n] for n in pair.nexts]
        s, info = awq_search_scales(x, weights, [ctx.scheme(n).weights for n in pair.nexts], params, ctx.dtype)
        fold(layer, arch, pair, s, master)
        record.ratios[pair.prev] = info.get("ratio")
        if info.get("ratio") is not None:  # the scales themselves: the frame the weights were quantized in
            record.scales[pair.prev] = s.float().tolist()
    if params.clip:
        for group in sequential_groups(arch, ctx.targets):
            clip_targets = [t for t in group if t not in arch.clip_skip]
            if not clip_targets:
                continue
            x = token_sample(ctx, group[0])
            if x is None:  # no tokens reached this expert: keep the full range
                continue
            for t in clip_targets:
                max_val = awq_search_clip(x, master[t], ctx.scheme(t).weights, params, ctx.dtype)
                master[t] = apply_clip(master[t], max_val)
                with torch.no_grad():
                    layer.get_submodule(t).weight.copy_(master[t])
                record.clip[t] = float(max_val.mean())
    return record
