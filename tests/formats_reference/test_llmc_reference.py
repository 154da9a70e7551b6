"""qtk's format primitives against what llm-compressor 0.14 really wrote for the same model.

llmc_reference.json was written by make_llmc_reference.py in llm-compressor's own venv. Here the same model is
rebuilt from reference_model.SPEC (bit for bit: checked by digest) and every quantized Linear is run through
qtk's primitives: each tensor llm-compressor wrote must come out of qtk with the same name suffix, safetensors
dtype and shape; and for the kept Linear (layer 0 v_proj: ragged for 128-blocks, fused with q/k) qtk's scales,
global scales and packed bytes must equal llm-compressor's bytes, which qtk's unpackers must also decode.
"""

import json

import pytest
import torch
from reference_model import LLMC_MANIFEST, SAMPLE_LINEAR, SPEC, calibration_ids, decode_sample, tensor_digest, weights

from qtk.io.safetensors import ST_DTYPES
from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.formats.fp8_block import fp8_block_quantize, fp8_block_scales
from qtk.quant.formats.mx import mx_scales, mxfp4_dequantize, mxfp4_quantize, mxfp8_quantize
from qtk.quant.formats.nvfp4 import nvfp4_dequantize, nvfp4_global_scale, nvfp4_group_scales, nvfp4_quantize, nvfp4_weight_global_scale
from qtk.quant.pack import pack_ct, unpack_ct
from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme

REF = json.loads(LLMC_MANIFEST.read_text())
CASES = sorted(REF["cases"])
FUSED = {"q_proj": ("q_proj", "k_proj", "v_proj"), "k_proj": ("q_proj", "k_proj", "v_proj"),
         "v_proj": ("q_proj", "k_proj", "v_proj"), "gate_proj": ("gate_proj", "up_proj"), "up_proj": ("gate_proj", "up_proj")}
INT4_G128 = QuantScheme(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)


@pytest.fixture(scope="module")
def W():
    return weights(REF["model"])


def _fused(W, linear: str) -> list[torch.Tensor]:
    parent, leaf = linear.rsplit(".", 1)
    return [W[f"{parent}.{n}.weight"] for n in FUSED.get(leaf, (leaf,))]


def qtk_tensors(case: dict, W, linear: str) -> dict[str, torch.Tensor]:
    """What qtk's primitives produce for one Linear under the case's scheme, by compressed-tensors suffix."""
    w = W[linear + ".weight"]
    groups = case["quantization_config"]["config_groups"]["group_0"]
    wa, act, fmt = groups["weights"], groups["input_activations"], case["quantization_config"]["format"]
    if fmt == "nvfp4-pack-quantized":
        gs = nvfp4_weight_global_scale(*_fused(W, linear))
        scale = nvfp4_group_scales(w, gs)
        out = {"weight_packed": pack_fp4(nvfp4_quantize(w, scale, gs)), "weight_scale": scale, "weight_global_scale": gs}
        if act is not None:
            out["input_global_scale"] = nvfp4_global_scale(torch.tensor(1.0))  # layout only: calibrated in use
        return out
    if fmt == "mxfp4-pack-quantized":
        codes = mx_scales(w, "fp4")
        return {"weight_packed": pack_fp4(mxfp4_quantize(w, codes)), "weight_scale": codes}
    if fmt == "mxfp8-quantized":
        codes = mx_scales(w, "fp8")
        return {"weight": mxfp8_quantize(w, codes), "weight_scale": codes}
    if wa["strategy"] == "block":
        s = fp8_block_scales(w, tuple(wa["block_structure"]))
        return {"weight": fp8_block_quantize(w, s, tuple(wa["block_structure"])), "weight_scale": s}
    if wa["type"] == "int" and wa["num_bits"] == 4:  # W4A8: int4 groups, layout only (see test_w4a8_int4_layout)
        qt = QTensor.quantize(w, INT4_G128)
        if fmt == "pack-quantized":
            return {"weight_packed": pack_ct(qt.values, 4), "weight_scale": qt.scale.to(w.dtype),
                    "weight_shape": torch.tensor(w.shape, dtype=torch.int64)}
        return {"weight": qt.values, "weight_scale": qt.scale.to(w.dtype)}
    raise AssertionError(f"no qtk primitive for format {fmt}")


def test_reference_model_rebuilds_bit_for_bit(W):
    assert REF["model"] == SPEC
    assert tensor_digest(W[SAMPLE_LINEAR + ".weight"]) == REF["sample_source_sha256"]
    dense = {n for n in REF["cases"]["nvfp4a16"]["tensors"] if not n.split(".")[-2].endswith("_proj")}
    assert dense == {n for n in W if not n.endswith("_proj.weight")}


@pytest.mark.parametrize("case_name", CASES)
def test_layout_of_every_tensor(case_name, W):
    """Every tensor llm-compressor wrote has a qtk counterpart with the same safetensors dtype and shape."""
    case = REF["cases"][case_name]
    linears = sorted({n.rsplit(".", 1)[0] for n in W if n.endswith("_proj.weight")})
    seen = set()
    for linear in linears:
        for suffix, t in qtk_tensors(case, W, linear).items():
            name = f"{linear}.{suffix}"
            assert name in case["tensors"], f"{case_name}: qtk makes {name}, llm-compressor does not write it"
            assert [ST_DTYPES[t.dtype], list(t.shape)] == case["tensors"][name], name
            seen.add(name)
    for name, (dtype, shape) in case["tensors"].items():
        if name in seen:
            continue
        if name.endswith(("k_scale", "v_scale")):  # FP8 KV cache scales: per-tensor, in the model dtype
            assert case["kv_cache_scheme"] is not None and (dtype, shape) == ("BF16", [1]), name
        else:  # left dense: embeddings, norms, lm_head
            assert [ST_DTYPES[W[name].dtype], list(W[name].shape)] == [dtype, shape], name


