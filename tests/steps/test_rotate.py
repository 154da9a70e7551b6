"""The rotate step (qtk.steps.rotate): the rotated float model computes the source's logits (and a wrong rotation
does not), its record rebuilds the rotated weights from the source, and a rotated checkpoint is an ordinary one:
transformers + compressed-tensors load it as qtk simulates it, `qtk inspect` passes, the rotation is in qtk.json."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from models import make_tiny_model
from qtk import api
from qtk.algorithms import rotate as rotation_math
from qtk.cli import main
from qtk.export import open_checkpoint
from qtk.model.simulate import build_simulated_model
from qtk.model.source import ModelSource
from qtk.recipe.params import RotateParams
from qtk.steps import LayerContext, records_from_json
from qtk.steps import rotate

IDS = torch.randint(3, 90, (2, 40), generator=torch.Generator().manual_seed(0))


ROT_W8 = """
name: rot-w8
weights: {num_bits: 8, type: int, symmetric: true, strategy: channel}
algorithm: [rotate, rtn]
ignore: [lm_head]
"""


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    """fp32 Llama with GQA, the lm_head tied to the embedding and norms far from 1 (make_tiny_model draws them in
    [0.6, 1.4]): the final norm cannot stay tied once folded."""
    return make_tiny_model(tmp_path_factory.mktemp("rot") / "tied", hidden=128, intermediate=256, dtype=torch.float32,
                           tie=True)


def rotated_float_model(src, params: RotateParams, *, fold_norms: bool = True):
    """The source model with the step run on every layer and the tensors outside the layers read through its
    source view: the float model a rotated checkpoint quantizes. fold_norms=False puts the norms' scales back after
    the step (a rotation that forgot to fold them)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval()
    source = ModelSource(src)
    view = rotate.source_view(source, params)
    arch = source.arch
    for i, layer in enumerate(model.get_submodule(arch.layers)):
        norms = {n: layer.get_submodule(n).weight.detach().clone() for n in ("input_layernorm", "post_attention_layernorm")}
        ctx = LayerContext(i, source.layer_prefix(i), layer, arch, None, list(arch.linears), None, torch.float32)
        rec = rotate.run(ctx, params)
        assert rec.r1["size"] == 128
        if not fold_norms:
            with torch.no_grad():
                for n, g in norms.items():
                    layer.get_submodule(n).weight.copy_(g)
    with torch.no_grad():
        model.get_submodule(arch.embed).weight = torch.nn.Parameter(view.tensor(f"{arch.embed}.weight"))
        model.get_submodule(arch.final_norm).weight.copy_(view.tensor(f"{arch.final_norm}.weight"))
        model.get_submodule(arch.lm_head).weight = torch.nn.Parameter(view.tensor(f"{arch.lm_head}.weight"))
    return model, view


def _logits(model):
    with torch.no_grad():
        return model(IDS).logits


