"""qtk's hf-modelopt NVFP4 outputs against what NVIDIA ModelOpt 0.47 exported for the same reference model
(modelopt_reference.json, NVFP4_DEFAULT_CFG / W4A16_NVFP4_CFG / + FP8_KV_CFG): the same tensor names, safetensors
dtypes and shapes, the same hf_quant_config.json and config.json quantization_config (the producer aside). qtk's
NVFP4 values are its own (compressed-tensors' arithmetic, shared with the vllm output): the reader must decode them
to the weights the vllm output decodes to, and fused q/k/v and gate/up must carry one weight_scale_2 / input_scale
(TensorRT-LLM asserts it)."""

import json
from pathlib import Path

import pytest
import torch
from reference_model import HERE, build, decode_sample, header

from qtk import api
from qtk.export import open_checkpoint, writer_for

REF = json.loads((HERE / "modelopt_reference.json").read_text())
CASES = {"hf/nvfp4": "nvfp4", "hf/nvfp4-kv8": "nvfp4-kv8", "hf/nvfp4-a16": "nvfp4-a16"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build(tmp_path_factory.mktemp("ref") / "model")


def _drop_producer(d: dict) -> dict:
    return {k: v for k, v in d.items() if k != "producer"}


def _assert_hf_layout_matches(d, ref) -> None:
    """hf_quant_config.json, config.json's quantization_config (but its producer) and every tensor's dtype and shape
    of the hf-modelopt checkpoint d equal ModelOpt's capture `ref`."""
    hq = json.loads((d / "hf_quant_config.json").read_text())
    assert hq["quantization"] == ref["hf_quant_config"]["quantization"]
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert _drop_producer(qc) == _drop_producer(ref["quantization_config"])
    got = {}
    for p in sorted(d.glob("*.safetensors")):
        got.update(header(p))
    assert {n: [dt, list(sh)] for n, (dt, sh) in got.items()} == {n: [dt, list(sh)] for n, (dt, sh) in ref["tensors"].items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hf_modelopt_nvfp4_matches_modelopt(case, model, tmp_path):
    ref = REF["cases"][case]
    res = api.convert(model, CASES[case], tmp_path / "out", targets=["hf-modelopt", "vllm"], num_samples=4, seq_len=32,
                      hash_source=False)
    d = res.outputs["hf-modelopt"]
    _assert_hf_layout_matches(d, ref)

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


# ---- W4A8_AWQ: int4 groups of 128 with static per-tensor FP8 activations (ModelOpt's W4A8_AWQ_BETA_CFG). qtk's
# w4a8-fp8 recipe quantizes activations per token at run time, which TensorRT-LLM's W4A8_AWQ cannot (one static
# input scale per tensor): these recipes are w4a8-fp8 with activations {strategy: tensor, dynamic: false}.
W4A8_STATIC = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor", "dynamic": False}


def w4a8_static(kv: bool = False):
    from qtk.recipe import parse_recipe

    doc = {"name": "w4a8-static" + ("-kv8" if kv else ""), "algorithm": [{"gptq": {"actorder": "static"}}],
           "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128},
           "activations": W4A8_STATIC, **({"kv_cache": {"num_bits": 8, "type": "float"}} if kv else {})}
    return parse_recipe(doc, origin="test")


def sample(case: str, name: str) -> torch.Tensor:
    return decode_sample(REF["cases"][case]["sample"][name])


def _convert_recording(monkeypatch, src, recipe, out, targets):
    """api.convert, recording each quantized Linear's QTensor as the pipeline hands it to the writers (all writers
    get the same LayerResults, so one record serves every target)."""
    seen: dict = {}
    for t in targets:
        cls = writer_for(t)

        def add_layer(self, r, _orig=cls.add_layer):
            seen.update(r.qweights)
            return _orig(self, r)

        monkeypatch.setattr(cls, "add_layer", add_layer)
    res = api.convert(src, recipe, out, targets=targets, num_samples=4, seq_len=32, hash_source=False)
    return res, seen


W4A8_TRT = {"trtllm/w4a8-awq/tp1": False, "trtllm/w4a8-awq-kv8/tp1": True}


@pytest.mark.parametrize("case", sorted(W4A8_TRT))
def test_trtllm_w4a8_awq_matches_modelopt(case, model, tmp_path, monkeypatch):
    """ModelOpt's TensorRT-LLM W4A8_AWQ export of the same model: the same config `quantization`, per rank the same
    tensor names, dtypes and shapes; the same value conventions as its recorded bytes (int4 row pairs, the group
    scale the real one, weights_scaling_factor_2 and activation_scaling_factor amax/448 of the weight and the input,
    a bfloat16 pre-quant scale); and the reader decodes exactly the QTensors qtk quantized."""
    from qtk.export.codecs.trtllm import unpack_int4_pairs

    ref = REF["cases"][case]
    res, seen = _convert_recording(monkeypatch, model, w4a8_static(W4A8_TRT[case]), tmp_path / "out",
                                   ["trtllm", "hf-modelopt"])
    d = res.outputs["trtllm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["quantization"] == ref["config"]["quantization"]
    assert cfg["mapping"] == ref["config"]["mapping"]
    got = header(d / "rank0.safetensors")
    assert {n: [dt, list(sh)] for n, (dt, sh) in got.items()} == {n: [dt, list(sh)] for n, (dt, sh) in ref["ranks"]["rank0"].items()}

    # value conventions, against ModelOpt's recorded qkv of layer 0
    from safetensors import safe_open

    qkv = "transformer.layers.0.attention.qkv."
    with safe_open(str(d / "rank0.safetensors"), "pt") as f:
        ours = {k: f.get_tensor(qkv + k) for k in ("weight", "weights_scaling_factor", "weights_scaling_factor_2",
                                                    "activation_scaling_factor", "prequant_scaling_factor")}
    theirs = {k: sample(case, qkv + k) for k in ours}
    for k in ours:
        assert ours[k].dtype == theirs[k].dtype, k
    q_ref, s_ref = unpack_int4_pairs(theirs["weight"]), theirs["weights_scaling_factor"]
    q_ours, s_ours = unpack_int4_pairs(ours["weight"]), ours["weights_scaling_factor"]
    # the same model and row-pair order: ModelOpt's codes agree with qtk's where both grids round the same way
    assert (q_ref == q_ours[: q_ref.shape[0]]).float().mean() > 0.6
    for q, s, s2 in ((q_ref, s_ref, theirs["weights_scaling_factor_2"]), (q_ours, s_ours, ours["weights_scaling_factor_2"])):
        n = min(q.shape[0], s.shape[0])  # the recorded rows
        w = q[:n].float().unflatten(1, (-1, 128)) * s[:n, :, None]
        assert float(w.abs().max()) <= float(s2) * 448 * (1 + 2**-20)  # the weight fits the FP8 range of scale_2
    # one weights_scaling_factor_2 for the fused qkv: its largest |q·s| maps to 448, as ModelOpt's (amax/448)
    mods = [f"model.layers.0.self_attn.{x}" for x in ("q_proj", "k_proj", "v_proj")]
    assert float(ours["weights_scaling_factor_2"]) * 448 == pytest.approx(max(float(seen[m].dequantize().abs().max()) for m in mods), rel=1e-6)
    assert 0.7 < float(ours["weights_scaling_factor_2"] / theirs["weights_scaling_factor_2"]) < 1.4  # same model: amax/448
    assert 0.5 < float(ours["activation_scaling_factor"] / theirs["activation_scaling_factor"]) < 2  # same tokens: amax/448
    assert torch.equal(ours["prequant_scaling_factor"], torch.ones(384, dtype=torch.bfloat16))  # AWQ is folded by qtk

    trt, mo = open_checkpoint(d), open_checkpoint(res.outputs["hf-modelopt"])
    assert trt.weights_scheme.group_size == 128 and not trt.activations.dynamic and trt.activations.strategy == "tensor"
    assert sorted(trt.modules()) == sorted(seen)
    for m, qt in seen.items():
        assert torch.equal(trt.qtensor(m).dequantize(), qt.dequantize()), m
        assert torch.equal(mo.qtensor(m).dequantize(), qt.dequantize()), m
        assert torch.equal(trt.input_scale(m), mo.input_scale(m)), m
    if W4A8_TRT[case]:
        assert trt.kv_scales(0) is not None and trt.kv_cache == "fp8"
    assert api.inspect(d).ok
    # `qtk eval`'s engine simulation runs both outputs alike: int4 weights, FP8 inputs under the static scale
    from qtk.model.simulate import build_simulated_model

    ids = torch.randint(3, 120, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        la = build_simulated_model(trt, simulate_kv=False)(ids).logits
        lb = build_simulated_model(mo, simulate_kv=False)(ids).logits
    assert torch.equal(la, lb)

    # `qtk inspect` judges the bytes: a scale_2 too small for the weights (FP8 overflow in the engine) fails
    import shutil

    from safetensors.torch import load_file, save_file

    bad = Path(shutil.copytree(d, tmp_path / "bad"))
    t = load_file(bad / "rank0.safetensors")
    t[qkv + "weights_scaling_factor_2"] = t[qkv + "weights_scaling_factor_2"] / 2
    save_file(t, bad / "rank0.safetensors", metadata={"format": "pt"})
    rep = api.inspect(bad)
    failed = [c.detail for c in rep.checks if not c.ok]
    assert any("exceeds 448 × scale_2" in f for f in failed), failed


def test_hf_modelopt_w4a8_awq_matches_modelopt(model, tmp_path, monkeypatch):
    """ModelOpt's unified HF W4A8_AWQ export: the same hf_quant_config.json and quantization_config (producer aside),
    tensor names, dtypes and shapes (pre_quant_scale on o_proj / down_proj only), the same conventions as its
    recorded v_proj bytes, one input_scale / weight_scale_2 per fused group, and the reader decodes exactly qtk's
    QTensors."""
    from qtk.export.codecs.trtllm import unpack_int4_pairs

    ref = REF["cases"]["hf/w4a8-awq"]
    res, seen = _convert_recording(monkeypatch, model, w4a8_static(), tmp_path / "out", ["hf-modelopt"])
    d = res.outputs["hf-modelopt"]
    _assert_hf_layout_matches(d, ref)
    mo = open_checkpoint(d)
    v = "model.layers.0.self_attn.v_proj."
    for k in ("weight", "weight_scale", "weight_scale_2", "input_scale"):
        assert mo.tensor(v + k).dtype == sample("hf/w4a8-awq", v + k).dtype, k
    q_ref = unpack_int4_pairs(sample("hf/w4a8-awq", v + "weight"))
    assert (q_ref == unpack_int4_pairs(mo.tensor(v + "weight"))[: q_ref.shape[0]]).float().mean() > 0.6
    for layer in range(2):
        p = f"model.layers.{layer}."
        for group in (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj")):
            for key in ("weight_scale_2", "input_scale"):
                vals = [mo.tensor(f"{p}{x}.{key}") for x in group]
                assert all(torch.equal(x, vals[0]) for x in vals), (p, group, key)
    for m, qt in seen.items():
        assert torch.equal(mo.qtensor(m).dequantize(), qt.dequantize()), m
    assert api.inspect(d).ok
    import shutil

    from safetensors.torch import load_file, save_file

    bad = Path(shutil.copytree(d, tmp_path / "bad"))
    for f in bad.glob("*.safetensors"):  # a weight_scale_2 too small for the weights: the engine's FP8 would overflow
        t = load_file(f)
        if v + "weight_scale_2" in t:
            t[v + "weight_scale_2"] = t[v + "weight_scale_2"] / 2
            save_file(t, f, metadata={"format": "pt"})
    failed = [c.detail for c in api.inspect(bad).checks if not c.ok]
    assert any("exceeds 448 × scale_2" in x for x in failed), failed


def test_trtllm_w4a8_awq_tp2_shards_concatenate_to_tp1(tmp_path):
    """TP 2: attention.dense / mlp.proj split along the input (packed int4 columns, group scales, pre-quant scale),
    qkv / fc / gate along the output (row pairs); the per-tensor scales are the same on every rank. Concatenated
    back, each rank's tensors are tp1's, and both decode to the same weights."""
    import sys

    from safetensors import safe_open

    sys.path.insert(0, str(HERE.parent))
    from models import make_tiny_model

    src = make_tiny_model(tmp_path / "m", hidden=256, intermediate=512, heads=4, kv_heads=2)
    outs = {}
    for tp in (1, 2):
        res = api.convert(src, w4a8_static(), tmp_path / f"out{tp}", targets=["trtllm"], tp=tp, num_samples=4,
                          seq_len=32, hash_source=False)
        outs[tp] = res.outputs["trtllm"]

    def load(path):
        with safe_open(str(path), "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}

    one, r0, r1 = load(outs[1] / "rank0.safetensors"), load(outs[2] / "rank0.safetensors"), load(outs[2] / "rank1.safetensors")
    assert r1["transformer.layers.0.attention.dense.weight"].shape == (128, 128)  # [out/2, in/2]: int4 row pairs
    assert r1["transformer.layers.0.attention.dense.weights_scaling_factor"].shape == (256, 1)
    assert r1["transformer.layers.0.mlp.fc.weight"].shape == (128, 256)
    for layer in range(2):
        p = f"transformer.layers.{layer}."
        for mod, axis in (("attention.dense", 1), ("mlp.proj", 1), ("mlp.fc", 0), ("mlp.gate", 0)):
            for k in ("weight", "weights_scaling_factor"):
                assert torch.equal(torch.cat([r0[p + mod + "." + k], r1[p + mod + "." + k]], axis), one[p + mod + "." + k]), (mod, k)
            pre = p + mod + ".prequant_scaling_factor"
            assert torch.equal(torch.cat([r0[pre], r1[pre]]) if axis == 1 else r0[pre], one[pre]), mod
            for k in ("weights_scaling_factor_2", "activation_scaling_factor"):
                assert torch.equal(r0[p + mod + "." + k], one[p + mod + "." + k]) and torch.equal(r1[p + mod + "." + k], one[p + mod + "." + k])
    a, b = open_checkpoint(outs[1]), open_checkpoint(outs[2])
    assert a.modules() == b.modules()
    for m in a.modules():
        assert torch.equal(a.qtensor(m).dequantize(), b.qtensor(m).dequantize()), m
        assert torch.equal(a.input_scale(m), b.input_scale(m)), m
    assert api.inspect(outs[2]).ok
