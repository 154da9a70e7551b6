"""Sparse MoE (Mixtral, Qwen3-MoE): every expert quantized under its checkpoint name, routers dense, an expert
that calibration never reaches handled without NaN and reported, smoothing folds that keep the float layer
(router included) unchanged, one static input scale per expert group as vLLM's fused MoE uses, TRT refused.

The round trip through transformers + compressed-tensors for every recipe is in test_architectures.py."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from models import make_tiny_model
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from qtk.model.source import ModelSource
from qtk.quant.qtensor import QTensor
from qtk.recipe import load_recipe

E, LAYERS = 4, 2
MOE = {
    "mixtral": {"num_local_experts": E, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 32, "num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "norm_topk_prob": True},
    "qwen2_moe": {"num_experts": E, "num_experts_per_tok": 2, "moe_intermediate_size": 128,
                  "shared_expert_intermediate_size": 256},
}
BLOCK = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")), "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
         "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj"))}
SHARED = {"qwen2_moe": 3}  # Linears of the shared expert (quantized like an ordinary MLP)


def _tensors(d) -> dict[str, tuple[torch.dtype, list[int]]]:
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                t = h.get_tensor(k)
                out[k] = (t.dtype, list(t.shape))
    return out


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {mt: make_tiny_model(root / mt, model_type=mt, hidden=128, intermediate=256, **kw) for mt, kw in MOE.items()}


def _starve(d, model_type: str) -> Path:
    """Bias the routers of the tiny model in d so that expert 3 can never be picked: residual channel 0 is 1.0 for
    every token in every layer (embedding column 0 = 1, o_proj and every expert's down Linear write nothing to
    channel 0), and expert 3's router row reads only that channel with weight -50, while experts 0-2 read the other
    channels with O(1) weights."""
    block, (_, _, down) = BLOCK[model_type]
    f = d / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(1)
    sd["model.embed_tokens.weight"][:, 0] = 1.0
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        sd[p + "self_attn.o_proj.weight"][0, :] = 0
        for e in range(E):
            sd[p + f"{block}.experts.{e}.{down}.weight"][0, :] = 0
        if model_type in SHARED:
            sd[p + f"{block}.shared_expert.{down}.weight"][0, :] = 0
        r = torch.zeros(E, 128)
        r[:3, 1:] = torch.randn(3, 127, generator=g) * 0.3
        r[3, 0] = -50.0
        sd[p + f"{block}.gate.weight"] = r.to(torch.bfloat16)
    save_file(sd, str(f), metadata={"format": "pt"})
    return d


@pytest.fixture(scope="module")
def starved(tmp_path_factory):
    root = tmp_path_factory.mktemp("starved")
    return {mt: _starve(make_tiny_model(root / mt, model_type=mt, hidden=128, intermediate=256, **kw), mt)
            for mt, kw in MOE.items()}


@pytest.fixture(scope="module")
def starved_mixtral(starved):
    return starved["mixtral"]


@pytest.mark.parametrize("model_type", list(MOE))
@pytest.mark.parametrize("recipe", ["w4a16-gptq", "fp8"])
def test_every_expert_quantized_routers_dense(moe_models, calib_file, tmp_path, model_type, recipe):
    res = api.convert(moe_models[model_type], recipe, tmp_path / "o", calib=str(calib_file), num_samples=4,
                      seq_len=48, hash_source=False)
    d = res.outputs["vllm"]
    tensors = _tensors(d)
    block, (g, u, dn) = BLOCK[model_type]
    qsuffix = "weight_packed" if recipe == "w4a16-gptq" else "weight"
    pat = re.compile(rf"model\.layers\.(\d+)\.{block}\.experts\.(\d+)\.({g}|{u}|{dn})\.{qsuffix}$")
    experts = [k for k in tensors if pat.match(k)]
    assert len(experts) == E * 3 * LAYERS
    for k in experts:
        base = k[: -len(qsuffix) - 1]
        assert base + ".weight_scale" in tensors
        if recipe == "fp8":
            assert tensors[k][0] == torch.float8_e4m3fn
        else:
            assert tensors[k][0] == torch.int32
    # no fused or transformers-internal expert names leak into the checkpoint
    assert not [k for k in tensors if "gate_up_proj" in k or k.endswith("experts.down_proj")]
    for i in range(LAYERS):
        router = f"model.layers.{i}.{block}.gate"
        assert tensors[router + ".weight"] == (torch.bfloat16, [E, 128])
        assert router + ".weight_scale" not in tensors and router + ".input_scale" not in tensors
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert f"re:.*{block}\\.gate$" in qc["ignore"]
    report = api.inspect(d)
    assert report.ok, [c for c in report.checks if not c.ok]
    assert report.summary["quantized_modules"] == LAYERS * (4 + 3 * E + SHARED.get(model_type, 0))
    if model_type in SHARED:  # the shared expert is quantized; its sigmoid gate stays 16-bit, excluded by name
        for i in range(LAYERS):
            p = f"model.layers.{i}.{block}"
            assert all(tensors[f"{p}.shared_expert.{w}.{qsuffix}"][0] == tensors[experts[0]][0] for w in (g, u, dn))
            assert tensors[f"{p}.shared_expert_gate.weight"] == (torch.bfloat16, [1, 128])
            assert f"{p}.shared_expert_gate" in qc["ignore"]
            assert f"{p}.shared_expert_gate.weight_scale" not in tensors
    assert len(res.manifest["stats"]["expert_tokens"]) == LAYERS
    assert all(len(v) == E for v in res.manifest["stats"]["expert_tokens"].values())


def test_static_input_scale_is_one_per_expert_group(moe_models, calib_file, tmp_path):
    """vLLM's fused MoE runs all experts' w1/w3 with one input scale and all w2 with one (the max over experts):
    qtk writes that max to every expert, so the checkpoint means the same to vLLM as to qtk's simulation."""
    res = api.convert(moe_models["mixtral"], "fp8", tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48,
                      hash_source=False)
    ck = open_checkpoint(res.outputs["vllm"])
    amax = res.manifest["stats"]["input_amax"]
    for i in range(LAYERS):
        p = f"model.layers.{i}.block_sparse_moe.experts"
        w13 = {float(ck.input_scale(f"{p}.{e}.{w}")) for e in range(E) for w in ("w1", "w3")}
        w2 = {float(ck.input_scale(f"{p}.{e}.w2")) for e in range(E)}
        assert len(w13) == 1 and len(w2) == 1 and min(w13 | w2) > 0
        assert w13 != w2  # the groups are separate: down_proj's input is not the layer input
        assert amax[f"{p}.0.w1"] == pytest.approx(w13.pop() * 448, rel=1e-6)