@pytest.mark.parametrize("model_type,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {"head_dim": 32})])
def test_the_rotated_float_model_computes_the_source_logits(tmp_path, model_type, extra):
    """fp32: equal to float rounding (|logit| ~ 1-10); Qwen2's q/k/v biases and Qwen3's per-head q/k norms too."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model(tmp_path / model_type, model_type=model_type, hidden=128, intermediate=256,
                          dtype=torch.float32, tie=model_type == "llama", **extra)
    base = _logits(AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32).eval())
    model, view = rotated_float_model(src, RotateParams(seed=7))
    rot = _logits(model)
    assert (rot - base).abs().max().item() <= 2e-5 * base.abs().max().item()
    # and the weights did change: a rotation that left everything as it was would pass the line above
    q = model.get_submodule("model.layers.0.self_attn.q_proj").weight
    assert (q - ModelSource(src).tensor("model.layers.0.self_attn.q_proj.weight")).abs().max() > 0.01


@pytest.mark.parametrize("wrong", ["norm not folded", "R2 without o_proj", "R1 without the embedding"])
def test_a_wrong_rotation_changes_the_logits(tied, monkeypatch, wrong):
    from transformers import AutoModelForCausalLM

    base = _logits(AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32).eval())
    if wrong == "R2 without o_proj":
        monkeypatch.setattr(rotation_math, "_head_columns", lambda r, W: W)
    model, view = rotated_float_model(tied, RotateParams(seed=7), fold_norms=wrong != "norm not folded")
    if wrong == "R1 without the embedding":
        with torch.no_grad():
            model.get_submodule("model.embed_tokens").weight.copy_(view.inner.tensor("model.embed_tokens.weight"))
    assert (_logits(model) - base).abs().max().item() > 0.05 * base.abs().max().item()


def test_the_record_rebuilds_each_rotated_weight_from_the_source(tied):
    """reframe (what the loop's error and `qtk inspect` compare against) is the step's own arithmetic."""
    model, _ = rotated_float_model(tied, RotateParams(seed=3))
    source = ModelSource(tied)
    layer = model.get_submodule("model.layers.1")
    fresh = source.layer(source.skeleton(), 1)
    ctx = LayerContext(1, "model.layers.1.", fresh, source.arch, None, list(source.arch.linears), None, torch.float32)
    rec = records_from_json({"rotate": json.loads(json.dumps(rotate.run(ctx, RotateParams(seed=3)).to_json()))})
    for rel in source.arch.linears:
        W = source.tensor(f"model.layers.1.{rel}.weight").float()
        got = records_from_json({"rotate": rec["rotate"].to_json()})["rotate"].reframe(W, rel, source.arch)
        assert torch.equal(got, layer.get_submodule(rel).weight.detach()), rel


def test_a_tied_embedding_is_untied_only_when_the_final_norm_is_not_all_ones(tied, tmp_path):
    src = ModelSource(tied)
    assert rotate.source_view(src, RotateParams()).untied
    ones = make_tiny_model(tmp_path / "ones", hidden=128, intermediate=256, dtype=torch.float32, tie=True)
    from safetensors.torch import load_file, save_file

    sd = load_file(str(ones / "model.safetensors"))
    sd["model.norm.weight"] = torch.ones_like(sd["model.norm.weight"])
    save_file(sd, str(ones / "model.safetensors"), metadata={"format": "pt"})
    view = rotate.source_view(ModelSource(ones), RotateParams())
    assert not view.untied and "lm_head.weight" not in view.non_layer_tensor_names()
    assert view.config_dict.get("tie_word_embeddings") is True
    # a checkpoint that stores lm_head beside a tied embedding: transformers would still tie them, so untie
    stored = make_tiny_model(tmp_path / "stored", hidden=128, intermediate=256, dtype=torch.float32, tie=True)
    sd = load_file(str(stored / "model.safetensors"))
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"].clone()
    save_file(sd, str(stored / "model.safetensors"), metadata={"format": "pt"})
    view = rotate.source_view(ModelSource(stored), RotateParams())
    assert view.untied and view.config_dict["tie_word_embeddings"] is False
    assert view.non_layer_tensor_names().count("lm_head.weight") == 1


def test_a_rotated_checkpoint_is_an_ordinary_one(tied, calib_file, tmp_path):
    """[rotate, rtn] int8 per channel: the written checkpoint (untied, norms 1) reloads in transformers +
    compressed-tensors as qtk simulates it, stays close to the source's logits, passes inspect, records the
    rotation; a converted gptq one too."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    p = tmp_path / "rot-w8.yaml"
    p.write_text(ROT_W8)
    res = api.convert(tied, str(p), tmp_path / "o", hash_source=False)  # no data: the step needs none
    d = res.outputs["vllm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False
    m = json.loads((d / "qtk.json").read_text())
    rec = m["stats"]["algorithm"]["0"]["rotate"]  # layer 0's records
    assert set(rec["norms"]) == {"input_layernorm", "post_attention_layernorm"} and len(rec["norms"]["input_layernorm"]) == 128
    assert rec["r1"]["kind"] == "hadamard" and rec["r1"]["size"] == 128 and rec["r1"]["seed"] == 0
    assert rec["r2"]["size"] == 32 and rec["r2"]["seed"] == 1 and "Sylvester(128)" in rec["r1"]["construction"]
    assert any("untied" in n for n in m["notes"])
    ck = open_checkpoint(d)
    assert torch.equal(ck.dense_state_dict()["model.norm.weight"].float(), torch.ones(128))
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(ck, simulate_activations=False, simulate_kv=False)
    base = _logits(AutoModelForCausalLM.from_pretrained(str(tied), dtype=torch.float32).eval())
    a, b = _logits(ref), _logits(sim)
    assert (a - b).abs().max().item() <= 1e-4
    assert (a - base).abs().max().item() <= 0.05 * base.abs().max().item()  # int8 noise, not a wrong frame
    assert api.inspect(d).ok


@pytest.mark.parametrize("algorithm", ["[rotate, gptq]", "[rotate, awq]"])
def test_rotation_composes_with_the_calibrated_solvers(tiny_llama, calib_file, tmp_path, algorithm):
    """The calibration hidden states are in the rotated frame: GPTQ's / AWQ's weights fit the source no worse than
    round-to-nearest of the same rotated weights does, checked by qtk inspect from the records of both steps."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    text = ("name: rot\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 32}\n"
            f"algorithm: {algorithm}\nignore: [lm_head]\n")
    p = tmp_path / "r.yaml"
    p.write_text(text)
    d = api.convert(tiny_llama, str(p), tmp_path / "o", calib=str(calib_file), num_samples=8, seq_len=64,
                    hash_source=False).outputs["vllm"]
    assert api.inspect(d).ok
    ref = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                               quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    sim = build_simulated_model(open_checkpoint(d), simulate_activations=False, simulate_kv=False)
    assert (_logits(ref) - _logits(sim)).abs().max().item() <= 1e-4
    base = _logits(AutoModelForCausalLM.from_pretrained(str(tiny_llama), dtype=torch.float32).eval())
    assert (_logits(ref) - base).abs().max().item() <= 0.5 * base.abs().max().item()


def test_a_family_the_rotation_cannot_fold_into_is_refused_before_any_work(tmp_path):
    src = make_tiny_model(tmp_path / "g", model_type="gemma2", hidden=128, intermediate=256, head_dim=32)
    r = CliRunner().invoke(main, ["convert", str(src), "--recipe", "w4a16-rot-gptq", "-o", str(tmp_path / "o")],
                           prog_name="qtk")
    lines = r.output.strip().splitlines()
    assert r.exit_code == 2 and len(lines) == 1 and "cannot rotate gemma2" in lines[0], r.output
    assert not (tmp_path / "o").exists()


def test_every_target_writes_the_rotated_untied_model(tied, calib_file, tmp_path):
    """gptq, awq, trtllm and hf-modelopt hold the same rotated model as vllm: each output, read back by qtk and
    simulated, gives the vllm output's logits (an lm_head left tied, or left unrotated, in any one would not), within
    the rounding of the legacy formats' fp16 scales and tensors (this model is float32)."""
    targets = ["vllm", "gptq", "awq", "trtllm", "hf-modelopt"]
    res = api.convert(tied, "w4a16-rot-gptq", tmp_path / "o", targets=targets, calib=str(calib_file), num_samples=8,
                      seq_len=64, hash_source=False)
    want = _logits(build_simulated_model(open_checkpoint(res.outputs["vllm"]), simulate_activations=False,
                                         simulate_kv=False))
    for t in targets[1:]:
        ck = open_checkpoint(res.outputs[t])
        got = _logits(build_simulated_model(ck, simulate_activations=False, simulate_kv=False))
        assert (got - want).abs().max().item() <= 1e-2 * want.abs().max().item(), (t, (got - want).abs().max().item())
        assert api.inspect(res.outputs[t]).ok, t
