"""MXFP4 / MXFP8 (OCP microscaling; compressed-tensors strategy group, group 32, scale_dtype torch.uint8): FP4 e2m1
or FP8 e4m3 elements, one power-of-two E8M0 scale per block of 32 input columns, chosen by compressed-tensors' rule
(qtk.quant.mx.mx_scales). Dequantized w = element · scale.

QTensor layout: values uint8 e2m1 codes [out, in] (MXFP4) or float8_e4m3fn [out, in] (MXFP8), scale float32
[out, in/32] holding powers of two (the writers store E8M0 codes, qtk.quant.mx.e8m0_encode).
"""

from __future__ import annotations

import torch

from qtk.quant.formats.base import Format, QParams, register_format
from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode
from qtk.quant.mx import FP8_E4M3_MAX, MX_GROUP, e8m0_decode, mx_fake_quant, mx_scales
from qtk.quant.e4m3 import to_float32
from qtk.quant.scheme import QuantScheme

_FP8 = torch.float8_e4m3fn


def _elem(scheme: QuantScheme) -> str:
    return "fp4" if scheme.num_bits == 4 else "fp8"


@register_format
class MXFormat(Format):
    name = "mx"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (scheme.type == "float" and scheme.num_bits in (4, 8) and scheme.strategy == "group"
                and scheme.group_size == MX_GROUP and scheme.scale_dtype == "e8m0")

    def storage_dtype(self, scheme):
        return torch.uint8 if scheme.num_bits == 4 else _FP8

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return torch.uint8  # E8M0 codes

    def qparams(self, w, scheme, model_dtype):
        return QParams(e8m0_decode(mx_scales(w.float(), _elem(scheme))))

    def group_qparams(self, cols, scheme, model_dtype, qp=None):
        return self.qparams(cols, scheme, model_dtype)  # one block: [out, 1]

    def _round(self, y: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        if scheme.num_bits == 4:
            return fp4_encode(y.clamp_(-FP4_MAX, FP4_MAX))
        return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8)

    @staticmethod
    def _values(q: torch.Tensor) -> torch.Tensor:
        return fp4_decode(q) if q.dtype == torch.uint8 else to_float32(q)

    def quantize(self, w, qp, scheme, model_dtype=None):  # float32 arithmetic (model_dtype: see Format.quantize)
        out, inp = w.shape
        g = scheme.group_size
        y = w.float().reshape(out, inp // g, g) / qp.scale.float().unsqueeze(-1)
        return self._round(y, scheme).reshape(out, inp)

    def dequantize(self, values, qp, scheme, g_idx=None):
        if g_idx is not None:
            return self._values(values) * qp.scale.float()[:, g_idx.long()]
        out, inp = values.shape
        g = scheme.group_size
        return (self._values(values).reshape(out, inp // g, g) * qp.scale.float().unsqueeze(-1)).reshape(out, inp)

    def column_quantizer(self, scheme, qp=None, model_dtype=None):
        def quantize_column(w, s, z):
            q = self._round(torch.div(w, s), scheme)
            return q, self._values(q).mul_(s)

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return self._values(q) * scale

    def fake_quant_activation(self, x, scheme, scale=None):
        return mx_fake_quant(x, _elem(scheme))

    def static_scale(self, amax, scheme):
        raise ValueError("MX activations are quantized dynamically; they have no static scale")
