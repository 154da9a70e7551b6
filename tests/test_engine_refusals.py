"""The refusals of the real-engine options (docs/errors.md, "The real engine"), word for word, before any work: vLLM
not installed (made so here whatever is installed), no output vLLM loads, --device with --engine vllm."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from qtk.cli import main

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "tiny-llama"
DOC = ROOT / "docs" / "errors.md"


def _doc_rows() -> dict[str, str]:
    section = DOC.read_text().split("## The real engine", 1)[1].split("\n## ", 1)[0]
    return {m.group(1): m.group(2) for m in re.finditer(r"^\| (.+?) \| 2 \| `(error: .*)` \|$", section, re.M)}


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setattr("qtk.eval.vllm_process.vllm_installed", lambda: False)


def _run(args, tmp_path) -> tuple[int, str]:
    r = CliRunner().invoke(main, [str(a) for a in args])
    return r.exit_code, r.output.strip()


CASES = {
    "`qtk convert --verify-engine vllm` where vLLM is not installed":
        (True, ["convert", EXAMPLE, "-r", "w4a16", "-o", "{tmp}/o", "--verify-engine", "vllm"]),
    "`qtk convert -t gptq --verify-engine vllm` (no output vLLM loads)":
        (False, ["convert", EXAMPLE, "-r", "w4a16", "-o", "{tmp}/o", "-t", "gptq", "--verify-engine", "vllm"]),
    "`qtk eval --engine vllm` where vLLM is not installed":
        (True, ["eval", "{tmp}/o", "--baseline", EXAMPLE, "--tasks", ROOT / "examples" / "tasks.yaml", "--engine", "vllm"]),
    "`qtk eval --engine vllm --device cpu`":
        (False, ["eval", "{tmp}/o", "--baseline", EXAMPLE, "--tasks", ROOT / "examples" / "tasks.yaml", "--engine", "vllm",
                 "--device", "cpu"]),
    "`qtk inspect --engine vllm` where vLLM is not installed": (True, ["inspect", "{tmp}/o", "--engine", "vllm"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_engine_options_are_refused_as_documented(case, tmp_path, monkeypatch):
    without_vllm, args = CASES[case]
    monkeypatch.setattr("qtk.eval.vllm_process.vllm_installed", lambda: not without_vllm)
    code, out = _run([str(a).replace("{tmp}", str(tmp_path)) for a in args], tmp_path)
    assert code == 2, out
    assert out.splitlines()[-1] == _doc_rows()[case], out
    assert not (tmp_path / "o").exists()  # refused before any work


def test_every_documented_engine_refusal_is_tested():
    assert set(_doc_rows()) == set(CASES)


def test_engine_check_says_when_the_machine_cannot_hold_the_model_twice(monkeypatch, tmp_path):
    """verify_engine sizes what it will hold (vLLM's copy, its KV cache, qtk's float32 simulation) from the config and
    the checkpoint's bytes, and says why it does not run rather than starting vLLM and running out of memory."""
    from qtk import api
    from qtk.eval import engine_check

    ckpt = api.convert(EXAMPLE, "w4a16", tmp_path / "o").outputs["vllm"]
    monkeypatch.setattr("qtk.pipeline.memory.available_memory", lambda: 10**6)
    monkeypatch.setattr("qtk.eval.vllm_process.VLLMProcess", lambda *a, **k: pytest.fail("vLLM started"))
    c = engine_check.verify_engine(ckpt, windows=[[1, 5, 6]])
    assert c.status == "unavailable" and "holds the model twice" in c.reason and "1.0 MB" not in c.reason
    assert "0.0 GB are available" in c.reason
