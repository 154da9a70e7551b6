"""The commands that run a checkpoint in vLLM, end to end as a user types them: `qtk eval --engine vllm`,
`qtk convert --verify-engine vllm`, `qtk inspect --engine vllm` (each starts its own vLLM worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qtk import api
from qtk.errors import CheckFailed

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "tiny-llama"
TASKS = ROOT / "examples" / "tasks.yaml"
QTK = [sys.executable, "-m", "qtk"]


def _qtk(*args, cwd=None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.run([*QTK, *map(str, args)], capture_output=True, text=True, timeout=1200, cwd=cwd, env=env)


@pytest.fixture(scope="module")
def int8_kv8(tmp_path_factory):
    return api.convert(EXAMPLE, "int8-kv8", tmp_path_factory.mktemp("good"), num_samples=16, seq_len=128).outputs["vllm"]


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """A checkpoint made to fail the gate that vLLM still runs: w4a16 with the o_proj and down_proj scales of every
    layer multiplied by 2.5 after writing (the format is intact, the model is not)."""
    from safetensors.torch import load_file, save_file

    d = tmp_path_factory.mktemp("bad")
    ckpt = api.convert(EXAMPLE, "w4a16", d / "out").outputs["vllm"]
    f = ckpt / "model.safetensors"
    sd = load_file(f)
    for k in sd:
        if k.endswith(("mlp.down_proj.weight_scale", "self_attn.o_proj.weight_scale")):
            sd[k] = sd[k] * 2.5
    save_file(sd, f, metadata={"format": "pt"})
    return ckpt


def _gate(ckpt, engine, tmp, name):
    out = tmp / f"{name}-{engine}.json"
    r = _qtk("eval", ckpt, "--baseline", EXAMPLE, "--tasks", TASKS, "--engine", engine, "--limit", 40,
             "--bootstrap", 500, "--cache-dir", tmp / f"cache-{engine}", "--json", out)
    return r, (json.loads(out.read_text()) if out.exists() else None)


def test_eval_in_vllm_gives_the_hf_engines_verdicts(vllm, int8_kv8, broken, tmp_path, record):
    """qtk eval --engine vllm on the CPU: int8-kv8 passes (exit 0), the damaged checkpoint fails (exit 1), and every
    task's verdict is the simulation's (--engine hf); the FP8 KV cache ran with the checkpoint's scales."""
    verdicts = {}
    for name, ckpt in (("int8-kv8", int8_kv8), ("damaged", broken)):
        for engine in ("hf", "vllm"):
            r, rep = _gate(ckpt, engine, tmp_path, name)
            assert r.returncode == (0 if name == "int8-kv8" else 1), (engine, r.stderr[-1500:])
            verdicts[name, engine] = {t["name"]: t["status"] for t in rep["tasks"]}
            verdicts[name, engine]["agreement"] = rep["agreement"]["status"]
            record(f"eval {name} --engine {engine}", f"exit {r.returncode}, {rep['timings']['total']:.1f} s, "
                   + ", ".join(f"{k} {v}" for k, v in verdicts[name, engine].items()))
            if engine == "vllm":
                assert rep["engine"]["engine"] == "vllm" and rep["engine"]["device"] == vllm.device
                if name == "int8-kv8":
                    assert rep["engine"]["kv_cache_dtype"].startswith("fp8"), rep["engine"]
                    assert rep["agreement"]["kl"] is not None  # the vocabulary fits in the top-k: KL exact
        assert verdicts[name, "vllm"] == verdicts[name, "hf"], name
    assert "fail" in verdicts["damaged", "vllm"].values()


def test_verify_engine_passes_a_checkpoint_vllm_runs_and_records_it(vllm, tmp_path, record):
    out = tmp_path / "o"
    r = _qtk("convert", EXAMPLE, "-r", "w4a16-gptq", "-o", out, "--num-samples", 16, "--seq-len", 128,
             "--verify-engine", "vllm")
    assert r.returncode == 0, r.stderr[-2000:]
    line = next(ln for ln in r.stderr.splitlines() if ln.startswith("engine check:"))
    record("convert --verify-engine", line[:150])
    assert "runs in vllm" in line and "as qtk simulates it" in line
    m = json.loads((out / "vllm" / "qtk.json").read_text())
    assert m["engine_check"]["vllm"]["status"] == "runs" and not m["engine_check"]["vllm"]["disagreements"]


def test_verify_engine_says_in_one_line_why_vllm_cannot_run_it_here(vllm, tmp_path):
    r = _qtk("convert", EXAMPLE, "-r", "w8a16", "-o", tmp_path / "o", "--verify-engine", "vllm")
    assert r.returncode == 0, r.stderr[-2000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("engine check:")]
    assert len(lines) == 1 and "cannot run the vllm output here" in lines[0] and "uint8b128" in lines[0], lines
    assert (tmp_path / "o" / "vllm" / "qtk.json").is_file()  # a checkpoint for GPUs is still a good checkpoint


def test_verify_engine_fails_when_engine_and_simulation_disagree(vllm, tmp_path, monkeypatch):
    """The KV cache simulated with round-to-nearest, as the GPU kernels do, where vLLM's CPU kernel truncates: the
    engine and the simulation then disagree by more than the bounds allow, and nothing is written."""
    import qtk.eval.engine_check as ec

    monkeypatch.setattr(ec, "engine_kv_rounding", lambda device: "nearest")
    with pytest.raises(CheckFailed, match=r"engine check: vllm .* disagree .*(mean \|Δ log p\||perplexity ratio)"):
        api.convert(EXAMPLE, "int8-kv8", tmp_path / "o", num_samples=16, seq_len=128, verify_engine="vllm")
    assert not (tmp_path / "o" / "vllm").exists()


def test_inspect_runs_the_checkpoint_in_vllm(vllm, int8_kv8):
    r = _qtk("inspect", int8_kv8, "--engine", "vllm", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    checks = {c["name"]: c for c in json.loads(r.stdout)["checks"]}
    c = checks["runs in vllm as qtk simulates it"]
    assert c["ok"] and not c["skipped"] and "top-1" in c["detail"]
