"""compressed-tensors packing: known words, exact round trips, and agreement with compressed-tensors itself."""

import pytest
import torch

from qtk.quant.pack import pack_ct, pack_ct_zero_point, pack_words, unpack_ct, unpack_ct_zero_point, unpack_words


def test_int4_known_word():
    q = torch.arange(8, dtype=torch.int8).reshape(1, 8)  # stored q+8 = 8..15, element i at bits 4i
    assert pack_ct(q, 4).item() & 0xFFFFFFFF == 0xFEDCBA98
    q = torch.tensor([[-8, -7, -6, -5, -4, -3, -2, -1]], dtype=torch.int8)
    assert pack_ct(q, 4).item() & 0xFFFFFFFF == 0x76543210


def test_int8_known_word():
    q = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)  # (q+128) << 8j
    assert pack_ct(q, 8).item() & 0xFFFFFFFF == (0 | 127 << 8 | 128 << 16 | 255 << 24)


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 16), (17, 33), (8, 128)])
def test_round_trip(bits, shape):
    g = torch.Generator().manual_seed(sum(shape) + bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int8)
    p = pack_ct(q, bits)
    assert p.dtype == torch.int32 and p.shape == (shape[0], -(-shape[1] * bits // 32))
    assert torch.equal(unpack_ct(p, bits, shape[1]), q)
    z = torch.randint(lo, hi + 1, shape, generator=g, dtype=torch.int8)
    pz = pack_ct_zero_point(z, bits)
    assert pz.shape == (-(-shape[0] * bits // 32), shape[1])
    assert torch.equal(unpack_ct_zero_point(pz, bits, shape[0]).to(torch.int8), z)


def test_pack_does_not_modify_input():
    q = torch.randint(-8, 8, (4, 16), dtype=torch.int8)
    c = q.clone()
    pack_ct(q, 4)
    assert torch.equal(q, c)


def test_order_permutes_slots():
    u = torch.arange(8).reshape(1, 8)
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    w = pack_words(u, 4, order)
    # slot j holds element order[j]
    assert [(w.item() >> (4 * j)) & 0xF for j in range(8)] == order
    assert torch.equal(unpack_words(w, 4, 8, order), u)


@pytest.mark.parametrize("bits", [4, 8])
def test_matches_compressed_tensors(bits):
    """The peer library's own packer produces the same words, for weights and zero points."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32

    g = torch.Generator().manual_seed(bits)
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    q = torch.randint(lo, hi + 1, (6, 64), generator=g, dtype=torch.int8)
    assert torch.equal(pack_ct(q, bits), pack_to_int32(q, bits, packed_dim=1))
    assert torch.equal(unpack_from_int32(pack_ct(q, bits), bits, q.shape, packed_dim=1).to(torch.int8), q)
    z = torch.randint(lo, hi + 1, (16, 3), generator=g, dtype=torch.int8)
    assert torch.equal(pack_ct_zero_point(z, bits), pack_to_int32(z, bits, packed_dim=0))


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("n", [512, 100, 36, 8, 3])
def test_byte_packing_gives_pack_words_words(bits, n):
    """pack_ct builds the words as bytes (little-endian hosts): the words pack_words' int64 arithmetic gives, the
    last one zero-padded when n does not fill it, and every value from the edges of the signed range."""
    from qtk.quant.pack import offset

    g = torch.Generator().manual_seed(n * bits)
    q = torch.randint(-(2 ** (bits - 1)), 2 ** (bits - 1), (37, n), dtype=torch.int8, generator=g)
    q[0, : min(n, 2)] = torch.tensor([-(2 ** (bits - 1)), 2 ** (bits - 1) - 1][: min(n, 2)], dtype=torch.int8)
    assert torch.equal(pack_ct(q, bits), pack_words(q.to(torch.int64) + offset(bits), bits))
