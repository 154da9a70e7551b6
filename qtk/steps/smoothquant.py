"""The SmoothQuant step (TRANSFORM): per smoothing pair, s from the channel maxima of the shared input
(qtk.algorithms.smoothquant), folded into the layer. Only pairs whose next Linears quantize their inputs are smoothed:
migrating activation outliers into the weights helps nothing that runs on 16-bit activations."""

from __future__ import annotations

from qtk.algorithms.smoothquant import smoothquant_scales
from qtk.recipe.params import SmoothQuantParams
from qtk.steps.capture import capture_many
from qtk.steps.context import LayerContext
from qtk.steps.records import SmoothQuantRecord
from qtk.steps.registry import register_step
from qtk.steps.smoothing import fold, smoothing_pairs
from qtk.steps.stats import LOCAL, ChannelMax, Reducer


def apply_smoothquant(layer, arch, targets, batches, params: SmoothQuantParams, master: dict, *, pairs=None,
                      reducer: Reducer = LOCAL, device=None) -> SmoothQuantRecord:
    """SmoothQuant on `pairs` (default: every pair smoothing_pairs allows); returns the scales folded in.

    One forward observes every pair's input: smoothing leaves the float layer's function unchanged, so the
    maxima a later pair sees do not depend on the folds of earlier pairs (beyond the model dtype's rounding)."""
    pairs = smoothing_pairs(layer, arch, targets) if pairs is None else pairs
    stats: dict[str, ChannelMax] = {}
    for pair in pairs:
        if pair.observed not in stats:
            stats[pair.observed] = ChannelMax(layer.get_submodule(pair.nexts[0]).weight.shape[1], device)
    capture_many(layer, batches, {m: acc.update for m, acc in stats.items()}, stop_when_all=True)
    for acc in stats.values():
        acc.reduce(reducer)
    record = SmoothQuantRecord()
    for pair in pairs:
        acc = stats[pair.observed]
        if not acc.tokens:  # an MoE expert that no calibration token reached: nothing to migrate, s = 1
            record.scales[pair.prev] = None
            continue
        s = smoothquant_scales(acc.amax, [master.get(n, layer.get_submodule(n).weight) for n in pair.nexts], params.alpha)
        fold(layer, arch, pair, s, master)
        record.scales[pair.prev] = s.tolist()
    return record


@register_step("smoothquant")
def run(ctx: LayerContext, params: SmoothQuantParams) -> SmoothQuantRecord:
    pairs = [p for p in smoothing_pairs(ctx.layer, ctx.arch, ctx.targets)
             if all(ctx.scheme(n).activations is not None for n in p.nexts)]
    return apply_smoothquant(ctx.layer, ctx.arch, ctx.targets, ctx.batches, params, ctx.master, pairs=pairs,
                             reducer=ctx.reducer, device=ctx.device)
