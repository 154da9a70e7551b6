"""OCP Microscaling (MX v1.0): blocks of 32 values along the input dim sharing one E8M0 scale.

MXFP4 elements are FP4 e2m1 (packed two per byte as in qtk.quant.fp4), MXFP8 elements FP8 e4m3.
E8M0 is an unsigned biased exponent: code c means 2^(c − 127); 0..254 are scales 2^-127..2^127 and
255 is NaN. compressed-tensors formats: ``mxfp4-pack-quantized`` (``weight_packed`` uint8 [out, in/2],
``weight_scale`` uint8 [out, in/32]) and ``mxfp8-quantized`` (``weight`` float8_e4m3fn [out, in],
``weight_scale`` uint8 [out, in/32]).

Scale selection, as compressed-tensors 0.20 (``generate_mx_scales``) computes it: the OCP rule is
X = 2^(floor(log2(amax)) − emax_elem) with emax_elem = 2 for e2m1 (max 6 = 1.5·2²) and 8 for e4m3
(max 448 = 1.75·2⁸); compressed-tensors first rounds amax to a power of two, UP when its mantissa is
≥ 1.75 (it adds a quarter of the exponent step to the bits and truncates; the e2m1 mantissa width is
used for MXFP8 too). So amax = 1.7·2^e gives 2^(e−2) for MXFP4 (values up to 6.8, saturated to 6) and
amax = 1.75·2^e gives 2^(e−1) (values up to 3.5). Elements are x / X, saturated and rounded to the
element format (round-to-nearest-even); dequantized x ≈ q · X.

Other rules in use (``mx_scales(..., rule=)``): "ocp", the spec's plain floor(log2(amax)) − emax_elem;
"modelopt", NVIDIA ModelOpt 0.47's 2^ceil(log2(amax / elem_max)), which never saturates (MXFP4QTensor,
MXFP8QTensor); on random bf16 weights its codes differ from compressed-tensors' in many blocks.

QTensor layout: values uint8 e2m1 codes [out, in] (MXFP4) or float8_e4m3fn [out, in] (MXFP8), scale float32
[out, in/32] holding powers of two (the writers store E8M0 codes, e8m0_encode).
"""

from __future__ import annotations

import functools

from qtk.errors import UsageError
from qtk.quant.e4m3 import to_float32
from qtk.quant.formats.base import Format, QParams, Stored, check_float, register_format
from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode
from qtk.quant.lazy import torch
from qtk.quant.scheme import QuantScheme, Strategy

MXFP4_PACKED, MXFP8_QUANTIZED = "mxfp4-pack-quantized", "mxfp8-quantized"

MX_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_E4M3_MAX = 448.0
EMAX_ELEM = {"fp4": 2, "fp8": 8}  # floor(log2(max)) of e2m1 (6) and e4m3 (448)
ELEM_MAX = {"fp4": 6.0, "fp8": FP8_E4M3_MAX}
RULES = ("compressed-tensors", "ocp", "modelopt")



@functools.cache
def _bits() -> dict:
    """dtype -> (int view, mantissa bits, exponent bits), for the power-of-two rounding on the stored bits."""
    return {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8), torch.float16: (torch.int16, 10, 5)}