def _sample(case_name: str, suffix: str) -> torch.Tensor:
    return decode_sample(REF["cases"][case_name]["sample"][f"{SAMPLE_LINEAR}.{suffix}"])


@pytest.mark.parametrize("case_name", ["nvfp4", "nvfp4-kv8", "nvfp4a16"])
def test_nvfp4_bytes_equal_llmcompressor(case_name, W):
    """The q/k/v-fused global scale, the fp8 group scales and the packed nibbles are llm-compressor's, and
    qtk's unpacker decodes llm-compressor's bytes to qtk's dequantized weight."""
    w = W[SAMPLE_LINEAR + ".weight"]
    gs = nvfp4_weight_global_scale(*_fused(W, SAMPLE_LINEAR))
    assert torch.equal(_sample(case_name, "weight_global_scale"), gs)
    assert not torch.equal(gs, nvfp4_weight_global_scale(w))  # the fused group (k_proj's amax) sets it
    scale = nvfp4_group_scales(w, gs)
    assert torch.equal(_sample(case_name, "weight_scale").view(torch.uint8), scale.view(torch.uint8))
    packed = _sample(case_name, "weight_packed")
    codes = nvfp4_quantize(w, scale, gs)
    assert torch.equal(packed, pack_fp4(codes)[: packed.shape[0]])
    rows = packed.shape[0]
    assert torch.equal(nvfp4_dequantize(unpack_fp4(packed), scale[:rows], gs), nvfp4_dequantize(codes, scale, gs)[:rows])


@pytest.mark.parametrize("case_name", ["nvfp4", "nvfp4-kv8"])
def test_nvfp4_input_global_scale_equals_llmcompressor(case_name, W):
    """v_proj's static global input scale: 448·6 / amax of layer 0's normed input over the calibration ids."""
    ids = calibration_ids()
    h = W["model.embed_tokens.weight"][ids]  # [samples, seq, hidden], bf16
    var = h.float().pow(2).mean(-1, keepdim=True)  # LlamaRMSNorm, eps 1e-6
    x = W["model.layers.0.input_layernorm.weight"] * (h.float() * torch.rsqrt(var + 1e-6)).to(h.dtype)
    assert torch.equal(_sample(case_name, "input_global_scale"), nvfp4_global_scale(x.abs().amax()))


@pytest.mark.parametrize("case_name, elem", [("mxfp4a16", "fp4"), ("mxfp4", "fp4"), ("mxfp8", "fp8")])
def test_mx_bytes_equal_llmcompressor(case_name, elem, W):
    w = W[SAMPLE_LINEAR + ".weight"]
    codes = mx_scales(w, elem)
    assert torch.equal(_sample(case_name, "weight_scale"), codes)
    if elem == "fp4":
        packed = _sample(case_name, "weight_packed")
        q = mxfp4_quantize(w, codes)
        assert torch.equal(packed, pack_fp4(q)[: packed.shape[0]])
        rows = packed.shape[0]
        assert torch.equal(mxfp4_dequantize(unpack_fp4(packed), codes[:rows]), mxfp4_dequantize(q, codes)[:rows])
    else:
        q8 = _sample(case_name, "weight")
        assert torch.equal(q8.view(torch.uint8), mxfp8_quantize(w, codes)[: q8.shape[0]].view(torch.uint8))


@pytest.mark.parametrize("case_name", ["fp8-block", "fp8-block-kv8"])
def test_fp8_block_bytes_equal_llmcompressor(case_name, W):
    """v_proj is 192 x 384: a [2, 3] grid whose second block row is ragged (64 rows)."""
    w = W[SAMPLE_LINEAR + ".weight"]
    s = fp8_block_scales(w)
    theirs = _sample(case_name, "weight_scale")
    assert theirs.shape == (2, 3) and theirs.dtype == torch.bfloat16
    assert torch.equal(theirs, s)
    q8 = _sample(case_name, "weight")
    assert torch.equal(q8.view(torch.uint8), fp8_block_quantize(w, s)[: q8.shape[0]].view(torch.uint8))


def test_w4a8_int4_layout():
    """llm-compressor writes W4AFP8 as int-quantized (int4 codes unpacked in int8) by default and as
    pack-quantized when asked (its example does, for vLLM): qtk's compressed-tensors packer turns the first
    into the second's bytes. (Value equality with qtk's int4 quantizer waits for the full -8..7 grid.)"""
    q = _sample("w4afp8", "weight")
    packed = _sample("w4afp8-packed", "weight_packed")
    assert q.dtype == torch.int8 and int(q.min()) >= -8 and int(q.max()) <= 7
    assert torch.equal(pack_ct(q, 4), packed)
    assert torch.equal(unpack_ct(packed, 4, q.shape[1]), q)
    assert _sample("w4afp8-packed", "weight_shape").tolist() == list(REF["cases"]["w4afp8"]["tensors"][SAMPLE_LINEAR + ".weight"][1])
    assert torch.equal(_sample("w4afp8", "weight_scale"), _sample("w4afp8-packed", "weight_scale"))
