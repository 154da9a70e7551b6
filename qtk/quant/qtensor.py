"""QTensor: the quantized truth for one weight. Algorithms produce it; writers pack it; readers rebuild it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qtk.quant.qparams import dequantize_weight, quantize_weight, weight_qparams
from qtk.quant.scheme import QuantScheme


@dataclass(frozen=True)
class QTensor:
    """Unpacked quantized values of a [out, in] weight and everything needed to dequantize them.

    values: int8 (signed range, also for int4/int2 and asymmetric) or float8_e4m3fn, shape [out, in]
    scale: float32, [1] (tensor), [out, 1] (channel) or [out, in/group] (group)
    zero_point: float32 integers in the signed range, same shape as scale; None when symmetric
    g_idx: int32 [in], group of each input column (GPTQ act-order); None = column // group_size
    dtype: the source dtype (what dense tensors and int scales are stored in)
    """

    values: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    def dequantize(self) -> torch.Tensor:
        return dequantize_weight(self.values, self.scale, self.zero_point, self.scheme, self.g_idx)

    @classmethod
    def quantize(cls, w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype | None = None) -> "QTensor":
        """Round-to-nearest with the scheme's observer. Int scales are rounded to the model dtype first,
        so the scale on disk is exactly the one that produced the values."""
        dtype = dtype or w.dtype
        scale, zero = weight_qparams(w, scheme, None if scheme.is_fp8 else dtype)
        return cls(quantize_weight(w, scale, zero, scheme), scale, scheme, zero, None, dtype)
