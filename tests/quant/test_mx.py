"""MXFP4 / MXFP8 (OCP MX v1.0): E8M0 encoding on known powers of two and its range, compressed-tensors'
scale rule at its rounding edge, and bit equality with its mxfp4-pack-quantized / mxfp8-quantized compressors."""

import math

import pytest
import torch

from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.formats.mx import (
    e8m0_decode,
    e8m0_encode,
    mx_fake_quant,
    mx_scales,
    mxfp4_dequantize,
    mxfp4_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
)


@pytest.mark.parametrize("scale, code", [(1.0, 127), (2.0, 128), (0.5, 126), (2.0**-127, 0), (2.0**127, 254),
                                          (2.0**-10, 117), (2.0**100, 227)])
def test_e8m0_known_powers_of_two(scale, code):
    assert e8m0_encode(torch.tensor([scale])).tolist() == [code]
    assert e8m0_decode(torch.tensor([code], dtype=torch.uint8)).tolist() == [scale]


def test_e8m0_range():
    codes = torch.arange(256, dtype=torch.uint8)
    s = e8m0_decode(codes)
    assert math.isnan(s[255].item())  # 255 is NaN in E8M0, never a scale
    assert torch.equal(e8m0_encode(s[:255]), codes[:255])  # 0..254 round-trip: 2^-127 .. 2^127
    assert e8m0_encode(torch.tensor([2.0**-140, 2.0**200, 0.0])).tolist() == [0, 254, 0]  # clamped into range
    x = torch.cat([torch.rand(10000) * 1000, torch.rand(1000) * 1e-38, torch.tensor([3.0, 0.75, 3e38, 2.0**-149])])
    want = (torch.floor(torch.log2(x)) + 127).clamp(0, 254).to(torch.uint8)  # the definition, on any positive float
    assert torch.equal(e8m0_encode(x), want) and torch.equal(e8m0_encode(x.bfloat16()), e8m0_encode(x.bfloat16().float()))
    with pytest.raises(ValueError, match="uint8"):
        e8m0_decode(torch.tensor([127]))


@pytest.mark.parametrize("amax, elem, code", [
    (6.0, "fp4", 127),  # 6 = 1.5·2² -> 2^(2-2)
    (1.7 * 8, "fp4", 127 + 3 - 2),  # mantissa < 1.75: floor(log2(amax)) - 2
    (1.75 * 8, "fp4", 127 + 4 - 2),  # mantissa >= 1.75 rounds amax up to the next power of two first
    (448.0, "fp8", 127 + 1),  # 448 = 1.75·2⁸ rounds up: 2^(9-8)
    (1.0, "fp8", 127 - 8),
    (0.0, "fp4", 0),  # an all-zero block: the smallest scale
])
def test_scale_rule(amax, elem, code):
    x = torch.zeros(1, 32)
    x[0, 5] = -amax
    assert mx_scales(x, elem).tolist() == [[code]]


@pytest.mark.parametrize("amax, ct, ocp, modelopt", [
    (6.0, 127, 127, 127),  # fits exactly: 2^0 under every rule
    (6.5, 127, 127, 128),  # 1.625·2²: floor rules saturate it to 6, ModelOpt's ceil never saturates
    (7.0, 128, 127, 128),  # 1.75·2²: compressed-tensors rounds it up first
    (1.7 * 8, 128, 128, 129),
])
def test_scale_rules(amax, ct, ocp, modelopt):
    x = torch.zeros(1, 32)
    x[0, 0] = amax
    got = [mx_scales(x, "fp4", rule).item() for rule in ("compressed-tensors", "ocp", "modelopt")]
    assert got == [ct, ocp, modelopt]


def test_layout_and_refusal():
    x = torch.randn(6, 96)
    assert mx_scales(x, "fp4").shape == (6, 3) and mx_scales(x, "fp4").dtype == torch.uint8
    assert pack_fp4(mxfp4_quantize(x, mx_scales(x, "fp4"))).shape == (6, 48)
    assert mxfp8_quantize(x, mx_scales(x, "fp8")).dtype == torch.float8_e4m3fn
    with pytest.raises(ValueError, match="32"):
        mx_scales(torch.ones(2, 48), "fp4")
    with pytest.raises(ValueError, match="fp4"):
        mx_scales(x, "fp6")
    with pytest.raises(ValueError, match="modelopt"):
        mx_scales(x, "fp4", rule="nearest")


def _weights(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.2
    w[0, :32] = 0
    w[1, :32] *= 1.75 * 2**-3 / w[1, :32].abs().max()  # exactly at the round-up edge
    w[2, :32] *= 1.74 * 2**-3 / w[2, :32].abs().max()  # just below it: saturates at 6
    return w.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(64, 128), (33, 96), (5, 32)])
@pytest.mark.parametrize("preset, elem", [("MXFP4", "fp4"), ("MXFP8", "fp8")])
def test_matches_compressed_tensors(preset, elem, shape, dtype):
    from compressed_tensors.compressors.mxfp4 import MXFP4PackedCompressor
    from compressed_tensors.compressors.mxfp8 import MXFP8QuantizationCompressor
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, compute_dynamic_scales_and_zp

    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = MXFP4PackedCompressor if elem == "fp4" else MXFP8QuantizationCompressor
    w = _weights(shape, dtype, seed=shape[0])
    blocks = w.reshape(shape[0], -1, 32)
    scale_ct, _ = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)  # float powers of two

    codes = mx_scales(w, elem)
    assert torch.equal(e8m0_decode(codes), scale_ct.float())
    sd = compressor.compress({"weight": w, "weight_scale": scale_ct}, scheme)
    assert sd["weight_scale"].dtype == torch.uint8 and torch.equal(sd["weight_scale"], codes)
    if elem == "fp4":
        q = mxfp4_quantize(w, codes)
        assert torch.equal(pack_fp4(q), sd["weight_packed"])
        decoded = compressor.decompress(sd, scheme)["weight"]
        assert torch.equal(decoded, mxfp4_dequantize(unpack_fp4(sd["weight_packed"]), codes, decoded.dtype))
    else:
        q = mxfp8_quantize(w, codes)
        assert torch.equal(sd["weight"].view(torch.uint8), q.view(torch.uint8))
        decoded = compressor.decompress(sd, scheme)["weight"]
        assert torch.equal(decoded, mxfp8_dequantize(sd["weight"], codes, decoded.dtype))

    x = (torch.randn(3, 4, shape[1], generator=torch.Generator().manual_seed(1)) * 3).to(dtype)
    act = scheme.input_activations
    s_act, _ = compute_dynamic_scales_and_zp(x, act, None)
    assert torch.equal(mx_fake_quant(x, elem), fake_quantize(x, s_act, None, act))
