"""Scales, zero points, quantize / dequantize of a weight and activation fake-quant by scheme: the functional names
the writers and tests call, each answered by the scheme's format spec (qtk.quant.formats, where the arithmetic and
its conventions live). Dequantized w = (q - zero) * scale.
"""

from __future__ import annotations

import torch

from qtk.quant.formats import QParams, fake_quant_activation, format_for, static_scale  # noqa: F401 (re-exported)
from qtk.quant.formats.fp8 import FP8_DTYPE  # noqa: F401 (re-exported)
from qtk.quant.formats.grouped import dequantize_grouped  # noqa: F401 (re-exported)
from qtk.quant.scheme import QuantScheme

__all__ = ["FP8_DTYPE", "dequantize_grouped", "quantize_weight", "dequantize_weight", "fake_quant_activation",
           "static_scale"]


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme,
                    model_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stored values (int8 or fp8) of w [out, in] with the given qparams (model_dtype: see Format.quantize)."""
    return format_for(scheme).quantize(w, QParams(scale, zero), scheme, model_dtype=model_dtype)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, scheme: QuantScheme,
                      g_idx: torch.Tensor | None = None) -> torch.Tensor:
    """float32 weights from q [out, in]; g_idx [in] maps each input column to its group (act-order)."""
    return format_for(scheme).dequantize(q, QParams(scale, zero), scheme, g_idx)
