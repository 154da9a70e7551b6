"""Each format's encode/decode pair (qtk/export/codecs/) round trips: decode(encode(qt)) gives back the QTensor the
writer was handed, exactly (values, zero points, g_idx) and with scales as the format stores them (model dtype,
float32, or float16 for the legacy formats). Writers write what encode returns and readers decode what they read,
so a layout that changes on one side only fails here."""

import pytest
import torch

from qtk.export.codecs import awq, ct, gptq, modelopt, trtllm
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme
from qtk.recipe.rules import ModuleScheme

BF16 = torch.bfloat16
SHAPES = [(64, 256), (24, 128), (8, 384)]  # output rows: multiples of 8 for the legacy packers; odd group counts


def _qt(shape, scheme, seed=0, dtype=BF16, g_idx=False):
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05
    qt = QTensor.quantize(w, scheme, dtype)
    if g_idx:  # act-order: the groups of a permutation of the columns, as GPTQ's actorder group stores them
        perm = torch.randperm(shape[1], generator=torch.Generator().manual_seed(seed + 1))
        qt = QTensor(qt.values, qt.scale, scheme, qt.zero_point, (perm // scheme.group_size).to(torch.int32), dtype)
    return qt


def _same(a: QTensor, b: QTensor, scale_dtype=None):
    assert torch.equal(a.values.view(torch.uint8) if a.values.is_floating_point() else a.values.to(torch.int16),
                       b.values.view(torch.uint8) if b.values.is_floating_point() else b.values.to(torch.int16))
    want = a.scale.float() if scale_dtype is None else a.scale.to(scale_dtype).float()
    assert torch.equal(b.scale.reshape(want.shape), want)
    if a.zero_point is None:
        assert b.zero_point is None or not b.zero_point.any()
    else:
        assert torch.equal(b.zero_point.reshape(a.zero_point.shape), a.zero_point.float())
    assert torch.equal(gptq.g_idx_of(a), gptq.g_idx_of(b))  # the groups of the columns, however stored
    assert b.scheme == a.scheme


INT = [QuantScheme(b, "int", sym, strategy, gs) for b in (4, 8) for sym in (True, False)
       for strategy, gs in (("channel", None), ("group", 64), ("group", 128))]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", INT, ids=lambda s: s.describe().replace(" ", "-"))
def test_compressed_tensors_pack_quantized(shape, scheme):
    if shape[1] % (scheme.group_size or 1):
        pytest.skip("group size does not divide in_features")
    qt = _qt(shape, scheme)
    fmt = ct.ct_format(ModuleScheme(scheme))
    assert fmt == "pack-quantized"
    _same(qt, ct.decode(ct.encode(qt, BF16, fmt), scheme, BF16), BF16)


@pytest.mark.parametrize("scheme,act", [
    (QuantScheme(8, "int", True, "channel"), QuantScheme(8, "int", True, "token", dynamic=True)),
    (QuantScheme(8, "float", True, "tensor"), QuantScheme(8, "float", True, "tensor")),
    (QuantScheme(8, "float", True, "channel"), QuantScheme(8, "float", True, "token", dynamic=True)),
])
def test_compressed_tensors_int_and_float_quantized(scheme, act):
    qt = _qt((48, 128), scheme)
    fmt = ct.ct_format(ModuleScheme(scheme, act))
    assert fmt == ("float-quantized" if scheme.is_fp8 else "int-quantized")
    _same(qt, ct.decode(ct.encode(qt, BF16, fmt), scheme, BF16), torch.float32 if scheme.is_fp8 else BF16)


def _fp16(scale):
    return scale.to(torch.float16)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("scheme", INT, ids=lambda s: s.describe().replace(" ", "-"))
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq(shape, scheme, act_order):
    if shape[1] % (scheme.group_size or 1) or (act_order and (scheme.strategy != "group" or shape[1] == scheme.group_size)):
        pytest.skip("group size does not divide in_features / act-order needs several groups")
    qt = _qt(shape, scheme, g_idx=act_order)
    v1 = not gptq.needs_v2(qt)
    t = gptq.encode(qt, v1, _fp16)
    _same(qt, gptq.decode(t, scheme, v1), torch.float16)
    assert gptq.acts_in_order(qt) is not act_order


def test_gptq_v1_qzeros_rewritten_as_v2_decode_the_same():
    scheme = QuantScheme(4, "int", False, "group", 64)
    qt = _qt((32, 128), scheme)
    t = gptq.encode(qt, True, _fp16)
    t2 = dict(t, qzeros=gptq.rewrite_v1_qzeros(t["qzeros"], 4))
    _same(gptq.decode(t, scheme, True), gptq.decode(t2, scheme, False))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("group", [64, 128])
def test_awq(shape, sym, group):
    if shape[1] % group:
        pytest.skip("group size does not divide in_features")
    scheme = QuantScheme(4, "int", sym, "group", group)
    qt = _qt(shape, scheme)
    _same(qt, awq.decode(awq.encode(qt, _fp16), scheme), torch.float16)


def _stored(parts: dict) -> dict:
    return {k: p.pack(p.tensor) if p.pack else p.tensor for k, p in parts.items()}


@pytest.mark.parametrize("algo,scheme", [
    ("FP8", QuantScheme(8, "float", True, "tensor")),
    ("FP8_PER_CHANNEL_PER_TOKEN", QuantScheme(8, "float", True, "channel")),
    ("W8A8_SQ_PER_CHANNEL", QuantScheme(8, "int", True, "channel")),
    ("W8A8_SQ_PER_CHANNEL_PER_TOKEN_PLUGIN", QuantScheme(8, "int", True, "channel")),
    ("W4A16_AWQ", QuantScheme(4, "int", True, "group", 64)),
    ("W4A8_AWQ", QuantScheme(4, "int", True, "group", 128)),
])
@pytest.mark.parametrize("row", [False, True])
def test_trtllm(algo, scheme, row):
    qt = _qt((64, 128), scheme)
    stored = _stored(trtllm.encode(algo, qt, 3.0, BF16, row))
    _same(qt, trtllm.decode(algo, stored, scheme, BF16), torch.float32)
    want = trtllm.layout(algo, 64, 128, scheme.group_size, BF16)
    for key, (dtypes, shape) in want.items():  # what the reader checks is what the writer stores
        assert stored[key].dtype in dtypes and (list(stored[key].shape) == shape or stored[key].numel() == 1 == len(shape) * shape[0])
        assert trtllm.axes(key, list(stored[key].shape))  # every stored key has sharding axes


@pytest.mark.parametrize("algo,bits", [("W8A16", 8), ("W4A16", 4)])
def test_trtllm_plain_weights_are_what_the_build_requantizes(algo, bits):
    scheme = QuantScheme(bits, "int", True, "channel")
    qt = _qt((64, 128), scheme)
    stored = _stored(trtllm.encode(algo, qt, None, BF16, False))
    assert torch.equal(stored["weight"], qt.dequantize().to(BF16))
    back = trtllm.decode(algo, stored, scheme, BF16)
    assert torch.equal(back.values, trtllm.trtllm_build_weight_only(stored["weight"], scheme, BF16).values)


@pytest.mark.parametrize("algo,scheme", [("FP8", QuantScheme(8, "float", True, "tensor")),
                                         ("W4A16_AWQ", QuantScheme(4, "int", True, "group", 128)),
                                         ("W4A8_AWQ", QuantScheme(4, "int", True, "group", 128))])
@pytest.mark.parametrize("prequant", [False, True])
def test_modelopt(algo, scheme, prequant):
    qt = _qt((64, 256), scheme)
    stored = modelopt.encode(algo, qt, 2.5, prequant, BF16)
    assert ("pre_quant_scale" in stored) == (prequant and algo != "FP8")
    _same(qt, modelopt.decode(algo, stored, scheme, BF16), torch.float32)
    if algo == "W4A8_AWQ":  # ModelOpt's conventions: input amax / 448, the weight's max |q·s| / 448, 0-dim float32
        assert stored["input_scale"].shape == stored["weight_scale_2"].shape == ()
        assert float(stored["input_scale"]) == pytest.approx(2.5 / 448)
        assert float(stored["weight_scale_2"]) * 448 == pytest.approx(float(qt.dequantize().abs().max()), rel=1e-6)


def test_trtllm_w4a8_awq_scales():
    """weights_scaling_factor_2 = max |q·s| / 448 (of the fused module when given), activation_scaling_factor =
    input amax / 448: TensorRT-LLM divides the group scales by the first, so every q·s/scale_2 lies in FP8's range."""
    scheme = QuantScheme(4, "int", True, "group", 128)
    qt = _qt((64, 256), scheme)
    stored = _stored(trtllm.encode("W4A8_AWQ", qt, 3.0, BF16, False))
    assert float(stored["activation_scaling_factor"]) == pytest.approx(3.0 / 448)
    s2 = float(stored["weights_scaling_factor_2"])
    assert s2 * 448 == pytest.approx(float(qt.dequantize().abs().max()), rel=1e-6)
    assert float(_stored(trtllm.encode("W4A8_AWQ", qt, 3.0, BF16, False, weight_amax=1.0))["weights_scaling_factor_2"]) == pytest.approx(1 / 448)


def test_trtllm_decoder_refuses_smoothing_left_outside_the_weights():
    from qtk.errors import UsageError

    scheme = QuantScheme(4, "int", True, "group", 64)
    stored = _stored(trtllm.encode("W4A16_AWQ", _qt((16, 64), scheme), None, BF16, False))
    stored["prequant_scaling_factor"] = stored["prequant_scaling_factor"] * 2
    with pytest.raises(UsageError, match="prequant_scaling_factor is not all ones"):
        trtllm.decode("W4A16_AWQ", stored, scheme, BF16, where="m")
