"""DeepSeek-V3 (MLA attention, dense first layers, routed + shared experts, a router bias): what qtk quantizes
follows what vLLM's deepseek_v2.py runs with the checkpoint's quant_config (every attention Linear, the dense
layers' MLPs, routed and shared experts), the router and its e_score_correction_bias stay as the source holds
them, a KV-cache recipe is refused (vLLM caches MLA's latent), and `qtk plan` counts the latent cache.

Every recipe's round trip through transformers + compressed-tensors is in test_architectures.py."""

import json

import pytest
import torch
from models import make_tiny_model
from safetensors.torch import load_file, save_file

from fp8_sources import read_tensors
from qtk import api
from qtk.errors import UsageError
from qtk.export import open_checkpoint
from test_architectures import DEEPSEEK

LAYERS = 3  # layer 0 dense (first_k_dense_replace 1), layers 1-2 sparse
ATTN = ("q_a_proj", "kv_a_proj_with_mqa", "q_b_proj", "kv_b_proj", "o_proj")


def _with_router_bias(d):
    """DeepSeek's router adds e_score_correction_bias to the scores it picks experts by: give it values that change
    which experts are picked (the tiny model's init leaves it zero), in float32 beside bf16 weights, as DeepSeek-V3
    ships it."""
    f = d / "model.safetensors"
    sd = load_file(str(f))
    g = torch.Generator().manual_seed(2)
    for i in range(1, LAYERS):
        sd[f"model.layers.{i}.mlp.gate.e_score_correction_bias"] = torch.randn(4, generator=g) * 0.5
    save_file(sd, str(f), metadata={"format": "pt"})
    return d


def assert_router_as_stored(src, d, parts=("weight", "e_score_correction_bias")) -> dict:
    """The sparse layers' router tensors written as the source holds them: the same dtype and values (torch.equal
    alone would pass a float32 bias written as bf16). Returns the written tensors."""
    source, written = read_tensors(src), read_tensors(d)
    for i in range(1, LAYERS):
        for t in parts:
            k = f"model.layers.{i}.mlp.gate.{t}"
            assert written[k].dtype == source[k].dtype and torch.equal(written[k], source[k]), k
            assert source[k].abs().sum() > 0, k  # values that route, not the skeleton's zeros
    return written


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    root = tmp_path_factory.mktemp("deepseek")
    return {"q_lora": _with_router_bias(make_tiny_model(root / "q_lora", model_type="deepseek_v3", layers=LAYERS,
                                                        hidden=128, intermediate=256, **DEEPSEEK)),
            "q_proj": _with_router_bias(make_tiny_model(root / "q_proj", model_type="deepseek_v3", layers=LAYERS,
                                                        hidden=128, intermediate=256, **{**DEEPSEEK, "q_lora_rank": None}))}


@pytest.mark.parametrize("variant", ["q_lora", "q_proj"])
def test_what_is_quantized_and_what_stays_as_the_source_holds_it(deepseek, calib_file, tmp_path, variant):
    src = deepseek[variant]
    res = api.convert(src, "w4a16-gptq", tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48,
                      hash_source=False)
    d = res.outputs["vllm"]
    ck = open_checkpoint(d)
    mods = set(ck.modules())
    attn = ATTN if variant == "q_lora" else ("q_proj",) + ATTN[1:2] + ATTN[3:]
    for i in range(LAYERS):
        assert {f"model.layers.{i}.self_attn.{m}" for m in attn} <= mods
    assert not any("q_a_layernorm" in m or "kv_a_layernorm" in m for m in mods)
    assert {f"model.layers.0.mlp.{m}" for m in ("gate_proj", "up_proj", "down_proj")} <= mods
    for i in range(1, LAYERS):
        p = f"model.layers.{i}.mlp"
        assert {f"{p}.experts.{e}.{m}" for e in range(4) for m in ("gate_proj", "up_proj", "down_proj")} <= mods
        assert {f"{p}.shared_experts.{m}" for m in ("gate_proj", "up_proj", "down_proj")} <= mods
    assert len(mods) == LAYERS * len(attn) + 3 + (LAYERS - 1) * (4 + 1) * 3
    # the router and its bias: not quantized, the source's bytes
    assert_router_as_stored(src, d)
    qc = json.loads((d / "config.json").read_text())["quantization_config"]
    assert "re:.*mlp\\.gate$" in qc["ignore"]
    # the bias routes calibration tokens: it was loaded, not left at the skeleton's zeros
    assert res.manifest["stats"]["expert_tokens"]["model.layers.1.mlp"] != [0] * 4
    report = api.inspect(d)
    assert report.ok, [c for c in report.checks if not c.ok]


