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
