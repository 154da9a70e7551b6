"""FP8 e4m3 in 2-D blocks (compressed-tensors strategy block, block_structure [128, 128]; DeepSeek-V3's layout): one
scale per block of the weight, amax/448 rounded to the model dtype (qtk.quant.fp8_block, bit-equal to
compressed-tensors for the scales). Dequantized w = q · scale of its block.

QTensor layout: values float8_e4m3fn [out, in], scale float32 [ceil(out/bm), ceil(in/bn)] (model-dtype values).

Also the activations that go with it: FP8 per token per group of `group_size` input channels, dynamic
(compressed-tensors strategy group on float 8 activations).
"""

from __future__ import annotations

import torch

from qtk.quant.formats.base import Format, QParams, register_format
from qtk.quant.formats.integer import HALF
from qtk.quant.fp8_block import FP8_E4M3_MAX, fp8_block_dequantize, fp8_block_quantize, fp8_block_scales, fp8_group_fake_quant
from qtk.quant.e4m3 import to_float32
from qtk.quant.scheme import QuantScheme


@register_format
class FP8BlockFormat(Format):
    name = "fp8-block"

    def accepts(self, scheme: QuantScheme) -> bool:
        if not scheme.is_fp8 or scheme.scale_dtype is not None:
            return False
        return (scheme.strategy == "block" and scheme.block_structure is not None) or (
            scheme.strategy == "group" and scheme.dynamic is True)  # per-token-group activations

    def storage_dtype(self, scheme):
        return torch.float8_e4m3fn

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return model_dtype

    def qparams(self, w, scheme, model_dtype):
        return QParams(fp8_block_scales(w.float(), tuple(scheme.block_structure), model_dtype).float())

    def quantize(self, w, qp, scheme, model_dtype=None):
        # a bf16 / fp16 model divides in its dtype, as compressed-tensors does on the weight tensor (fp8.py)
        dt = model_dtype if model_dtype in HALF else torch.float32
        return fp8_block_quantize(w.to(dt), qp.scale.to(dt), tuple(scheme.block_structure))

    def dequantize(self, values, qp, scheme, g_idx=None):
        if g_idx is not None:
            raise ValueError("FP8 block weights have no act-order g_idx")
        return fp8_block_dequantize(values, qp.scale.float(), tuple(scheme.block_structure), torch.float32)

    def column_quantizer(self, scheme, qp=None, model_dtype=None):
        def quantize_column(w, s, z):
            q = torch.div(w, s).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
            return q, to_float32(q).mul_(s)

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return to_float32(q) * scale

    def fake_quant_activation(self, x, scheme, scale=None):
        return fp8_group_fake_quant(x, scheme.group_size)

    def static_scale(self, amax, scheme):
        raise ValueError("FP8 per-token-group activations are quantized dynamically; they have no static scale")