@pytest.mark.parametrize("model_type", list(MOE))
def test_expert_without_tokens_is_reported_and_quantized_with_rtn(starved, calib_file, tmp_path, caplog, model_type):
    block, names = BLOCK[model_type]
    recipe = load_recipe("w4a16-gptq")
    with caplog.at_level("WARNING"):
        res = api.convert(starved[model_type], recipe, tmp_path / "o", calib=str(calib_file), num_samples=4,
                          seq_len=48, hash_source=False)
    stats = res.manifest["stats"]
    for i in range(LAYERS):
        tokens = stats["expert_tokens"][f"model.layers.{i}.{block}"]
        assert tokens[3] == 0 and min(tokens[:3]) > 0
        assert sum(tokens) == 4 * 48 * 2  # every token goes to top-2 experts
        assert stats["starved_experts"][f"model.layers.{i}.{block}.experts.3"] == 0
        gptq = stats["algorithm"][i]["gptq"]
        for w in names:
            assert gptq[f"{block}.experts.3.{w}"] == {"fallback": "rtn", "reason": "no calibration tokens"}
        # the manifest says per expert how it was treated: the starved one by RTN, the others by GPTQ where their
        # Hessian saw at least the recipe's 64 tokens, else by RTN saying how many it saw
        treat = {e: stats["expert_treatment"][f"model.layers.{i}.{block}.experts.{e}"] for e in range(E)}
        assert treat[3] == {"tokens": 0, "weights": "rtn: no calibration tokens"}
        for e in range(3):
            assert treat[e]["tokens"] == tokens[e]
            rec = gptq[f"{block}.experts.{e}.{names[0]}"]
            if treat[e]["weights"] == "gptq":
                assert "fallback" not in rec and tokens[e] >= 60
            else:
                assert treat[e]["weights"] == "rtn: " + rec["reason"]
                assert re.fullmatch(r"\d+ calibration tokens, fewer than calibration.min_expert_tokens \(64\)",
                                    rec["reason"]) and tokens[e] < 70
        assert [e for e in range(3) if treat[e]["weights"] == "gptq"]
    assert "received no calibration tokens; quantized with RTN" in caplog.text
    assert f"{block}.experts.3 (0)" in caplog.text
    assert any("received none" in n and "GPTQ rounded" in n and "stats.expert_treatment" in n for n in res.notes["vllm"])
    d = res.outputs["vllm"]
    assert "received none" in (d / "README.md").read_text()
    ck = open_checkpoint(d)
    src = ModelSource(starved[model_type])
    for i in range(LAYERS):
        for w in names:
            m = f"model.layers.{i}.{block}.experts.3.{w}"
            qt = ck.qtensor(m)
            assert torch.isfinite(qt.scale).all() and (qt.scale > 0).all()
            # exactly RTN of the source weight (GPTQ with its all-zero Hessian would have zeroed every column)
            rtn = QTensor.quantize(src.tensor(m + ".weight").float(), recipe.weights, src.dtype)
            assert torch.equal(qt.values, rtn.values) and torch.equal(qt.scale, rtn.scale.to(qt.scale.dtype).float())
            assert qt.values.unique().numel() > 4
    assert api.inspect(d).ok


