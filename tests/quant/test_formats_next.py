"""The issue-14 format specs (NVFP4, MXFP4/MXFP8, FP8 block) in the registry: each equals the bit-exact primitives
(which equal compressed-tensors: tests/quant/test_{nvfp4,mx,fp8_block}.py), RTN shares NVFP4's global scale across a
fused group, and GPTQ runs every new weight format through the spec (no special case) and beats RTN on its loss."""

import pytest
import torch

from qtk.algorithms.gptq import gptq_quantize, gptq_quantize_shared
from qtk.model.arch import FAMILIES
from qtk.quant.formats import fake_quant_activation, format_for, static_scale
from qtk.quant.formats.fp8_block import fp8_block_quantize, fp8_block_scales, fp8_group_fake_quant
from qtk.quant.formats.mx import e8m0_decode, mx_scales, mxfp4_quantize, mxfp8_quantize
from qtk.quant.formats.nvfp4 import (nvfp4_fake_quant, nvfp4_global_scale, nvfp4_group_scales, nvfp4_quantize,
                             nvfp4_weight_global_scale)
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme
from qtk.recipe.params import GPTQParams
from qtk.steps.rtn import rtn_weights

NVFP4 = QuantScheme(4, "float", strategy="tensor_group", group_size=16)
NVFP4_ACT = QuantScheme(4, "float", strategy="tensor_group", group_size=16, dynamic="local")
MXFP4 = QuantScheme(4, "float", strategy="group", group_size=32, scale_dtype="e8m0")
MXFP8 = QuantScheme(8, "float", strategy="group", group_size=32, scale_dtype="e8m0")
FP8_BLOCK = QuantScheme(8, "float", strategy="block", block_structure=(128, 128))
FP8_GROUP_ACT = QuantScheme(8, "float", strategy="group", group_size=128, dynamic=True)


def _w(out=256, inp=384, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=g) * 0.02).to(torch.bfloat16)


def test_registry_resolves_each_new_scheme():
    assert [format_for(s).name for s in (NVFP4, NVFP4_ACT, MXFP4, MXFP8, FP8_BLOCK, FP8_GROUP_ACT)] == [
        "nvfp4", "nvfp4", "mx", "mx", "fp8-block", "fp8-block"]


def test_nvfp4_spec_equals_primitives():
    w = _w()
    qt = QTensor.quantize(w.float(), NVFP4, torch.bfloat16)  # fp32 master of bf16 weights, as the solvers pass them
    gs = nvfp4_global_scale(w.abs().amax())
    s = nvfp4_group_scales(w, gs)
    assert torch.equal(qt.extra["global_scale"], gs)
    assert torch.equal(qt.scale, s.float()) and qt.scale.shape == (256, 384 // 16)
    assert torch.equal(qt.values, nvfp4_quantize(w, s, gs)) and qt.values.dtype == torch.uint8
    assert torch.equal(qt.dequantize(), qt.format.dequantize(qt.values, qt.qparams, NVFP4))


def test_mx_and_fp8_block_specs_equal_primitives():
    w = _w()
    q4 = QTensor.quantize(w.float(), MXFP4, torch.bfloat16)
    codes = mx_scales(w, "fp4")
    assert torch.equal(q4.scale, e8m0_decode(codes)) and torch.equal(q4.values, mxfp4_quantize(w, codes))
    q8 = QTensor.quantize(w.float(), MXFP8, torch.bfloat16)
    codes8 = mx_scales(w, "fp8")
    assert torch.equal(q8.scale, e8m0_decode(codes8))
    assert torch.equal(q8.values.view(torch.uint8), mxfp8_quantize(w, codes8).view(torch.uint8))
    wr = _w(192, 384)  # ragged rows: 1.5 blocks
    qb = QTensor.quantize(wr.float(), FP8_BLOCK, torch.bfloat16)
    sb = fp8_block_scales(wr)
    assert qb.scale.shape == (2, 3) and torch.equal(qb.scale, sb.float())
    # the division in bf16, as compressed-tensors divides the bf16 weight (tests/quant/test_ct_rounding.py)
    assert torch.equal(qb.values.view(torch.uint8), fp8_block_quantize(wr, sb).view(torch.uint8))


def test_new_activation_formats():
    x = torch.randn(3, 5, 256) * 3
    gs = static_scale(7.5, NVFP4_ACT)
    assert torch.equal(gs, nvfp4_global_scale(torch.tensor(7.5)))
    assert torch.equal(fake_quant_activation(x, NVFP4_ACT, gs), nvfp4_fake_quant(x, gs))
    assert torch.equal(fake_quant_activation(x, FP8_GROUP_ACT), fp8_group_fake_quant(x, 128))
    with pytest.raises(ValueError, match="global input scale"):
        fake_quant_activation(x, NVFP4_ACT)


def test_rtn_shares_the_nvfp4_global_scale_in_fused_groups():
    arch = FAMILIES["llama"].arch
    ws = {"self_attn.q_proj": _w(256, 384, 1), "self_attn.k_proj": _w(128, 384, 2) * 4, "self_attn.v_proj": _w(128, 384, 3),
          "self_attn.o_proj": _w(384, 256, 4)}
    out = rtn_weights({k: v.float() for k, v in ws.items()}, {k: NVFP4 for k in ws}, arch, torch.bfloat16)
    joint = nvfp4_weight_global_scale(*(ws[f"self_attn.{p}_proj"] for p in "qkv"))
    for p in "qkv":
        assert torch.equal(out[f"self_attn.{p}_proj"].extra["global_scale"], joint)
        assert torch.equal(out[f"self_attn.{p}_proj"].scale, nvfp4_group_scales(ws[f"self_attn.{p}_proj"], joint).float())
    assert torch.equal(out["self_attn.o_proj"].extra["global_scale"], nvfp4_global_scale(ws["self_attn.o_proj"].abs().amax()))
    assert not torch.equal(out["self_attn.q_proj"].extra["global_scale"], nvfp4_global_scale(ws["self_attn.q_proj"].abs().amax()))


def _hessian(inp=384, n=2048, seed=5):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, inp, generator=g) * (torch.rand(inp, generator=g) * 3 + 0.1)
    return 2 * x.t() @ x / n


