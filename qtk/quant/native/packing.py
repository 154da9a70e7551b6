"""Python side of kernels.c's nibble packing and unpacking: two 4-bit codes per byte, low nibble first (FP4's packing,
and compressed-tensors' int4 words on a little-endian host), in one pass at memory speed. Every 4-bit Linear a writer
encodes is packed through it (in the data-free stream's writing thread, where torch's passes took longer than the
rounding) and the convert self-check decodes each through it. None where the kernels do not apply (the caller's torch
path)."""

from __future__ import annotations

import functools
import math

import torch

from qtk.io.safetensors import recycled_empty
from qtk.quant.native import library, thread_count


def unpack_nibbles(packed: torch.Tensor, out_cols: int, sub: int = 0, dtype: torch.dtype = torch.uint8):
    """packed uint8 [rows, in_bytes] (any leading dims) -> [rows, out_cols] codes minus `sub` (uint8, wrapping),
    viewed as `dtype` (uint8 or int8); None on an accelerator, without the kernels, or for a tensor that is not
    uint8 or too short for out_cols."""
    lib = library()
    if (lib is None or packed.device.type != "cpu" or packed.dtype != torch.uint8 or packed.dim() < 1
            or packed.shape[-1] * 2 < out_cols):
        return None
    src = packed.contiguous()
    lead = tuple(src.shape[:-1])
    rows = src.numel() // max(src.shape[-1], 1) if src.shape[-1] else 0
    out = recycled_empty((*lead, out_cols), torch.uint8)  # the self-check decodes layer after layer: same sizes
    if rows and out_cols:
        used = lib.qtk_unpack_nibbles(src.data_ptr(), rows, src.shape[-1], out_cols, out.data_ptr(), sub,
                                      thread_count())
        if used < 1:
            return None
    return out if dtype == torch.uint8 else out.view(dtype)


def pack_nibbles(codes: torch.Tensor, out_bytes: int, add: int = 0):
    """codes uint8 or int8 [rows, in_cols] (any leading dims) -> uint8 [rows, out_bytes]: code 2i plus `add` (uint8,
    wrapping) in byte i's low nibble, code 2i+1 in its high one, the bytes past the codes 0; None on an accelerator,
    without the kernels, or for codes of another dtype or too many for out_bytes."""
    lib = library()
    if (lib is None or codes.device.type != "cpu" or codes.dtype not in (torch.uint8, torch.int8) or codes.dim() < 1
            or out_bytes * 2 < codes.shape[-1]):
        return None
    src = codes.contiguous()
    lead = tuple(src.shape[:-1])
    rows = math.prod(lead)
    out = recycled_empty((*lead, out_bytes), torch.uint8)  # the stream writes layer after layer: same sizes
    if rows and out_bytes:
        used = lib.qtk_pack_nibbles(src.data_ptr(), rows, src.shape[-1], out_bytes, out.data_ptr(), add,
                                    thread_count())
        if used < 1:
            return None
    return out


def e4m3_to_float(t: torch.Tensor):
    """float8_e4m3fn t -> float32 (torch's values bit for bit, NaN included: the byte table is torch's conversion of
    all 256 codes) in one threaded native pass, into a recycled buffer (the self-check decodes NVFP4's group scales
    layer after layer: torch's conversion of them took a fifth of that check); None on an accelerator, without the
    kernels, or for another dtype."""
    if t.dtype != torch.float8_e4m3fn:
        return None
    return bytes_to_float(t.view(torch.uint8), _e4m3_table())


@functools.cache
def _e4m3_table() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()


def bytes_to_float(codes: torch.Tensor, table: torch.Tensor):
    """uint8 codes -> float32 table[codes] (table: float32 [256], every code's value by the format's definition) in
    one threaded native pass, into a recycled buffer (the self-check decodes every NVFP4 weight's fp8 and every MX
    weight's E8M0 scales so); None on an accelerator, without the kernels, or for codes that are not uint8."""
    lib = library()
    if lib is None or codes.device.type != "cpu" or codes.dtype != torch.uint8:
        return None
    if table.dtype != torch.float32 or table.shape != (256,):
        raise ValueError(f"a byte table is float32 [256], got {table.dtype} {list(table.shape)}")
    src, lut = codes.contiguous(), table.contiguous()
    out = recycled_empty(tuple(src.shape), torch.float32)
    if src.numel() and lib.qtk_lut8_f32(src.data_ptr(), src.numel(), lut.data_ptr(), out.data_ptr(), thread_count()) < 1:
        return None
    return out
