"""Legacy GPTQ and AWQ GEMM packing (docs/formats.md, gptq and awq): known words, exact round trips for odd-but-valid
shapes, agreement with a bit-by-bit reference, and a GPTQ act-order layer read back the way loaders do."""

import pytest
import torch

from qtk.algorithms.gptq import gptq_quantize
from qtk.recipe.params import GPTQParams
from qtk.quant.pack import (
    AWQ_ORDER,
    pack_awq,
    pack_gptq_qweight,
    pack_gptq_qzeros,
    unpack_awq,
    unpack_gptq_qweight,
    unpack_gptq_qzeros,
)
from qtk.recipe import QuantScheme
from qtk.steps.stats import Hessian


def u32(x) -> int:
    return int(x) & 0xFFFFFFFF


def ref_word(values, bits) -> int:
    """Python-int reference: values[i] at bits·i, least significant first."""
    word = 0
    for i, v in enumerate(values):
        assert 0 <= v < 2**bits
        word |= int(v) << (bits * i)
    return word


def signed_randint(bits, shape, seed):
    lo, hi = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return torch.randint(lo, hi + 1, shape, generator=torch.Generator().manual_seed(seed), dtype=torch.int8)


# ---- GPTQ qweight ----

def test_gptq_qweight_known_words():
    # one output row, 16 inputs: stored q + 8 runs 0..15 along the input dim
    q = (torch.arange(16) - 8).to(torch.int8).reshape(1, 16)
    p = pack_gptq_qweight(q, 4)
    assert p.dtype == torch.int32 and p.shape == (2, 1)
    assert [u32(w) for w in p[:, 0]] == [0x76543210, 0xFEDCBA98]
    q8 = torch.tensor([[-128, -1, 0, 127]], dtype=torch.int8)
    assert u32(pack_gptq_qweight(q8, 8)[0, 0]) == 0 | 127 << 8 | 128 << 16 | 255 << 24


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("out_f,n_words", [(1, 1), (3, 2), (7, 3), (13, 5)])
def test_gptq_qweight_round_trip_and_layout(bits, out_f, n_words):
    per = 32 // bits
    in_f = per * n_words
    q = signed_randint(bits, (out_f, in_f), seed=bits * 100 + out_f)
    q0 = q.clone()
    p = pack_gptq_qweight(q, bits)
    assert p.shape == (in_f * bits // 32, out_f) and p.is_contiguous()
    assert torch.equal(q, q0)
    for k in range(n_words):
        for o in range(out_f):
            vals = [int(q[o, k * per + i]) + 2 ** (bits - 1) for i in range(per)]
            assert u32(p[k, o]) == ref_word(vals, bits)
    back = unpack_gptq_qweight(p, bits)
    assert back.dtype == torch.int8 and torch.equal(back, q)


def test_gptq_qweight_rejects_partial_words():
    with pytest.raises(ValueError, match="whole int32 words"):
        pack_gptq_qweight(torch.zeros(4, 12, dtype=torch.int8), 4)


# ---- GPTQ qzeros ----

@pytest.mark.parametrize("bits,word", [(4, 0x77777777), (8, 0x7F7F7F7F), (2, 0x55555555)])
def test_gptq_symmetric_v1_qzeros_known_words(bits, word):
    p = pack_gptq_qzeros(None, bits, shape=(32, 3))  # out 32, 3 groups
    assert p.shape == (3, 32 * bits // 32)
    assert all(u32(w) == word for w in p.flatten())
    # the same through explicit signed zeros (0 = 2^(bits-1) unsigned)
    assert torch.equal(pack_gptq_qzeros(torch.zeros(32, 3), bits), p)
    assert torch.equal(unpack_gptq_qzeros(p, bits), torch.zeros(32, 3, dtype=torch.int8))


def test_gptq_symmetric_v2_qzeros_store_raw_zero():
    p = pack_gptq_qzeros(None, 4, v1=False, shape=(8, 2))
    assert [u32(w) for w in p.flatten()] == [0x88888888, 0x88888888]


@pytest.mark.parametrize("v1", [True, False], ids=["v1", "v2"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("out_f,groups", [(16, 1), (48, 3), (80, 7)])
def test_gptq_qzeros_round_trip_and_layout(bits, out_f, groups, v1):
    per = 32 // bits
    z = signed_randint(bits, (out_f, groups), seed=out_f + groups + bits)
    if v1:
        z = z.clamp(min=-(2 ** (bits - 1)) + 1)  # v1 cannot hold unsigned zero 0
    p = pack_gptq_qzeros(z.float(), bits, v1=v1)  # QTensor zero points are float32
    assert p.dtype == torch.int32 and p.shape == (groups, out_f * bits // 32)
    for grp in range(groups):
        for k in range(out_f // per):
            vals = [int(z[k * per + i, grp]) + 2 ** (bits - 1) - (1 if v1 else 0) for i in range(per)]
            assert u32(p[grp, k]) == ref_word(vals, bits)
    assert torch.equal(unpack_gptq_qzeros(p, bits, v1=v1), z)


def test_gptq_v1_refuses_unsigned_zero_point_zero():
    z = torch.zeros(8, 1)
    z[3, 0] = -8  # unsigned 0: v1 would have to store -1
    with pytest.raises(ValueError, match="gptq_v2"):
        pack_gptq_qzeros(z, 4, v1=True)
    assert torch.equal(unpack_gptq_qzeros(pack_gptq_qzeros(z, 4, v1=False), 4, v1=False), z.to(torch.int8))
    with pytest.raises(ValueError, match="shape"):
        pack_gptq_qzeros(None, 4)


def test_gptq_actorder_layer_reads_back_like_a_loader():
    """Pack a GPTQ act-order asymmetric layer and dequantize it the way GPTQ loaders do:
    w[o, i] = scales[g_idx[i], o] · (qweight_u[i, o] − (qzeros_v1[g_idx[i], o] + 1))."""
    g = torch.Generator().manual_seed(0)
    out_f, in_f, gs = 16, 128, 32
    X = torch.randn(256, in_f, generator=g) * torch.linspace(0.2, 3, in_f)[torch.randperm(in_f, generator=g)]
    W = 0.05 * torch.randn(out_f, in_f, generator=g)
    scheme = QuantScheme(4, strategy="group", group_size=gs, symmetric=False)
    h = Hessian(in_f)
    h.update(X)
    qt, _ = gptq_quantize(W, h.H, scheme, GPTQParams(actorder="group"), torch.float16)
    assert qt.g_idx is not None

    qweight = pack_gptq_qweight(qt.values, 4)  # [in/8, out]
    qzeros = pack_gptq_qzeros(qt.zero_point, 4, v1=True)  # [groups, out/8]
    scales = qt.scale.t().to(torch.float16)  # [groups, out]

    def nibbles(words):  # int32 [r, c] -> [r, 8c], sequential, LSB first
        w = words.to(torch.int64) & 0xFFFFFFFF
        return ((w.unsqueeze(-1) >> (4 * torch.arange(8))) & 0xF).reshape(w.shape[0], -1)

    qw_u = nibbles(qweight.t()).t()  # [in, out]
    qz = nibbles(qzeros) + 1  # [groups, out]
    gi = qt.g_idx.long()
    w = scales[gi].float() * (qw_u - qz[gi]).float()  # [in, out]
    assert torch.equal(w.t(), qt.dequantize())


# ---- AWQ GEMM ----

def test_awq_known_word():
    # elements 0..7 of one row land in slots by AWQ_ORDER: slot i holds element [0,2,4,6,1,3,5,7][i]
    u = torch.arange(8).reshape(1, 8)
    assert AWQ_ORDER == [0, 2, 4, 6, 1, 3, 5, 7]
    assert u32(pack_awq(u)[0, 0]) == 0x75316420
    u2 = torch.zeros(1, 8, dtype=torch.int64)
    u2[0, 1] = 0xF  # element 1 sits in slot 4, bits 16..19
    assert u32(pack_awq(u2)[0, 0]) == 0x000F0000


@pytest.mark.parametrize("rows,out_f", [(1, 8), (5, 24), (13, 40), (3, 136)])
def test_awq_round_trip_and_layout(rows, out_f):
    u = torch.randint(0, 16, (rows, out_f), generator=torch.Generator().manual_seed(rows * out_f))
    u0 = u.clone()
    p = pack_awq(u)
    assert p.dtype == torch.int32 and p.shape == (rows, out_f // 8)
    assert torch.equal(u, u0)
    for r in range(rows):
        for k in range(out_f // 8):
            assert u32(p[r, k]) == ref_word([int(u[r, k * 8 + AWQ_ORDER[i]]) for i in range(8)], 4)
    assert torch.equal(unpack_awq(p), u)


def test_awq_zeros_are_raw_and_inputs_checked():
    z_u = torch.full((2, 16), 8)  # symmetric int4 zero point, stored raw (no -1)
    assert all(u32(w) == 0x88888888 for w in pack_awq(z_u).flatten())
    with pytest.raises(ValueError, match="unsigned"):
        pack_awq(torch.full((1, 8), -1))
    with pytest.raises(ValueError, match="4-bit only"):
        pack_awq(torch.zeros(1, 4, dtype=torch.int64), bits=8)
    with pytest.raises(ValueError, match="whole int32 words"):
        pack_awq(torch.zeros(1, 12, dtype=torch.int64))
