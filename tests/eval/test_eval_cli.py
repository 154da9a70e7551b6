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


# --- refusals at load (issue 11 item 20, issue 16 item 2) -----------------------------------------

EVIL = """import pathlib
pathlib.Path({marker!r}).write_text("the model's own code ran")  # transformers runs a copy: an absolute path
from transformers import PreTrainedConfig


class EvilConfig(PreTrainedConfig):
    model_type = "evil"
"""


def _with_remote_code(src, dst):
    """A copy of a model directory whose config and tokenizer name code in evil.py (model_type unknown to transformers,
    so transformers would ask on a terminal whether to run it)."""
    import shutil

    shutil.copytree(src, dst)
    (dst / "evil.py").write_text(EVIL.format(marker=str(dst / "RAN")))
    for name, changes in (("config.json", {"model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"}}),
                          ("tokenizer_config.json", {"auto_map": {"AutoTokenizer": ["evil.EvilTok", "evil.EvilTok"]}})):
        d = json.loads((dst / name).read_text()) if (dst / name).is_file() else {}
        (dst / name).write_text(json.dumps({**d, **changes}))
    return dst


def _qtk_eval(*args, stdin="y\n" * 20):
    import os

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    return subprocess.run([sys.executable, "-m", "qtk.cli", "eval", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, timeout=600)


def test_remote_code_never_runs_without_the_flag_even_when_stdin_says_yes(ckpts, tiny_llama, task_dir, tmp_path):
    """transformers asked "Do you wish to run the custom code? [y/N]" and a 'y' on stdin ran the checkpoint's code."""
    base = _with_remote_code(tiny_llama, tmp_path / "base")
    cand = _with_remote_code(ckpts["int8-kv8"], tmp_path / "cand")
    tasks = task_dir / "tasks.yaml"
    for c, b, role, where in ((ckpts["int8-kv8"], base, "baseline", base), (cand, tiny_llama, "candidate", cand)):
        r = _qtk_eval(c, "--baseline", b, "--tasks", tasks, "--no-cache")
        assert not (where / "RAN").exists(), r.stderr[-2000:]
        assert "wish to run" not in r.stdout + r.stderr
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert f"error: the {role} {where} needs custom code" in lines[0] and "--trust-remote-code" in lines[0]
    # the flag is the only way through: with it transformers may import the code (and this one is no model)
    r = _qtk_eval(ckpts["int8-kv8"], "--baseline", base, "--tasks", tasks, "--no-cache", "--trust-remote-code", stdin="")
    assert (base / "RAN").exists() and r.returncode == 2 and "Traceback" not in r.stderr


def test_baseline_must_be_unquantized_and_the_candidate_one_checkpoint(ckpts, tiny_llama, task_dir, tmp_path):
    out_root = ckpts["int8-kv8"].parent  # what qtk convert -o named: it holds vllm/
    r = _run(out_root, "--baseline", tiny_llama, "--tasks", task_dir / "tasks.yaml")
    assert r.exit_code == 2 and "is the output root of qtk convert (it holds vllm/)" in r.output
    assert f"e.g. qtk eval {out_root / 'vllm'}" in r.output
    r = _run(ckpts["int8-kv8"], "--baseline", ckpts["w8-kv8"], "--tasks", task_dir / "tasks.yaml")
    assert r.exit_code == 2 and "is a quantized checkpoint (it has a compressed-tensors quantization_config)" in r.output
    assert "original unquantized" in r.output
    r = _run(ckpts["int8-kv8"], "--baseline", ckpts["w8-kv8-trt"], "--tasks", task_dir / "tasks.yaml")
    assert r.exit_code == 2 and "is a quantized checkpoint" in r.output
