"""float8_e4m3fn decoded by bit arithmetic (qtk/quant/e4m3.py) is torch's cast, code for code."""

import torch

from qtk.quant.e4m3 import E4M3, _bits_to_float, to_float32


def test_every_code_decodes_as_torch_casts_it():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3)
    finite = (torch.arange(256) & 0x7F) != 0x7F
    assert torch.equal(_bits_to_float(codes)[finite], codes.float()[finite])  # subnormals, ±0 and ±448 included
    assert torch.equal(to_float32(codes[finite]), codes[finite].float())
    out = to_float32(codes)  # the NaN codes: torch's cast, NaN where it is NaN
    assert torch.isnan(out).sum() == 2 and torch.equal(out[finite], codes.float()[finite])


def test_a_weight_and_its_strided_views():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, 512, generator=g) * 50).clamp(-448, 448).to(E4M3)
    assert torch.equal(to_float32(w), w.float())
    assert torch.equal(to_float32(w[:, 3:200]), w[:, 3:200].float())  # not contiguous
    assert to_float32(w).shape == w.shape and to_float32(torch.empty(0, 4, dtype=E4M3)).shape == (0, 4)
    x = torch.randn(4, 4)
    assert to_float32(x) is x and torch.equal(to_float32(x.bfloat16()), x.bfloat16().float())


def test_a_nan_code_anywhere_in_a_large_weight_decodes_to_nan():
    """The NaN codes decode by bit arithmetic to +-480, past the largest finite 448: the result's min/max sends the
    tensor to torch's cast, which keeps them NaN (a weight-sized temporary is no longer scanned for them)."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(256, 1024, generator=g) * 50).clamp(-448, 448).to(E4M3)
    for code, where in ((0x7F, (3, 17)), (0xFF, (255, 1023))):
        v = w.clone()
        v.view(torch.uint8)[where] = code
        out = to_float32(v)
        assert torch.isnan(out[where]) and int(torch.isnan(out).sum()) == 1
        keep = ~torch.isnan(out)
        assert torch.equal(out[keep], v.float()[keep])
    assert float(to_float32(torch.tensor([0x7E, 0xFE], dtype=torch.uint8).view(E4M3)).abs().max()) == 448.0
