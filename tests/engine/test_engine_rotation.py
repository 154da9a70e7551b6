"""A rotated checkpoint is an ordinary one: vLLM's CPU build runs w4a16-rot-gptq's vllm output as qtk simulates it,
on the example model and on a tied one whose lm_head the rotation unties (the layout vLLM must load as two tensors)."""

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
