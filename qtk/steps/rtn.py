"""The round-to-nearest step (SOLVE): each Linear with its scheme's observer; implied when no listed step solves the
weights (AWQ's scaled and clipped weights round to nearest). Per-tensor scales are shared inside fusion groups,
because the engines fuse q/k/v and gate/up into one GEMM with one scale; so is a format's tensor-wide part (NVFP4's
global scale), which the engines require equal across a fused group."""

from __future__ import annotations

from typing import Callable, Protocol

import torch

from qtk.quant.error import block_rows
from qtk.quant.formats import format_for
from qtk.quant.formats.kernel import native_rtn
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy
from qtk.recipe.params import STEP_PARAMS, Phase, RTNParams
from qtk.steps.context import LayerContext
from qtk.steps.registry import register_step


def row_block(scheme: QuantScheme, shape) -> int | None:
    """Rows per block when `scheme`'s rows round on their own, or in slabs of a few rows (Format.row_slab: per-channel
    or per-group scales from the min-max observer, on an int or fp8 grid; MX's E8M0 groups; NVFP4's groups of 16
    under a global scale fixed up front from the weight's amax; FP8 blocks in slabs of whole tile rows), so a
    weight's QTensor is its row blocks' QTensors stacked, bit for bit, and can be made (and decoded, and its error
    summed) a block at a time without whole-weight float32 temporaries. None otherwise (per-tensor scales, the MSE
    observer) and for weights of one block. The blocks are the error's (qtk.quant.error.block_rows:
    ERROR_BLOCK_BYTES of float32, cache-sized, a power of two; a tile row when that is taller), so the error summed
    block by block as they are rounded is the figure of the whole weight, bit for bit."""
    slab = format_for(scheme).row_slab(scheme)
    if slab is None or len(shape) != 2 or slab & (slab - 1):  # a slab not a power of two is no whole number of blocks
        return None
    rows = max(block_rows(shape), slab)
    return rows if rows < shape[0] else None


class Measure(Protocol):
    """What a caller of rtn_weights is shown of each weight as it is rounded (the data-free stream's error and
    self-check figures): the float32 source rows and their QTensor, block by block (r0: the first row; one call
    with the whole weight when it is rounded whole), then the whole QTensor."""

    def block(self, name: str, r0: int, w32: torch.Tensor, qt: QTensor, decoded: torch.Tensor | None = None) -> None:
        """decoded: the engine's float32 decode of qt (engine_weight), when the rounding made it on the way."""

    def native(self, name: str, qt: QTensor, sums) -> None:
        """The whole weight rounded by qtk's native kernel (qtk.quant.native.rounding), with its per-row error sums and
        largest decoded magnitude (RowSums) in place of the blocks."""

    def done(self, name: str, qt: QTensor) -> None: ...


def quantize_rows(w: torch.Tensor, scheme: QuantScheme, dtype, rows: int,
                  extra: dict[str, torch.Tensor] | None = None,
                  on_block: Callable[..., None] | None = None) -> QTensor:
    """QTensor.quantize(w.float(), scheme, dtype), `rows` rows at a time (for a scheme row_block accepts): the same
    tensors. w may be in the model dtype: each block is copied to float32 where it is rounded (a cache-sized
    copy, never the whole weight's). A format's tensor-wide part (NVFP4's global scale) is fixed first, from the
    whole weight's min/max, or given in `extra` (a fusion group's, Format.shared_extra), and every block rounded
    under it. on_block(r0, w32_block, qt_block, decoded), when given, sees each block while it is hot in cache;
    then a block of a model-dtype weight is rounded in the model dtype where the format gives the same bits that
    way (Format.quantize_decoded, which also hands over the engine's decode: decoded, else None)."""
    fmt = format_for(scheme)
    if extra is None and fmt.tensor_wide(scheme):
        extra = fmt.shared_extra([w], scheme, dtype)
    values = torch.empty(w.shape, dtype=fmt.storage_dtype(scheme), device=w.device)
    scales, zeros = [], []
    for r in range(0, w.shape[0], rows):
        rows_in = w[r:r + rows]
        block = rows_in.float()
        qp = fmt.row_qparams(block, scheme, dtype, extra)
        fast = fmt.quantize_decoded(rows_in, qp, scheme, dtype) if on_block is not None else None
        v, decoded = fast if fast is not None else (fmt.quantize(block, qp, scheme, model_dtype=dtype), None)
        values[r:r + rows] = v
        scales.append(qp.scale)
        zeros.append(qp.zero_point)
        if on_block is not None:
            on_block(r, block, QTensor(v, qp.scale, scheme, qp.zero_point, None, dtype, dict(extra or {})), decoded)
        del qp, v, block, decoded
    return QTensor(values, torch.cat(scales), scheme, None if zeros[0] is None else torch.cat(zeros), None, dtype,
                   dict(extra or {}))


