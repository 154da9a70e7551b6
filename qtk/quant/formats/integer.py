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

compressed-tensors: weight-only and W4A8-FP8 weights are pack-quantized (weight_packed int32 [out, ceil(in·bits/32)],
weight_scale [out, groups] in the model dtype, weight_shape int64 [2], weight_zero_point int32 packed along out when
asymmetric); with int activations (W8A8, W4A8-INT8) int-quantized (weight int8 [out, in] holding the codes,
weight_scale): vLLM's CompressedTensorsW4A8Int loads int4 codes that way, as llm-compressor's W4A8 writes them.
"""

from __future__ import annotations

from qtk.errors import UsageError
from qtk.quant.formats.base import Stored, register_format
from qtk.quant.formats.grouped import (STRATEGIES, GroupedFormat, check_scale_and_g_idx, check_unpacked, decode_unpacked,
                                       g_idx_of, is_half)
from qtk.quant.lazy import torch
from qtk.quant.scheme import INT_BITS, QuantScheme, Strategy

PACKED, INT_QUANTIZED = "pack-quantized", "int-quantized"
# relative error ||W - Q(W)|| / ||W|| a sane round-to-nearest stays far below (Gaussian weights: ~0.01 at int8, ~0.15
# at int4)
ERROR_BOUND = {8: 0.1, 4: 0.7, 2: 1.5}


def _rounded(t: torch.Tensor, half: torch.dtype | None) -> torch.Tensor:
    """t rounded to `half` and back to float32: the result of the same op on half-precision tensors (which
    compute in float32 and round once); t itself when half is None."""
    return t if half is None else t.to(half).float()


def _e4m3(s: QuantScheme) -> bool:
    return s.type == "float" and s.num_bits == 8


@register_format
class IntFormat(GroupedFormat):
    name = "int"
    ct_formats = (PACKED, INT_QUANTIZED)

    def accepts(self, scheme: QuantScheme) -> bool:
        return self.claims(scheme) and scheme.num_bits in INT_BITS and scheme.strategy in (*STRATEGIES, Strategy.TOKEN)

    def claims(self, scheme: QuantScheme) -> bool:
        return scheme.type == "int" and scheme.scale_dtype is None

    def validate(self, s: QuantScheme, where: str, role: str) -> None:
        if s.num_bits not in INT_BITS:
            raise UsageError(f"{where}.num_bits: int{s.num_bits} is not supported", f"use one of {', '.join(map(str, INT_BITS))}")
        if s.strategy == Strategy.TENSOR_GROUP:
            raise UsageError(f"{where}.strategy: tensor_group is NVFP4's (fp4)", "use strategy: group for int weights")

    def pairs(self, w: QuantScheme, a: QuantScheme, where: str) -> bool | None:
        """int4 group weights with 8-bit activations: W4A8-FP8 or W4A8-INT8."""
        if w.type == "int" and w.num_bits == 4 and w.strategy == Strategy.GROUP and _e4m3(a):  # W4A8-FP8
            # per token, dynamic: vLLM's CompressedTensorsW4A8Fp8; per tensor, static: TensorRT-LLM's W4A8_AWQ
            per_token = a.strategy == Strategy.TOKEN and a.dynamic is True
            per_tensor = a.strategy == Strategy.TENSOR and not a.dynamic
            if not ((per_token or per_tensor) and w.symmetric and w.group_size == 128):
                raise UsageError(f"{where}: int4 group weights run with 8-bit activations only as W4A8-FP8: symmetric "
                                 "groups of 128, FP8 activations per token, dynamic (vLLM's CompressedTensorsW4A8Fp8) or "
                                 "per tensor, static (TensorRT-LLM's W4A8_AWQ)", "use the w4a8-fp8 recipe as a template")
            return True
        if w.type == "int" and w.num_bits == 4 and a.type == "int" and a.num_bits == 8:  # W4A8-INT8
            # vLLM's CompressedTensorsW4A8Int (_is_dynamic_token_w4a8_int): symmetric int4 weights, int8 per token, dynamic
            if not (w.strategy == Strategy.GROUP and w.symmetric and a.strategy == Strategy.TOKEN and a.dynamic is True and a.symmetric):
                raise UsageError(f"{where}: 4-bit weights with 8-bit int activations (W4A8) run only as W4A8-INT8: symmetric "
                                 "int4 groups with symmetric INT8 activations per token, dynamic (vLLM's CompressedTensorsW4A8Int)",
                                 "use the w4a8-int8 recipe as a template, or drop activations for weight-only (W4A16)")
            return True
        return None

    def storage_dtype(self, scheme: QuantScheme) -> torch.dtype:
        return torch.int8

    def learned_grid(self, scheme: QuantScheme) -> str | None:
        return "int" if scheme.strategy in (Strategy.CHANNEL, Strategy.GROUP) else None

    def signed_scales(self, scheme: QuantScheme) -> bool:
        # (q - z) · s is the same affine map whatever the sign of s, and every engine's int kernel multiplies by it;
        # the full-range grid stores negative ones (measured in vLLM: tests/engine; the legacy GPTQ / AWQ layouts hold
        # the same scales beside their zero points)
        return True

    def full_range_scale(self, xmin, xmax, scheme: QuantScheme, scale_dtype: torch.dtype | None) -> torch.Tensor:
        """The full-range symmetric scale of groups with min xmin <= 0 <= max xmax (llama.cpp's, auto-round's int_sym):
        magnitude amax / -qmin (amax / 8 for int4), signed so that the group's larger-magnitude extreme lands
        exactly on qmin (negative when the positive side is the larger), rounded to scale_dtype; an all-zero group's
        is 1. A finer step than compressed-tensors' amax / ((qmax - qmin) / 2), whose extremes fall half a step
        off the grid; the other extreme may clip by up to one step."""
        xmin, xmax = xmin.clamp_max(0), xmax.clamp_min(0)
        scale = torch.maximum(xmax, -xmin) / -scheme.qmin
        scale = torch.where(xmax > -xmin, -scale, scale)
        if scale_dtype is not None:
            scale = scale.to(scale_dtype).float()
        return torch.where(scale != 0, scale, torch.ones_like(scale))

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        return not scheme.symmetric

    def scale_dtype(self, scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype | None:
        return model_dtype

    def quotient_dtype(self, model_dtype):
        return model_dtype if is_half(model_dtype) else None

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

    # ---- compressed-tensors ----

    def ct_format(self, module) -> str:
        # int activations (W8A8 int8, W4A8-INT8): int-quantized; weight-only and W4A8-FP8 (vLLM's
        # CompressedTensorsW4A8Fp8 reads weight_packed) stay packed
        a = module.activations
        return INT_QUANTIZED if a is not None and a.type == "int" else PACKED

    def stored(self, module, shape, dtype):
        out, inn = shape
        w = module.weights
        scale = self.stored_scale_shape(w, out, inn)
        if self.ct_format(module) == INT_QUANTIZED:
            ts = [Stored("weight", (out, inn), "int8", "quantized"), Stored("weight_scale", scale, dtype, "scales")]
            if not w.symmetric:
                ts.append(Stored("weight_zero_point", scale, "int8", "scales"))
            return ts
        words = -(-inn * w.num_bits // 32)  # values packed along the input dim into int32 words
        ts = [Stored("weight_packed", (out, words), "int32", "quantized"), Stored("weight_scale", scale, dtype, "scales"),
              Stored("weight_shape", (2,), "int64", "scales")]
        if not w.symmetric:
            zp_rows = 1 if w.strategy == Strategy.TENSOR else -(-out * w.num_bits // 32)  # zero points pack along dim 0
            ts.append(Stored("weight_zero_point", (zp_rows, scale[-1]), "int32", "scales"))
        return ts

    def encode(self, qt, dtype, fmt):
        if fmt == PACKED:
            from qtk.quant.pack import pack_ct, pack_ct_zero_point

            bits = qt.scheme.num_bits
            out = {"weight_packed": pack_ct(qt.values, bits), "weight_scale": qt.scale.to(dtype),
                   "weight_shape": torch.tensor(list(qt.shape), dtype=torch.int64)}
            if qt.zero_point is not None:
                out["weight_zero_point"] = pack_ct_zero_point(qt.zero_point.reshape(qt.scale.shape), bits)
            return out
        return {"weight": qt.values, "weight_scale": qt.scale.to(dtype)}

    def decode(self, t, scheme, dtype):
        if "weight_packed" not in t:  # int-quantized
            return decode_unpacked(t, scheme, dtype)
        from qtk.quant.formats.base import as_float32
        from qtk.quant.pack import unpack_ct, unpack_ct_zero_point
        from qtk.quant.qtensor import QTensor

        out_f, in_f = t["weight_shape"].tolist()
        values = unpack_ct(t["weight_packed"], scheme.num_bits, in_f)
        zero = None
        if "weight_zero_point" in t:
            zero = unpack_ct_zero_point(t["weight_zero_point"], scheme.num_bits, out_f).float()
        return QTensor(values, as_float32(t["weight_scale"]), scheme, zero, g_idx_of(t), dtype)

    def check_stored(self, view, module, scheme, fmt, shape):
        s = scheme.weights
        out_f, in_f = shape
        if fmt != PACKED:
            return check_unpacked(view, module, s, shape, torch.int8, self.scale_shape(s, out_f, in_f))
        problems: list[str] = []  # pack-quantized
        per = 32 // s.num_bits if s.num_bits in (2, 4, 8) else 0
        view.expect(f"{module}.weight_packed", torch.int32, [out_f, -(-in_f // per) if per else -1], problems)
        if view.expect(f"{module}.weight_shape", (torch.int64, torch.int32), [2], problems):
            got = view.tensor(f"{module}.weight_shape").tolist()
            if got != [out_f, in_f]:
                problems.append(f"{module}.weight_shape says {got}, the config implies {[out_f, in_f]}")
        if view.has(f"{module}.weight"):
            problems.append(f"{module}.weight is an unpacked weight in a pack-quantized checkpoint")
        zp = f"{module}.weight_zero_point"
        if not s.symmetric:
            groups = self.scale_shape(s, out_f, in_f)[-1]
            view.expect(zp, torch.int32, [-(-out_f // per) if per else -1, groups], problems,
                        " (asymmetric weights need zero points)")
        elif view.has(zp):
            problems.append(f"{zp} is present but the config declares symmetric weights")
        check_scale_and_g_idx(view, module, self.scale_shape(s, out_f, in_f), s.describe(), in_f, problems)
        return problems

    # ---- the data-free stream and the checks ----

    def _native_kind(self, scheme):
        from qtk.quant.native.rounding import INT

        return INT if scheme.symmetric else None

    def _native_grid(self, scheme):
        return (scheme.qmax - scheme.qmin) / 2, float(scheme.qmin), float(scheme.qmax)

    def stream_key(self, scheme: QuantScheme) -> str:
        return "int8" if scheme.num_bits == 8 else "int4"

    def error_bound(self, scheme: QuantScheme) -> float:
        return ERROR_BOUND.get(scheme.num_bits, float("inf"))

    def value_problems(self, module, values, scheme):
        """Codes: one min/max pass tells both a collapsed weight and codes off the grid."""
        if values.is_floating_point():
            return super().value_problems(module, values, scheme)
        lo, hi = (int(x) for x in torch.aminmax(values)) if values.numel() else (0, 0)
        off = []
        if values.numel() and (lo < scheme.qmin or hi > scheme.qmax):
            off.append(f"{module} holds values {lo}..{hi}, outside int{scheme.num_bits}'s {scheme.qmin}..{scheme.qmax}")
        return values.numel() > 1 and lo == hi, off
