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


def test_symmetric_scale_is_amax_over_qmax_and_no_zero_point():
    qt = QTensor.quantize(W, S(), torch.float32)
    assert qt.zero_point is None
    torch.testing.assert_close(qt.scale.squeeze(1), W.abs().amax(1) / 127)
    assert (qt.values.abs().amax(1) == 127).all()  # the largest magnitude maps to ±qmax exactly


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
