"""Observers and quantizers: scale conventions, error bounds, and the engines' activation quantization."""

import pytest
import torch

from qtk.quant.qparams import FP8_DTYPE, fake_quant_activation, static_scale
from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme


def S(**kw):
    base = dict(num_bits=8, type="int", symmetric=True, strategy="channel")
    base.update(kw)
    return QuantScheme(**base)


W = torch.randn(24, 256, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("scheme", [
    S(), S(num_bits=4, strategy="group", group_size=64), S(num_bits=4, strategy="group", group_size=32, symmetric=False),
    S(strategy="tensor"), S(num_bits=2, strategy="group", group_size=128, symmetric=False), S(num_bits=4, strategy="channel"),
])
def test_int_round_trip_error_is_at_most_half_a_step(scheme):
    qt = QTensor.quantize(W, scheme, torch.float32)
    assert qt.values.dtype == torch.int8
    assert int(qt.values.min()) >= scheme.qmin and int(qt.values.max()) <= scheme.qmax
    err = (qt.dequantize() - W).abs()
    if scheme.strategy == "group":
        step = qt.scale.repeat_interleave(scheme.group_size, dim=1)
    else:
        step = qt.scale.expand_as(W) if qt.scale.numel() > 1 else qt.scale.expand(W.shape)
    assert (err <= step / 2 + 1e-6).all()


def test_symmetric_scale_uses_the_full_grid_and_no_zero_point():
    """amax/127.5 and codes -128..127 (amax/7.5 and -8..7 at int4), as compressed-tensors computes them."""
    qt = QTensor.quantize(W, S(), torch.float32)
    assert qt.zero_point is None
    torch.testing.assert_close(qt.scale.squeeze(1), W.abs().amax(1) / 127.5)
    # the largest magnitude lands on an end of the grid: -128 when it is negative, 127 (half a step short) when positive
    ends = torch.where(W.gather(1, W.abs().argmax(1, keepdim=True)).squeeze(1) < 0, -128, 127).to(torch.int8)
    assert torch.equal(qt.values.gather(1, W.abs().argmax(1, keepdim=True)).squeeze(1), ends)
    q4 = QTensor.quantize(W, S(num_bits=4, strategy="group", group_size=32), torch.float32)
    assert int(q4.values.min()) == -8 and int(q4.values.max()) == 7


@pytest.mark.parametrize("scheme", [
    S(), S(strategy="tensor"), S(num_bits=4, strategy="group", group_size=32), S(num_bits=4, strategy="channel"),
    S(num_bits=4, strategy="group", group_size=64, symmetric=False), S(symmetric=False),
])
def test_scales_and_codes_equal_compressed_tensors(scheme):
    """compressed-tensors' own calculate_qparams and quantize (what llm-compressor runs) give qtk's scales and codes."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    w = W * torch.linspace(0.5, 2, W.shape[1])  # groups of different ranges
    args = QuantizationArgs(**{k: v for k, v in scheme.to_ct_args().items() if k not in ("observer", "observer_kwargs")})
    g = scheme.group_size or (w.shape[1] if scheme.strategy == "channel" else w.numel())
    wg = w.reshape(-1, g) if scheme.strategy != "tensor" else w.reshape(1, -1)
    scale, zp = calculate_qparams(wg.amin(1), wg.amax(1), args)
    shape = (w.shape[0], -1) if scheme.strategy != "tensor" else (1,)
    scale, zp = scale.reshape(shape), zp.reshape(shape)
    ref = quantize(w, scale, zp, args, dtype=torch.int8)
    qt = QTensor.quantize(w, scheme, torch.float32)
    assert torch.equal(qt.scale.reshape(shape), scale)
    assert torch.equal(qt.values, ref)
    if not scheme.symmetric:
        assert torch.equal(qt.zero_point.reshape(shape), zp.float())


def test_int_scales_are_rounded_to_the_model_dtype_before_quantizing():
    qt = QTensor.quantize(W.bfloat16(), S(num_bits=4, strategy="group", group_size=128), torch.bfloat16)
    assert torch.equal(qt.scale, qt.scale.bfloat16().float())


def test_fp8_tensor_scale_and_cast():
    qt = QTensor.quantize(W, S(type="float", strategy="tensor"), torch.bfloat16)
    assert qt.values.dtype == FP8_DTYPE and qt.scale.shape == (1,)
    torch.testing.assert_close(qt.scale, W.abs().max().reshape(1) / 448)
    rel = (qt.dequantize() - W).norm() / W.norm()
    assert 0 < rel < 0.05


def test_mse_observer_never_worse_than_minmax():
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    w[:, 0] *= 12  # an outlier column makes clipping worthwhile
    for sch in (S(num_bits=4, strategy="group", group_size=32), S(num_bits=4, strategy="channel", symmetric=False)):
        a = QTensor.quantize(w, sch, torch.float32)
        b = QTensor.quantize(w, QuantScheme(**{**sch.__dict__, "observer": "mse"}), torch.float32)
        ea = (a.dequantize() - w).abs().pow(2.4).sum()
        eb = (b.dequantize() - w).abs().pow(2.4).sum()
        assert eb <= ea


def test_zero_rows_give_finite_positive_scales():
    w = W.clone()
    w[3] = 0
    qt = QTensor.quantize(w, S(num_bits=4, strategy="group", group_size=64, symmetric=False), torch.float32)
    assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
    assert (qt.dequantize()[3] == 0).all()


def test_per_token_dynamic_int8_matches_the_engine_formula():
    x = torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(1))
    y = fake_quant_activation(x, S(strategy="token", dynamic=True))
    s = x.abs().amax(-1, keepdim=True) / 127  # vLLM's per-token dynamic scale
    torch.testing.assert_close(y, torch.round(x / s).clamp(-128, 127) * s)
    assert not torch.equal(x, y)


def test_static_fp8_activation_uses_the_calibrated_scale():
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(2))
    sch = S(type="float", strategy="tensor")
    scale = static_scale(x.abs().max(), sch)
    y = fake_quant_activation(x, sch, scale)
    ref = (x / scale).clamp(-448, 448).to(FP8_DTYPE).float() * scale
    torch.testing.assert_close(y, ref)
    # a too-small scale saturates at ±448 * scale
    y2 = fake_quant_activation(x, sch, scale / 4)
    assert y2.abs().max() <= 448 * scale / 4 + 1e-6
