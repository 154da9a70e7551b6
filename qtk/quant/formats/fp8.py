"""FP8 e4m3 (float8_e4m3fn) with one scale per tensor or output channel: scale = amax / 448, values cast to fp8
(round to nearest even, saturated at ±448); scales stay float32. Activations: dynamic per token, or a static
amax / 448."""

from __future__ import annotations

import torch

from qtk.quant.formats.base import register_format
from qtk.quant.formats.grouped import GroupedFormat
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
        return None  # float32: fp8 scales are not rounded to the model dtype

    def decodes_in_model_dtype(self, scheme: QuantScheme) -> bool:
        return False  # float32 scales: the fp8 GEMMs multiply by them in float32

    def raw_scale(self, xmin, xmax, scheme, half=None):
        return torch.maximum(xmax, -xmin) / FP8_MAX

    def quantize_grouped(self, wg, scale, zero, scheme, half=None):
        return (wg / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)

    def max_value(self, scheme: QuantScheme) -> float:
        return FP8_MAX

    def round_activation_(self, y, scheme):
        return y.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float()
