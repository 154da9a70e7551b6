"""FP8-block sources (DeepSeek-V3 / Qwen3-FP8 style: float8_e4m3fn weights with a float32 weight_scale_inv per
128x128 block) are read as the BF16 model they stand for, one tensor at a time as the layers stream: converting one
writes exactly what converting its dequantized BF16 model writes, for a calibrated recipe (w4a16-gptq) and a
data-free one (nvfp4), with edge blocks 128 does not fill. The refusals of damaged sources are in
tests/test_bad_inputs.py; the peak memory in benchmarks/convert_fp8_source.py."""

from __future__ import annotations

import json

import pytest
import torch

from fp8_sources import dequantized_reference, make_fp8_block_source, read_tensors
from models import make_tiny_model
from qtk import api
from qtk.model.source import ModelSource

NS, T = 8, 32



@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """name -> (FP8-block source, its dequantized BF16 model). "rows": every input size a multiple of 128, k/v of 64
    rows (a partial block row); "ragged": hidden 208, intermediate 320 (partial blocks both ways in every Linear)."""
    root = tmp_path_factory.mktemp("fp8src")
    shapes = {"rows": dict(model_type="qwen3", hidden=256, intermediate=384, heads=4, kv_heads=2, head_dim=32),
              "ragged": dict(model_type="llama", hidden=208, intermediate=320, heads=4, kv_heads=2, head_dim=32)}
    out = {}
    for name, s in shapes.items():
        bf16 = make_tiny_model(root / f"{name}-orig", layers=2, **s)
        fp8 = make_fp8_block_source(bf16, root / f"{name}-fp8")
        out[name] = (fp8, dequantized_reference(fp8, root / f"{name}-deq"))
    return out


def test_source_reads_fp8_weights_dequantized(sources):
    """ModelSource hides the scales and hands each FP8 weight back in the model dtype, equal to the block-by-block
    reference, mapped or read; the rest as stored."""
    fp8, ref = sources["ragged"]
    src = ModelSource(fp8)
    want = read_tensors(ref)
    assert not any(n.endswith("_scale_inv") for n in src.weight_map)
    assert set(src.weight_map) == set(want)
    assert src.config_dict == json.loads((ref / "config.json").read_text())
    assert "quantization_config" not in src.config.to_dict()
    q = "model.layers.1.mlp.down_proj.weight"
    assert src._stored_dtype(q) == torch.float8_e4m3fn and src.tensor_dtype(q) == torch.bfloat16
    for n, t in want.items():
        for mapped in (False, True):
            got = src.tensor(n, mapped=mapped)
            assert got.dtype == t.dtype and torch.equal(got, t), n


@pytest.mark.parametrize("name,recipe", [("rows", "w4a16-gptq"), ("rows", "nvfp4"), ("ragged", "nvfp4")])
def test_converts_as_its_dequantized_model(sources, calib_file, tmp_path, name, recipe):
    fp8, ref = sources[name]
    got = api.convert(fp8, recipe, tmp_path / "fp8", calib=str(calib_file), num_samples=NS, seq_len=T,
                      hash_source=False).outputs["vllm"]
    want = api.convert(ref, recipe, tmp_path / "ref", calib=str(calib_file), num_samples=NS, seq_len=T,
                       hash_source=False).outputs["vllm"]
    a, b = read_tensors(got), read_tensors(want)
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), n
    assert json.loads((got / "config.json").read_text()) == json.loads((want / "config.json").read_text())
    m = json.loads((got / "qtk.json").read_text())
    assert m["source"]["quantization"]["weight_block_size"] == [128, 128]
    assert m["source"]["quantization"]["quantized_weights"] == 14  # 7 Linears x 2 layers
    assert m["stats"]["weight_error"] == json.loads((want / "qtk.json").read_text())["stats"]["weight_error"]
    assert api.inspect(got).ok


def test_dequantized_as_transformers_reads_it(tmp_path):
    """The format as transformers' own FP8 integration reads it (dequantize=True on the CPU): the same weights."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    bf16 = make_tiny_model(tmp_path / "orig", model_type="llama", layers=1, hidden=256, intermediate=384, heads=2,
                           kv_heads=1, head_dim=128)
    fp8 = make_fp8_block_source(bf16, tmp_path / "fp8")
    m = AutoModelForCausalLM.from_pretrained(str(fp8), quantization_config=FineGrainedFP8Config(dequantize=True),
                                             dtype=torch.bfloat16)
    src = ModelSource(fp8)
    sd = m.state_dict()
    checked = 0
    for n in src.weight_map:
        if n in src.quant.scales:
            assert sd[n].dtype == torch.bfloat16 and torch.equal(sd[n], src.tensor(n)), n
            checked += 1
    assert checked == 7


def test_vision_language_fp8_source(tmp_path):
    """A Qwen3-VL-FP8-shaped source (language model and vision Linears in FP8 blocks): converted as its dequantized
    model, the vision tower written dequantized in 16 bits."""
    from vlm_models import make_tiny_vlm

    orig = make_tiny_vlm(tmp_path / "orig", "qwen3_vl")
    fp8 = make_fp8_block_source(orig, tmp_path / "fp8", quantized=lambda n: n.endswith("proj.weight") or "linear_fc" in n)
    ref = dequantized_reference(fp8, tmp_path / "deq")
    got = api.convert(fp8, "w4a16-gptq", tmp_path / "a", num_samples=NS, seq_len=T, hash_source=False).outputs["vllm"]
    want = api.convert(ref, "w4a16-gptq", tmp_path / "b", num_samples=NS, seq_len=T, hash_source=False).outputs["vllm"]
    a, b = read_tensors(got), read_tensors(want)
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert a["model.visual.blocks.0.mlp.linear_fc1.weight"].dtype == torch.bfloat16
    assert json.loads((got / "qtk.json").read_text())["source"]["quantization"]["quantized_weights"] > 14
