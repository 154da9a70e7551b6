"""NVFP4: FP4 e2m1 values in groups of 16 along the input dim, one FP8 e4m3 scale per group, and one
fp32 global scale per tensor (NVIDIA Blackwell's block-scaled FP4; compressed-tensors strategy
``tensor_group``, format ``nvfp4-pack-quantized``).

Conventions, as compressed-tensors 0.20 computes them (``generate_gparam``, ``calculate_qparams``,
``_quantize``/``_dequantize``) and llm-compressor writes them:
- global scale gs = 448 · 6 / amax(tensor) (fp32 [1]; it MULTIPLIES the local scales, so a larger tensor
  range gives a smaller gs). Stored as ``weight_global_scale`` / ``input_global_scale``; vLLM inverts it
  on load (its kernels take 1/gs). ModelOpt stores the inverse instead (``weight_scale_2`` = amax/2688).
- group scale s = fp8_e4m3(gs · amax(group) / 6), clamped to ±448; a scale that is 0 in fp8 becomes 0.125
  (compressed-tensors' eps for an fp8 scale dtype). Stored as ``weight_scale`` float8_e4m3fn [out, in/16].
- q = e2m1(x / (s / gs)), dequantized x ≈ q · (s / gs): the effective scale s / gs is formed first, in fp32.
- amax/6 and 2688/amax are computed in the dtype of the observed tensor (bf16 weights round them to
  bf16 first), because compressed-tensors runs them on the tensors it is given; the result is bit-equal
  to its output for fp32, bf16 and fp16 inputs.

Activations (W4A4): the global input scale is static (calibrated amax), the group scales are dynamic,
computed per token per group of 16 at run time with the same rule (``dynamic: local``). This follows
compressed-tensors' order of operations (what transformers + compressed-tensors run); vLLM's emulation
(``ref_nvfp4_quant``) forms fp32 amax·(1/6) and multiplies by the reciprocal of s/gs, which can differ
in the last bit of a scale for bf16 inputs.

QTensor layout: values uint8 codes [out, in] (0..15, unpacked), scale float32 [out, in/16] (fp8 e4m3 values),
extra {"global_scale": float32 [1]}. Linears the engines fuse (q/k/v, gate/up) share one global scale, from their
joint amax, as llm-compressor links them and vLLM / TensorRT-LLM expect.

compressed-tensors nvfp4-pack-quantized: weight_packed uint8 [out, in/2] (e2m1 codes, element 2i in the low nibble),
weight_scale float8_e4m3fn [out, in/16], weight_global_scale float32 [1]; W4A4 adds input_global_scale float32 [1]
(no weight_shape).
"""

from __future__ import annotations

import math

from qtk.errors import UsageError
from qtk.quant.formats.base import Format, QParams, Stored, check_float, groups_misfit, register_format
from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode
from qtk.quant.lazy import torch
from qtk.quant.scheme import LOCAL, QuantScheme, Strategy

GLOBAL = "global_scale"
NVFP4_PACKED = "nvfp4-pack-quantized"

NVFP4_GROUP = 16
FP8_E4M3_MAX = 448.0
_ZERO_SCALE = 0.125  # what compressed-tensors stores for a group whose fp8 scale is 0


