"""NVFP4 (compressed-tensors strategy tensor_group, group 16): FP4 e2m1 codes, one FP8 e4m3 scale per group of 16
input columns, one float32 global scale per tensor that multiplies the group scales (qtk.quant.nvfp4 holds the
arithmetic, bit-equal to compressed-tensors). Dequantized w = e2m1(q) · (scale / global_scale).

QTensor layout: values uint8 codes [out, in] (0..15, unpacked), scale float32 [out, in/16] (fp8 e4m3 values),
extra {"global_scale": float32 [1]}. Linears the engines fuse (q/k/v, gate/up) share one global scale, from their
joint amax, as llm-compressor links them and vLLM / TensorRT-LLM expect.

Activations (W4A4, `dynamic: local`): group scales per token per group of 16 at run time under a static global
input scale, 448·6 / amax(calibrated input) (static_scale).
"""

from __future__ import annotations

import torch

from qtk.quant.formats.base import Format, QParams, register_format
from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode
from qtk.quant.nvfp4 import FP8_E4M3_MAX, NVFP4_GROUP, _ZERO_SCALE, nvfp4_fake_quant, nvfp4_global_scale
from qtk.quant.scheme import QuantScheme

GLOBAL = "global_scale"
_FP8 = torch.float8_e4m3fn


def _group_scales(w: torch.Tensor, gs: torch.Tensor, model_dtype: torch.dtype, group: int) -> torch.Tensor:
    """fp8(gs · amax(group)/6) as float32 [out, in/group]; amax/6 rounded to the model dtype first, as
    compressed-tensors computes it on the model's weights (nvfp4.nvfp4_group_scales)."""
    out, inp = w.shape
    amax = w.float().reshape(out, inp // group, group).abs().amax(-1)
    local = (amax / FP4_MAX).to(model_dtype).float()
    s = (gs.float().reshape(()) * local).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).float()
    return torch.where(s == 0, _ZERO_SCALE, s)


def _amax(w: torch.Tensor) -> torch.Tensor:
    """max |w| as a float32 scalar, from one min/max pass (no |w| temporary of w's size; NaN when w holds one)."""
    lo, hi = torch.aminmax(w.detach())
    return torch.maximum(-lo.float(), hi.float())


def _global(ws: list[torch.Tensor], model_dtype: torch.dtype) -> torch.Tensor:
    """The global scale of the joint amax of ws, computed in the model dtype (as compressed-tensors does)."""
    amax = torch.stack([_amax(w) for w in ws]).amax()
    return nvfp4_global_scale(amax.to(model_dtype))


@register_format
class NVFP4Format(Format):
    name = "nvfp4"

    def accepts(self, scheme: QuantScheme) -> bool:
        return scheme.is_fp4 and scheme.strategy == "tensor_group" and scheme.group_size == NVFP4_GROUP

    def storage_dtype(self, scheme):
        return torch.uint8

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return _FP8

    def tensor_wide(self, scheme):
        return True

    def qparams(self, w, scheme, model_dtype):
        return self.row_qparams(w, scheme, model_dtype, self.shared_extra([w], scheme, model_dtype))

    def shared_extra(self, weights, scheme, model_dtype):
        """{global_scale: 448·6 / amax}, amax over all of `weights` (one min/max pass each)."""
        return {GLOBAL: _global(weights, model_dtype)}

    def row_qparams(self, w, scheme, model_dtype, extra=None):
        """The group scales of rows w under the global scale in extra: groups of 16 lie within a row, so a weight's
        group scales are its row blocks' stacked."""
        if extra is None:
            return self.qparams(w, scheme, model_dtype)
        return QParams(_group_scales(w, extra[GLOBAL], model_dtype, scheme.group_size), None, dict(extra))

    def group_qparams(self, cols, scheme, model_dtype, qp=None):
        return QParams(_group_scales(cols, qp.extra[GLOBAL], model_dtype, cols.shape[1]))

    @staticmethod
    def _effective(scale: torch.Tensor, qp: QParams) -> torch.Tensor:
        return scale.float() / qp.extra[GLOBAL].float().reshape(())  # s / gs, formed first in fp32

    def quantize(self, w, qp, scheme, model_dtype=None):  # float32 arithmetic (model_dtype: see Format.quantize)
        out, inp = w.shape
        g = scheme.group_size
        y = w.float().reshape(out, inp // g, g) / self._effective(qp.scale, qp).unsqueeze(-1)
        return fp4_encode(y.clamp(-FP4_MAX, FP4_MAX)).reshape(out, inp)

    def dequantize(self, values, qp, scheme, g_idx=None):
        eff = self._effective(qp.scale, qp)
        if g_idx is not None:
            return fp4_decode(values) * eff[:, g_idx.long()]
        out, inp = values.shape
        g = scheme.group_size
        return (fp4_decode(values).reshape(out, inp // g, g) * eff.unsqueeze(-1)).reshape(out, inp)

    def column_quantizer(self, scheme, qp=None, model_dtype=None):
        inv_gs = qp.extra[GLOBAL].float().reshape(())

        def quantize_column(w, s, z):
            eff = s / inv_gs
            q = fp4_encode(torch.div(w, eff).clamp_(-FP4_MAX, FP4_MAX))
            return q, fp4_decode(q).mul_(eff)

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return fp4_decode(q) * (scale / qp.extra[GLOBAL].float().reshape(()))

    def fake_quant_activation(self, x, scheme, scale=None):
        if scale is None:
            raise ValueError("NVFP4 activations need a calibrated global input scale")
        return nvfp4_fake_quant(x, scale)

    def static_scale(self, amax, scheme):
        """The global input scale 448·6 / amax (float32 [1]); it multiplies the run-time group scales."""
        return nvfp4_global_scale(torch.as_tensor(amax, dtype=torch.float32))
