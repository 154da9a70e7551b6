"""MXINT8 (OCP Microscaling v1.0): int8 elements, one power-of-two E8M0 scale per block of 32 input columns. A number
format qtk does not ship, written as a format author writes one: this file and a recipe, nothing else
(tests/quant/test_format_in_one_file.py registers it and converts, reads back, inspects and plans with it).

Scale X = 2^(floor(log2(amax of the block)) - 6), so amax / X lies in [64, 128) and the codes q = round(w / X),
saturated to -127..127, use the int8 range; dequantized w = q · X. compressed-tensors has no MXINT8 layout: this one
writes `weight` int8 [out, in] and `weight_scale` uint8 E8M0 codes [out, in/32] under the format name
"mxint8-quantized", as its MXFP8 sibling does.
"""

from __future__ import annotations

from qtk.errors import UsageError
from qtk.quant.formats.base import Format, QParams, Stored, all_equal
from qtk.quant.lazy import torch

GROUP = 32
QMAX = 127
CT_FORMAT = "mxint8-quantized"


def _e8m0_encode(scale):
    """Powers of two -> E8M0 codes (the float32 exponent field)."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _e8m0_decode(codes):
    return (codes.to(torch.int32) << 23).view(torch.float32)


class MXINT8Format(Format):
    name = "mxint8"
    ct_formats = (CT_FORMAT,)
    ct_scale_dtype = "torch.uint8"

    # ---- which schemes ----

    def claims(self, s):
        return s.type == "int" and s.scale_dtype == "e8m0"

    def accepts(self, s):
        return self.claims(s) and s.num_bits == 8 and s.strategy == "group" and s.group_size == GROUP and s.symmetric

    def validate(self, s, where, role):
        if role != "weights":
            raise UsageError(f"{where}: MXINT8 is a weight format", "drop scale_dtype from the activations")
        if not self.accepts(s):
            raise UsageError(f"{where}: MXINT8 is symmetric int8 in groups of {GROUP} under E8M0 scales",
                             f"use num_bits: 8, strategy: group, group_size: {GROUP}, symmetric: true")

    # ---- the arithmetic ----

    def storage_dtype(self, s):
        return torch.int8

    def has_zero_point(self, s):
        return False

    def scale_dtype(self, s, model_dtype):
        return torch.uint8

    def qparams(self, w, s, model_dtype):
        out, inp = w.shape
        amax = w.float().reshape(out, inp // GROUP, GROUP).abs().amax(-1).clamp_min(2.0 ** -120)
        return QParams(torch.exp2(torch.floor(torch.log2(amax)) - 6))

    def group_qparams(self, cols, s, model_dtype, qp=None):
        return self.qparams(cols, s, model_dtype)

    def quantize(self, w, qp, s, model_dtype=None):
        out, inp = w.shape
        q = (w.float().reshape(out, inp // GROUP, GROUP) / qp.scale.unsqueeze(-1)).round().clamp(-QMAX, QMAX)
        return q.reshape(out, inp).to(torch.int8)

    def dequantize(self, values, qp, s, g_idx=None):
        scale = qp.scale.float()[:, g_idx.long()] if g_idx is not None else qp.scale.float().repeat_interleave(GROUP, 1)
        return values.float() * scale

    def column_quantizer(self, s, qp=None, model_dtype=None):
        def quantize_column(w, scale, z):
            q = torch.div(w, scale).round_().clamp_(-QMAX, QMAX)
            return q, q * scale

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return q.float() * scale

    # ---- compressed-tensors, as the vllm target writes it ----

    def scale_shape(self, s, out_f, in_f):
        return [out_f, in_f // GROUP]

    def stored(self, module, shape, dtype):
        out, inn = shape
        return [Stored("weight", (out, inn), "int8", "quantized"), Stored("weight_scale", (out, inn // GROUP), "uint8", "scales")]

    def encode(self, qt, dtype, fmt):
        return {"weight": qt.values, "weight_scale": _e8m0_encode(qt.scale)}

    def decode(self, tensors, s, dtype):
        from qtk.quant.qtensor import QTensor

        return QTensor(tensors["weight"], _e8m0_decode(tensors["weight_scale"]), s, dtype=dtype)

    def check_stored(self, view, module, scheme, fmt, shape):
        problems: list[str] = []
        view.expect(f"{module}.weight", (torch.int8,), list(shape), problems)
        view.expect(f"{module}.weight_scale", (torch.uint8,), self.scale_shape(scheme.weights, *shape), problems)
        return problems

    # ---- what the checks hold it to ----

    def error_bound(self, s):
        return 0.1

    def value_problems(self, module, values, s):
        lo, hi = (int(x) for x in torch.aminmax(values))
        off = [f"{module} holds codes {lo}..{hi}, outside MXINT8's -127..127"] if lo < -QMAX or hi > QMAX else []
        return values.numel() > 1 and all_equal(values), off
