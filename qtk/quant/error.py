"""The relative weight error |W_hat - W| / |W| that the manifest records and the self-check judges, summed a row
block at a time: each block's squared norms (float32, over at most ERROR_BLOCK_BYTES of float32, a size that stays
in a core's cache) are added in float64. Two properties follow. The figure does not need a whole-weight float32
difference (the data-free stream gives it the blocks it rounds, as it makes them, and never holds one), and it is
the same number, bit for bit, whether the weight arrives whole or in row blocks that start on block boundaries
(`ErrorSum.add` cuts what it is given at those boundaries). It is also closer to the exact figure than one float32
norm of a whole weight, whose rounding grows with the weight's size (tests/quant/test_error.py)."""

from __future__ import annotations

import math

import torch

from qtk.quant.native import rounding as native

ERROR_BLOCK_BYTES = 2 << 20  # float32 bytes per block


def block_rows(shape) -> int:
    """Rows (of the last dimension) per block of a tensor of `shape`, a power of two (so a slab of rows a format
    must round together, FP8's 128-row blocks, is a whole number of blocks, or a block a whole number of slabs):
    the whole of a 0-/1-D tensor."""
    if len(shape) < 2:
        return 1
    rows = max(1, ERROR_BLOCK_BYTES // max(1, 4 * int(shape[-1])))
    return 1 << (rows.bit_length() - 1)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(1, -1) if t.dim() < 2 else t.reshape(-1, t.shape[-1])


class ErrorSum:
    """Squared norms of W_hat - W and of W, added block by block (float64 on W's device: no host sync per block).
    On the CPU with qtk's native kernels (qtk.quant.native) each block's sums are float64 sums of float32 differences,
    row by row (qtk_sq_rows), as the native rounding kernel forms them while it rounds: the stream and the module
    loop then give the same figure whichever of the two made it. Without the kernels (or on an accelerator) a
    block's are its float32 norms squared; the two figures agree to float32 rounding."""

    def __init__(self):
        self.err = self.ref = None

    def add(self, w_hat: torch.Tensor, ref: torch.Tensor) -> "ErrorSum":
        """Rows of W_hat (any float dtype, read as float32) and of the reference W (float32), the same shape; the
        first row given must start a block (block_rows of the whole weight's shape)."""
        w_hat, ref = _rows(w_hat), _rows(ref)
        step = block_rows(ref.shape)
        rows = native.sq_rows(w_hat, ref)
        if rows is not None:
            return self.add_rows(*rows, step)
        for r in range(0, ref.shape[0], step):
            d = w_hat[r:r + step].float() - ref[r:r + step]
            e = torch.linalg.vector_norm(d).double().square()
            w = torch.linalg.vector_norm(ref[r:r + step]).double().square()
            self.err, self.ref = (e, w) if self.err is None else (self.err + e, self.ref + w)
        return self

    def add_rows(self, row_e: torch.Tensor, row_w: torch.Tensor, step: int) -> "ErrorSum":
        """Per-row float64 sums (qtk.quant.native), added `step` rows per block in order."""
        for e, w in zip(native.block_sums(row_e, step), native.block_sums(row_w, step)):
            self.err, self.ref = (e, w) if self.err is None else (self.err + e, self.ref + w)
        return self

    def value(self) -> float:
        if self.err is None:
            return 0.0
        if isinstance(self.err, float) and isinstance(self.ref, float):
            return math.sqrt(self.err) / max(math.sqrt(self.ref), 1e-12)
        return float(self.err.sqrt() / self.ref.sqrt().clamp_min(1e-12))


def relative_error(w_hat: torch.Tensor, ref: torch.Tensor) -> float:
    """|w_hat - ref| / |ref| (ref float32), summed in row blocks (ErrorSum)."""
    return ErrorSum().add(w_hat, ref).value()
