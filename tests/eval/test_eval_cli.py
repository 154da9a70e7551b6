"""`qtk eval` on the command line: the verdict is the exit code (0 pass, 1 gate failed, 2 usage error)."""

import json
import subprocess
import sys

from click.testing import CliRunner

from qtk.eval.cli import eval_cmd


def _run(*args):
    return CliRunner().invoke(eval_cmd, [str(a) for a in args])


def test_exit_codes_and_reports(ckpts, tiny_llama, task_dir, tmp_path):
    cache = tmp_path / "cache"
    ok = _run(ckpts["int8-kv8"], "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml", "--cache-dir", cache,
              "--json", tmp_path / "ok.json", "--junit", tmp_path / "ok.xml", "--bootstrap", 200)
    assert ok.exit_code == 0, ok.output
    assert "gate PASSED" in ok.output and json.loads((tmp_path / "ok.json").read_text())["passed"] is True
    bad = _run(ckpts["w2"], "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml", "--cache-dir", cache,
               "--markdown", tmp_path / "bad.md", "--bootstrap", 200)
    assert bad.exit_code == 1, bad.output
    assert "accuracy gate failed" in bad.output and "(baseline cached)" in bad.output
    assert "FAILED" in (tmp_path / "bad.md").read_text()
    # progress as `qtk convert` logs it: one line per task run with an ETA; a cached baseline is not run
    runs = [line for line in ok.stderr.splitlines() if "] task run " in line]
    assert [line.split("] ")[1].split(",")[0] for line in runs] == [f"task run {i}/6" for i in range(1, 7)], ok.stderr
    assert runs[0].startswith("[qtk eval ") and ", ETA " in runs[0] and "baseline add (" in runs[0]
    assert [line.split("] ")[1].split(",")[0] for line in bad.stderr.splitlines() if "] task run " in line] == \
        [f"task run {i}/3" for i in range(1, 4)]
    assert all(line.strip() for line in ok.stderr.splitlines()) and "Loading weights" not in ok.stderr


def test_usage_errors_exit_2(ckpts, tiny_llama, task_dir, tmp_path):
    r = _run(ckpts["int8-kv8"], "--baseline", tiny_llama, "--tasks", tmp_path / "missing.yaml")
    assert r.exit_code == 2 and "error: task file" in r.output
    r = _run(ckpts["int8-kv8"], "--tasks", task_dir / "tasks.yaml")  # click: missing --baseline
    assert r.exit_code == 2 and "--baseline" in r.output
    r = _run(tiny_llama, "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml")
    assert r.exit_code == 2 and "not a checkpoint qtk can read" in r.output
    r = _run(ckpts["int8-kv8"], "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml", "--threads", 0)
    assert r.exit_code == 2 and "--threads must be >= 1" in r.output


def test_vllm_engine_without_vllm_or_gpu_is_a_usage_error(ckpts, tiny_llama, task_dir, tmp_path):
    from qtk.eval.engines import vllm_available

    ok, why = vllm_available()
    if ok:
        return  # covered by test_engines.test_vllm_engine_runs_or_says_why_not on a GPU machine
    r = _run(ckpts["int8-kv8"], "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml", "--engine", "vllm",
             "--cache-dir", tmp_path)
    assert r.exit_code == 2 and why in r.output and "--engine hf" in r.output


def test_importing_the_command_is_light():
    code = "import sys, qtk.eval.cli; bad = [m for m in ('torch', 'transformers', 'numpy') if m in sys.modules]; print(bad)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"
