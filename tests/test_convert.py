"""End to end: every shipped recipe converts, reloads in transformers + compressed-tensors (a real client)
with the logits of qtk's own simulated model, and writes KV scales = amax/448 measured independently."""

import json

import pytest
import torch

from models import EXAMPLE, apply_ct_transforms, needs_ct_float32_decode
from qtk import api
from qtk.calib import calibration_ids, load_texts
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.plan.decide import w4a8_kind
from qtk.recipe import builtin_recipes, load_recipe

# FP8 blocks need Linears that are multiples of 128 both ways (the tiny models' k/v have 64 rows, which vLLM refuses):
# tests/export/test_formats_next_vllm.py runs those recipes on a model they tile
# static W4A8 (TensorRT-LLM's W4A8_AWQ: static per-tensor FP8 inputs) has no vLLM form: tests/trtllm covers it
RECIPES = sorted(r for r in builtin_recipes() if load_recipe(r).weights.strategy != "block"
                 and w4a8_kind(load_recipe(r)) != "fp8-static")
NS, T = 8, 64


def _models(tiny_llama):
    out = [("random", tiny_llama)]
    if (EXAMPLE / "model.safetensors").is_file():
        out.append(("example", EXAMPLE))
    return out


@pytest.fixture(scope="module")
def converted(tiny_llama, calib_file, tmp_path_factory):
    """Each recipe once per model; the outputs are shared by the tests below."""
    out = {}
    root = tmp_path_factory.mktemp("conv")
    for label, model in _models(tiny_llama):
        for r in RECIPES:
            res = api.convert(model, r, root / label / r, calib=str(calib_file), num_samples=NS, seq_len=T, hash_source=False)
            out[(label, r)] = (model, res.outputs["vllm"])
    return out


def _reload(d):
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    model = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                 quantization_config=CompressedTensorsConfig(dequantize=True))
    # transformers does not apply a checkpoint's online transforms (w4a16-rot4-gptq's R4): compressed-tensors' own code does
    return apply_ct_transforms(model, d).eval()


@needs_ct_float32_decode
def test_every_recipe_reloads_in_transformers_with_simulated_logits(converted):
    ids = torch.randint(3, 90, (2, 48), generator=torch.Generator().manual_seed(0))
    assert {r for _, r in converted} == set(RECIPES)
    for (label, r), (_, d) in converted.items():
        sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
        ref = _reload(d)
        with torch.no_grad():
            a, b = ref(ids).logits, sim(ids).logits
        diff = (a - b).abs().max().item()
        assert diff <= 1e-4, f"{label}/{r}: transformers reload differs from qtk's model by {diff}"
        cfg = json.loads((d / "config.json").read_text())["quantization_config"]
        assert cfg["quant_method"] == "compressed-tensors" and cfg["quantization_status"] == "compressed"
        assert "lm_head" in cfg["ignore"]


@needs_ct_float32_decode
def test_quantized_model_is_close_to_but_not_the_source(converted):
    """The reload is really quantized (differs from bf16) and still close to it."""
    from transformers import AutoModelForCausalLM

    ids = torch.randint(3, 90, (1, 32), generator=torch.Generator().manual_seed(1))
    for (label, r), (model, d) in converted.items():
        if label != "random":
            continue
        base = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()
        with torch.no_grad():
            a = base(ids).logits.log_softmax(-1)
            b = _reload(d)(ids).logits.log_softmax(-1)
        kl = (a.exp() * (a - b)).sum(-1).mean().item()
        assert 0 < kl < 0.5, f"{r}: KL to the source {kl}"