def test_experts_under_the_minimum_are_rounded_to_nearest(starved_mixtral, calib_file, tmp_path):
    """An expert that some tokens reached, but fewer than calibration.min_expert_tokens, gets no GPTQ solve fitted to
    those few tokens: its weights are rounded to nearest from their own statistics, bit for bit, and the manifest
    says why; attention Linears (which see every token) are still solved by GPTQ."""
    text = load_recipe("w4a16-gptq").text
    text = text.replace("calibration: {", "calibration: {min_expert_tokens: 100000, ")
    r = tmp_path / "r.yaml"
    r.write_text(text)
    recipe = load_recipe(r)
    res = api.convert(starved_mixtral, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48,
                      hash_source=False)
    stats = res.manifest["stats"]
    treat = stats["expert_treatment"]
    tokens = stats["expert_tokens"]["model.layers.0.block_sparse_moe"]
    for e in range(3):
        t = treat[f"model.layers.0.block_sparse_moe.experts.{e}"]
        assert t["tokens"] == tokens[e] > 0
        # GPTQ counts the tokens its Hessian saw, routed by the float layer; `tokens` are routed with the quantized
        # attention upstream (what the next layer sees), so a token near a routing tie may go either way
        n = re.fullmatch(r"rtn: (\d+) calibration tokens, fewer than calibration.min_expert_tokens \(100000\)",
                         t["weights"])
        assert n and abs(int(n.group(1)) - tokens[e]) <= 3
    assert "fallback" not in stats["algorithm"][0]["gptq"]["self_attn.q_proj"]
    ck = open_checkpoint(res.outputs["vllm"])
    src = ModelSource(starved_mixtral)
    m = "model.layers.0.block_sparse_moe.experts.1.w1"
    rtn = QTensor.quantize(src.tensor(m + ".weight").float(), recipe.weights, src.dtype)
    assert torch.equal(ck.qtensor(m).values, rtn.values)
    q = "model.layers.0.self_attn.q_proj"
    assert not torch.equal(ck.qtensor(q).values,
                           QTensor.quantize(src.tensor(q + ".weight").float(), recipe.weights, src.dtype).values)
    assert api.inspect(res.outputs["vllm"]).ok


