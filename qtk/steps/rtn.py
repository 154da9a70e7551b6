"""The round-to-nearest step (SOLVE): each Linear with its scheme's observer; implied when no listed step solves the
weights (AWQ's scaled and clipped weights round to nearest). Per-tensor scales are shared inside fusion groups,
because the engines fuse q/k/v and gate/up into one GEMM with one scale; so is a format's tensor-wide part (NVFP4's
global scale), which the engines require equal across a fused group."""

from __future__ import annotations

from typing import Callable

import torch

from qtk.quant.formats import format_for
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme
from qtk.recipe.params import STEP_PARAMS, Phase, RTNParams
from qtk.steps.context import LayerContext
from qtk.steps.registry import register_step


def rtn_weights(weights: dict[str, torch.Tensor], schemes: dict[str, QuantScheme], arch, dtype,
                measure: Callable[[str, torch.Tensor, QTensor], None] | None = None) -> dict[str, QTensor]:
    """QTensors of `weights` (relative name -> [out, in]) with their weight schemes (relative name -> scheme; the
    members of a fusion group share theirs); a per-tensor scale is taken over the whole fusion group. Each weight
    is rounded from its float32 copy, made where it is used, so a caller may pass model-dtype weights and hold one
    float32 copy at a time (the data-free stream), not one per Linear of the layer. measure(name, w32, qt), when
    given, is called with each float32 copy and its QTensor while the copy is alive (the stream's error)."""
    out: dict[str, QTensor] = {}

    def done(m: str, w32: torch.Tensor, qt: QTensor) -> None:
        out[m] = qt
        if measure is not None:
            measure(m, w32, qt)

    for g in arch.fusion_groups:
        members = [m for m in g if m in weights]
        if len(members) > 1 and schemes[members[0]].strategy == "tensor":
            scheme = schemes[members[0]]
            fmt = format_for(scheme)
            joint = torch.cat([weights[m].float() for m in members], dim=0)
            qp = fmt.qparams(joint, scheme, dtype)
            del joint
            for m in members:
                w32 = weights[m].float()
                done(m, w32, QTensor.of(fmt.quantize(w32, qp, scheme, model_dtype=dtype), qp, scheme, dtype))
                del w32  # before the next copy is made
        elif len(members) > 1:  # a tensor-wide part the fused GEMM shares (NVFP4's global scale), from the joint weights
            scheme = schemes[members[0]]
            fmt = format_for(scheme)
            qps = fmt.fused_qparams([weights[m].float() for m in members], scheme, dtype)
            for m, qp in zip(members, qps or ()):
                w32 = weights[m].float()
                done(m, w32, QTensor.of(fmt.quantize(w32, qp, scheme, model_dtype=dtype), qp, scheme, dtype))
                del w32  # before the next copy is made
    for name, w in weights.items():
        if name not in out:
            w32 = w.float()
            done(name, w32, QTensor.quantize(w32, schemes[name], dtype))
            del w32
    return out


def _implied(recipe) -> RTNParams | None:
    """Round-to-nearest solves the weights of a recipe whose listed steps do not (e.g. [awq])."""
    return None if any(STEP_PARAMS[s.name].phase is Phase.SOLVE for s in recipe.algorithm) else RTNParams()


@register_step("rtn", implied=_implied)
def run(ctx: LayerContext, params: RTNParams) -> None:
    weights = {t: ctx.weight(t).float() for t in ctx.targets}
    ctx.qweights.update(rtn_weights(weights, {t: ctx.scheme(t).weights for t in ctx.targets}, ctx.arch, ctx.dtype))
