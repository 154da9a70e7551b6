"""FP8 block scaling: the scale grid of a ragged shape, per-token-group activations, and bit equality with
compressed-tensors' FP8_BLOCK preset (observer math, float-quantized compressor, activation fake-quant)."""

import pytest
import torch

from qtk.quant.formats.fp8_block import fp8_block_dequantize, fp8_block_quantize, fp8_block_scales, fp8_group_fake_quant


def test_ragged_layout():
    # [200, 300] -> a 2 x 3 grid; the last block row holds rows 128..199, the last block column columns 256..299
    w = torch.zeros(200, 300)
    w[130, 10] = 448.0 * 3  # block (1, 0)
    w[5, 299] = -448.0 * 5  # block (0, 2), in the ragged column
    w[199, 257] = 448.0 * 7  # block (1, 2), the ragged corner
    s = fp8_block_scales(w)
    assert s.shape == (2, 3) and s.dtype == torch.float32
    eps = torch.finfo(torch.float32).eps  # an all-zero block keeps a positive scale
    assert s.tolist() == [[eps, eps, 5.0], [3.0, eps, 7.0]]
    q = fp8_block_quantize(w, s)
    assert q.shape == (200, 300) and q.dtype == torch.float8_e4m3fn
    assert q[130, 10].item() == 448.0 and q[5, 299].item() == -448.0 and q[199, 257].item() == 448.0
    assert torch.equal(fp8_block_dequantize(q, s), w)


def test_scale_takes_the_storage_dtype():
    w = torch.randn(256, 128, dtype=torch.bfloat16)
    assert fp8_block_scales(w).dtype == torch.bfloat16  # compressed-tensors keeps the weight's dtype
    assert fp8_block_scales(w, scale_dtype=torch.float32).dtype == torch.float32  # Hugging Face's weight_scale_inv
    assert fp8_block_scales(w, block=(64, 32)).shape == (4, 4)


def test_round_trip_error_is_bounded():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(300, 260, generator=g) * 0.05
    s = fp8_block_scales(w)
    deq = fp8_block_dequantize(fp8_block_quantize(w, s), s)
    assert ((deq - w).abs() <= w.abs() * 2**-4 + s.max() * 2**-9).all()  # e4m3: 3 mantissa bits, subnormals 2^-9
    assert torch.equal(fp8_block_dequantize(fp8_block_quantize(deq, s), s), deq)


def test_group_fake_quant_per_token_and_per_group():
    x = torch.zeros(2, 256)
    x[0, :128] = torch.linspace(-1, 1, 128) * 448 * 2  # group amax 896: scale 2
    x[1] = 3.0
    y = fp8_group_fake_quant(x)
    assert torch.equal(y[0, :128], x[0, :128].div(2).to(torch.float8_e4m3fn).float().mul(2))
    assert torch.equal(y[0, 128:], x[0, 128:])  # all-zero group stays zero
    assert torch.equal(y[1], x[1])  # 3 is representable: scale 3/448, q = 448
    assert torch.equal(fp8_group_fake_quant(torch.ones(2, 200), None), torch.ones(2, 200))


