"""Observers and quantizers: scales and zero points per strategy, pure functions on tensors.

Conventions (shared by every writer, so one QTensor serves all targets):
- symmetric int: the full signed grid q in [qmin, qmax] = [-2^(b-1), 2^(b-1)-1] with
  scale = amax / ((qmax - qmin) / 2) (amax/7.5 int4, amax/127.5 int8), as compressed-tensors'
  calculate_qparams computes it (and llm-compressor and AutoGPTQ with it);
- asymmetric int: scale = (max - min) / (qmax - qmin), zero = round(qmin - min/scale), q in [qmin, qmax],
  both in the signed range (compressed-tensors' convention; legacy packers shift to unsigned);
- fp8 e4m3: scale = amax / 448, values cast to float8_e4m3fn.
Dequantized w = (q - zero) * scale.

Every target decodes exactly that for any q of the full grid (docs/grids.md): vLLM's
compressed-tensors kernels (int8, and uint4b8/uint8b128 = q + 2^(b-1) for packed weights), the legacy GPTQ
and AWQ kernels ((q_u - z_u) * s with z_u = 2^(b-1) when symmetric), TensorRT-LLM's int8 SmoothQuant GEMM and
its group-wise int4 kernel (W4A16_AWQ, signed int4 times the scale). ModelOpt exports amax/7 (amax/127) scales,
which leave the code -2^(b-1) unused; that is its choice of scale, not a constraint of the kernels that read it.
The one place another grid is simulated is trtllm-build's own weight-only quantization of plain W8A16/W4A16
weights (qtk.export.trtllm). Activations keep the engines' run-time conventions (amax/127 per token, static
amax/127 or amax/448), and so does the INT8 KV cache (amax/127).
"""

from __future__ import annotations

import torch

from qtk.recipe import FP8_MAX, QuantScheme

FP8_DTYPE = torch.float8_e4m3fn
_TINY = torch.finfo(torch.float32).tiny


