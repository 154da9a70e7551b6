"""qtk's format primitives against NVIDIA ModelOpt 0.47's exports of the same model (unified HF checkpoint and
TensorRT-LLM checkpoint), recorded by tests/trtllm/make_modelopt_reference.py --next.

ModelOpt computes in float32 throughout and has rules of its own (NVFP4 scale_2 = amax/2688, MX scales
2^ceil(log2(amax/max)), MXFP4 ties rounded down, int4 AWQ on a -7..7 grid). Layouts are checked for every
quantized tensor; values for layer 0's v_proj (HF) and fused qkv (TensorRT-LLM), where qtk must reproduce
ModelOpt's bytes from ModelOpt's own scales and decode them.
"""

import json

import pytest
import torch
from reference_model import HERE, SAMPLE_LINEAR, SPEC, calibration_ids, decode_sample, weights

from qtk.export.codecs.trtllm import pack_int4_pairs, unpack_int4_pairs
from qtk.quant.fp4 import FP4_MAX, e2m1_table, fp4_decode, pack_fp4, unpack_fp4
from qtk.quant.formats.fp8_block import fp8_block_quantize, fp8_block_scales
from qtk.quant.formats.mx import e8m0_decode, mx_scales, mxfp4_dequantize, mxfp4_quantize, mxfp8_quantize
from qtk.quant.formats.nvfp4 import FP8_E4M3_MAX, nvfp4_group_scales, nvfp4_quantize, nvfp4_weight_global_scale

REF = json.loads((HERE / "modelopt_reference.json").read_text())
L0 = "model.layers.0.self_attn."
QKV = "transformer.layers.0.attention.qkv."


@pytest.fixture(scope="module")
def W():
    return weights(REF["model"])


def _s(case: str, name: str) -> torch.Tensor:
    return decode_sample(REF["cases"][case]["sample"][name])


def _v(W):
    return W[SAMPLE_LINEAR + ".weight"]


def _qkv(W):
    return torch.cat([W[f"{L0}{p}_proj.weight"] for p in "qkv"])


def test_recorded_on_the_reference_model():
    assert REF["model"] == SPEC and REF["versions"]["modelopt"] == "0.47.0"
    assert REF["cases"]["trtllm/fp8-block-wo/tp1"]["error"].startswith("AssertionError: Mismatch in expected scale shape")


@pytest.mark.parametrize("case, prefix, fused", [("hf/nvfp4", L0 + "v_proj.", False), ("hf/nvfp4-a16", L0 + "v_proj.", False),
                                                  ("trtllm/nvfp4/tp1", QKV, True), ("trtllm/nvfp4-kv8/tp1", QKV, True)])
def test_nvfp4_bytes(case, prefix, fused, W):
    """scale_2 is the fused q/k/v amax / (6·448) in float32, the inverse of compressed-tensors' global scale (up to
    its bf16 rounding); with gs = 1/scale_2 qtk gives ModelOpt's fp8 group scales and packed nibbles."""
    trt = case.startswith("trtllm")
    w = _qkv(W) if fused else _v(W)
    s2 = _s(case, prefix + ("weights_scaling_factor_2" if trt else "weight_scale_2"))
    assert s2.shape == () and s2.item() == (_qkv(W).float().abs().amax() / (6 * FP8_E4M3_MAX)).item()
    gs = (1 / s2).reshape(1)
    ct_gs = nvfp4_weight_global_scale(*[W[f"{L0}{p}_proj.weight"] for p in "qkv"])
    assert gs.item() != ct_gs.item() and abs(gs.item() / ct_gs.item() - 1) < 2**-8  # compressed-tensors: bf16 amax/6
    scale = _s(case, prefix + ("weights_scaling_factor" if trt else "weight_scale"))  # HF: all rows; TRT-LLM: 8
    rows = scale.shape[0]
    assert torch.equal(nvfp4_group_scales(w[:rows].float(), gs).view(torch.uint8), scale.view(torch.uint8))
    packed = _s(case, prefix + "weight")
    n = packed.shape[0]
    assert torch.equal(pack_fp4(nvfp4_quantize(w[:n], scale[:n], gs)), packed)