@pytest.mark.parametrize("damage", ["zero", "nan"])
def test_expert_with_a_zero_or_nan_scale_fails_inspect(starved_mixtral, calib_file, tmp_path, damage):
    """A checkpoint in which one expert's weight scales were zeroed or NaN'd on disk (what peers write for an expert
    calibration never reached) fails `qtk inspect`, naming that expert."""
    res = api.convert(starved_mixtral, "fp8", tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48,
                      hash_source=False)
    d = res.outputs["vllm"]
    assert api.inspect(d).ok
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    m = "model.layers.1.block_sparse_moe.experts.3.w2"
    sd[m + ".weight_scale"] = torch.full_like(sd[m + ".weight_scale"], 0.0 if damage == "zero" else math.nan)
    save_file(sd, str(f), metadata={"format": "pt"})
    report = api.inspect(d)
    assert not report.ok
    bad = {c.name: c.detail for c in report.checks if not c.ok}
    assert "weight scales finite and positive (an int grid's in magnitude)" in bad, bad
    assert m in bad["weight scales finite and positive (an int grid's in magnitude)"]


@pytest.mark.parametrize("recipe", ["int8-kv8", "w4a16-awq", "fp8"])
def test_expert_without_tokens_smoothing_and_static_scales_stay_finite(starved_mixtral, calib_file, tmp_path, recipe):
    """SmoothQuant/AWQ on an expert with no tokens fold s = 1; a static input scale never comes from amax 0."""
    res = api.convert(starved_mixtral, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48,
                      hash_source=False)
    ck = open_checkpoint(res.outputs["vllm"])
    algo = res.manifest["stats"]["algorithm"][0]
    if recipe == "int8-kv8":
        assert algo["smoothquant"]["block_sparse_moe.experts.3.w3"] is None
        assert algo["smoothquant"]["block_sparse_moe.experts.0.w3"] is not None
    if recipe == "w4a16-awq":
        assert "block_sparse_moe.experts.3.w3" in algo["awq"]["scales"]
        assert algo["awq"]["scales"]["block_sparse_moe.experts.3.w3"] is None
    treat = res.manifest["stats"]["expert_treatment"]
    starved_one, fed = (treat[f"model.layers.0.block_sparse_moe.experts.{e}"] for e in (3, 0))
    if recipe in ("int8-kv8", "w4a16-awq"):
        assert starved_one["smoothing"] == "s = 1: no calibration tokens"
        assert fed["smoothing"] in (("smoothquant",) if recipe == "int8-kv8" else
                                    ("awq", "s = 1: the search kept the weights as they are"))
    assert ("input_scale" in starved_one) == load_recipe(recipe).static_activations
    for m in ck.modules():
        qt = ck.qtensor(m)
        assert torch.isfinite(qt.dequantize()).all(), m
        s = ck.input_scale(m)
        assert s is None or (torch.isfinite(s).all() and (s > 0).all())
    for t in ck.dense_state_dict().values():
        assert not t.is_floating_point() or torch.isfinite(t).all()
    assert api.inspect(res.outputs["vllm"]).ok


@pytest.mark.parametrize("model_type", list(MOE))
def test_smoothquant_fold_keeps_the_float_moe_layer(moe_models, calib_file, model_type):
    """post_attention_layernorm feeds the router and every expert: one s is folded into the norm, every
    expert's gate/up columns and the router's columns, so routing and the layer output do not change."""
    from qtk.recipe.params import STEP_PARAMS
    from qtk.steps.smoothquant import apply_smoothquant
    from qtk.calib import calibration_ids, load_texts
    from qtk.pipeline import capture_layer_inputs

    src = ModelSource(moe_models[model_type])
    ids = calibration_ids(src.tokenizer(), load_texts(str(calib_file), "text"), 4, 48, 0)
    skeleton = src.skeleton()
    batches, _ = capture_layer_inputs(src, skeleton, ids, 2)
    batches = [(h.float(), kw) for h, kw in batches]
    layer = src.layer(skeleton, 0, dtype=torch.float32)
    block, (g, u, _) = BLOCK[model_type]
    norm = layer.post_attention_layernorm.weight.detach().clone()
    router = layer.get_submodule(f"{block}.gate").weight.detach().clone()
    w1 = layer.get_submodule(f"{block}.experts.2.{g}").weight.detach().clone()
    dense_gate = [layer.get_submodule(f"{block}.shared_expert_gate").weight.detach().clone()] if model_type in SHARED else []
    with torch.no_grad():
        before = [layer(h, **kw) for h, kw in batches]
    targets = list(src.arch.linears)
    master = {t: layer.get_submodule(t).weight.detach().float() for t in targets}
    rec = apply_smoothquant(layer, src.arch, targets, batches, STEP_PARAMS["smoothquant"](alpha=0.8), master).scales
    assert rec["post_attention_layernorm"] is not None and rec[f"{block}.experts.1.{u}"] is not None
    s = torch.tensor(rec["post_attention_layernorm"])
    assert (s - 1).abs().max() > 0.05  # a real migration happened
    torch.testing.assert_close(layer.post_attention_layernorm.weight.detach(), norm / s)
    torch.testing.assert_close(layer.get_submodule(f"{block}.gate").weight.detach(), router * s)
    torch.testing.assert_close(layer.get_submodule(f"{block}.experts.2.{g}").weight.detach(), w1 * s)
    for w in dense_gate:  # the shared expert's 16-bit gate reads the same input: s folded into it too
        torch.testing.assert_close(layer.get_submodule(f"{block}.shared_expert_gate").weight.detach(), w * s)
    with torch.no_grad():
        after = [layer(h, **kw) for h, kw in batches]
    for a, b in zip(before, after):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


