"""FP4 e2m1: the code table, round-to-nearest-even at every midpoint, the nibble order of packed bytes,
and agreement with compressed-tensors' own cast and packer."""

import pytest
import torch

from qtk.quant.fp4 import E2M1_VALUES, e2m1_table, fp4_decode, fp4_encode, fp4_round, pack_fp4, unpack_fp4


def test_code_table():
    # OCP MX v1.0 e2m1: sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; code 1 is the subnormal 0.5
    assert E2M1_VALUES[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    for code in range(16):
        sign, exp, man = code >> 3, (code >> 1) & 3, code & 1
        mag = man * 0.5 if exp == 0 else (1 + man / 2) * 2.0 ** (exp - 1)
        assert E2M1_VALUES[code] == (-mag if sign else mag)
        assert torch.signbit(e2m1_table()[code]).item() == bool(sign)  # code 8 is -0.0, not +0.0


def test_every_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(fp4_encode(fp4_decode(codes))[1:8], codes[1:8])
    assert torch.equal(fp4_encode(fp4_decode(codes))[9:], codes[9:])
    assert fp4_encode(torch.tensor([-0.0])).item() == 0  # an exact -0.0 has no sign, as compressed-tensors writes it


@pytest.mark.parametrize("x, value", [
    (0.25, 0.0), (0.2500001, 0.5), (0.75, 1.0), (0.7499999, 0.5), (1.25, 1.0), (1.2500001, 1.5),
    (1.75, 2.0), (2.5, 2.0), (2.5000002, 3.0), (3.5, 4.0), (5.0, 4.0), (5.0000005, 6.0), (6.0, 6.0),
    (7.0, 6.0), (1e30, 6.0), (float("inf"), 6.0),
])
def test_ties_to_even_and_saturation(x, value):
    # every midpoint goes to the neighbour with the even code (0, 1.0, 2.0, 4.0); beyond 6 saturates
    assert fp4_round(torch.tensor([x])).item() == value
    assert fp4_round(torch.tensor([-x])).item() == -value


def test_small_negatives_keep_their_sign():
    assert fp4_encode(torch.tensor([-0.1, 0.1, -0.25])).tolist() == [8, 0, 8]


def test_nibble_order_hand_written_byte():
    # element 0 -> low nibble, element 1 -> high nibble: [1.0, -6.0] = codes [0x2, 0xF] -> 0xF2
    codes = fp4_encode(torch.tensor([[1.0, -6.0, 0.5, 3.0]]))
    assert codes.tolist() == [[0x2, 0xF, 0x1, 0x5]]
    packed = pack_fp4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0xF2, 0x51]]
    assert torch.equal(unpack_fp4(packed), codes)


@pytest.mark.parametrize("shape", [(1, 2), (3, 34), (17, 64), (2, 5, 16)])
def test_pack_round_trip(shape):
    g = torch.Generator().manual_seed(sum(shape))
    codes = torch.randint(0, 16, shape, generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.shape == (*shape[:-1], shape[-1] // 2)
    assert torch.equal(unpack_fp4(packed), codes)


def test_pack_refuses_odd_width():
    with pytest.raises(ValueError, match="even"):
        pack_fp4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_compressed_tensors(dtype):
    """compressed-tensors' cast_to_fp4 and its packer/unpacker agree with qtk on every value, midpoints included."""
    from compressed_tensors.compressors.nvfp4.helpers import pack_fp4_to_uint8, unpack_fp4_from_uint8
    from compressed_tensors.quantization.utils.fp4_utils import cast_to_fp4

    g = torch.Generator().manual_seed(0)
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.0, 0.1])
    x = torch.cat([torch.randn(1000, generator=g) * 3, mids, -mids]).clamp(-6, 6)
    x = x[: x.numel() // 2 * 2].reshape(2, -1).to(dtype)
    theirs = cast_to_fp4(x.clone())
    assert torch.equal(fp4_round(x).to(dtype), theirs)
    packed = pack_fp4(fp4_encode(x))
    assert torch.equal(packed, pack_fp4_to_uint8(theirs))
    assert torch.equal(fp4_decode(unpack_fp4(packed)).to(torch.bfloat16), unpack_fp4_from_uint8(packed, *x.shape))


def test_decode_by_bit_arithmetic_is_the_table_code_for_code():
    """fp4_decode's int16 path (qtk.quant.fp4._decode_bits): every code's value and sign (-0.0 for code 8) as the
    lookup table gives them, in any shape and dtype asked for."""
    import torch

    from qtk.quant.fp4 import _decode_bits, e2m1_table, fp4_decode

    codes = torch.arange(16, dtype=torch.uint8)
    got, want = _decode_bits(codes), e2m1_table()
    assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    c = torch.randint(0, 16, (33, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    assert torch.equal(fp4_decode(c), want[c.long()]) and fp4_decode(c).shape == (33, 64)
    assert torch.equal(fp4_decode(c, torch.bfloat16), want.bfloat16()[c.long()])


def test_encode_by_binade_steps_is_the_threshold_definition():
    """fp4_encode (rounded steps per binade) gives the codes of the threshold definition (_MIDPOINTS) on every
    multiple of 1/16 in [-8, 8], both float neighbours of each (so every tie and the values either side of it),
    saturation, infinities, NaN (-> 0) and signed zeros, in float32 and bf16."""
    import math

    import torch

    from qtk.quant.fp4 import _fp4_encode_thresholds, fp4_encode

    grid = torch.arange(-128, 129, dtype=torch.float32) / 16
    up, down = torch.full_like(grid, math.inf), torch.full_like(grid, -math.inf)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e30, -1e30, -1e-30, 0.0, -0.0])
    vals = torch.cat([grid, torch.nextafter(grid, up), torch.nextafter(grid, down), special])
    assert torch.equal(fp4_encode(vals), _fp4_encode_thresholds(vals))
    assert fp4_encode(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.1])).tolist() == [0, 2, 2, 4, 4, 6, 6, 8]
    x = torch.randn(300, 256, generator=torch.Generator().manual_seed(0)) * 5
    assert torch.equal(fp4_encode(x), _fp4_encode_thresholds(x))
    assert torch.equal(fp4_encode(x.bfloat16()), _fp4_encode_thresholds(x.bfloat16()))