@pytest.mark.parametrize("recipe", ["w4a16", "fp8-dynamic"])
def test_data_free_stream_keeps_the_router_bias_as_stored(deepseek, tmp_path, recipe):
    """The data-free stream writes what the layer loop writes: a float32 routing bias stays float32 (cast to the
    model's bf16 it would round the scores vLLM picks experts by), byte for byte the source's."""
    src = deepseek["q_lora"]
    d = api.convert(src, recipe, tmp_path / "o", hash_source=False).outputs["vllm"]
    assert read_tensors(src)["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    written = assert_router_as_stored(src, d)
    assert written["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16
    assert api.inspect(d).ok


def test_router_bias_changes_routing_in_the_simulation(deepseek, tmp_path):
    """The simulated model reads e_score_correction_bias from the checkpoint: with it zeroed the logits change."""
    from qtk.model.simulate import build_simulated_model

    res = api.convert(deepseek["q_lora"], "w8a16", tmp_path / "o", hash_source=False)
    d = res.outputs["vllm"]
    ids = torch.randint(3, 90, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)(ids).logits
    f = next(d.glob("*.safetensors"))
    sd = load_file(str(f))
    for k in [k for k in sd if k.endswith("e_score_correction_bias")]:
        sd[k] = torch.zeros_like(sd[k])
    save_file(sd, str(f), metadata={"format": "pt"})
    with torch.no_grad():
        b = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)(ids).logits
    assert (a - b).abs().max() > 1e-3


@pytest.mark.parametrize("recipe", ["int8-kv8", "fp8-kv8"])
def test_kv_cache_recipes_are_refused_before_any_work(deepseek, tmp_path, recipe):
    from click.testing import CliRunner

    from qtk.cli import main

    r = CliRunner().invoke(main, ["convert", str(deepseek["q_lora"]), "-r", recipe, "-o", str(tmp_path / "o")])
    assert r.exit_code == 2, r.output
    line = [x for x in r.output.splitlines() if x.startswith("error:")]
    assert len(line) == 1 and "MLA" in line[0] and "kv_lora_rank + qk_rope_head_dim" in line[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("variant", ["q_lora", "q_proj"])
def test_plan_counts_the_latent_kv_cache_and_the_bytes_the_conversion_writes(deepseek, tmp_path, variant):
    """qtk plan from config.json alone: MLA caches kv_lora_rank + qk_rope_head_dim per token and layer (as vLLM
    stores it), and the checkpoint bytes it counts for a recipe are the bytes the conversion writes."""
    from qtk.plan.memory import ModelShape, kv_bytes_per_token, read_config, weight_bytes
    from qtk.recipe import load_recipe

    s = ModelShape.from_config(read_config(deepseek[variant] / "config.json"))
    assert s.is_mla and s.moe_layers == (False, True, True)
    assert kv_bytes_per_token(s, 2) == LAYERS * (DEEPSEEK["kv_lora_rank"] + DEEPSEEK["qk_rope_head_dim"]) * 2
    res = api.convert(deepseek[variant], "w4a16", tmp_path / "o", hash_source=False)
    # config.json does not say the routing bias is stored in float32 (kept so): plan counts it in the model dtype
    written = sum(t.numel() * (2 if k.endswith("e_score_correction_bias") else t.element_size())
                  for k, t in read_tensors(res.outputs["vllm"]).items())
    assert weight_bytes(s, load_recipe("w4a16")).total == written
    # a KV-cache recipe is planned with a note that convert refuses it
    notes = api.plan(deepseek[variant], "int8-kv8", gpu="H100").notes
    assert any("qtk convert refuses for MLA" in n for n in notes), notes
    assert not any("refuses" in n for n in api.plan(deepseek[variant], "w4a16", gpu="H100").notes)


def test_mla_layers_are_refused_by_a_family_without_them(tmp_path):
    """A config mixing dense and sparse layers other than DeepSeek's dense-first layout is still refused."""
    from qtk.model.arch import arch_for

    with pytest.raises(UsageError, match="mixes dense and MoE layers"):
        arch_for("deepseek_v3", {"model_type": "deepseek_v3", "n_routed_experts": 4, "moe_layer_freq": 2})


@pytest.mark.parametrize("recipe", ["w8a16", "w8a16-gptq"])  # the data-free stream and the calibrated loop
def test_glm4_moe_router_bias_is_written_as_the_source_holds_it(tmp_path, calib_file, recipe):
    """GLM-4.5 routes as DeepSeek does: its e_score_correction_bias, a buffer, is read from the checkpoint and written
    back on both conversion paths, and its dense first layer's MLP is quantized."""
    from test_architectures import ARCH_CONFIGS

    src = make_tiny_model(tmp_path / "glm", model_type="glm4_moe", layers=LAYERS, hidden=128, intermediate=256,
                          **ARCH_CONFIGS["glm4_moe"])
    _with_router_bias(src)
    res = api.convert(src, recipe, tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=48, hash_source=False)
    d = res.outputs["vllm"]
    assert_router_as_stored(src, d, parts=("e_score_correction_bias",))
    assert "model.layers.0.mlp.down_proj" in open_checkpoint(d).modules()
    assert api.inspect(d).ok