@pytest.mark.parametrize("scheme", [NVFP4, MXFP4, MXFP8], ids=["nvfp4", "mxfp4", "mxfp8"])
@pytest.mark.parametrize("actorder", [None, "static"])
def test_gptq_runs_through_the_spec_and_beats_rtn(scheme, actorder):
    w, H = _w().float(), _hessian()
    qt, info = gptq_quantize(w, H, scheme, GPTQParams(actorder=actorder), torch.bfloat16)
    assert qt.scheme == scheme and qt.values.dtype == format_for(scheme).storage_dtype(scheme)
    assert torch.equal(info["dequantized"], qt.dequantize())  # the loop's values are what the format decodes
    # the chosen values lie on the format's grid: quantizing the decoded weight with the same scales reproduces it
    fmt = format_for(scheme)
    assert torch.equal(fmt.dequantize(fmt.quantize(qt.dequantize(), qt.qparams, scheme), qt.qparams, scheme), qt.dequantize())
    rtn = QTensor.quantize(w, scheme, torch.bfloat16).dequantize()
    dW = w - rtn
    rtn_loss = float(((dW @ H) * dW).sum()) / 2
    assert info["loss"] < 0.95 * rtn_loss, (info["loss"], rtn_loss)


def test_gptq_nvfp4_fused_group_shares_the_global_scale():
    ws = [_w(256, 384, 1), _w(128, 384, 2) * 3, _w(128, 384, 3)]
    solved = gptq_quantize_shared([w.float() for w in ws], _hessian(), NVFP4, GPTQParams(), torch.bfloat16)
    joint = nvfp4_weight_global_scale(*ws)
    for (qt, _), w in zip(solved, ws):
        assert torch.equal(qt.extra["global_scale"], joint) and qt.shape == tuple(w.shape)


def test_gptq_refuses_fp8_blocks():
    from qtk.errors import UsageError

    with pytest.raises(UsageError, match="round-to-nearest"):
        gptq_quantize(_w().float(), _hessian(), FP8_BLOCK, GPTQParams(), torch.bfloat16)


@pytest.mark.parametrize("scheme", [NVFP4, MXFP4], ids=["nvfp4", "mxfp4"])
def test_awq_searches_through_the_spec(scheme):
    """AWQ's scale and clip searches quantize through the format spec: clips per FP4 group, no worse than no clip."""
    from qtk.algorithms.awq import apply_clip, awq_search_clip
    from qtk.recipe.params import AWQParams

    g = torch.Generator().manual_seed(3)
    w = (torch.randn(64, 256, generator=g) * 0.02)
    x = torch.randn(512, 256, generator=g) * (torch.rand(256, generator=g) * 3 + 0.1)
    mv = awq_search_clip(x, w, scheme, AWQParams())
    assert mv.shape == (64, 256 // scheme.group_size)
    assert bool((mv <= w.reshape(64, -1, scheme.group_size).abs().amax(-1) + 1e-12).all())

    def out_err(W):
        q = QTensor.quantize(W, scheme, torch.float32).dequantize()
        return float(((x @ (q - w).t()) ** 2).mean())

    assert out_err(apply_clip(w, mv)) <= out_err(w) * 1.001
