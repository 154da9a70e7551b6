"""FP8 e4m3 (float8_e4m3fn) with one scale per tensor or output channel: scale = amax / 448, values cast to fp8
(round to nearest even, saturated at ±448). Activations: dynamic per token, or a static amax / 448.

Weights follow compressed-tensors' arithmetic (its calculate_qparams and quantize(), which llm-compressor's
checkpoints go through), so the codes and scales are llm-compressor's bit for bit: the scale is amax / 448
rounded to the model dtype and stored in it (a zero scale becomes that dtype's eps), and for a bf16 / fp16 model
w / scale is rounded to the model dtype before the fp8 cast (the division runs on the bf16 weight tensor there).
That double rounding decides ~3 % of a real bf16 model's codes (issue 11 item 4). A float32 model keeps float32
arithmetic; GPTQ's column loop keeps float32 quotients (llm-compressor's GPTQ divides float32 working weights).
Dequantized w = q · scale in float32, as vLLM's fp8 GEMMs apply the scale (exact: 4 × 8 significant bits).
"""

from __future__ import annotations

import torch

from qtk.quant.formats.base import register_format
from qtk.quant.formats.grouped import GroupedFormat
from qtk.quant.formats.integer import HALF, _rounded
from qtk.quant.fp8_block import fp8_group_fake_quant
from qtk.quant.scheme import FP8_MAX, QuantScheme

FP8_DTYPE = torch.float8_e4m3fn


@register_format
class FP8Format(GroupedFormat):
    name = "fp8-e4m3"

    def accepts(self, scheme: QuantScheme) -> bool:
        return scheme.type == "float" and scheme.num_bits == 8 and scheme.strategy in ("tensor", "channel", "token")

    def storage_dtype(self, scheme: QuantScheme) -> torch.dtype:
        return FP8_DTYPE

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        return False

    def scale_dtype(self, scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype | None:
        return model_dtype

    def quotient_dtype(self, model_dtype):
        return model_dtype if model_dtype in HALF else None

    def decodes_in_model_dtype(self, scheme: QuantScheme) -> bool:
        return False  # the fp8 GEMMs multiply by the scale in float32

    def raw_scale(self, xmin, xmax, scheme, half=None):
        return torch.maximum(xmax, -xmin) / FP8_MAX

    def quantize_grouped(self, wg, scale, zero, scheme, half=None):
        return _rounded(wg / scale, half).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

    def max_value(self, scheme: QuantScheme) -> float:
        return FP8_MAX

    def fake_quant_activation(self, x, scheme, scale=None):
        if x.dtype not in HALF:
            return super().fake_quant_activation(x, scheme, scale)
        # a bf16 / fp16 model: compressed-tensors' run-time path computes in x's dtype (the scale amax/448 rounded
        # to it, x / scale rounded to it before the fp8 cast, the product too); float32 arithmetic differs
        if scheme.dynamic and scheme.strategy == "token":
            return fp8_group_fake_quant(x, None)
        if scheme.dynamic:
            amax = x.detach().abs().amax().float()
            s = (amax / FP8_MAX).to(x.dtype)
            s = torch.where(s == 0, torch.finfo(x.dtype).eps, s)
        elif scale is None:
            raise ValueError("static activation quantization needs a calibrated input scale")
        else:
            s = scale.reshape(()).to(x.dtype)
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(x.dtype) * s

    def round_activation_(self, y, scheme):
        return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
