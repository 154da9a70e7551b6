"""qtk's hf-modelopt NVFP4 outputs against what NVIDIA ModelOpt 0.47 exported for the same reference model
(modelopt_reference.json, NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG / + FP8_KV_CFG): the same tensor names, safetensors
dtypes and shapes, the same hf_quant_config.json and config.json quantization_config (the producer aside). qtk's
NVFP4 values are its own (compressed-tensors' arithmetic, shared with the vllm output): the reader must decode them
to the weights the vllm output decodes to, and fused q/k/v and gate/up must carry one weight_scale_2 / input_scale
(TensorRT-LLM asserts it)."""

import json

import pytest
import torch
from reference_model import HERE, build, header

from qtk import api
from qtk.export import open_checkpoint

REF = json.loads((HERE / "modelopt_reference.json").read_text())
CASES = {"hf/nvfp4": "nvfp4", "hf/nvfp4-kv8": "nvfp4-kv8", "hf/nvfp4-a16": "nvfp4-a16"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ref") / "model")


def _drop_producer(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "producer"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_modelopt_nvfp4_matches_modelopt(case, model, tmp_path):
    ref = REF["cases"][case]
    res = api.convert(model, CASES[case], tmp_path / "out", targets=["hf-modelopt", "vllm"], num_samples=4, seq_len=32,
                      hash_source=False)
    d = res.outputs["hf-modelopt"]
    hq = json.loads((d / "hf_quant_config.json").read_text())
    assert hq["quantization"] == ref["hf_quant_config"]["quantization"]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert _drop_producer(qc) == _drop_producer(ref["quantization_config"])
    got = {}
    for p in sorted(d.glob("*.safetensors")):
        got.update(header(p))
    assert {n: [dt, list(sh)] for n, (dt, sh) in got.items()} == {n: [dt, list(sh)] for n, (dt, sh) in ref["tensors"].items()}

    mo, ct = open_checkpoint(d), open_checkpoint(res.outputs["vllm"])
    for m in ct.modules():
        a, b = mo.qtensor(m).dequantize(), ct.qtensor(m).dequantize()
        assert torch.allclose(a, b, rtol=1e-6, atol=0), m  # 1/weight_scale_2 is gs up to one float32 rounding
    for layer in range(2):
        p = f"model.layers.{layer}."
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            for key in ("weight_scale_2", "input_scale") if case != "hf/nvfp4-a16" else ("weight_scale_2",):
                vals = [mo.tensor(f"{p}{x}.{key}") for x in group]
                assert all(torch.equal(v, vals[0]) for v in vals), (p, group, key)
    assert api.inspect(d).ok
    # the engine simulation reads ModelOpt's inverse scales back: the same model as the vllm output's
    from qtk.model.simulate import build_simulated_model

    ids = torch.randint(3, 120, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la = build_simulated_model(mo, simulate_kv=False)(ids).logits
        lb = build_simulated_model(ct, simulate_kv=False)(ids).logits
    assert (la - lb).abs().max().item() <= 1e-3 * lb.abs().max().item()


# trtllm/nvfp4/tp2 is left out: the reference model's 3 KV heads do not split over 2 ranks (ModelOpt splits inside a
# head; qtk refuses --tp 2 there, tests/trtllm covers NVFP4-independent TP sharding)
TRT_CASES = {"trtllm/nvfp4/tp1": ("nvfp4", 1), "trtllm/nvfp4-kv8/tp1": ("nvfp4-kv8", 1), "trtllm/nvfp4-a16/tp1": ("nvfp4-a16", 1)}


@pytest.mark.parametrize("case", sorted(TRT_CASES))
def test_trtllm_nvfp4_matches_modelopt(case, model, tmp_path):
    """ModelOpt's export_tensorrt_llm_checkpoint of the same model: config `quantization` and `mapping`, per rank the
    same tensor names, dtypes and shapes (TP shards: packed bytes and group scales split along the input for
    attention.dense / mlp.proj)."""
    recipe, tp = TRT_CASES[case]
    ref = REF["cases"][case]
    res = api.convert(model, recipe, tmp_path / "out", targets=["trtllm", "vllm"], tp=tp, num_samples=4, seq_len=32,
                      hash_source=False)
    d = res.outputs["trtllm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization"] == ref["config"]["quantization"]
    assert cfg["mapping"]["tp_size"] == ref["config"]["mapping"]["tp_size"]
    for rank, want in ref["ranks"].items():
        got = header(d / f"{rank}.safetensors")
        assert {n: [dt, list(sh)] for n, (dt, sh) in got.items()} == {n: [dt, list(sh)] for n, (dt, sh) in want.items()}, rank
    trt, ct = open_checkpoint(d), open_checkpoint(res.outputs["vllm"])
    for m in ct.modules():
        assert torch.allclose(trt.qtensor(m).dequantize(), ct.qtensor(m).dequantize(), rtol=1e-6, atol=0), m
    assert api.inspect(d).ok


def test_trtllm_nvfp4_tp2_shards_decode_to_the_same_weights(tmp_path):
    """TP 2 on a model whose KV heads split: packed bytes and group scales of attention.dense / mlp.proj split along
    the input, qkv / fc / gate along the output; merged back they decode to the vllm output's weights."""
    import sys

    sys.path.insert(0, str(HERE.parent))
    from models import make_tiny_model

    src = make_tiny_model(tmp_path / "m", hidden=256, intermediate=512, heads=4, kv_heads=2)
    res = api.convert(src, "nvfp4", tmp_path / "out", targets=["trtllm", "vllm"], tp=2, num_samples=4, seq_len=32,
                      hash_source=False)
    d = res.outputs["trtllm"]
    h = header(d / "rank1.safetensors")
    assert h["transformer.layers.0.attention.dense.weight"] == ["U8", [256, 64]]
    assert h["transformer.layers.0.attention.dense.weights_scaling_factor"] == ["F8_E4M3", [256, 8]]
    assert h["transformer.layers.0.mlp.fc.weight"] == ["U8", [256, 128]]
    trt, ct = open_checkpoint(d), open_checkpoint(res.outputs["vllm"])
    for m in ct.modules():
        assert torch.allclose(trt.qtensor(m).dequantize(), ct.qtensor(m).dequantize(), rtol=1e-6, atol=0), m
    assert api.inspect(d).ok
