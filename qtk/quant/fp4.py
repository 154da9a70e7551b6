"""FP4 E2M1 (OCP MX v1.0 §5.3.3): the 16 codes, rounding, encoding and the two-codes-per-byte packing.

An e2m1 code is 4 bits: sign (bit 3), 2 exponent bits, 1 mantissa bit. Magnitudes by code & 7:
0, 0.5, 1, 1.5, 2, 3, 4, 6 (bias 1; code 1 is the only subnormal). No inf, no NaN; 6 is the max.

Rounding is round-to-nearest, ties to the even code, with saturation at ±6 — exactly the thresholds
of compressed-tensors' ``cast_to_fp4`` (0.25 → 0, 0.75 → 1, 1.25 → 1, 1.75 → 2, 2.5 → 2, 3.5 → 4,
5 → 4). The sign is kept for values that round to zero: −0.1 encodes as 0x8 (−0), as compressed-tensors'
packer writes it; an exact ±0.0 encodes as 0x0 (torch.sign(−0.0) is +0 there).

Packing (compressed-tensors ``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized``, vLLM, ModelOpt):
along the last dim, element 2i in the LOW nibble and element 2i+1 in the HIGH nibble of byte i,
stored as uint8 — so [1.0, -6.0] packs to 0xF2.
"""

from __future__ import annotations

import functools

from qtk.quant.lazy import torch

FP4_MAX = 6.0
# code -> value; codes 8..15 are the negatives of 0..7 (code 8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)

# A magnitude reaches code k+1 when it is above (">") or at-or-above (">=") the midpoint between
# values k and k+1: ">=" where the upper code is even (the tie goes up), ">" where the lower one is.
_MIDPOINTS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_table(dtype: torch.dtype | None = None, device=None) -> torch.Tensor:
    """The 16 code values as a lookup table [16] (dtype default float32)."""
    return torch.tensor(E2M1_VALUES, dtype=dtype or torch.float32, device=device)


def fp4_encode(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code of each (already scaled) value, ties to even, saturating at ±6: uint8 [*] in 0..15.

    Without a comparison per threshold (torch's CPU comparisons run at a fifth of its arithmetic's speed): the
    magnitude's code is the sum of its steps within each binade, each rounded half to even, as torch.round does:
    round(2·min(a, 2)) counts the half steps below 2 (codes 0..4), round(clamp(a, 2, 4)) - 2 the unit steps up to 4,
    round(clamp(a, 4, 6) / 2) - 2 the last one. Multiplying by 2 or 1/2 is exact, so a tie of the grid is a tie of
    the rounding: 0.25 -> 0, 0.75 -> 2 (1.0), 1.25 -> 2, 1.75 -> 4 (2.0), 2.5 -> 4, 3.5 -> 6 (4.0), 5 -> 6, as the
    thresholds _MIDPOINTS say (tested against them on every multiple of 1/16 and its neighbours). NaN -> 0."""
    a = torch.nan_to_num(x.float(), nan=0.0).abs_()
    code = torch.clamp(a, max=2.0).mul_(2.0).round_()
    step = torch.clamp(a, 2.0, 4.0).round_()
    code.add_(step)
    torch.clamp(a, 4.0, 6.0, out=step).mul_(0.5).round_()
    code = code.add_(step).sub_(4.0).to(torch.uint8)
    return code.bitwise_or_((x < 0).view(torch.uint8).bitwise_left_shift(3))


def _fp4_encode_thresholds(x: torch.Tensor) -> torch.Tensor:
    """fp4_encode by its definition, one comparison per threshold (_MIDPOINTS): the tests' reference."""
    a = x.float().abs()
    mag = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for mid, tie_up in _MIDPOINTS:
        mag += (a >= mid if tie_up else a > mid).to(torch.uint8)
    return mag | (x < 0).to(torch.uint8) << 3


def _decode_bits(codes: torch.Tensor) -> torch.Tensor:
    """e2m1 bits s.ee.m moved to bf16's sign (bit 15) and bits 8..6 are a bf16 of the code's value times 2^-126
    (normal and subnormal codes alike), so one exact multiply gives the value: int16 arithmetic, no gather."""
    b = codes.to(torch.int16)
    v = (b & 8).bitwise_left_shift_(12).bitwise_or_((b & 7).bitwise_left_shift_(6))
    return v.view(torch.bfloat16).float().mul_(2.0 ** 126)


@functools.cache
def _bits_hold() -> bool:
    """Whether _decode_bits gives the table's values here (not where denormals are flushed), checked once on a
    tile large enough for torch to split over its threads."""
    tile = torch.arange(16, dtype=torch.uint8).repeat(1 << 14)
    want = e2m1_table()[tile.long()]
    got = _decode_bits(tile)
    return torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))


def fp4_decode(codes: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Values of e2m1 codes (uint8 [*], 0..15) -> dtype [*] (default float32)."""
    dtype = dtype or torch.float32
    if codes.device.type == "cpu" and codes.dtype == torch.uint8 and codes.numel() and _bits_hold():
        if int(codes.max()) <= 15:  # a byte that is no code (a corrupt tensor) takes the table's error
            out = _decode_bits(codes)
            return out if dtype == torch.float32 else out.to(dtype)
    return e2m1_table(dtype, codes.device)[codes.long()]


def fp4_round(x: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize to the e2m1 grid (float32), i.e. fp4_decode(fp4_encode(x))."""
    return fp4_decode(fp4_encode(x))


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """Two codes per byte along the last dim: codes [..., n] (n even) -> uint8 [..., n/2], element 2i low nibble."""
    n = codes.shape[-1]
    if n % 2:
        raise ValueError(f"pack_fp4: the last dim must be even to pack two FP4 codes per byte, got {n}")
    from qtk.quant.native.packing import pack_nibbles

    fast = pack_nibbles(codes, n // 2) if codes.dim() else None  # one native pass on the CPU
    if fast is not None:
        return fast
    c = codes.to(torch.uint8).reshape(*codes.shape[:-1], n // 2, 2)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_fp4: uint8 [..., n/2] -> codes uint8 [..., n]."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_fp4: packed FP4 is stored as uint8, got {packed.dtype}")
    from qtk.quant.native.packing import unpack_nibbles

    fast = unpack_nibbles(packed, packed.shape[-1] * 2) if packed.dim() else None  # one native pass on the CPU
    if fast is not None:
        return fast
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)
