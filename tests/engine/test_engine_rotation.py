"""A rotated checkpoint is an ordinary one: vLLM's CPU build runs w4a16-rot-gptq's vllm output as qtk simulates it,
on the example model and on a tied one whose lm_head the rotation unties (the layout vLLM must load as two tensors).
An online rotation (rotate_online, a compressed-tensors transform) runs as simulated or is refused for the reason
qtk.plan.serving.vllm_cpu_support names (vLLM 0.32's CPU build: at the first forward, no cpu_linear)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qtk.eval.engine_check import check_windows, compare
from qtk.eval.engines import load_tokenizer

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tiny-llama"


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    import torch

    from models import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tied") / "tied-llama", hidden=128, intermediate=256,
                           dtype=torch.bfloat16, tie=True)


@pytest.mark.parametrize("which", ["example", "tied"])
def test_rotated_w4a16_gptq_runs_in_vllm_as_simulated(vllm, record, tied, tmp_path, which):
    from qtk import api

    src = EXAMPLE if which == "example" else tied
    d = api.convert(src, "w4a16-rot-gptq", tmp_path / "o", num_samples=16, seq_len=128, hash_source=False).outputs["vllm"]
    cfg = json.loads((d / "config.json").read_text())
    assert cfg.get("tie_word_embeddings") is False  # the example was never tied; the tied one is untied
    c = compare(d, check_windows(load_tokenizer(src), num=4, seq_len=256), vllm)
    record(f"w4a16-rot-gptq ({which})", ("runs: " + c.line()) if c.status == "runs" else f"{c.status}: {c.reason[:160]}")
    assert c.status == "runs", c.reason
    assert not c.disagreements, f"engine and simulation disagree: {'; '.join(c.disagreements)} ({c.line()})"


@pytest.mark.parametrize("block", [0, 64])
def test_an_online_rotation_runs_in_vllm_as_simulated_or_vllm_says_why(vllm, record, tmp_path, block):
    """R4 (rotate_online) written as a compressed-tensors transform: vLLM's CPU build either runs it as qtk
    simulates it, or refuses it for the reason qtk.plan.serving.vllm_cpu_support names (so a vLLM release that
    learns to apply it on CPU fails here and says so). block 0: one Hadamard of the whole MLP width (512); 64: eight
    blocks of one 64-order matrix (the transform's head_dim)."""
    import re

    from qtk import api
    from qtk.plan.serving import vllm_cpu_support
    from qtk.recipe import load_recipe

    p = tmp_path / "r4.yaml"
    p.write_text("name: r4-w4a16\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}\n"
                 f"algorithm: [rotate, {{rotate_online: {{seed: 1, block: {block}}}}}, gptq]\nignore: [lm_head]\n")
    d = api.convert(EXAMPLE, str(p), tmp_path / "o", num_samples=16, seq_len=128, hash_source=False).outputs["vllm"]
    tc = json.loads((d / "config.json").read_text())["quantization_config"]["transform_config"]
    assert tc["config_groups"]["R4"]["head_dim"] == (block or None)
    want = vllm_cpu_support(load_recipe(str(p)))
    c = compare(d, check_windows(load_tokenizer(EXAMPLE), num=4, seq_len=256), vllm)
    record(f"w4a16 + rotate + rotate_online (block {block or 'full'})",
           ("runs: " + c.line()) if c.status == "runs" else f"{c.status}: {c.reason[:200]}")
    if c.status == "runs":
        assert want.runs, (f"vLLM {vllm.version} now applies online transforms on this CPU, where "
                           f"qtk.plan.serving.vllm_cpu_support says: {want.detail} — update it")
        assert not c.disagreements, f"engine and simulation disagree: {'; '.join(c.disagreements)} ({c.line()})"
    else:
        assert c.status == "refused", c.reason
        assert not want.runs, f"qtk says vLLM's CPU backend runs it ({want.detail}), but it refused: {c.reason}"
        assert re.search(want.refusal, c.reason), f"vLLM refused it for another reason than qtk names: {c.reason}"
