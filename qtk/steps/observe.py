"""The static input-range observation (OBSERVE), implied by every recipe in which some module's scheme quantizes its
input with a static (calibrated) scale: the per-tensor |x| max at the input of each such fused group, after the
transforms, for the solvers (GPTQ's Hessians see inputs as the engine quantizes them) and the writers."""

from __future__ import annotations

from qtk.recipe.params import Phase
from qtk.steps.capture import capture_many, sequential_groups
from qtk.steps.context import LayerContext
from qtk.steps.registry import NO_PARAMS, register_step
from qtk.steps.stats import LOCAL, Amax, Reducer


def observe_input_amax(layer, arch, groups: list[tuple[str, ...]], batches, reducer: Reducer = LOCAL) -> dict[str, float]:
    """Per-tensor |x| max at the input of each group (one statistic per shared input), one forward that stops once
    every group's input was seen; Linears whose engine takes one static input scale for all (MoE experts) get
    their maximum."""
    stats = {g[0]: Amax() for g in groups}
    capture_many(layer, batches, {h: acc.update for h, acc in stats.items()}, stop_when_all=True)
    for acc in stats.values():
        acc.reduce(reducer)
    out = {t: stats[g[0]].value for g in groups for t in g}
    for shared in arch.shared_input_scale:  # one static input scale for all experts, as vLLM's fused MoE uses
        members = [t for t in shared if t in out]
        if members:
            m = max(out[t] for t in members)
            out.update({t: m for t in members})
    return out


def _implied(recipe):
    return NO_PARAMS if recipe.static_activations else None


@register_step("input_amax", phase=Phase.OBSERVE, needs_data=True, implied=_implied, title="static input ranges")
def run(ctx: LayerContext, params) -> None:
    observe_static_ranges(ctx)


def observe_static_ranges(ctx: LayerContext) -> None:
    """ctx.amax of every fused group whose scheme quantizes its input with a static scale, measured on the layer as
    it is now (a step that changes those inputs after OBSERVE measures them again)."""
    groups = [g for g in sequential_groups(ctx.arch, ctx.targets) if ctx.group_scheme(g).static_activations]
    ctx.amax.update(observe_input_amax(ctx.layer, ctx.arch, groups, ctx.batches, ctx.reducer))