def _independent_kv_amax(model_dir, d, calib_file):
    """K after RoPE recomputed by hand from k_proj outputs and the model's rotary embedding, V from v_proj, in the
    model dtype (bf16) as the engine and qtk's calibration compute them."""
    from transformers import AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    ck = open_checkpoint(d)
    m = build_simulated_model(ck, simulate_kv=False, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = calibration_ids(tok, load_texts(str(calib_file)), NS, T, 0)
    cfg = m.config
    hd = cfg.hidden_size // cfg.num_attention_heads
    k_out, v_out = {}, {}
    hooks = []
    for i, layer in enumerate(m.model.layers):
        hooks.append(layer.self_attn.k_proj.register_forward_hook(lambda mod, a, o, i=i: k_out.setdefault(i, []).append(o)))
        hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda mod, a, o, i=i: v_out.setdefault(i, []).append(o)))
    with torch.no_grad():
        for b in ids.split(8):
            m(b)
    pos = torch.arange(T).unsqueeze(0)
    cos, sin = m.model.rotary_emb(torch.zeros(1, T, 1, dtype=torch.bfloat16), pos)
    out = {}
    for i in k_out:
        k = torch.cat(k_out[i]).view(NS, T, -1, hd).transpose(1, 2)
        _, k_rot = apply_rotary_pos_emb(k, k, cos, sin)
        out[i] = (k_rot.abs().max().item(), torch.cat(v_out[i]).abs().max().item())
    return out


@pytest.mark.parametrize("recipe", ["int8-kv8", "fp8-kv8"])
def test_kv_scales_are_amax_over_448_of_k_after_rope_and_v(converted, calib_file, recipe):
    for (label, r), (model, d) in converted.items():
        if r != recipe:
            continue
        ck = open_checkpoint(d)
        assert ck.kv_cache == "fp8"
        amax = _independent_kv_amax(model, d, calib_file)
        for i, (ka, va) in amax.items():
            k_scale, v_scale = ck.kv_scales(i)
            assert k_scale == pytest.approx(ka / 448, rel=1e-4), (label, i)
            assert v_scale == pytest.approx(va / 448, rel=1e-4), (label, i)
            assert k_scale != pytest.approx(v_scale)  # K and V really measured separately


def test_static_activation_scales_and_shared_qkv_weight_scale(converted):
    for (label, r), (model, d) in converted.items():
        if r != "fp8":
            continue
        ck = open_checkpoint(d)
        for i in range(2):
            p = f"model.layers.{i}"
            qkv = [ck.qtensor(f"{p}.self_attn.{x}_proj").scale for x in "qkv"]
            assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2])  # fused group, one scale
            gu = [ck.qtensor(f"{p}.mlp.{x}_proj").scale for x in ("gate", "up")]
            assert torch.equal(gu[0], gu[1])
            ins = [ck.input_scale(f"{p}.self_attn.{x}_proj") for x in "qkv"]
            assert all(s is not None and s.item() > 0 for s in ins) and torch.equal(ins[0], ins[1])


def test_manifest_records_recipe_calibration_and_versions(converted):
    (model, d) = converted[("random", "int8-kv8")]
    m = json.loads((d / "qtk.json").read_text())
    assert m["recipe"]["name"] == "int8-kv8" and m["recipe"]["hash"] == load_recipe("int8-kv8").hash
    assert m["calibration"]["num_samples"] == NS and m["calibration"]["seq_len"] == T
    assert len(m["calibration"]["token_hash"]) == 16
    import importlib.metadata as md

    assert m["versions"]["compressed-tensors"] == md.version("compressed-tensors")
    assert set(m["stats"]["kv_amax"]) == {"0", "1"}
    assert (d / "tokenizer.json").is_file() and (d / "generation_config.json").is_file()
    readme = (d / "README.md").read_text()
    serve = next(line for line in readme.splitlines() if line.startswith("vllm serve"))
    # the 8-bit KV recipe runs as FP8 KV in vLLM, at the path the checkpoint was renamed to
    assert "--kv-cache-dtype fp8" in serve and str(d) in serve and "qtk-tmp" not in readme


def test_calibration_free_recipe_is_deterministic_and_skips_calibration(tiny_llama, tmp_path):
    a = api.convert(tiny_llama, "w4a16", tmp_path / "a", hash_source=False)
    b = api.convert(tiny_llama, "w4a16", tmp_path / "b", hash_source=False)
    assert a.manifest["calibration"] == {"used": False}
    fa = (a.outputs["vllm"] / "model.safetensors").read_bytes()
    assert fa == (b.outputs["vllm"] / "model.safetensors").read_bytes()


def test_calibrated_conversion_is_deterministic(tiny_llama, calib_file, tmp_path):
    outs = [api.convert(tiny_llama, "fp8-kv8", tmp_path / n, calib=str(calib_file), num_samples=4, seq_len=32,
                        hash_source=False).outputs["vllm"] for n in "ab"]
    assert (outs[0] / "model.safetensors").read_bytes() == (outs[1] / "model.safetensors").read_bytes()


