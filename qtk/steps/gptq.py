"""The GPTQ step (SOLVE): one Hessian and one solve per group of Linears sharing an input (qtk.algorithms.gptq), each
group with its scheme (the members of a fusion group share one). Inputs enter the Hessians as the engine quantizes
them (the group's activation scheme, with its static scale), and the next layer sees the quantized layer's outputs.

params.true_sequential: each group's Hessian is taken on inputs produced by the already-quantized earlier
sub-blocks, one partial forward per group. Otherwise (the default, as llm-compressor does) all Hessians come
from one forward of the float layer, in as few passes as HESSIAN_PASS_BYTES allows, and the quantized groups
are swapped in at the end.
"""

from __future__ import annotations

import logging

from qtk.algorithms.gptq import gptq_quantize_shared
from qtk.quant.formats import fake_quant_activation, static_scale
from qtk.recipe.params import GPTQParams
from qtk.steps.capture import capture_many, sequential_groups
from qtk.steps.context import LayerContext
from qtk.steps.records import GPTQRecord, GPTQSolve, RTNFallback
from qtk.steps.registry import register_step
from qtk.steps.rtn import rtn_weights
from qtk.steps.stats import Hessian
from qtk.steps.swap import swap_in_all

HESSIAN_PASS_BYTES = 1 << 30  # Hessians held by one calibration forward (MoE layers with many experts take several)

log = logging.getLogger(__name__)


@register_step("gptq")
def run(ctx: LayerContext, params: GPTQParams) -> GPTQRecord:
    record = GPTQRecord()
    groups = sequential_groups(ctx.arch, ctx.targets)
    if params.true_sequential:
        for group in groups:
            hessians = group_hessians(ctx, [group])
            solve_groups(ctx, [group], hessians, params, record)
            swap_in_all(ctx, group)
        return record
    for chunk in hessian_passes(ctx.layer, groups):
        hessians = group_hessians(ctx, chunk)
        solve_groups(ctx, chunk, hessians, params, record)
    swap_in_all(ctx, list(ctx.qweights))
    return record


def solve_cost(ctx: LayerContext, group) -> float:
    """GPTQ's work on a group: the Cholesky of H [in, in] plus the column sweep over every row of its members."""
    w = ctx.layer.get_submodule(group[0]).weight
    rows = sum(ctx.layer.get_submodule(t).weight.shape[0] for t in group)
    return float(w.shape[1]) ** 3 + rows * float(w.shape[1]) ** 2


def solve_groups(ctx: LayerContext, groups, hessians: dict, params: GPTQParams, record: GPTQRecord) -> None:
    """Solve each group; with several processes each group is solved by one of them (balanced by cost: every
    process holds the same reduced Hessians) and its QTensors and record are sent to all, so every process swaps in,
    and propagates, the same quantized layer."""
    reducer = ctx.reducer
    if reducer.world_size == 1:
        for group in groups:
            solve_group(ctx, group, hessians.pop(group), params, record)
        return
    owners = reducer.owners([solve_cost(ctx, g) for g in groups])
    solved = GPTQRecord()  # this process's solves, entered below in group order (the order writers see)
    for group, owner in zip(groups, owners):
        if owner == reducer.rank:
            solve_group(ctx, group, hessians[group], params, solved)
        hessians.pop(group)
    host = "cpu"  # objects travel through the host: a CUDA tensor would unpickle on its sender's GPU index
    for group, owner in zip(groups, owners):
        mine = ({t: ctx.qweights.pop(t).to(host) for t in group}, {t: solved.modules[t] for t in group}) \
            if owner == reducer.rank else None
        qts, recs = reducer.broadcast_object(mine, src=owner)
        for t in group:
            ctx.qweights[t] = qts[t].to(ctx.device)
            record.modules[t] = recs[t]


def hessian_passes(layer, groups):
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


def group_hessians(ctx: LayerContext, groups) -> dict[tuple[str, ...], Hessian]:
    """{group: Hessian} from one forward over the batches, on the inputs as the engine quantizes them, reduced."""
    hessians = {g: Hessian(ctx.layer.get_submodule(g[0]).weight.shape[1], ctx.device) for g in groups}

    def observer(g):
        act = ctx.group_scheme(g).engine_activations
        if act is None:
            return hessians[g].update
        scale = static_scale(ctx.amax[g[0]], act) if act.has_static_scale else None

        def update(x):  # the engine multiplies W by the quantized activations
            hessians[g].update(fake_quant_activation(x, act, scale))

        return update

    capture_many(ctx.layer, ctx.batches, {g[0]: observer(g) for g in groups}, stop_when_all=True)
    for h in hessians.values():
        h.reduce(ctx.reducer)
    return hessians


def too_few_tokens(ctx: LayerContext, group, tokens: int) -> str | None:
    """Why a group's Hessian cannot be trusted, or None. No token: H is zero (GPTQ would zero every column). An MoE
    expert under the recipe's calibration.min_expert_tokens: H has the rank of a handful of tokens, and GPTQ's error
    feedback would fit the weights to those tokens rather than to the expert's inputs; its weight alone decides its
    scales (RTN). Dense Linears see every calibration token, so only experts are held to the minimum."""
    if tokens == 0:
        return "no calibration tokens"
    least = ctx.recipe.calibration.min_expert_tokens
    if tokens < least and ctx.arch.is_expert(group[0]):
        return f"{tokens} calibration tokens, fewer than calibration.min_expert_tokens ({least})"
    return None


def solve_group(ctx: LayerContext, group, hessian: Hessian, params: GPTQParams, record: GPTQRecord) -> None:
    weights = [ctx.weight(t) for t in group]
    scheme = ctx.group_scheme(group).weights
    reason = too_few_tokens(ctx, group, hessian.tokens)
    if reason is not None:  # round to nearest: the weight's own statistics, nothing fitted to a handful of tokens
        log.warning("GPTQ: %s received %s; quantized with RTN instead (more calibration samples would reach it)",
                    ", ".join(ctx.prefix + t for t in group), reason)
        ctx.qweights.update(rtn_weights(dict(zip(group, weights)), {t: scheme for t in group}, ctx.arch, ctx.dtype))
        for t in group:
            record.modules[t] = RTNFallback(reason)
        return
    solved = gptq_quantize_shared(weights, hessian.H, scheme, params, ctx.dtype, names=[ctx.prefix + t for t in group])
    for t, (qt, i) in zip(group, solved):
        ctx.qweights[t] = qt
        record.modules[t] = GPTQSolve(i["damp_percent"], i["retries"], i["dead_columns"], i["loss"])
