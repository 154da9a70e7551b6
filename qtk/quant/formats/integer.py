"""int-N (N in 2, 4, 8) with one scale per tensor, output channel or group of input columns, symmetric or asymmetric.

Conventions (shared by every writer, so one QTensor serves all targets):
- symmetric: the full signed grid q in [qmin, qmax] = [-2^(b-1), 2^(b-1)-1] with scale = amax / ((qmax - qmin) / 2)
  (amax/7.5 int4, amax/127.5 int8), as compressed-tensors' calculate_qparams computes it (and llm-compressor and
  AutoGPTQ with it);
- asymmetric: scale = (max - min) / (qmax - qmin), zero = round(qmin - min/scale), q in [qmin, qmax], both in the
  signed range (compressed-tensors' convention; legacy packers shift to unsigned);
- scales are rounded to the model dtype before the values are computed, so the scale on disk is exactly the one that
  produced them. Values are stored unpacked as int8 [out, in].
- for a bf16 / fp16 model every step is rounded to the model dtype as compressed-tensors computes it on the weight
  tensor itself (its quantize(), which llm-compressor's checkpoints go through): the quotient w / scale, the
  quotient plus the zero point, the asymmetric range max - min and min / scale. The rounding of the quotient
  decides codes near a half step (a group's negative extreme, quotient -7.49 in float32, is -7.5 in bf16 and
  rounds to -8), so the codes are compressed-tensors' bit for bit. Ties round to even after the zero point is
  added, as there. GPTQ's column quantizer rounds the same way below 8 bits (qtk.algorithms.gptq says why) and keeps
  float32 quotients for 8-bit grids, as llm-compressor's GPTQ divides its float32 working weights.

Every target decodes exactly (q - zero) * scale for any q of the full grid (docs/grids.md): vLLM's
compressed-tensors kernels (int8, and uint4b8/uint8b128 = q + 2^(b-1) for packed weights), the legacy GPTQ
and AWQ kernels ((q_u - z_u) * s with z_u = 2^(b-1) when symmetric), TensorRT-LLM's int8 SmoothQuant GEMM and
its group-wise int4 kernel (W4A16_AWQ, signed int4 times the scale). ModelOpt exports amax/7 (amax/127) scales,
which leave the code -2^(b-1) unused; that is its choice of scale, not a constraint of the kernels that read it.
The one place another grid is simulated is trtllm-build's own weight-only quantization of plain W8A16/W4A16
weights (qtk.export.trtllm). Activations keep the engines' run-time conventions: amax/127 per token, or a static
amax/127.
"""

from __future__ import annotations

import torch

from qtk.quant.formats.base import register_format
from qtk.quant.formats.grouped import STRATEGIES, GroupedFormat
from qtk.quant.scheme import INT_BITS, QuantScheme

HALF = (torch.bfloat16, torch.float16)


def _rounded(t: torch.Tensor, half: torch.dtype | None) -> torch.Tensor:
    """t rounded to `half` and back to float32: the result of the same op on half-precision tensors (which
    compute in float32 and round once); t itself when half is None."""
    return t if half is None else t.to(half).float()


@register_format
class IntFormat(GroupedFormat):
    name = "int"

    def accepts(self, scheme: QuantScheme) -> bool:
        return scheme.type == "int" and scheme.num_bits in INT_BITS and scheme.strategy in (*STRATEGIES, "token")

    def storage_dtype(self, scheme: QuantScheme) -> torch.dtype:
        return torch.int8

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        return not scheme.symmetric

    def scale_dtype(self, scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype | None:
        return model_dtype

    def quotient_dtype(self, model_dtype):
        return model_dtype if model_dtype in HALF else None

    def raw_scale(self, xmin, xmax, scheme, half=None):
        if scheme.symmetric:
            return torch.maximum(xmax, -xmin) / ((scheme.qmax - scheme.qmin) / 2)  # full grid: amax/7.5, amax/127.5
        return _rounded(xmax - xmin, half) / (scheme.qmax - scheme.qmin)

    def zero_point(self, xmin, scale, scheme, half=None):
        if scheme.symmetric:
            return None
        return torch.round(_rounded(scheme.qmin - _rounded(xmin / scale, half), half)).clamp(scheme.qmin, scheme.qmax)

    def quantize_grouped(self, wg, scale, zero, scheme, half=None):
        q = _rounded(wg / scale, half)
        if zero is not None:
            q = _rounded(q + zero, half)
        return q.round().clamp(scheme.qmin, scheme.qmax)

    def column_quantizer(self, scheme: QuantScheme, qp=None, model_dtype=None):
        qmin, qmax = scheme.qmin, scheme.qmax
        half = self.quotient_dtype(model_dtype)

        def quantize_column(w, s, z):  # quantize_grouped / dequantize_grouped on one column: the same float ops
            q = torch.div(w, s)
            if half is not None:
                q = _rounded(q, half)
            if z is not None:
                q.add_(z)
                if half is not None:
                    q = _rounded(q, half)
            q.round_().clamp_(qmin, qmax)
            return q, (q if z is None else q - z).mul(s)

        return quantize_column

    def max_value(self, scheme: QuantScheme) -> float:
        return float(scheme.qmax)

    def round_activation_(self, y, scheme):
        return y.round_().clamp_(scheme.qmin, scheme.qmax)