def _grouped(x: torch.Tensor, group: int = NVFP4_GROUP) -> torch.Tensor:
    """x [..., n] -> [..., n/group, group]."""
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"NVFP4 groups of {group} do not divide the last dim {n}")
    return x.reshape(*x.shape[:-1], n // group, group)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """gs = 448·6 / amax -> float32 [1]; amax 0 or non-finite gives 1.0 (compressed-tensors' fallback).

    The division runs in amax's dtype (a bf16 amax gives a bf16-rounded gs), as compressed-tensors does."""
    a = torch.as_tensor(amax).detach().abs().amax().reshape(1)
    if not a.is_floating_point():
        a = a.float()
    a = a.clamp(min=torch.finfo(a.dtype).tiny)
    gs = torch.nan_to_num(FP8_E4M3_MAX * FP4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32)


def nvfp4_weight_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One global scale for weights the engines fuse into one GEMM (q/k/v, gate/up): that of their joint amax.

    Equal to the smallest of their separate global scales, which is how llm-compressor unifies them."""
    if not weights:
        raise ValueError("nvfp4_weight_global_scale needs at least one weight")
    amax = torch.stack([w.detach().abs().amax().to(weights[0].dtype) for w in weights]).amax()
    return nvfp4_global_scale(amax)


def nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Group scales of x [..., n] under global_scale [1] -> float8_e4m3fn [..., n/16]."""
    amax = _grouped(x.detach()).abs().amax(-1)  # [..., n/16], exact in x's dtype
    local = (amax.float() / FP4_MAX).to(x.dtype)  # amax/6 rounded to the observed dtype
    s = (global_scale.float().reshape(()) * local.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
    return torch.where(s == 0, _ZERO_SCALE, s).to(torch.float8_e4m3fn)


def _effective(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """s / gs in fp32, [..., G, 1] to broadcast over a group."""
    return (scale.float() / global_scale.float().reshape(())).unsqueeze(-1)


def nvfp4_quantize(x: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of x [..., n] with group scales [..., n/16] and global scale [1] -> uint8 [..., n]."""
    y = _grouped(x.float()) / _effective(scale, global_scale)
    return fp4_encode(y.clamp(-FP4_MAX, FP4_MAX)).reshape(x.shape)


def nvfp4_dequantize(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
    """x ≈ e2m1(codes) · (s / gs): codes uint8 [..., n] -> dtype [..., n] (default float32)."""
    return (_grouped(fp4_decode(codes)) * _effective(scale, global_scale)).reshape(codes.shape).to(dtype or torch.float32)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] as the engines run W4A4: dynamic per-token group scales of
    16 under the static (calibrated) global input scale. Returns x's dtype."""
    scale = nvfp4_group_scales(x, global_scale)
    return nvfp4_dequantize(nvfp4_quantize(x, scale, global_scale), scale, global_scale, x.dtype)

def _group_scales(w: torch.Tensor, gs: torch.Tensor, model_dtype: torch.dtype, group: int) -> torch.Tensor:
    """fp8(gs · amax(group)/6) as float32 [out, in/group]; amax/6 rounded to the model dtype first, as
    compressed-tensors computes it on the model's weights (nvfp4.nvfp4_group_scales)."""
    out, inp = w.shape
    return _scales_of_amax(w.float().reshape(out, inp // group, group).abs().amax(-1), gs, model_dtype)


def _scales_of_amax(amax: torch.Tensor, gs: torch.Tensor, model_dtype: torch.dtype) -> torch.Tensor:
    """fp8(gs · amax/6) as float32, amax [out, G] float32 (each group's max |w|)."""
    local = (amax / FP4_MAX).to(model_dtype).float()
    s = (gs.float().reshape(()) * local).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn).float()
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

    ct_formats = (NVFP4_PACKED,)
    ct_scale_dtype = "torch.float8_e4m3fn"
    input_scale_key = "input_global_scale"
    input_scale_multiplies = True
    run_time_local = True
    scale_checks = "NVFP4 global scales finite and shared in fused groups; E8M0 scales in range"

    def accepts(self, scheme: QuantScheme) -> bool:
        return self.claims(scheme) and scheme.strategy == Strategy.TENSOR_GROUP and scheme.group_size == NVFP4_GROUP

    def claims(self, scheme: QuantScheme) -> bool:
        return scheme.type == "float" and scheme.num_bits == 4 and scheme.scale_dtype is None

    def validate(self, s: QuantScheme, where: str, role: str) -> None:
        check_float(s, where)
        if s.strategy != Strategy.TENSOR_GROUP or s.group_size != NVFP4_GROUP:
            raise UsageError(f"{where}: fp4 is NVFP4 (groups of 16 under a global scale) or MXFP4 (groups of 32, e8m0 scales)",
                             "use 'strategy: tensor_group, group_size: 16' (NVFP4) or "
                             "'strategy: group, group_size: 32, scale_dtype: e8m0' (MXFP4)")
        if s.observer == "mse":
            raise UsageError(f"{where}.observer: the mse observer searches int / fp8 per-channel grids only",
                             "use observer: minmax")
        if role == "activations" and s.dynamic != LOCAL:
            raise UsageError(f"{where}.dynamic: NVFP4 activations take group scales at run time under a calibrated global "
                             "scale", "set dynamic: local")

    def activation_strategies(self, scheme: QuantScheme) -> bool:
        return scheme.dynamic == LOCAL

    def activation_bits(self, scheme: QuantScheme) -> bool:
        return scheme.dynamic == LOCAL

    def pairs(self, w: QuantScheme, a: QuantScheme, where: str) -> bool | None:
        if not (self.claims(w) and self.claims(a)):
            raise UsageError(f"{where}: NVFP4 weights and activations go together (W4A4) or the weights alone (W4A16)",
                             "use the nvfp4 or nvfp4-a16 recipe as a template")
        return True

    def storage_dtype(self, scheme):
        return torch.uint8

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return torch.float8_e4m3fn

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

    def learned_grid(self, scheme):
        return "fp4"

    def group_scales_from_amax(self, amax, scheme, model_dtype, extra=None):
        scale = _scales_of_amax(amax, extra[GLOBAL], model_dtype)
        qp = QParams(scale, None, dict(extra))
        return qp, self._effective(scale, qp)

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

    def static_amax(self, scale, scheme):
        return FP8_E4M3_MAX * FP4_MAX / scale  # the global input scale multiplies: 448·6 / amax

    # ---- compressed-tensors ----

    def scale_shape(self, scheme, out_f, in_f):
        return [out_f, in_f // scheme.group_size]

    def stored(self, module, shape, dtype):
        out, inn = shape
        return [Stored("weight_packed", (out, inn // 2), "uint8", "quantized"),  # FP4 codes two a byte
                Stored("weight_scale", (out, inn // module.weights.group_size), "float8_e4m3fn", "scales"),
                Stored("weight_global_scale", (1,), "float32", "scales")]

    def encode(self, qt, dtype, fmt):
        from qtk.quant.fp4 import pack_fp4

        return {"weight_packed": pack_fp4(qt.values), "weight_scale": qt.scale.to(torch.float8_e4m3fn),
                "weight_global_scale": qt.extra[GLOBAL].float().reshape(1)}

    def decode(self, t, scheme, dtype):
        from qtk.quant.formats.base import as_float32
        from qtk.quant.fp4 import unpack_fp4
        from qtk.quant.qtensor import QTensor

        return QTensor(unpack_fp4(t["weight_packed"]), as_float32(t["weight_scale"]), scheme, dtype=dtype,
                       extra={GLOBAL: t["weight_global_scale"].float().reshape(1)})

    def check_stored(self, view, module, scheme, fmt, shape):
        s = scheme.weights
        problems = check_group_codes(view, module, s, fmt, shape, torch.float8_e4m3fn, packed=True)
        if not shape[1] % s.group_size:
            view.expect(f"{module}.weight_global_scale", (torch.float32,), ([], [1], [1, 1]), problems)
        return problems

    # ---- the data-free stream and the checks ----

    def native_plan(self, w, scheme, model_dtype, extra=None):
        from qtk.quant.native.rounding import NVFP4, NativePlan

        rows, cols = w.shape
        if extra is None or set(extra) != {GLOBAL} or cols % scheme.group_size:
            return None
        return NativePlan(NVFP4, scheme.group_size, 1, (rows, cols // scheme.group_size), torch.uint8,
                          global_scale=float(extra[GLOBAL].float().reshape(())))

    def row_slab(self, scheme):
        """Groups of 16 lie within a row, under the global scale fixed up front from the weight's amax."""
        return 1 if scheme.observer == "minmax" else None

    def stream_key(self, scheme):
        return "nvfp4"

    def error_bound(self, scheme):
        return 0.7

    def value_problems(self, module, values, scheme):
        """uint8 codes: one min/max pass tells both a collapsed weight and codes off FP4's 0..15."""
        return fp4_value_problems(module, values)

    def scale_problems(self, module, qt):
        g = float(qt.extra[GLOBAL].reshape(-1)[0])
        return [] if math.isfinite(g) and g > 0 else [f"{module}.weight_global_scale is {g}"]

    def shared_value(self, qt):
        g = float(qt.extra[GLOBAL].reshape(-1)[0])
        return g if math.isfinite(g) and g > 0 else None


def check_group_codes(view, module: str, s: QuantScheme, fmt: str, shape, scale_dtype, packed: bool) -> list[str]:
    """A weight of codes in groups of s.group_size, one one-byte scale each (NVFP4, MX): the groups divide the input
    (else only that), the codes (FP4 two a byte when packed, else fp8) and the scales in their dtype and shape."""
    out_f, in_f = shape
    g = s.group_size
    problems = groups_misfit(module, fmt, in_f, g)
    if problems:
        return problems
    if packed:
        view.expect(f"{module}.weight_packed", (torch.uint8,), [out_f, in_f // 2], problems, " (two FP4 codes a byte)")
    else:
        view.expect(f"{module}.weight", (torch.float8_e4m3fn,), [out_f, in_f], problems)
    view.expect(f"{module}.weight_scale", (scale_dtype,), [out_f, in_f // g], problems, f" ({s.describe()})")
    return problems


def fp4_value_problems(module: str, values) -> tuple[bool, list[str]]:
    """(collapsed, codes off FP4's 0..15) of e2m1 codes: one min/max pass over uint8 codes."""
    from qtk.quant.formats.base import all_equal

    codes = not values.is_floating_point()
    lo, hi = (int(x) for x in torch.aminmax(values)) if codes and values.numel() else (0, 0)
    collapsed = values.numel() > 1 and (lo == hi if codes else all_equal(values))
    top = hi if codes else (int(values.max()) if values.numel() else 0)
    return collapsed, [f"{module} holds codes up to {top}, outside FP4's 0..15"] if values.numel() and top > 15 else []
