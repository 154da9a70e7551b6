"""Python side of kernels.c: round-to-nearest of a weight in one native pass per row, as a plan says (the kinds
below: per-channel / per-group int and fp8, fp8 128x128 blocks, MXFP4, NVFP4; each number format gives its plan,
qtk.quant.formats, which checks the kernel against its torch path before trusting it), and the relative error's
squared sums. Each function returns None where the kernels do not apply (turned off, not built, a CUDA tensor, a
weight holding NaN/Inf): the caller then takes the torch path, which gives the same codes and scales and raises the
errors."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from qtk.io.safetensors import recycled_empty
from qtk.quant.native import RTNArgs, library, thread_count

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
INT, FP8, BLOCK, MXFP4, NVFP4 = range(5)


@dataclass
class RowSums:
    """Per-row float64 sums of (decoded - w)^2 and w^2, and the decoded weight's largest magnitude."""

    row_e: torch.Tensor
    row_w: torch.Tensor
    amax: float


@dataclass(frozen=True)
class NativePlan:
    """How the kernel rounds a weight [rows, cols] (a format's native_plan, qtk.quant.formats): its kind, columns per
    scale (group), rows per scale (group_rows: a tile's height for FP8 blocks), the shape of the scales, the codes'
    dtype, and the grid: the divisor of amax for a scale, the codes' range, the scale an all-zero group gets, NVFP4's
    global scale."""

    kind: int
    group: int
    group_rows: int
    scale_shape: tuple[int, int]
    values_dtype: torch.dtype
    divisor: float = 0.0
    qmin: float = 0.0
    qmax: float = 0.0
    zero_scale: float = 0.0
    global_scale: float = 0.0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def applies(w: torch.Tensor, model_dtype: torch.dtype) -> bool:
    """Whether the kernel can round w [rows, cols] of a model stored in model_dtype at all: a CPU matrix with rows and
    columns, in the model dtype or float32, of a dtype the kernel reads."""
    return (w.device.type == "cpu" and w.dim() == 2 and w.dtype in _DT and model_dtype in _DT
            and (w.dtype == model_dtype or w.dtype == torch.float32) and 0 not in w.shape)


def rtn(w: torch.Tensor, plan: NativePlan, model_dtype: torch.dtype, want_error: bool = True,
        threads: int | None = None, lib=None):
    """(values, scale, RowSums | None) of weight w [out, in] rounded by the kernel as `plan` says (applies(w) holds);
    None where the weight or a scale holds NaN/Inf, or memory ran out (the torch path then raises the clear error).
    values and scale have the torch path's dtypes and shapes (scale float32). lib: the kernels (default: library())."""
    lib = lib or library()
    if lib is None:
        return None
    w = w.contiguous()
    rows, cols = w.shape
    values = recycled_empty((rows, cols), plan.values_dtype)  # the last layer's codes' buffer, in the stream
    scale = torch.empty(plan.scale_shape, dtype=torch.float32)
    row_e = torch.empty(rows, dtype=torch.float64) if want_error else None
    row_w = torch.empty(rows, dtype=torch.float64) if want_error else None
    hi, bad = torch.zeros(64, dtype=torch.float32), torch.zeros(64, dtype=torch.int32)
    args = RTNArgs(_ptr(w), rows, cols, plan.group, plan.group_rows, _DT[w.dtype], _DT[model_dtype], plan.kind,
                   int(want_error), plan.divisor, plan.qmin, plan.qmax, plan.zero_scale, plan.global_scale, _ptr(values),
                   _ptr(scale), _ptr(row_e), _ptr(row_w), _ptr(hi), _ptr(bad))
    used = lib.qtk_rtn(ctypes.byref(args), thread_count(threads))
    if used < 1 or bool(bad[:used].any()):
        return None  # NaN/Inf in the weight or its scale (or out of memory): the torch path raises the clear error
    return values, scale, RowSums(row_e, row_w, float(hi[:used].max())) if want_error else None


def sq_rows(w_hat: torch.Tensor, ref: torch.Tensor, threads: int | None = None):
    """(row_e, row_w): per-row float64 sums of (w_hat - ref)^2 and ref^2 for [rows, cols] tensors on the CPU (w_hat
    read as float32, ref float32); None where the kernels do not apply."""
    lib = library()
    if (lib is None or w_hat.device.type != "cpu" or ref.device.type != "cpu" or ref.dtype != torch.float32
            or w_hat.shape != ref.shape or ref.dim() != 2 or not w_hat.is_floating_point()):
        return None
    d, r = w_hat.float().contiguous(), ref.contiguous()
    rows, cols = r.shape
    row_e, row_w = torch.empty(rows, dtype=torch.float64), torch.empty(rows, dtype=torch.float64)
    lib.qtk_sq_rows(_ptr(d), _ptr(r), rows, cols, _ptr(row_e), _ptr(row_w), thread_count(threads))
    return row_e, row_w


def block_sums(row: torch.Tensor, step: int) -> list[float]:
    """The row sums added in order, `step` rows per block (the last block may be shorter)."""
    lib = library()
    rows = row.numel()
    out = torch.empty(-(-rows // step), dtype=torch.float64)
    lib.qtk_block_sums(_ptr(row), rows, step, _ptr(out))
    return out.tolist()
