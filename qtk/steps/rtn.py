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


ROW_BLOCK_BYTES = 32 << 20  # float32 bytes of one row block of a weight rounded a block at a time


def row_block(scheme: QuantScheme, shape) -> int | None:
    """Rows per block when `scheme` rounds every row on its own (per-channel or per-group scales from the min-max
    observer, on an int or fp8 grid, and MX's E8M0 groups: each scale is a min/max over part of one row, each code an
    elementwise function of the row and its scale), so a weight's QTensor is its row blocks' QTensors stacked, bit for
    bit, and can be made (and decoded) a block at a time without whole-weight float32 temporaries; None otherwise
    (per-tensor scales, the MSE observer, formats with tensor-wide parts such as NVFP4's global scale, FP8 blocks)
    and for weights of one block."""
    from qtk.quant.formats.grouped import GroupedFormat
    from qtk.quant.formats.mx import MXFormat

    if (scheme.strategy not in ("channel", "group") or scheme.observer != "minmax"
            or not isinstance(format_for(scheme), (GroupedFormat, MXFormat)) or len(shape) != 2):
        return None
    rows = max(1, ROW_BLOCK_BYTES // max(1, 4 * int(shape[1])))
    return rows if rows < shape[0] else None


def quantize_rows(w32: torch.Tensor, scheme: QuantScheme, dtype, rows: int) -> QTensor:
    """QTensor.quantize(w32, scheme, dtype), `rows` rows at a time (for a scheme row_block accepts): the same tensors."""
    values = torch.empty(w32.shape, dtype=format_for(scheme).storage_dtype(scheme), device=w32.device)
    scales, zeros = [], []
    for r in range(0, w32.shape[0], rows):
        qt = QTensor.quantize(w32[r:r + rows], scheme, dtype)
        values[r:r + rows] = qt.values
        scales.append(qt.scale)
        zeros.append(qt.zero_point)
        del qt
    return QTensor(values, torch.cat(scales), scheme, None if zeros[0] is None else torch.cat(zeros), None, dtype, {})


def row_slice(qt: QTensor, r0: int, r1: int) -> QTensor:
    """Rows r0:r1 of a QTensor whose scheme row_block accepts (its scale and zero point are per row)."""
    from dataclasses import replace

    return replace(qt, values=qt.values[r0:r1], scale=qt.scale[r0:r1],
                   zero_point=None if qt.zero_point is None else qt.zero_point[r0:r1])


def rtn_weights(weights: dict[str, torch.Tensor], schemes: dict[str, QuantScheme], arch, dtype,
                measure: Callable[[str, torch.Tensor, QTensor], None] | None = None,
                consume: bool = False) -> dict[str, QTensor]:
    """QTensors of `weights` (relative name -> [out, in]) with their weight schemes (relative name -> scheme; the
    members of a fusion group share theirs); a per-tensor scale is taken over the whole fusion group. Each weight
    is rounded from its float32 copy, made where it is used, so a caller may pass model-dtype weights and hold one
    float32 copy at a time (the data-free stream), not one per Linear of the layer. measure(name, w32, qt), when
    given, is called with each float32 copy and its QTensor while the copy is alive (the stream's error).
    consume: each weight is removed from `weights` once its QTensor is made, so a caller that holds it nowhere else
    frees it then (the stream: a layer's source weights go one by one, not at the end of the layer)."""
    out: dict[str, QTensor] = {}

    def done(m: str, w32: torch.Tensor, qt: QTensor) -> None:
        out[m] = qt
        if consume:
            del weights[m]
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
    for name in list(weights):  # names only: no reference to a weight beyond its own turn
        if name not in out:
            w32 = weights[name].float()
            rows = row_block(schemes[name], w32.shape)  # large per-row weights: no whole-weight temporaries
            qt = QTensor.quantize(w32, schemes[name], dtype) if rows is None else quantize_rows(w32, schemes[name], dtype, rows)
            done(name, w32, qt)
            del w32, qt
    return out


def _implied(recipe) -> RTNParams | None:
    """Round-to-nearest solves the weights of a recipe whose listed steps do not (e.g. [awq])."""
    return None if any(STEP_PARAMS[s.name].phase is Phase.SOLVE for s in recipe.algorithm) else RTNParams()


@register_step("rtn", implied=_implied)
def run(ctx: LayerContext, params: RTNParams) -> None:
    weights = {t: ctx.weight(t).float() for t in ctx.targets}
    ctx.qweights.update(rtn_weights(weights, {t: ctx.scheme(t).weights for t in ctx.targets}, ctx.arch, ctx.dtype))
