"""convert --gate: convert, then gate each output; the exit code is the verdict."""

import json

from click.testing import CliRunner
from models import write_jsonl

from qtk.cli import main


def _tasks(tmp_path, min_recovery):
    import random

    rng = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "the", "model", "sort", "key"]
    write_jsonl(tmp_path / "prose.jsonl", [{"text": " ".join(rng.choice(words) for _ in range(30))} for _ in range(24)])
    p = tmp_path / "tasks.yaml"
    p.write_text("version: 1\nagreement: {max_kl: 0.05}\ntasks:\n"
                 f"  - {{name: prose, type: perplexity, data: prose.jsonl, gate: {{min_recovery: {min_recovery}}}}}\n")
    return p


def test_convert_gate_passes_and_fails_by_the_task_limit(tiny_llama, tmp_path):
    out = tmp_path / "o"
    args = ["convert", str(tiny_llama), "--recipe", "w8a16", "-o", str(out), "--no-hash"]
    r = CliRunner().invoke(main, [*args, "--gate", str(_tasks(tmp_path, 0.9)), "--overwrite"])
    assert r.exit_code == 0, r.output
    rep = json.loads((out / "gate-vllm.json").read_text())
    assert rep["passed"] is True
    assert (out / "gate-vllm.xml").is_file() and (out / "gate-vllm.md").is_file()
    # a deliberately broken candidate: 2-bit round-to-nearest weights
    broken = tmp_path / "w2.yaml"
    broken.write_text("name: w2\nweights: {num_bits: 2, strategy: group, group_size: 32, symmetric: false}\n")
    args[3] = str(broken)
    r = CliRunner().invoke(main, [*args, "--gate", str(_tasks(tmp_path, 0.9)), "--overwrite"])
    assert r.exit_code == 1, r.output
    assert "gate failed for: vllm" in r.output
    assert json.loads((out / "gate-vllm.json").read_text())["passed"] is False


def test_convert_threads_reach_calibration_and_gate(tiny_llama, tmp_path, monkeypatch):
    import torch

    from qtk import api

    seen = []
    real = api.convert

    def convert(*a, **kw):  # the thread count the conversion (calibration) runs with
        seen.append(torch.get_num_threads())
        return real(*a, **kw)

    monkeypatch.setattr(api, "convert", convert)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the session runs on one thread: start elsewhere, so --threads 1 must act
    try:
        out = tmp_path / "o"
        r = CliRunner().invoke(main, ["convert", str(tiny_llama), "--recipe", "w8a16", "-o", str(out), "--no-hash",
                                      "--threads", "1", "--gate", str(_tasks(tmp_path, 0.9))])
        assert r.exit_code == 0, r.output
        assert seen == [1]
        assert json.loads((out / "gate-vllm.json").read_text())["engine"]["threads"] == 1
    finally:
        torch.set_num_threads(before)
    r = CliRunner().invoke(main, ["convert", str(tiny_llama), "--recipe", "w8a16", "-o", str(out), "--threads", "0"])
    assert r.exit_code == 2 and "--threads" in r.output