def _round(w: torch.Tensor, scheme: QuantScheme, dtype, extra: dict[str, torch.Tensor] | None = None,
           on_block: Callable[..., None] | None = None, on_native: Callable[..., None] | None = None,
           threads: int | None = None) -> QTensor:
    """w's QTensor (w in any float dtype, rounded from its float32 values; under a fusion group's tensor-wide part
    `extra`, if given). On the CPU, the schemes qtk's native kernel covers (per-channel / per-group symmetric int
    and fp8, fp8 blocks, MXFP4, NVFP4: qtk.quant.native.rounding) are rounded there, the same codes and scales in one
    pass per row, and shown to on_native(qt, RowSums) when given. Otherwise a row block at a time when the weight
    is large and its rows round on their own (row_block), so no whole-weight float32 temporaries; else from one
    float32 copy, shown whole to on_block."""
    fmt = format_for(scheme)
    if extra is None and fmt.tensor_wide(scheme):
        extra = fmt.shared_extra([w], scheme, dtype)
    got = native_rtn(w, scheme, dtype, extra, want_error=on_native is not None, threads=threads)
    if got is not None:
        values, scale, sums = got
        qt = QTensor(values, scale, scheme, None, None, dtype, dict(extra or {}))
        if on_native is not None:
            on_native(qt, sums)
        return qt
    rows = row_block(scheme, w.shape)
    if rows is not None:
        return quantize_rows(w, scheme, dtype, rows, extra, on_block)
    w32 = w.float()
    if extra is None:
        qt = QTensor.quantize(w32, scheme, dtype)
    else:
        qp = fmt.row_qparams(w32, scheme, dtype, extra)
        qt = QTensor.of(fmt.quantize(w32, qp, scheme, model_dtype=dtype), qp, scheme, dtype)
    if on_block is not None:
        on_block(0, w32, qt)
    return qt


def rtn_weights(weights: dict[str, torch.Tensor], schemes: dict[str, QuantScheme], arch, dtype,
                measure: Measure | None = None, consume: bool = False, threads: int | None = None) -> dict[str, QTensor]:
    """QTensors of `weights` (relative name -> [out, in]) with their weight schemes (relative name -> scheme; the
    members of a fusion group share theirs); a per-tensor scale is taken over the whole fusion group. Each weight
    is rounded from float32 values made where they are used (a row block at a time where row_block allows, else one
    whole copy at a time), so a caller may pass model-dtype weights (the data-free stream). measure (Measure), when
    given, sees each weight's float32 rows and their QTensor while they are alive, then the whole QTensor.
    consume: each weight is removed from `weights` once its QTensor is made, so a caller that holds it nowhere else
    frees it then (the stream: a layer's source weights go one by one, not at the end of the layer). threads: the
    native kernel's (default torch's thread count)."""
    out: dict[str, QTensor] = {}

    def shown(m: str):
        return None if measure is None else (lambda r0, w32, qt, decoded=None: measure.block(m, r0, w32, qt, decoded))

    def native(m: str):
        return None if measure is None else (lambda qt, sums: measure.native(m, qt, sums))

    def done(m: str, qt: QTensor) -> None:
        out[m] = qt
        if consume:
            del weights[m]
        if measure is not None:
            measure.done(m, qt)

    for g in arch.fusion_groups:
        members = [m for m in g if m in weights]
        if len(members) > 1 and schemes[members[0]].strategy == Strategy.TENSOR:
            scheme = schemes[members[0]]
            fmt = format_for(scheme)
            joint = torch.cat([weights[m].float() for m in members], dim=0)
            qp = fmt.qparams(joint, scheme, dtype)
            del joint
            for m in members:
                w32 = weights[m].float()
                qt = QTensor.of(fmt.quantize(w32, qp, scheme, model_dtype=dtype), qp, scheme, dtype)
                if measure is not None:
                    measure.block(m, 0, w32, qt)
                del w32  # before the next copy is made
                done(m, qt)
        elif len(members) > 1:  # a tensor-wide part the fused GEMM shares (NVFP4's global scale), from the joint weights
            scheme = schemes[members[0]]
            fmt = format_for(scheme)
            # min/max passes over the weights as given (model dtype in the stream): no float32 copy of any member yet
            extra = fmt.shared_extra([weights[m] for m in members], scheme, dtype)
            for m in members if extra is not None else ():
                done(m, _round(weights[m], scheme, dtype, extra, shown(m), native(m), threads))
    for name in list(weights):  # names only: no reference to a weight beyond its own turn
        if name not in out:
            done(name, _round(weights[name], schemes[name], dtype, on_block=shown(name), on_native=native(name),
                              threads=threads))
    return out


def _implied(recipe) -> RTNParams | None:
    """Round-to-nearest solves the weights of a recipe whose listed steps do not (e.g. [awq])."""
    return None if any(STEP_PARAMS[s.name].phase is Phase.SOLVE for s in recipe.algorithm) else RTNParams()


@register_step("rtn", implied=_implied)
def run(ctx: LayerContext, params: RTNParams) -> None:
    weights = {t: ctx.weight(t).float() for t in ctx.targets}
    ctx.qweights.update(rtn_weights(weights, {t: ctx.scheme(t).weights for t in ctx.targets}, ctx.arch, ctx.dtype))