def test_trtllm_refuses_moe(moe_models, tmp_path):
    with pytest.raises(UsageError, match="not 'mixtral'.*use --target vllm") as e:
        api.convert(moe_models["mixtral"], "w8a16", tmp_path / "o", targets=["trtllm"])
    assert e.value.exit_code == 2
    assert not (tmp_path / "o").exists()


def test_trtllm_refusal_cli_exit_2(moe_models, tmp_path):
    from click.testing import CliRunner

    from qtk.cli import main

    r = CliRunner().invoke(main, ["convert", str(moe_models["qwen3_moe"]), "-r", "w8a16", "-o", str(tmp_path / "o"),
                                  "--target", "trtllm"])
    assert r.exit_code == 2
    assert "use --target vllm" in r.output and "Traceback" not in r.output


def test_mixed_dense_and_moe_layers_are_refused(moe_models, tmp_path):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(moe_models["qwen3_moe"], d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["mlp_only_layers"] = [1]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UsageError, match="mixes dense and MoE layers"):
        api.convert(d, "w8a16", tmp_path / "o")


def test_missing_expert_fails_inspect(moe_models, calib_file, tmp_path):
    """A checkpoint in which one expert was left dense fails `qtk inspect`'s coverage check, naming it."""
    res = api.convert(moe_models["qwen3_moe"], "fp8-dynamic", tmp_path / "o", hash_source=False)
    d = res.outputs["vllm"]
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    m = "model.layers.1.mlp.experts.2.down_proj"
    w = sd.pop(m + ".weight").float() * sd.pop(m + ".weight_scale").float()
    sd[m + ".weight"] = w.to(torch.bfloat16)
    save_file(sd, str(f), metadata={"format": "pt"})
    report = api.inspect(d)
    assert not report.ok
    bad = [c for c in report.checks if not c.ok]
    assert bad[0].name == "every targeted Linear is quantized" and m in bad[0].detail


@pytest.mark.parametrize("recipe,target", [("w4a16-gptq", "gptq"), ("w4a16-awq", "awq"), ("fp8", "hf-modelopt")])
def test_other_targets_quantize_every_expert_and_exclude_routers(moe_models, calib_file, tmp_path, recipe, target):
    """The legacy GPTQ/AWQ and ModelOpt writers see experts as ordinary Linears too; routers are excluded by
    name, so an engine that would quantize them (vLLM's Qwen3-MoE gate takes the quant config) leaves them dense."""
    res = api.convert(moe_models["qwen3_moe"], recipe, tmp_path / "o", targets=[target], calib=str(calib_file),
                      num_samples=4, seq_len=48, hash_source=False)
    ck = open_checkpoint(res.outputs[target])
    mods = ck.modules()
    assert len([m for m in mods if ".mlp.experts." in m]) == E * 3 * LAYERS
    assert not [m for m in mods if m.endswith("mlp.gate")]
    from qtk.recipe import matches

    excluded = ck.ignore_patterns()
    assert all(matches(f"model.layers.{i}.mlp.gate", excluded) for i in range(LAYERS)), excluded
    assert not matches("model.layers.0.mlp.experts.0.gate_proj", excluded)
    assert api.inspect(res.outputs[target]).ok
