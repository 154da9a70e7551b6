"""Python side of kernels.c: round-to-nearest of a weight in one native pass per row (per-channel / per-group int
and fp8, fp8 128x128 blocks, MXFP4, NVFP4), and the relative error's squared sums. Each function returns None
where the kernels do not apply (turned off, not built, a CUDA tensor, a scheme or shape they do not cover, a weight
holding NaN/Inf): the caller then takes the torch path, which gives the same codes and scales and raises the
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
class _Plan:
    kind: int
    group: int
    group_rows: int
    scale_shape: tuple[int, int]
    values_dtype: torch.dtype
    divisor: float = 0.0
    qmin: float = 0.0
    qmax: float = 0.0
    zero_scale: float = 0.0


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _plan(w: torch.Tensor, scheme, model_dtype: torch.dtype, extra) -> _Plan | None:
    """How the kernel rounds `w` under `scheme`, or None where it does not (the torch path's result is the
    reference: qtk.quant.formats.*)."""
    from qtk.quant.formats import format_for
    from qtk.quant.formats.fp8 import FP8Format
    from qtk.quant.formats.fp8_block import FP8BlockFormat
    from qtk.quant.formats.integer import HALF, IntFormat
    from qtk.quant.formats.mx import MXFormat
    from qtk.quant.formats.nvfp4 import GLOBAL, NVFP4Format

    if (w.device.type != "cpu" or w.dim() != 2 or w.dtype not in _DT or model_dtype not in _DT
            or (w.dtype != model_dtype and w.dtype != torch.float32) or scheme.observer != "minmax"
            or 0 in w.shape):
        return None
    rows, cols = w.shape
    fmt = format_for(scheme)
    eps = torch.finfo(model_dtype).eps
    if type(fmt) is NVFP4Format:
        if extra is None or set(extra) != {GLOBAL} or cols % scheme.group_size:
            return None
        return _Plan(NVFP4, scheme.group_size, 1, (rows, cols // scheme.group_size), torch.uint8)
    if extra:
        return None
    if type(fmt) is MXFormat and scheme.num_bits == 4 and not cols % scheme.group_size:
        return _Plan(MXFP4, scheme.group_size, 1, (rows, cols // scheme.group_size), torch.uint8)
    if type(fmt) is FP8BlockFormat and scheme.strategy == "block":
        bm, bn = (int(x) for x in scheme.block_structure)
        return _Plan(BLOCK, bn, bm, (-(-rows // bm), -(-cols // bn)), torch.float8_e4m3fn, 448.0, zero_scale=eps)
    if type(fmt) not in (FP8Format, IntFormat) or scheme.strategy not in ("channel", "group"):
        return None
    group = cols if scheme.strategy == "channel" else int(scheme.group_size)
    if cols % group or fmt.scale_dtype(scheme, model_dtype) != model_dtype:
        return None
    zero = eps if model_dtype in HALF else 1.0  # compressed-tensors' guard; a float32 model's all-zero group: 1.0
    shape = (rows, cols // group)
    if type(fmt) is FP8Format:
        return _Plan(FP8, group, 1, shape, torch.float8_e4m3fn, fmt.max_value(scheme), zero_scale=zero)
    if not scheme.symmetric:
        return None
    return _Plan(INT, group, 1, shape, torch.int8, (scheme.qmax - scheme.qmin) / 2, float(scheme.qmin),
                 float(scheme.qmax), zero)


def native_rtn(w: torch.Tensor, scheme, model_dtype: torch.dtype, extra: dict | None = None, want_error: bool = True,
               threads: int | None = None, lib=None):
    """(values, scale, RowSums | None) of the torch path's QTensor for weight w [out, in] (the model dtype or float32,
    on the CPU) under `scheme` and a format's tensor-wide part `extra` (NVFP4's global scale: given, the fusion
    group's); None where the kernel does not apply. values and scale have the torch path's dtypes and shapes (scale
    float32). lib: the kernels (default: library())."""
    lib = lib or library()
    plan = None if lib is None else _plan(w, scheme, model_dtype, extra)
    if plan is None:
        return None
    w = w.contiguous()
    rows, cols = w.shape
    values = recycled_empty((rows, cols), plan.values_dtype)  # the last layer's codes' buffer, in the stream
    scale = torch.empty(plan.scale_shape, dtype=torch.float32)
    row_e = torch.empty(rows, dtype=torch.float64) if want_error else None
    row_w = torch.empty(rows, dtype=torch.float64) if want_error else None
    hi, bad = torch.zeros(64, dtype=torch.float32), torch.zeros(64, dtype=torch.int32)
    gs = float(extra["global_scale"].float().reshape(())) if plan.kind == NVFP4 else 0.0
    args = RTNArgs(_ptr(w), rows, cols, plan.group, plan.group_rows, _DT[w.dtype], _DT[model_dtype], plan.kind,
                   int(want_error), plan.divisor, plan.qmin, plan.qmax, plan.zero_scale, gs, _ptr(values), _ptr(scale),
                   _ptr(row_e), _ptr(row_w), _ptr(hi), _ptr(bad))
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


def reference(w: torch.Tensor, scheme, model_dtype: torch.dtype):
    """The torch path's QTensor (what the kernel must equal), with NVFP4's global scale from w itself."""
    from qtk.quant.qtensor import QTensor

    return QTensor.quantize(w.float(), scheme, model_dtype)


def self_test(lib) -> str | None:
    """None when the kernels give the torch path's codes and scales on a few small weights (zeros, subnormals,
    quotients across each element format's range, every kind and dtype); else what differed."""
    from qtk.quant.scheme import QuantScheme

    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=g) * 0.05
    w[1] = 0.0
    w[2] *= 1e-38  # subnormal scales and quotients
    w[3, :128] = torch.arange(128) / 127.0 * 448.0  # quotients across the whole fp8 range
    w[4] = torch.linspace(-3e-3, 3e-3, 256)  # fp8 subnormal codes once divided by the row's scale
    w[5] = torch.linspace(-6.5, 6.5, 256)  # every fp4 threshold
    cases = [(QuantScheme(num_bits=8, type="float", strategy="channel"), d) for d in _DT] + [
        (QuantScheme(num_bits=8, type="int", strategy="channel"), torch.bfloat16),
        (QuantScheme(num_bits=4, type="int", strategy="group", group_size=32), torch.float16),
        (QuantScheme(num_bits=4, type="int", strategy="group", group_size=64), torch.float32),
        (QuantScheme(num_bits=8, type="float", strategy="block", block_structure=(16, 96)), torch.bfloat16),
        (QuantScheme(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="e8m0"), torch.bfloat16),
        (QuantScheme(num_bits=4, type="float", strategy="tensor_group", group_size=16), torch.bfloat16)]
    for scheme, dtype in cases:
        x = w.to(dtype)
        ref = reference(x, scheme, dtype)
        for given in (x, x.float()):
            got = native_rtn(given, scheme, dtype, dict(ref.extra) or None, want_error=False, lib=lib)
            if got is None:
                return f"kernel refused {scheme.type}{scheme.num_bits} {scheme.strategy} {dtype}"
            values, scale, _ = got
            if not (values.dtype == ref.values.dtype and torch.equal(values.view(torch.uint8), ref.values.view(torch.uint8))
                    and torch.equal(scale, ref.scale.float().reshape(scale.shape))):
                return f"codes or scales differ for {scheme.type}{scheme.num_bits} {scheme.strategy} {dtype}"
    return None
