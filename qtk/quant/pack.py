"""Bit packing of integer values into int32 words, in the orders each format expects.

All packers take unpacked signed values (QTensor convention) and never modify their input.
compressed-tensors pack-quantized (docs/formats.md, vllm): store q + 2^(bits-1), along the input dim,
element i of a word at bits*(i % per_word), least significant first; int4 [0..7] -> 0xFEDCBA98.
"""

from __future__ import annotations

import sys

import torch

from qtk.io.safetensors import recycled_empty


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
    """compressed-tensors `weight_packed`: signed q [out, in] -> int32 [out, ceil(in*bits/32)]. On a little-endian
    host a word's bytes hold its slots in order (slot i at bit bits*i), so the words are built as bytes: q + 2^(bits-1)
    in uint8 (wrapping), 8/bits values or'ed into each byte, the bytes viewed as int32 (the last word zero-padded as
    pack_words pads it); uint8 traffic, not pack_words' int64. Elsewhere, pack_words a row block at a time."""
    rows_, n = q.shape
    if sys.byteorder == "little" and not 8 % bits and q.dtype == torch.int8:
        per, n_words = 8 // bits, -(-n * bits // 32)
        if bits == 4:
            from qtk.quant.native.packing import pack_nibbles

            fast = pack_nibbles(q, n_words * 4, add=offset(bits))  # one native pass on the CPU
            if fast is not None:
                return fast.view(torch.int32).reshape(rows_, n_words)
        pad = n_words * 4 * per - n
        if per == 1 and not pad:  # int8: each byte + 128 (xor 0x80), into a recycled buffer (the stream's writer
            # packs layer after layer: a fresh tensor a weight cost a page fault per 4 KiB)
            u = torch.bitwise_xor(q.view(torch.uint8), 0x80, out=recycled_empty((rows_, n), torch.uint8))
            return u.view(torch.int32).reshape(rows_, n_words)
        u = q.view(torch.uint8) + offset(bits)  # uint8 arithmetic wraps: -8 + 8 -> 0, 7 + 8 -> 15
        if pad:
            u = torch.cat([u, u.new_zeros(rows_, pad)], dim=1)
        if per > 1:
            u = u.reshape(rows_, -1, per)
            b = u[:, :, 0] & ((1 << bits) - 1)
            for i in range(1, per):
                b |= (u[:, :, i] & ((1 << bits) - 1)) << (bits * i)
            u = b
        return u.contiguous().view(torch.int32).reshape(rows_, n_words)
    rows = max(1, (8 << 20) // max(1, n))
    if q.shape[0] <= rows:
        return pack_words(q.to(torch.int64) + offset(bits), bits)
    return torch.cat([pack_words(q[r:r + rows].to(torch.int64) + offset(bits), bits) for r in range(0, q.shape[0], rows)])


def unpack_ct(packed: torch.Tensor, bits: int, in_features: int) -> torch.Tensor:
    """Inverse of pack_ct. On a little-endian host the words' bytes hold their values in order (slot i at bit
    bits*i), so the values come out of the bytes in uint8, an eighth of unpack_words' int64 traffic: the decode of
    every written Linear in the convert self-check runs through here."""
    if sys.byteorder != "little" or 8 % bits:
        return (unpack_words(packed, bits, in_features) - offset(bits)).to(torch.int8)
    per, rows = 8 // bits, packed.shape[0]
    b = packed.contiguous().view(torch.uint8).reshape(rows, -1)
    if per == 1:  # into a recycled buffer: the self-check decodes layer after layer
        return torch.bitwise_xor(b[:, :in_features], 0x80, out=recycled_empty((rows, in_features), torch.uint8)
                                 ).view(torch.int8)
    if bits == 4:
        from qtk.quant.native.packing import unpack_nibbles

        fast = unpack_nibbles(b, in_features, sub=offset(bits), dtype=torch.int8)  # one native pass on the CPU
        if fast is not None:
            return fast
    out = torch.empty(rows, b.shape[1], per, dtype=torch.uint8)  # slot i of each byte, written in place
    mask = (1 << bits) - 1
    for i in range(per):
        torch.bitwise_and(b if i == 0 else b >> (bits * i), mask, out=out[:, :, i])
    v = out.reshape(rows, -1)[:, :in_features].view(torch.int8)
    return v.sub_(offset(bits)) if v.is_contiguous() else v - offset(bits)


def pack_ct_zero_point(z: torch.Tensor, bits: int) -> torch.Tensor:
    """compressed-tensors `weight_zero_point`: signed z [out, groups] packed along dim 0 -> [ceil(out*bits/32), groups]."""
    return pack_words(z.to(torch.int64).t() + offset(bits), bits).t().contiguous()


def unpack_ct_zero_point(packed: torch.Tensor, bits: int, out_features: int) -> torch.Tensor:
    return (unpack_words(packed.t(), bits, out_features) - offset(bits)).t().contiguous()


# ---- legacy GPTQ and AWQ GEMM (docs/formats.md, gptq and awq) ----

def _whole_words(n: int, bits: int, what: str) -> None:
    per = _per_word(bits)
    if n % per:
        raise ValueError(f"{what}: {n} values do not fill whole int32 words of {per} {bits}-bit values")


def pack_gptq_qweight(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ `qweight`: signed q [out, in] -> int32 [in*bits/32, out], packed along the input dim,
    sequential, least significant first, stored unsigned (q + 2^(bits-1))."""
    _whole_words(q.shape[1], bits, "pack_gptq_qweight: in_features")
    return pack_words(q.to(torch.int64) + offset(bits), bits).t().contiguous()


def unpack_gptq_qweight(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of pack_gptq_qweight: int32 [in*bits/32, out] -> signed int8 q [out, in]."""
    n = packed.shape[0] * _per_word(bits)
    return (unpack_words(packed.t(), bits, n) - offset(bits)).to(torch.int8)


def pack_gptq_qzeros(z: torch.Tensor | None, bits: int, v1: bool = True,
                     shape: tuple[int, int] | None = None) -> torch.Tensor:
    """GPTQ `qzeros`: signed zero points z [out, groups] (None = symmetric, then shape=(out, groups) is
    required) -> int32 [groups, out*bits/32], packed along the output dim, stored unsigned.

    Symmetric zero points are 2^(bits-1). v1 (checkpoint_format "gptq", what readers assume by default)
    stores z - 1, so symmetric 4-bit gives 0x77777777; v1=False is checkpoint_format "gptq_v2" (raw z).
    """
    if z is None:
        if shape is None:
            raise ValueError("pack_gptq_qzeros: symmetric (z=None) needs shape=(out_features, groups)")
        zu = torch.full(shape, offset(bits), dtype=torch.int64)
    else:
        zu = z.to(torch.int64) + offset(bits)  # [out, groups]
    _whole_words(zu.shape[0], bits, "pack_gptq_qzeros: out_features")
    if v1:
        if (zu == 0).any():
            raise ValueError("pack_gptq_qzeros: an unsigned zero point of 0 cannot be stored in GPTQ v1 "
                             "(it stores z - 1); write checkpoint_format gptq_v2 (v1=False) instead")
        zu = zu - 1
    return pack_words(zu.t(), bits)


def unpack_gptq_qzeros(packed: torch.Tensor, bits: int, v1: bool = True) -> torch.Tensor:
    """Inverse of pack_gptq_qzeros: int32 [groups, out*bits/32] -> signed int8 z [out, groups]."""
    n = packed.shape[1] * _per_word(bits)
    zu = unpack_words(packed, bits, n) + (1 if v1 else 0)  # [groups, out]
    return (zu - offset(bits)).t().contiguous().to(torch.int8)


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # slot i of an AWQ word holds element AWQ_ORDER[i] of its 8


def pack_awq(q_unsigned: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """AWQ GEMM `qweight` / `qzeros`: unsigned values [rows, out] (rows = in for qweight, in/group for
    qzeros; zeros raw, no -1) -> int32 [rows, out/8], packed along the output dim in AWQ_ORDER."""
    if bits != 4:
        raise ValueError(f"pack_awq: the AWQ GEMM layout is 4-bit only, got {bits}")
    if q_unsigned.numel() and (q_unsigned.min() < 0 or q_unsigned.max() > 15):
        raise ValueError("pack_awq: values must be unsigned 4-bit (0..15); shift signed q by +8 first")
    _whole_words(q_unsigned.shape[1], bits, "pack_awq: out_features")
    return pack_words(q_unsigned.to(torch.int64), bits, AWQ_ORDER)


def unpack_awq(packed: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """Inverse of pack_awq: int32 [rows, out/8] -> unsigned int64 [rows, out]."""
    if bits != 4:
        raise ValueError(f"unpack_awq: the AWQ GEMM layout is 4-bit only, got {bits}")
    return unpack_words(packed, bits, packed.shape[1] * 8, AWQ_ORDER)
