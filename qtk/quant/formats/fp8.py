"""FP8 e4m3 (float8_e4m3fn) with one scale per tensor or output channel: scale = amax / 448, values cast to fp8
(round to nearest even, saturated at ±448). Activations: dynamic per token, or a static amax / 448.

Weights follow compressed-tensors' arithmetic (its calculate_qparams and quantize(), which llm-compressor's
checkpoints go through), so the codes and scales are llm-compressor's bit for bit: the scale is amax / 448
rounded to the model dtype and stored in it (a zero scale becomes that dtype's eps), and for a bf16 / fp16 model
w / scale is rounded to the model dtype before the fp8 cast (the division runs on the bf16 weight tensor there).
That double rounding decides a few percent of a real bf16 model's codes. A float32 model keeps float32
arithmetic; GPTQ's column loop keeps float32 quotients (llm-compressor's GPTQ divides float32 working weights).
Dequantized w = q · scale in float32, as vLLM's fp8 GEMMs apply the scale (exact: 4 × 8 significant bits).

compressed-tensors float-quantized: weight float8_e4m3fn [out, in], weight_scale float32 holding the model-dtype
values ([1] per tensor, [out, 1] per channel), so compressed-tensors' decompression q.to(scale.dtype) * scale is the
exact product vLLM's fp8 GEMMs apply.
"""

from __future__ import annotations

from qtk.errors import UsageError
from qtk.quant.formats.base import Stored, check_float, register_format
from qtk.quant.formats.grouped import GroupedFormat, check_unpacked, decode_unpacked, is_half
from qtk.quant.formats.integer import _rounded
from qtk.quant.lazy import torch
from qtk.quant.scheme import FP8_MAX, QuantScheme, Strategy

FLOAT_QUANTIZED = "float-quantized"


def __getattr__(name: str):
    if name == "FP8_DTYPE":  # the storage dtype, named where torch is imported only when used
        return torch.float8_e4m3fn
    raise AttributeError(name)


@register_format
class FP8Format(GroupedFormat):
    name = "fp8-e4m3"
    ct_formats = (FLOAT_QUANTIZED,)

    def accepts(self, scheme: QuantScheme) -> bool:
        return scheme.type == "float" and scheme.num_bits == 8 and scheme.strategy in (Strategy.TENSOR, Strategy.CHANNEL, Strategy.TOKEN)

    def claims(self, scheme: QuantScheme) -> bool:
        return (scheme.type == "float" and scheme.num_bits == 8 and scheme.scale_dtype is None
                and scheme.strategy not in (Strategy.BLOCK, Strategy.GROUP))

    def validate(self, s: QuantScheme, where: str, role: str) -> None:
        check_float(s, where)
        if s.strategy == Strategy.TENSOR_GROUP:
            raise UsageError(f"{where}.strategy: tensor_group is NVFP4's (fp4)", "set num_bits: 4 or use strategy: block / channel")

    def storage_dtype(self, scheme: QuantScheme) -> torch.dtype:
        return torch.float8_e4m3fn

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        return False

    def scale_dtype(self, scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype | None:
        return model_dtype

    def quotient_dtype(self, model_dtype):
        return model_dtype if is_half(model_dtype) else None

    def decodes_in_model_dtype(self, scheme: QuantScheme) -> bool:
        return False  # the fp8 GEMMs multiply by the scale in float32

    def raw_scale(self, xmin, xmax, scheme, half=None):
        return torch.maximum(xmax, -xmin) / FP8_MAX

    def quantize_grouped(self, wg, scale, zero, scheme, half=None):
        return _rounded(wg / scale, half).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)

    def max_value(self, scheme: QuantScheme) -> float:
        return FP8_MAX

    def fake_quant_activation(self, x, scheme, scale=None):
        if not is_half(x.dtype):
            return super().fake_quant_activation(x, scheme, scale)
        # a bf16 / fp16 model: compressed-tensors' run-time path computes in x's dtype (the scale amax/448 rounded
        # to it, x / scale rounded to it before the fp8 cast, the product too); float32 arithmetic differs
        if scheme.dynamic and scheme.strategy == Strategy.TOKEN:
            from qtk.quant.formats.fp8_block import fp8_group_fake_quant  # per token: one group of the whole row

            return fp8_group_fake_quant(x, None)
        if scheme.dynamic:
            amax = x.detach().abs().amax().float()
            s = (amax / FP8_MAX).to(x.dtype)
            s = torch.where(s == 0, torch.finfo(x.dtype).eps, s)
        elif scale is None:
            raise ValueError("static activation quantization needs a calibrated input scale")
        else:
            s = scale.reshape(()).to(x.dtype)
        return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(x.dtype) * s

    def round_activation_(self, y, scheme):
        return y.clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()

    def fused_weights(self, qts):
        """vLLM runs q/k/v and gate/up as one GEMM with one per-tensor FP8 weight scale: members written with scales
        of their own (llm-compressor's checkpoints) are requantized at load to the largest, fp8(q_i·s_i / s_max), and
        that is what it runs (vLLM's requantize_with_max_scale; TensorRT-LLM's writer does the same). None when they
        are not per-tensor or already share one scale (then nothing changes)."""
        if not all(qt.scheme.strategy == Strategy.TENSOR for qt in qts):
            return None
        scales = [qt.scale.float().reshape(()) for qt in qts]
        s_max = torch.stack(scales).max()
        if all(torch.equal(s, s_max) for s in scales):
            return None
        return [(qt.values.float() * s).div_(s_max).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float().mul_(s_max)
                for qt, s in zip(qts, scales)]

    # ---- compressed-tensors ----

    def stored(self, module, shape, dtype):
        out, inn = shape
        return [Stored("weight", (out, inn), "float8_e4m3fn", "quantized"),
                Stored("weight_scale", self.stored_scale_shape(module.weights, out, inn), "float32", "scales")]

    def encode(self, qt, dtype, fmt):
        # model-dtype values (llm-compressor's, bit for bit) stored float32
        return {"weight": qt.values, "weight_scale": qt.scale.to(torch.float32)}

    def decode(self, t, scheme, dtype):
        return decode_unpacked(t, scheme, dtype)

    def check_stored(self, view, module, scheme, fmt, shape):
        s = scheme.weights
        return check_unpacked(view, module, s, shape, torch.float8_e4m3fn, self.scale_shape(s, *shape))

    # ---- the data-free stream and the checks ----

    def _native_kind(self, scheme):
        from qtk.quant.native.rounding import FP8

        return FP8

    def _native_grid(self, scheme):
        return self.max_value(scheme), 0.0, 0.0

    def stream_key(self, scheme: QuantScheme) -> str:
        return "fp8"

    def error_bound(self, scheme: QuantScheme) -> float:
        return 0.2  # Gaussian weights round to ~0.04