@pytest.mark.parametrize("case", ["hf/nvfp4", "hf/nvfp4-kv8"])
def test_nvfp4_input_scale(case, W):
    """input_scale = amax(layer 0's normed input) / 2688: compressed-tensors' input_global_scale inverted. ModelOpt
    calibrated the float32 model; its amax was rounded to bf16 when the model was cast for export."""
    ids = calibration_ids()
    h = W["model.embed_tokens.weight"][ids].float()
    x = W["model.layers.0.input_layernorm.weight"].float() * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6))
    amax = x.abs().amax().to(torch.bfloat16).float()
    assert _s(case, L0 + "v_proj.input_scale").item() == (amax / 2688).item()


@pytest.mark.parametrize("case, prefix", [("hf/mxfp4", L0 + "v_proj."), ("trtllm/mxfp4/tp1", QKV)])
def test_mxfp4_bytes(case, prefix, W):
    """ModelOpt's E8M0 scales follow its ceil rule; its packed nibbles decode (qtk's unpacker) to the e2m1 value
    nearest x/X, with ties rounded toward zero where compressed-tensors and qtk round to even."""
    trt = case.startswith("trtllm")
    w = _qkv(W) if trt else _v(W)
    codes = _s(case, prefix + ("weights_scaling_factor" if trt else "weight_scale"))
    assert torch.equal(mx_scales(w, "fp4", rule="modelopt")[: codes.shape[0]], codes)
    packed = _s(case, prefix + "weight")
    rows = packed.shape[0]
    theirs = fp4_decode(unpack_fp4(packed))
    x = (w[:rows].float().reshape(rows, -1, 32) / e8m0_decode(codes[:rows]).unsqueeze(-1)).reshape(rows, -1)
    ours = fp4_decode(mxfp4_quantize(w[:rows], codes[:rows]))
    grid = e2m1_table()[:8]
    mids = (grid[1:] + grid[:-1]) / 2
    a = x.abs().clamp(max=FP4_MAX)
    tie = (a.unsqueeze(-1) == mids).any(-1)
    assert tie.any() and torch.equal(theirs[~tie], ours[~tie])
    assert torch.equal(theirs[tie].abs(), grid[torch.searchsorted(mids, a[tie])])  # a midpoint: the smaller neighbour
    assert (theirs[tie] != ours[tie]).any()  # where that neighbour's code is odd, round-to-even differs
    assert torch.equal(mxfp4_dequantize(unpack_fp4(packed), codes[:rows]), theirs.reshape(rows, -1, 32).mul(
        e8m0_decode(codes[:rows]).unsqueeze(-1)).reshape(rows, -1))


@pytest.mark.parametrize("case, prefix", [("hf/mxfp8", L0 + "v_proj."), ("trtllm/mxfp8/tp1", QKV)])
def test_mxfp8_bytes(case, prefix, W):
    trt = case.startswith("trtllm")
    w = _qkv(W) if trt else _v(W)
    codes = _s(case, prefix + ("weights_scaling_factor" if trt else "weight_scale"))
    assert torch.equal(mx_scales(w, "fp8", rule="modelopt")[: codes.shape[0]], codes)
    q = _s(case, prefix + "weight")
    rows = q.shape[0]
    assert torch.equal(mxfp8_quantize(w[:rows], codes[:rows]).view(torch.uint8), q.view(torch.uint8))


def test_fp8_block_bytes(W):
    """ModelOpt's weight-only FP8 blocks: float32 scales amax/448 stored [R, 1, C, 1] (ragged rows included)."""
    s = _s("hf/fp8-block-wo", L0 + "v_proj.weight_scale")
    assert list(s.shape) == [2, 1, 3, 1]
    ours = fp8_block_scales(_v(W), scale_dtype=torch.float32)
    assert torch.equal(ours.reshape(2, 1, 3, 1), s)
    q = _s("hf/fp8-block-wo", L0 + "v_proj.weight")
    assert torch.equal(fp8_block_quantize(_v(W), ours)[: q.shape[0]].view(torch.uint8), q.view(torch.uint8))