def _grouped(w: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """View w [out, in] as [out, n_groups, group] so each statistic reduces over the last dim."""
    out, inp = w.shape
    if scheme.strategy == "tensor":
        return w.reshape(1, 1, -1)
    if scheme.strategy == "channel":
        return w.reshape(out, 1, inp)
    if scheme.strategy == "group":
        g = scheme.group_size
        assert inp % g == 0, f"group_size {g} does not divide in_features {inp}"  # validated upstream
        return w.reshape(out, inp // g, g)
    raise ValueError(f"weights cannot use strategy {scheme.strategy!r}")


def _scale_zero(xmin: torch.Tensor, xmax: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None):
    """Scale (and zero point) from per-group min/max; scales rounded to their storage dtype first."""
    xmin = torch.minimum(xmin, torch.zeros_like(xmin))
    xmax = torch.maximum(xmax, torch.zeros_like(xmax))
    if scheme.is_fp8:
        scale = torch.maximum(xmax, -xmin) / FP8_MAX
        zero = None
    elif scheme.symmetric:
        scale = torch.maximum(xmax, -xmin) / ((scheme.qmax - scheme.qmin) / 2)  # full grid: amax/7.5, amax/127.5
        zero = None
    else:
        scale = (xmax - xmin) / (scheme.qmax - scheme.qmin)
    # an all-zero group quantizes to zeros with any scale; 1.0 keeps every scale finite and positive
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    if scale_dtype is not None:
        scale = scale.to(scale_dtype).float()
        scale = torch.where(scale > 0, scale, torch.full_like(scale, torch.finfo(scale_dtype).tiny))
    if not scheme.is_fp8 and not scheme.symmetric:
        zero = torch.round(scheme.qmin - xmin / scale).clamp(scheme.qmin, scheme.qmax)
    return scale, zero


def quantize_grouped(wg: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """q for w viewed [*, n_groups, group] with scale/zero [*, n_groups, 1]."""
    if scheme.is_fp8:
        return (wg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = torch.round(wg / scale)
    if zero is not None:
        q = q + zero
    return q.clamp(scheme.qmin, scheme.qmax)


def dequantize_grouped(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None) -> torch.Tensor:
    q = q.float()
    if zero is not None:
        q = q - zero
    return q * scale


def _mse_shrink(wg, xmin, xmax, scheme, scale_dtype, grid: int = 80, max_shrink: float = 0.8, norm: float = 2.4):
    """MSE-grid observer: per group, the shrink of [min, max] that minimises |Q(w) - w|^norm."""
    best_err = torch.full(xmin.shape, float("inf"))
    best_min, best_max = xmin.clone(), xmax.clone()
    for i in range(int(max_shrink * grid)):
        p = 1 - i / grid
        smin, smax = p * xmin, p * xmax
        scale, zero = _scale_zero(smin, smax, scheme, scale_dtype)
        err = (dequantize_grouped(quantize_grouped(wg, scale, zero, scheme), scale, zero) - wg).abs().pow(norm).sum(-1, keepdim=True)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_min = torch.where(better, smin, best_min)
        best_max = torch.where(better, smax, best_max)
    return best_min, best_max


def weight_qparams(w: torch.Tensor, scheme: QuantScheme, scale_dtype: torch.dtype | None = None):
    """Scale and zero point for weight w [out, in]; shapes [1], [out, 1] or [out, in/group].

    scale_dtype: the dtype the scale is stored in (the model dtype for int, None = float32 for fp8).
    """
    wg = _grouped(w.float(), scheme)
    xmin = wg.amin(-1, keepdim=True)
    xmax = wg.amax(-1, keepdim=True)
    if scheme.observer == "mse":
        xmin, xmax = _mse_shrink(wg, xmin, xmax, scheme, scale_dtype)
    scale, zero = _scale_zero(xmin, xmax, scheme, scale_dtype)
    return _ungroup(scale, scheme), (None if zero is None else _ungroup(zero, scheme))


def _ungroup(t: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """[out|1, n_groups, 1] -> the storage shape of a scale for the strategy."""
    if scheme.strategy == "tensor":
        return t.reshape(1)
    if scheme.strategy == "channel":
        return t.reshape(-1, 1)
    return t.reshape(t.shape[0], t.shape[1])


def _regroup(t: torch.Tensor, w_shape, scheme: QuantScheme) -> torch.Tensor:
    out, inp = w_shape
    if scheme.strategy == "tensor":
        return t.reshape(1, 1, 1)
    if scheme.strategy == "channel":
        return t.reshape(out, 1, 1)
    return t.reshape(out, inp // scheme.group_size, 1)


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme) -> torch.Tensor:
    """Integer (as int8) or fp8 values of w [out, in] with the given qparams."""
    wg = _grouped(w.float(), scheme)
    q = quantize_grouped(wg, _regroup(scale, w.shape, scheme), None if zero is None else _regroup(zero, w.shape, scheme), scheme)
    q = q.reshape(w.shape)
    return q if scheme.is_fp8 else q.to(torch.int8)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """float32 weights from q [out, in]; g_idx [in] maps each input column to its group (act-order)."""
    if g_idx is not None:
        s = scale[:, g_idx.long()]
        z = None if zero is None else zero[:, g_idx.long()].float()
        qf = q.float()
        return ((qf - z) if z is not None else qf) * s
    qg = _grouped(q.float() if not scheme.is_fp8 else q.float(), scheme)
    w = dequantize_grouped(qg, _regroup(scale.float(), q.shape, scheme),
                           None if zero is None else _regroup(zero.float(), q.shape, scheme))
    return w.reshape(q.shape)


# ---- activations (simulated exactly as the engines quantize them at run time) ----

def fake_quant_activation(x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize-dequantize activations: per-token dynamic (scale = row amax / qmax) or static per-tensor.

    Runs on every Linear input of a simulated model, so it works in place on one float32 buffer."""
    qmax = FP8_MAX if scheme.is_fp8 else float(scheme.qmax)
    if scheme.dynamic:
        amax = x.abs().amax(-1, keepdim=True) if scheme.strategy == "token" else x.abs().amax()
        if amax.dtype != torch.float32:
            amax = amax.float()
        # an all-zero row quantizes to zeros with any positive scale: the smallest normal float stands in for 0
        s = amax.div_(qmax).clamp_min_(_TINY)
    else:
        if scale is None:
            raise ValueError("static activation quantization needs a calibrated input scale")
        s = scale.float().reshape(())
    y = x.float().div(s) if x.dtype != torch.float32 else x.div(s)
    if scheme.is_fp8:
        y = y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
    else:
        y = y.round_().clamp_(scheme.qmin, scheme.qmax)
    y = y.mul_(s)
    return y if y.dtype == x.dtype else y.to(x.dtype)


def static_scale(amax: float | torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
    """Static per-tensor scale from a calibrated absolute maximum."""
    a = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    qmax = FP8_MAX if scheme.is_fp8 else float(scheme.qmax)
    s = a / qmax
    return torch.where(s > 0, s, torch.ones_like(s))
