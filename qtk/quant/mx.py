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
MXFP8QTensor). On a random bf16 weight ModelOpt's codes differ from compressed-tensors' in about a quarter
of the blocks (and from the plain OCP rule's in ~40 %).
"""

from __future__ import annotations

import functools

import torch

from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode

MX_GROUP = 32
E8M0_BIAS = 127
E8M0_NAN = 255
FP8_E4M3_MAX = 448.0
EMAX_ELEM = {"fp4": 2, "fp8": 8}  # floor(log2(max)) of e2m1 (6) and e4m3 (448)
ELEM_MAX = {"fp4": 6.0, "fp8": FP8_E4M3_MAX}
RULES = ("compressed-tensors", "ocp", "modelopt")

# dtype -> (int view, mantissa bits, exponent bits), for the power-of-two rounding on the stored bits
_BITS = {torch.float32: (torch.int32, 23, 8), torch.bfloat16: (torch.int16, 7, 8), torch.float16: (torch.int16, 10, 5)}


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
    int_dtype, m, e = _BITS[a.dtype]
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
    if x.dtype not in _BITS:
        x = x.float()
    amax = _grouped(x).abs().amax(-1)  # [..., n/32], in x's dtype
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


def mxfp4_dequantize(codes: torch.Tensor, scale_codes: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ≈ e2m1(codes) · 2^(scale − 127): codes uint8 [..., n] -> dtype [..., n]."""
    return (_grouped(fp4_decode(codes)) * _scale(scale_codes)).reshape(codes.shape).to(dtype)


def mxfp8_quantize(x: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
    """FP8 e4m3 elements of x [..., n] with E8M0 scales [..., n/32] -> float8_e4m3fn [..., n]."""
    y = (_grouped(x.float()) / _scale(scale_codes)).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return y.to(torch.float8_e4m3fn).reshape(x.shape)


def mxfp8_dequantize(q: torch.Tensor, scale_codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ≈ q · 2^(scale − 127): float8_e4m3fn [..., n] -> dtype [..., n]."""
    return (_grouped(q.float()) * _scale(scale_codes)).reshape(q.shape).to(dtype)


def mx_fake_quant(x: torch.Tensor, elem: str) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] with dynamic MX scales per token per block of 32 (x's dtype)."""
    codes = mx_scales(x, elem)
    if elem == "fp4":
        return mxfp4_dequantize(mxfp4_quantize(x, codes), codes, x.dtype)
    return mxfp8_dequantize(mxfp8_quantize(x, codes), codes, x.dtype)
