"""float8_e4m3fn to float32 at memory speed. torch's CPU cast of e4m3 goes element by element (several times slower
than a bf16 -> float32 copy), and the data-free stream decodes every FP8 weight it writes (its error and the
self-check's figures), as do the self-check and the simulation. Bit arithmetic on int16 does it vectorised: the
e4m3 bits s.eeee.mmm, moved to bf16's positions (s at bit 15, eeee.mmm at bits 10..4), are a bf16 whose value is
the e4m3 value times 2^-120, normal and subnormal codes alike (both formats put the exponent bias in the same
place), so one exact multiply by 2^120 gives the value. The two NaN codes (0x7f, 0xff) have no such image (they
decode to +-480, past the largest finite 448, so the result's min/max finds them): a tensor holding one is cast by
torch. So is every tensor when the trick does not reproduce torch's cast of all 256
codes on this machine (a process with denormals flushed to zero, say), checked once."""

from __future__ import annotations

import functools

from qtk.quant.lazy import torch


def __getattr__(name: str):
    if name == "E4M3":  # torch.float8_e4m3fn, named without importing torch when this module is
        return torch.float8_e4m3fn
    raise AttributeError(name)

_SIGN_AND_MAGNITUDE = -30736  # 0x87F0 as int16: bit 15 and bits 10..4 after the shift


def _bits_to_float(v: torch.Tensor) -> torch.Tensor:
    b = v.view(torch.int8).to(torch.int16)  # sign-extended: the sign lands in bits 15..8, cleared below but bit 15
    b.bitwise_left_shift_(4).bitwise_and_(_SIGN_AND_MAGNITUDE)
    return b.view(torch.bfloat16).float().mul_(2.0 ** 120)


@functools.cache
def _trick_holds() -> bool:
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn)
    tile = codes.repeat(1024)  # large enough for torch to split it over its threads, as a weight is
    return torch.equal(_bits_to_float(tile), tile.float())


def to_float32(t: torch.Tensor) -> torch.Tensor:
    """t as float32 (a new tensor, or t itself when it is float32), e4m3 decoded by bit arithmetic where exact."""
    if t.dtype != torch.float8_e4m3fn:
        return t.float()
    if t.device.type != "cpu" or not t.numel() or not _trick_holds():
        return t.float()
    out = _bits_to_float(t.contiguous())
    # a NaN code (s.1111.111) lands where 480 would (the largest finite e4m3 is 448): one reduction over the result
    # finds it, with no temporary the size of t; torch's cast keeps it NaN
    lo, hi = torch.aminmax(out)
    if max(-float(lo), float(hi)) > 448.0:
        return t.float()
    return out