def test_sharded_source_and_sharded_output(tmp_path, calib_file):
    from models import make_tiny_model

    src = make_tiny_model(tmp_path / "sharded", hidden=128, intermediate=256, shard_bytes=200_000)
    assert (src / "model.safetensors.index.json").is_file()
    res = api.convert(src, "int8-kv8", tmp_path / "o", calib=str(calib_file), num_samples=4, seq_len=32,
                      max_shard_bytes=150_000, hash_source=False)
    d = res.outputs["vllm"]
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    shards = sorted(set(idx["weight_map"].values()))
    assert len(shards) > 1 and all((d / s).is_file() for s in shards)
    from safetensors import safe_open

    n = 0
    for s in shards:
        with safe_open(str(d / s), "pt") as f:
            for k in f.keys():
                assert idx["weight_map"][k] == s
                f.get_tensor(k)
                n += 1
    assert n == len(idx["weight_map"])
    ref = api.convert(src, "int8-kv8", tmp_path / "o1", calib=str(calib_file), num_samples=4, seq_len=32, hash_source=False)
    a, b = open_checkpoint(d), open_checkpoint(ref.outputs["vllm"])
    for m in a.modules():
        assert torch.equal(a.qtensor(m).values, b.qtensor(m).values)


def test_source_directory_is_never_modified(tiny_llama, tmp_path):
    before = {p.name: p.stat().st_mtime_ns for p in tiny_llama.iterdir()}
    api.convert(tiny_llama, "w8a16", tmp_path / "o", hash_source=True)
    assert {p.name: p.stat().st_mtime_ns for p in tiny_llama.iterdir()} == before


def test_one_run_writes_vllm_and_sharded_trtllm(tiny_llama, calib_file, tmp_path):
    res = api.convert(tiny_llama, "int8-kv8", tmp_path / "o", targets=["vllm", "trtllm"], tp=2, calib=str(calib_file),
                      num_samples=4, seq_len=32, hash_source=False)
    assert sorted(p.name for p in res.outputs["trtllm"].glob("rank*.safetensors")) == ["rank0.safetensors", "rank1.safetensors"]
    assert any("--tensor-parallel-size 2" in n for n in res.notes["vllm"])
    assert api.inspect(res.outputs["vllm"]).ok and api.inspect(res.outputs["trtllm"]).ok


def test_pre_tokenized_calib_ids_give_the_same_checkpoint(tiny_llama, calib_file, tmp_path):
    """calib_ids = the ids the calibration options would make: the same weights, and the same token hash."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    ids = calibration_ids(AutoTokenizer.from_pretrained(tiny_llama), load_texts(str(calib_file)), NS, T, 0)
    a = api.convert(tiny_llama, "w4a16-gptq", tmp_path / "a", calib=str(calib_file), num_samples=NS, seq_len=T, seed=0,
                    hash_source=False).outputs["vllm"]
    b = api.convert(tiny_llama, "w4a16-gptq", tmp_path / "b", calib_ids=ids, hash_source=False).outputs["vllm"]
    ta, tb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    ma, mb = (json.loads((d / "qtk.json").read_text())["calibration"] for d in (a, b))
    assert ma["token_hash"] == mb["token_hash"] and mb["dataset"] == "calib_ids (pre-tokenized)"
    with pytest.raises(api.UsageError, match="calib_ids"):
        api.convert(tiny_llama, "w4a16-gptq", tmp_path / "c", calib_ids=ids, num_samples=4, hash_source=False)


def test_output_readme_shows_only_the_engines_that_load_it(tiny_llama, tmp_path):
    out = api.convert(tiny_llama, "w4a16", tmp_path / "o", targets=["vllm", "trtllm", "gptq"], hash_source=False).outputs
    for target, path in out.items():
        readme = (path / "README.md").read_text()
        has_vllm, has_trt = "vllm serve" in readme, "trtllm-build" in readme
        assert (has_vllm, has_trt) == ((False, True) if target == "trtllm" else (True, False)), target
    assert f"--checkpoint_dir {out['trtllm']} " in (out["trtllm"] / "README.md").read_text()