def test_group_fake_quant_partial_last_group():
    """200 channels: a group of 128 and a partial one of 72, each scaled by its own amax (vLLM's native QuantFP8 pads
    with zeros, which cannot raise an amax); the same as quantizing the two slices apart."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    x[:, 10] = 100.0  # only the first group sees it: the partial group keeps its own, finer scale
    y = fp8_group_fake_quant(x)
    assert y.shape == x.shape
    assert torch.equal(y[:, :128], fp8_group_fake_quant(x[:, :128].contiguous(), None))
    assert torch.equal(y[:, 128:], fp8_group_fake_quant(x[:, 128:].contiguous(), None))
    assert not torch.equal(y[:, 128:], fp8_group_fake_quant(x, None)[:, 128:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(256, 384), (192, 256), (200, 300), (64, 100)])
def test_matches_compressed_tensors(shape, dtype):
    """Scales, fp8 values (ragged edges included) and decompressed weights equal compressed-tensors' FP8_BLOCK;
    in bf16 that needs the division in bf16, as compressed-tensors does it (3 % of codes differ otherwise)."""
    from compressed_tensors.compressors.naive_quantized import FloatQuantizationCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme("FP8_BLOCK", ["Linear"])
    g = torch.Generator().manual_seed(shape[1])
    w = (torch.randn(shape, generator=g) * torch.rand(shape[0], 1, generator=g) * 0.2).to(dtype)
    w[:128, :64] = 0
    R, C = -(-shape[0] // 128), -(-shape[1] // 128)
    blocks = torch.nn.functional.pad(w, (0, C * 128 - shape[1], 0, R * 128 - shape[0])).reshape(R, 128, C, 128)
    scale_ct, _ = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), scheme.weights)

    s = fp8_block_scales(w)
    assert s.dtype == scale_ct.dtype and torch.equal(s, scale_ct)
    sd = FloatQuantizationCompressor.compress({"weight": w, "weight_scale": scale_ct}, scheme)
    q = fp8_block_quantize(w, s)
    assert sd["weight"].shape == shape and torch.equal(sd["weight"].view(torch.uint8), q.view(torch.uint8))
    decoded = FloatQuantizationCompressor.decompress(sd, scheme)["weight"]
    assert decoded.dtype == dtype and torch.equal(decoded, fp8_block_dequantize(q, s))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset, group", [("FP8_BLOCK", 128), ("W4AFP8", None)])
def test_activations_match_compressed_tensors(preset, group, dtype):
    """Per token per group of 128 (FP8_BLOCK) and per token (W4AFP8's FP8 activations), as compressed-tensors
    simulates them on a [batch, tokens, hidden] input."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    act = preset_name_to_scheme(preset, ["Linear"]).input_activations
    x = (torch.randn(2, 5, 384, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    x[0, 0, :128] = 0
    s, _ = compute_dynamic_scales_and_zp(x, act, None)
    assert torch.equal(fp8_group_fake_quant(x, group), fake_quantize(x, s, None, act))


@pytest.mark.parametrize("shape", [(576, 192), (192, 200), (1536, 576)])
def test_ragged_codes_equal_compressed_tensors_forward(shape):
    """On ragged bf16 weights qtk's codes equal compressed-tensors' own block quantization (lifecycle.forward.quantize:
    pad, quantize per block, crop) and its fake-quant, with scales from its calculate_qparams over the padded blocks."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize, quantize
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    args = preset_name_to_scheme("FP8_BLOCK", ["Linear"]).weights
    g = torch.Generator().manual_seed(shape[0])
    w = (torch.randn(shape, generator=g) * 0.05).to(torch.bfloat16)
    w[-1, -1] = 3.0  # the ragged corner block's amax comes from its real elements only
    R, C = -(-shape[0] // 128), -(-shape[1] // 128)
    blocks = torch.nn.functional.pad(w, (0, C * 128 - shape[1], 0, R * 128 - shape[0])).reshape(R, 128, C, 128)
    scale_ct, zp = calculate_qparams(blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3)), args)
    s = fp8_block_scales(w)
    assert s.shape == (R, C) and torch.equal(s, scale_ct)
    assert s[-1, -1].item() == torch.tensor(3.0 / 448, dtype=torch.bfloat16).item()
    q_ct = quantize(w, scale_ct, zp, args, dtype=torch.float8_e4m3fn)
    q = fp8_block_quantize(w, s)
    assert q_ct.shape == shape and torch.equal(q_ct.view(torch.uint8), q.view(torch.uint8))
    assert torch.equal(fake_quantize(w, scale_ct, zp, args), fp8_block_dequantize(q, s, dtype=torch.bfloat16))
