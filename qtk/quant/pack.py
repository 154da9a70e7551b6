"""Bit packing of integer values into int32 words, in the orders each format expects.

All packers take unpacked signed values (QTensor convention) and never modify their input.
compressed-tensors pack-quantized (FORMATS.md §1): store q + 2^(bits-1), along the input dim,
element i of a word at bits*(i % per_word), least significant first; int4 [0..7] -> 0xFEDCBA98.
"""

from __future__ import annotations

import torch


def _per_word(bits: int) -> int:
    if 32 % bits:
        raise ValueError(f"{bits}-bit values do not pack evenly into int32 words")
    return 32 // bits


def pack_words(u: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """Pack unsigned values u [rows, n] (each < 2^bits) along the last dim into int32 [rows, ceil(n/per)].

    order: which element of each chunk of per_word lands in slot 0, 1, ... (AWQ interleave); default identity.
    The last word is zero-padded.
    """
    per = _per_word(bits)
    rows, n = u.shape
    n_words = -(-n // per)
    pad = n_words * per - n
    v = u.to(torch.int64)
    if pad:
        v = torch.cat([v, v.new_zeros(rows, pad)], dim=1)
    v = v.reshape(rows, n_words, per)
    if order is not None:
        v = v[:, :, order]
    shifts = torch.arange(per, dtype=torch.int64) * bits
    words = (v << shifts).sum(-1)
    # reinterpret the low 32 bits as signed int32
    words = torch.where(words >= 2**31, words - 2**32, words)
    return words.to(torch.int32)


def unpack_words(words: torch.Tensor, bits: int, n: int, order: list[int] | None = None) -> torch.Tensor:
    """Inverse of pack_words: int32 [rows, n_words] -> unsigned int64 values [rows, n]."""
    per = _per_word(bits)
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per, dtype=torch.int64) * bits
    v = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    if order is not None:
        inv = [0] * per
        for slot, elem in enumerate(order):
            inv[elem] = slot
        v = v[:, :, inv]
    return v.reshape(w.shape[0], -1)[:, :n]


def offset(bits: int) -> int:
    return 1 << (bits - 1)


def pack_ct(q: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors `weight_packed`: signed q [out, in] -> int32 [out, ceil(in*bits/32)]."""
    return pack_words(q.to(torch.int64) + offset(bits), bits)


def unpack_ct(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    return (unpack_words(packed, bits, in_features) - offset(bits)).to(torch.int8)


def pack_ct_zero_point(z: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors `weight_zero_point`: signed z [out, groups] packed along dim 0 -> [ceil(out*bits/32), groups]."""
    return pack_words(z.to(torch.int64).t() + offset(bits), bits).t().contiguous()


def unpack_ct_zero_point(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    return (unpack_words(packed.t(), bits, out_features) - offset(bits)).t().contiguous()