@pytest.mark.parametrize("case, prefix", [("hf/w4a8-awq", L0 + "v_proj."), ("trtllm/w4a8-awq/tp1", QKV)])
def test_w4a8_awq_layout(case, prefix):
    """int4 codes two output rows per byte (low nibble = even row) as in W4A16_AWQ, on ModelOpt's -7..7 grid;
    weight_scale [out, in/128] float32 (group amax/7) and scale_2 = amax/448 (the kernel runs the weight in
    FP8), so 7·weight_scale never exceeds 448·scale_2."""
    trt = case.startswith("trtllm")
    packed = _s(case, prefix + "weight")
    assert packed.dtype == (torch.int8 if trt else torch.uint8)
    q = unpack_int4_pairs(packed)
    assert q.shape == (2 * packed.shape[0], packed.shape[1]) and int(q.abs().max()) == 7
    assert torch.equal(pack_int4_pairs(q).view(torch.uint8), packed.view(torch.uint8))
    ws = _s(case, prefix + ("weights_scaling_factor" if trt else "weight_scale"))
    s2 = _s(case, prefix + ("weights_scaling_factor_2" if trt else "weight_scale_2"))
    assert ws.dtype == s2.dtype == torch.float32 and ws.shape[1] == packed.shape[1] // 128
    assert (ws * 7).max() <= s2.reshape(()) * FP8_E4M3_MAX * (1 + 2**-20)


@pytest.mark.parametrize("case", sorted(c for c in REF["cases"] if "error" not in REF["cases"][c]))
def test_layout_of_every_quantized_tensor(case, W):
    """Every quantized Linear's tensors have the shapes qtk's primitives give ([out, in/2] packed FP4 bytes,
    [out, in/16] NVFP4 and [out, in/32] MX scales, [out/2, in] int4 row pairs, [out, in/128] int4 group scales)."""
    c = REF["cases"][case]
    algo = (c["config"]["quantization"] if case.startswith("trtllm") else c["hf_quant_config"]["quantization"])["quant_algo"]
    tensors = c["ranks"]["rank0"] if case.startswith("trtllm") else c["tensors"]
    checked = 0
    for name, (dtype, shape) in tensors.items():
        base = name.removesuffix(".weight")
        scale = tensors.get(base + ".weights_scaling_factor") or tensors.get(base + ".weight_scale")
        if name == base or scale is None:  # not a weight, or a dense one
            continue
        if algo in ("NVFP4", "W4A16_NVFP4", "mxfp4"):
            n_in = shape[1] * 2  # two e2m1 codes per byte
            assert dtype == "U8" and list(pack_fp4(torch.zeros(shape[0], n_in, dtype=torch.uint8)).shape) == shape
            nvfp4 = "NVFP4" in algo
            assert scale == ["F8_E4M3" if nvfp4 else "U8", [shape[0], n_in // (16 if nvfp4 else 32)]], name
        elif algo == "MXFP8":
            assert dtype == "F8_E4M3" and scale == ["U8", [shape[0], shape[1] // 32]], name
        elif algo == "W4A8_AWQ":
            assert dtype in ("I8", "U8") and scale == ["F32", [shape[0] * 2, shape[1] // 128]], name
        elif algo == "fp8_pb_wo":
            assert dtype == "F8_E4M3"
            assert scale == ["F32", [-(-shape[0] // 128), 1, -(-shape[1] // 128), 1]], name
        else:
            raise AssertionError(f"{case}: unexpected quant_algo {algo}")
        checked += 1
    assert checked == (7 if case.startswith("hf") else 5) * SPEC["layers"], (case, checked)  # q,k,v,o,gate,up,down
