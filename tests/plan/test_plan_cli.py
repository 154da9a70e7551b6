"""`qtk plan` as users run it (click's CliRunner on the command object)."""

import json
import shutil

import pytest
from click.testing import CliRunner
from plan_helpers import CONFIGS

from qtk.errors import CheckFailed, UsageError
from qtk.plan.cli import plan


def run(*args):
    return CliRunner().invoke(plan, [str(a) for a in args])


@pytest.fixture
def model_dir(tmp_path):
    d = tmp_path / "llama-3-8b"
    d.mkdir()
    shutil.copy(CONFIGS / "llama-3-8b.json", d / "config.json")
    return d


def test_plan_a_recipe_on_a_gpu(model_dir):
    r = run(model_dir, "--recipe", "int8-kv8", "--gpu", "a100-80g", "--context", 4096, "--concurrency", 8)
    assert r.exit_code == 0, r.output
    out = r.output
    assert "9.08 GB" in out  # checkpoint total
    assert "65,536 B" in out  # KV per token: 2 x 32 x 8 x 128 x 1 byte
    assert "fits" in out and "does not fit" not in out
    assert "vllm serve CHECKPOINT --kv-cache-dtype fp8 --gpu-memory-utilization 0.9 --max-num-seqs 8" in out
    assert "trtllm-build" in out and "qtk convert needs" in out


def test_fp8_on_an_a100_is_planned_but_warned(model_dir):
    r = run(model_dir, "--recipe", "fp8", "--gpu", "a100-80g")
    assert r.exit_code == 0, r.output
    assert "FP8 recipe on A100 80GB SXM: no FP8 tensor cores" in " ".join(r.output.split())


def test_int4_plan_carries_the_math_code_warning(model_dir):
    r = run(model_dir, "--recipe", "w4a16", "--json")
    assert any("risky for math/code" in n for n in json.loads(r.output)["notes"])


def test_recommend_json_for_pipelines():
    r = run(CONFIGS / "llama-3.2-3b.json", "--gpu", "h100-80g", "--context", 32768, "--recommend", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    assert d["recipe"] == d["recommendation"]["chosen"]
    assert d["deployment"]["context"] == 32768 and d["deployment"]["gpu"]["name"] == "h100-sxm"
    chosen = next(c for c in d["recommendation"]["candidates"] if c["status"] == "chosen")
    assert chosen["recipe"] == d["recipe"] and chosen["fits"]
    kv_bytes = 1 if d["weights"]["kv_scales"] else 2
    assert d["memory"]["kv_per_request"] == 32768 * 114_688 // 2 * kv_bytes
    assert d["memory"]["kv_total"] == 8 * d["memory"]["kv_per_request"]
    assert d["serving"]["vllm"].startswith("vllm serve")
    assert {"decode_tokens_per_s", "prefill_tokens_per_s"} <= set(d["throughput"])
    assert d["conversion"]["total"] > 0


def test_unquantized_json_kv_numbers_match_the_issue():
    r = run(CONFIGS / "llama-3.2-3b.json", "--context", 32768, "--concurrency", 8, "--gpu", "h200", "--json")
    m = json.loads(r.output)["memory"]
    assert (m["kv_per_token"], m["kv_per_request"], m["kv_total"]) == (114_688, 3_758_096_384, 30_064_771_072)


def test_nothing_fits_exits_1_with_a_clear_message():
    r = run(CONFIGS / "llama-3.1-70b.json", "--recommend", "--gpu", "t4", "--context", 32768)
    assert isinstance(r.exception, CheckFailed) and r.exception.exit_code == 1
    msg = str(r.exception)
    assert "nothing fits" in msg and "--tp" in msg and "\n" not in msg
    assert "Recommendation" in r.output  # the table of reasons is printed before the error
    rj = run(CONFIGS / "llama-3.1-70b.json", "--recommend", "--gpu", "t4", "--context", 32768, "--json")
    assert isinstance(rj.exception, CheckFailed)
    assert json.loads(rj.output)["recommendation"]["chosen"] is None


def test_a_recipe_that_does_not_fit_exits_1_and_says_how_many_would():
    r = run(CONFIGS / "llama-3.1-70b.json", "--recipe", "w4a16", "--gpu", "h100-80g", "--context", 32768,
            "--concurrency", 64)
    assert isinstance(r.exception, CheckFailed)
    assert "does not fit" in str(r.exception) and "--concurrency" in str(r.exception)


def test_overrides_change_the_budget():
    r = run(CONFIGS / "llama-3-8b.json", "--gpu-mem", 40, "--gpu-memory-utilization", 0.5, "--json")
    assert json.loads(r.output)["memory"]["budget"] == 20 * 10**9


@pytest.mark.parametrize("args, match", [
    (["--gpu", "v100"], "unknown GPU"),
    (["--recipe", "w8a16", "--recommend"], "--recipe and --recommend"),
    (["--recipe", "no-such-recipe"], "unknown recipe"),
    (["--context", "0"], "--context"),
    (["--tp", "0"], "--tp"),
    (["--gpu-memory-utilization", "1.5"], "utilization"),
])
def test_usage_errors_name_the_option(args, match):
    r = run(CONFIGS / "llama-3-8b.json", *args)
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2
    assert match in str(r.exception)


def test_directory_without_config(tmp_path):
    r = run(tmp_path)
    assert isinstance(r.exception, UsageError) and "no config.json" in str(r.exception)
