"""The format registry: every scheme finds its spec, the specs' arithmetic is the one the quantizers always used, and a
format with qparams beyond scale and zero point (a global scale, as NVFP4 has) plugs in as one spec: QTensor carries
its extras and GPTQ solves with it."""

import pytest
import torch

from qtk.algorithms.gptq import gptq_quantize
from qtk.quant.formats import FORMATS, Format, QParams, format_for, register_format, unregister_format
from qtk.quant.formats.fp8 import FP8_DTYPE
from qtk.quant.formats.grouped import dequantize_grouped
from qtk.quant.fp4 import fp4_decode, fp4_encode
from qtk.quant.qtensor import QTensor
from qtk.recipe.params import GPTQParams
from qtk.quant.scheme import QuantScheme

W = torch.randn(24, 128, generator=torch.Generator().manual_seed(0))


def S(**kw):
    return QuantScheme(**{"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", **kw})

@pytest.mark.parametrize("scheme,name", [
    (S(), "int"), (S(num_bits=4, strategy="group", group_size=32, symmetric=False), "int"), (S(num_bits=2), "int"),
    (S(strategy="token", dynamic=True), "int"), (S(type="float"), "fp8-e4m3"), (S(type="float", strategy="tensor"), "fp8-e4m3"),
])
def test_every_scheme_finds_its_format(scheme, name):
    assert format_for(scheme).name == name

def test_a_scheme_no_format_takes_is_refused_naming_the_registered_ones():
    with pytest.raises(ValueError, match=r"no number format quantizes fp4 channel.*registered: int, fp8-e4m3"):
        format_for(S(type="float", num_bits=4))

@pytest.mark.parametrize("scheme,dtype", [(S(), torch.int8), (S(num_bits=4, strategy="group", group_size=32), torch.int8),
                                          (S(type="float"), FP8_DTYPE)])
def test_storage_and_scale_dtypes(scheme, dtype):
    f = format_for(scheme)
    qt = QTensor.quantize(W.to(torch.bfloat16), scheme)
    assert f.storage_dtype(scheme) == dtype == qt.values.dtype
    # scales are rounded to the model dtype (the scale on disk produced the values; fp8 too, as compressed-tensors)
    assert f.scale_dtype(scheme, torch.bfloat16) == torch.bfloat16
    assert torch.equal(qt.scale, qt.scale.to(torch.bfloat16).float())

@pytest.mark.parametrize("scheme", [S(), S(num_bits=4, symmetric=False), S(type="float")])
def test_gptq_column_quantizer_equals_the_grouped_quantizer(scheme):
    """GPTQ's per-column path (inlined in place for int) gives the same codes and dequantized values, bit for bit,
    as quantizing the column with the format's grouped quantizer."""
    f = format_for(scheme)
    qp = f.qparams(W, scheme, torch.float32)
    quantize_column = f.column_quantizer(scheme, qp)
    for j in (0, 5, 127):
        w, s = W[:, j].clone(), qp.scale[:, 0]
        z = None if qp.zero_point is None else qp.zero_point[:, 0]
        q, dq = quantize_column(w, s, z)
        ref = f.quantize_grouped(W[:, j], s, z, scheme)
        assert torch.equal(q.to(f.storage_dtype(scheme)).float(), ref.float())
        assert torch.equal(dq, dequantize_grouped(ref, s, z))
        assert torch.equal(f.dequantize_columns(q.reshape(1, -1), s.reshape(1, -1), None if z is None else z.reshape(1, -1)),
                           dq.reshape(1, -1))

@pytest.mark.parametrize("scheme", [S(), S(type="float"), S(strategy="tensor", type="float")])
def test_activation_fake_quant_is_the_formats(scheme):
    from qtk.quant.formats import fake_quant_activation, static_scale

    x = torch.randn(3, 7, 128)
    s = static_scale(x.abs().amax(), scheme)
    y = fake_quant_activation(x, scheme, s)
    qmax = 448.0 if scheme.is_fp8 else 127.0
    torch.testing.assert_close(s, (x.abs().amax() / qmax).reshape(1))
    grid = (x / s).clamp(-qmax, qmax)
    grid = grid.to(FP8_DTYPE).float() if scheme.is_fp8 else grid.round()
    assert torch.equal(y, grid * s)

class GlobalScaledFP4(Format):
    """A test format shaped like NVFP4: e2m1 codes, a per-row scale under one per-tensor global scale (an extra)."""

    name = "test-fp4-global"

    def accepts(self, scheme):
        return scheme.type == "float" and scheme.num_bits == 4 and scheme.strategy == "channel"

    def storage_dtype(self, scheme):
        return torch.uint8

    def has_zero_point(self, scheme):
        return False

    def scale_dtype(self, scheme, model_dtype):
        return None

    def qparams(self, w, scheme, model_dtype):
        gs = (w.abs().amax() / 6).clamp_min(1e-12).reshape(1).float()
        local = (w.abs().amax(1, keepdim=True) / 6 / gs).clamp_min(1e-6).to(torch.bfloat16).float()  # [out, 1]
        return QParams(local, None, {"global_scale": gs})

    def quantize(self, w, qp, scheme, model_dtype=None):
        return fp4_encode(w.float() / (qp.scale * qp.extra["global_scale"]))

    def dequantize(self, values, qp, scheme, g_idx=None):
        return fp4_decode(values) * (qp.scale * qp.extra["global_scale"])

    def column_quantizer(self, scheme, qp=None, model_dtype=None):
        gs = qp.extra["global_scale"]

        def quantize_column(w, s, z):
            code = fp4_encode(w / (s * gs))
            return code, fp4_decode(code) * (s * gs)

        return quantize_column

    def dequantize_columns(self, q, scale, zero, qp=None):
        return fp4_decode(q) * (scale * qp.extra["global_scale"])

@pytest.fixture
def toy_format():
    register_format(GlobalScaledFP4)
    yield format_for(S(type="float", num_bits=4))
    unregister_format(GlobalScaledFP4.name)
    assert all(f.name != GlobalScaledFP4.name for f in FORMATS)

def test_a_new_format_is_one_spec_with_its_extras_in_the_qtensor(toy_format):
    scheme = S(type="float", num_bits=4)
    qt = QTensor.quantize(W, scheme, torch.float32)
    assert qt.format is toy_format and qt.values.dtype == torch.uint8
    assert set(qt.extra) == {"global_scale"}
    torch.testing.assert_close(qt.extra["global_scale"], (W.abs().amax() / 6).reshape(1))
    err = (qt.dequantize() - W).abs()
    assert (err <= qt.scale * qt.extra["global_scale"] + 1e-6).all()  # at most a step of the coarsest e2m1 interval

    # GPTQ runs the same column loop on it and keeps the extras; on correlated inputs it beats round-to-nearest
    g = torch.Generator().manual_seed(1)
    X = torch.randn(512, 128, generator=g) @ torch.randn(128, 128, generator=g) * 0.3
    H = 2 * X.t() @ X / X.shape[0]
    gq, _ = gptq_quantize(W, H, scheme, GPTQParams(actorder=None))
    assert torch.equal(gq.extra["global_scale"], qt.extra["global_scale"])

    def out_err(q):
        return float(((X @ (q.dequantize() - W).t()) ** 2).mean())

    assert out_err(gq) < out_err(qt)

def test_registering_a_format_name_twice_is_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_format(type("Again", (GlobalScaledFP4,), {"name": "int"}))