def _grouped(x: torch.Tensor, group: int = MX_GROUP) -> torch.Tensor:
    """x [..., n] -> [..., n/group, group]."""
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"MX blocks of {group} do not divide the last dim {n}")
    return x.reshape(*x.shape[:-1], n // group, group)


def e8m0_encode(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two scales -> E8M0 codes uint8 (127 + floor(log2 scale)), clamped to 0..254 (255 is NaN). For a
    positive float32 that is its exponent field (0 for a subnormal or zero, whose floor(log2) is below -126; 255 for
    +Inf, clamped): integer passes where log2 and floor took float ones (the writer encodes every MX weight's scales)."""
    bits = scale.float().contiguous().view(torch.int32)
    return ((bits >> 23) & 0xFF).clamp_(max=E8M0_NAN - 1).to(torch.uint8)


def e8m0_decode(codes: torch.Tensor) -> torch.Tensor:
    """E8M0 codes uint8 -> float32 scales 2^(c − 127); 255 -> NaN (the definition, in torch: the reference
    quantizer's, which the native kernels' self-test runs)."""
    if codes.dtype != torch.uint8:
        raise ValueError(f"E8M0 scales are stored as uint8, got {codes.dtype}")
    c = codes.to(torch.int32)
    bits = torch.where(c == 0, 0x00400000, c << 23)  # 2^(c - 127) as float32 bits; 2^-127 is subnormal
    return torch.where(c == E8M0_NAN, 0x7FC00000, bits).view(torch.float32)


def e8m0_to_float(codes: torch.Tensor) -> torch.Tensor:
    """e8m0_decode through the native byte table (each code's value made by e8m0_decode) where the kernels apply,
    into a recycled buffer: what a reader of stored MX scales decodes with (the convert self-check decodes every MX
    weight's; torch's integer passes took a tenth of that check). Codes that are not uint8: e8m0_decode's error."""
    from qtk.quant.native.packing import bytes_to_float

    fast = bytes_to_float(codes, _e8m0_table())
    return fast if fast is not None else e8m0_decode(codes)


@functools.cache
def _e8m0_table() -> torch.Tensor:
    return e8m0_decode(torch.arange(256, dtype=torch.uint8))


def _round_to_power_of_two(a: torch.Tensor) -> torch.Tensor:
    """a >= 0 (float32/bf16/fp16) to a power of two, up when the mantissa is >= 1.75 — on a's own bits."""
    int_dtype, m, e = _bits()[a.dtype]
    bits = a.view(int_dtype).to(torch.int32)
    bits = (bits + (1 << (m - 2))) & (((1 << (e + 1)) - 1) << m)  # keep sign and exponent only
    return bits.to(int_dtype).view(a.dtype)


def mx_scales(x: torch.Tensor, elem: str, rule: str = "compressed-tensors") -> torch.Tensor:
    """E8M0 scale codes of x [..., n] for elem 'fp4' or 'fp8' -> uint8 [..., n/32] (rules: module docstring)."""
    if elem not in EMAX_ELEM:
        raise ValueError(f"MX element type must be one of {sorted(EMAX_ELEM)}, got {elem!r}")
    if rule not in RULES:
        raise ValueError(f"MX scale rule must be one of {', '.join(RULES)}, got {rule!r}")
    x = x.detach()
    if x.dtype not in _bits():
        x = x.float()
    return _codes_of_amax(_grouped(x).abs().amax(-1), elem, rule)  # amax [..., n/32], in x's dtype


def _codes_of_amax(amax: torch.Tensor, elem: str, rule: str = "compressed-tensors") -> torch.Tensor:
    """E8M0 scale codes of blocks whose max |x| is amax (float32 / bf16 / fp16) under `rule`."""
    if rule == "modelopt":
        e = torch.ceil(torch.log2(amax.float() / ELEM_MAX[elem]))  # the +127 bias below
    else:
        if rule == "compressed-tensors":
            amax = _round_to_power_of_two(amax)
        e = torch.floor(torch.log2(amax.float())) - EMAX_ELEM[elem]  # -inf for an all-zero block
    return (e + E8M0_BIAS).clamp(0, E8M0_NAN - 1).to(torch.uint8)


def _scale(codes: torch.Tensor) -> torch.Tensor:
    return e8m0_decode(codes).unsqueeze(-1)  # [..., G, 1]


def mxfp4_quantize(x: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of x [..., n] with E8M0 scales [..., n/32] -> uint8 [..., n] (pack with fp4.pack_fp4)."""
    y = (_grouped(x.float()) / _scale(scale_codes)).clamp(-FP4_MAX, FP4_MAX)
    return fp4_encode(y).reshape(x.shape)


def mxfp4_dequantize(codes: torch.Tensor, scale_codes: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x ≈ e2m1(codes) · 2^(scale − 127): codes uint8 [..., n] -> dtype [..., n] (default float32)."""
    return (_grouped(fp4_decode(codes)) * _scale(scale_codes)).reshape(codes.shape).to(dtype or torch.float32)


def mxfp8_quantize(x: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 elements of x [..., n] with E8M0 scales [..., n/32] -> float8_e4m3fn [..., n]."""
    y = (_grouped(x.float()) / _scale(scale_codes)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn).reshape(x.shape)


def mxfp8_dequantize(q: torch.Tensor, scale_codes: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x ≈ q · 2^(scale − 127): float8_e4m3fn [..., n] -> dtype [..., n] (default float32)."""
    return (_grouped(q.float()) * _scale(scale_codes)).reshape(q.shape).to(dtype or torch.float32)


def mx_fake_quant(x: torch.Tensor, elem: str) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] with dynamic MX scales per token per block of 32 (x's dtype)."""
    codes = mx_scales(x, elem)
    if elem == "fp4":
        return mxfp4_dequantize(mxfp4_quantize(x, codes), codes, x.dtype)
    return mxfp8_dequantize(mxfp8_quantize(x, codes), codes, x.dtype)

def _elem(scheme: QuantScheme) -> str:
    return "fp4" if scheme.num_bits == 4 else "fp8"


@register_format
class MXFormat(Format):
    name = "mx"
    ct_formats = (MXFP4_PACKED, MXFP8_QUANTIZED)
    ct_scale_dtype = "torch.uint8"  # compressed-tensors' MX compressors key on it
    scale_checks = "NVFP4 global scales finite and shared in fused groups; E8M0 scales in range"

    def accepts(self, scheme: QuantScheme) -> bool:
        return (self.claims(scheme) and scheme.num_bits in (4, 8) and scheme.strategy == Strategy.GROUP
                and scheme.group_size == MX_GROUP)

    def claims(self, scheme: QuantScheme) -> bool:
        return scheme.type == "float" and scheme.scale_dtype == "e8m0"

    def validate(self, s: QuantScheme, where: str, role: str) -> None:
        check_float(s, where)
        if s.strategy != Strategy.GROUP or s.group_size != MX_GROUP:
            raise UsageError(f"{where}: MX formats (scale_dtype e8m0) scale blocks of 32", "use strategy: group, group_size: 32")
        if s.observer == "mse" and s.num_bits == 4:
            raise UsageError(f"{where}.observer: the mse observer searches int / fp8 per-channel grids only",
                             "use observer: minmax")
        if role == "activations" and not self.activation_strategies(s):
            raise UsageError(f"{where}: MX activations are MXFP8 (num_bits 8) with block scales taken at run time; "
                             f"qtk's targets write no {s.describe()} activations",
                             "use the mxfp8 recipe's activations (num_bits: 8, dynamic: true) or drop them (mxfp4-a16)")

    def activation_strategies(self, scheme: QuantScheme) -> bool:
        return scheme.num_bits == 8 and scheme.dynamic is True

    def pairs(self, w: QuantScheme, a: QuantScheme, where: str) -> bool | None:
        # W8A8-MX: vLLM's CompressedTensorsW8A8Mxfp8 (FlashInfer CUTLASS on Blackwell)
        if not (self.claims(w) and self.claims(a) and w.num_bits == 8 and a.num_bits == 8):
            raise UsageError(f"{where}: MX weights run with quantized activations only as MXFP8 with MXFP8 activations "
                             f"(W8A8-MX), not {w.describe()} weights with {a.describe()} activations",
                             "use the mxfp8 recipe as a template, or drop activations (mxfp4-a16, mxfp8-a16)")
        return True

    def storage_dtype(self, scheme):
        return torch.uint8 if scheme.num_bits == 4 else torch.float8_e4m3fn

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return torch.uint8  # E8M0 codes

    def qparams(self, w, scheme, model_dtype):
        return QParams(e8m0_decode(mx_scales(w.float(), _elem(scheme))))

    def group_qparams(self, cols, scheme, model_dtype, qp=None):
        return self.qparams(cols, scheme, model_dtype)  # one block: [out, 1]

    def learned_grid(self, scheme):
        return "fp4" if scheme.num_bits == 4 else None

    def group_scales_from_amax(self, amax, scheme, model_dtype, extra=None):
        scale = e8m0_decode(_codes_of_amax(amax.float(), _elem(scheme)))
        return QParams(scale), scale.float()

    def _round(self, y: torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        if scheme.num_bits == 4:
            return fp4_encode(y.clamp_(-FP4_MAX, FP4_MAX))
        return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)

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

    # ---- compressed-tensors: mxfp4-pack-quantized, mxfp8-quantized ----

    def ct_format(self, module) -> str:
        return MXFP4_PACKED if module.weights.num_bits == 4 else MXFP8_QUANTIZED

    def scale_shape(self, scheme, out_f, in_f):
        return [out_f, in_f // scheme.group_size]

    def stored(self, module, shape, dtype):
        out, inn = shape
        w = module.weights
        values = (Stored("weight_packed", (out, inn // 2), "uint8", "quantized") if w.num_bits == 4  # FP4 two a byte
                  else Stored("weight", (out, inn), "float8_e4m3fn", "quantized"))
        return [values, Stored("weight_scale", (out, inn // w.group_size), "uint8", "scales")]

    def encode(self, qt, dtype, fmt):
        if fmt == MXFP4_PACKED:
            from qtk.quant.fp4 import pack_fp4

            return {"weight_packed": pack_fp4(qt.values), "weight_scale": e8m0_encode(qt.scale)}
        return {"weight": qt.values, "weight_scale": e8m0_encode(qt.scale)}

    def decode(self, t, scheme, dtype):
        from qtk.quant.fp4 import unpack_fp4
        from qtk.quant.qtensor import QTensor

        values = unpack_fp4(t["weight_packed"]) if scheme.num_bits == 4 else t["weight"]
        return QTensor(values, e8m0_to_float(t["weight_scale"]), scheme, dtype=dtype)

    def check_stored(self, view, module, scheme, fmt, shape):
        from qtk.quant.formats.nvfp4 import check_group_codes

        return check_group_codes(view, module, scheme.weights, fmt, shape, torch.uint8, packed=fmt != MXFP8_QUANTIZED)

    # ---- the data-free stream and the checks ----

    def native_plan(self, w, scheme, model_dtype, extra=None):
        from qtk.quant.native.rounding import MXFP4, NativePlan

        rows, cols = w.shape
        if extra or scheme.num_bits != 4 or cols % scheme.group_size:
            return None
        return NativePlan(MXFP4, scheme.group_size, 1, (rows, cols // scheme.group_size), torch.uint8)

    def row_slab(self, scheme):
        """Blocks of 32 lie within a row: each E8M0 scale is a max over part of one row."""
        return 1 if scheme.observer == "minmax" else None

    def stream_key(self, scheme):
        return "mx"

    def error_bound(self, scheme):
        return 0.7 if scheme.num_bits == 4 else 0.2

    def value_problems(self, module, values, scheme):
        if scheme.num_bits == 4:
            from qtk.quant.formats.nvfp4 import fp4_value_problems

            return fp4_value_problems(module, values)
        return super().value_problems(module, values, scheme)

    def scale_problems(self, module, qt):
        """Every E8M0 scale a finite power of two (code 255 is NaN)."""
        from qtk.quant.native.scan import count_not_pow2

        sc = qt.scale.float()
        n_bad = count_not_pow2(sc)
        if n_bad is None:  # a positive finite power of two (subnormal too) has mantissa 0.5; NaN, Inf, <= 0 fail
            n_bad = int((torch.frexp(sc).mantissa != 0.5).sum())
        return [f"{module}: {n_bad} E8M0 scales are NaN (code 255) or not powers of two"] if n_bad else []
