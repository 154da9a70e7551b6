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
    assert d["memory"]["kv_per_request_per_gpu"] == 32768 * 114_688 // 2 * kv_bytes
    assert d["memory"]["kv_total_per_gpu"] == 8 * d["memory"]["kv_per_request_per_gpu"]
    assert d["serving"]["vllm"].startswith("vllm serve")
    assert {"decode_tokens_per_s", "prefill_tokens_per_s"} <= set(d["throughput"])
    assert d["conversion"]["total"] > 0


def test_unquantized_json_kv_numbers_match_the_issue():
    r = run(CONFIGS / "llama-3.2-3b.json", "--context", 32768, "--concurrency", 8, "--gpu", "h200", "--json")
    m = json.loads(r.output)["memory"]
    assert (m["kv_per_token_per_gpu"], m["kv_per_request_per_gpu"], m["kv_total_per_gpu"]) == (114_688, 3_758_096_384, 30_064_771_072)


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
    (["--recipe", "w8a16", "--recipe", "w4a16"], "--recipe given 2 times"),
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


# --- issue 11 items 15-19 ------------------------------------------------------------------------


def main_run(*args):
    """Through the `qtk` entry point, as a user sees it: errors become one `error:` line on stderr."""
    from qtk.cli import main

    return CliRunner().invoke(main, ["plan", *[str(a) for a in args]])


def test_a_weights_file_is_refused_in_one_line(tmp_path):
    """`qtk plan model/model.safetensors` printed a 33-line UnicodeDecodeError traceback."""
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}\xbb\xff" * 64)
    (tmp_path / "weights.bin").write_bytes(b"\x80\x02\xbb\xff" * 64)  # any other name: not UTF-8, one line too
    for f, needle in ((tmp_path / "model.safetensors", "is a weights file, not a config.json"),
                      (tmp_path / "weights.bin", "is a weights file"), (tmp_path / "blob", "not UTF-8 text")):
        if not f.exists():
            f.write_bytes(b"\xbb\xff\x00" * 64)
        r = main_run(f)
        lines = r.output.strip().splitlines()
        assert r.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.output
        assert "Traceback" not in r.output


def test_tp_must_divide_the_heads_like_convert_requires(tmp_path):
    """--tp 3 on 32 attention heads "fitted" and printed --tensor-parallel-size 3."""
    from qtk.export.trtllm.sharding import check_geometry
    from qtk.model.arch import Geometry

    r = run(CONFIGS / "llama-3-8b.json", "--tp", 3)
    assert isinstance(r.exception, UsageError) and r.exception.exit_code == 2
    assert "--tp 3 does not divide the attention heads (32)" in str(r.exception)
    assert "tensor-parallel-size 3" not in r.output
    # one rule, shared with the trtllm writer: the same geometry gets the same refusal, word for word
    with pytest.raises(UsageError) as e:
        check_geometry(Geometry(layers=32, hidden=4096, intermediate=14336, heads=32, kv_heads=8, head_dim=128, vocab=128256), 3, 1)
    assert str(e.value) == str(r.exception)
    rr = run(CONFIGS / "llama-3-8b.json", "--recommend", "--tp", 3)
    assert isinstance(rr.exception, UsageError) and "does not divide the attention heads" in str(rr.exception)
    # 2 and 8 split the 8 KV heads, 16 copies each to two GPUs: all plan
    for tp in (2, 8, 16):
        assert not isinstance(run(CONFIGS / "llama-3-8b.json", "--tp", tp, "--json").exception, UsageError), tp
    # 48 heads over 12 GPUs split, but 8 KV heads over 12 can neither be split nor copied evenly
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({**json.loads((CONFIGS / "llama-3-8b.json").read_text()), "num_attention_heads": 48, "hidden_size": 6144}))
    r12 = run(cfg, "--tp", 12)
    assert isinstance(r12.exception, UsageError) and "cannot share the 8 KV heads evenly" in str(r12.exception)


def test_a_custom_gpu_is_labelled_custom_not_as_the_gpu_it_started_from():
    """With --gpu-mem/--gpu-bw/--price the report still named "H100 80GB SXM" and its price."""
    r = run(CONFIGS / "llama-3-8b.json", "--gpu-mem", 40, "--price", 1.5, "--json")
    g = json.loads(r.output)["deployment"]["gpu"]
    assert g["name"] == "custom" and g["base"] == "h100-sxm" and g["price_per_hour"] == 1.5
    assert g["label"].startswith("custom GPU (40 GB, $1.50/h; bandwidth, compute, FP8 and interconnect as H100 80GB SXM")
    text = " ".join(run(CONFIGS / "llama-3-8b.json", "--gpu-bw", 2).output.split())
    assert "1× H100 80GB SXM," not in text and "1× custom GPU (2 TB/s; memory, price," in text
    assert "$2.49/h" in text  # the price it inherits, shown next to a label that says where it comes from
    plain = json.loads(run(CONFIGS / "llama-3-8b.json", "--json").output)["deployment"]["gpu"]
    assert plain["name"] == "h100-sxm" and plain["label"] == "H100 80GB SXM" and plain["base"] is None


def test_the_default_gpu_is_one_the_help_lists():
    from qtk.plan.hardware import gpu_names

    default = next(p.default for p in plan.params if p.name == "gpu")
    assert default in gpu_names()
    help_text = " ".join(CliRunner().invoke(plan, ["--help"]).output.split())
    assert f"[default: {default}]" in help_text and f"{default}," in help_text


def test_recommend_combines_weight_schemes_with_kv_options():
    """70B on one H100 at 8K x 16: "nothing fits" while w4a16 + FP8 KV fits with 16 % headroom."""
    from qtk.plan.decide import RecipeClass
    from qtk.recipe import parse_recipe
    import yaml

    r = run(CONFIGS / "llama-3.1-70b.json", "--gpu", "h100-80g", "--context", 8192, "--concurrency", 16, "--recommend", "--json")
    assert r.exit_code == 0, r.output
    d = json.loads(r.output)
    rec = d["recommendation"]
    chosen = next(c for c in rec["candidates"] if c["status"] == "chosen")
    assert chosen["recipe"] == "w4a16-gptq+kv8" and chosen["derived_from"] == "w4a16-gptq"
    assert chosen["headroom_fraction"] == pytest.approx(0.16, abs=0.005)
    # the recipe to convert with is printed; it parses as a recipe, with the FP8 KV cache this GPU runs
    doc = yaml.safe_load(rec["recipe_yaml"])
    recipe = parse_recipe(doc, rec["recipe_yaml"], "r.yaml")
    k = RecipeClass.of(recipe)
    assert (k.weight_bits, k.kv8, recipe.kv_cache.type) == (4, True, "float")
    # every shipped weight scheme was tried with and without 8-bit KV (fp8-kv8 is fp8 + KV, so not repeated)
    names = {c["recipe"] for c in rec["candidates"]}
    assert {"w4a16+kv8", "w4a16-awq+kv8", "w8a16+kv8", "int8-kv8+kv16", "fp8-dynamic+kv8"} <= names
    assert "fp8+kv8" not in names
    # and planning that file gives the same memory the recommendation promised
    text = " ".join(run(CONFIGS / "llama-3.1-70b.json", "--gpu", "h100-80g", "--context", 8192, "--concurrency", 16,
                        "--recommend").output.split())
    assert "w4a16-gptq+kv8 is w4a16-gptq with an FP8 KV cache" in text and "kv_cache: num_bits: 8 type: float" in text


def test_recommend_considers_recipe_files_given_with_recipe(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("name: mine-w4g64\nweights: {num_bits: 4, type: int, symmetric: true, strategy: group, group_size: 64}\n"
                    "algorithm: [gptq]\n")
    r = run(CONFIGS / "llama-3.1-70b.json", "--gpu", "h100-80g", "--context", 8192, "--concurrency", 16, "--recommend",
            "--recipe", mine, "--json")
    assert r.exit_code == 0, r.output
    by = {c["recipe"]: c for c in json.loads(r.output)["recommendation"]["candidates"]}
    assert by["mine-w4g64"]["status"] == "no-fit" and by["mine-w4g64+kv8"]["derived_from"] == "mine-w4g64"
    assert by["mine-w4g64+kv8"]["status"] in ("passed", "chosen")


def test_nothing_fits_is_said_once():
    r = main_run(CONFIGS / "llama-3.1-70b.json", "--recommend", "--gpu", "t4", "--context", 32768)
    assert r.exit_code == 1
    assert r.output.count("nothing fits") == 1, r.output
    assert r.output.strip().splitlines()[-1].startswith("error: nothing fits")


def test_json_names_the_kv_figures_per_gpu_and_shows_the_decode_efficiency():
    one = json.loads(run(CONFIGS / "llama-3-8b.json", "--json").output)
    two = json.loads(run(CONFIGS / "llama-3-8b.json", "--tp", 2, "--json").output)
    assert "kv_per_token" not in two["memory"]
    # 8 KV heads over 2 GPUs: each holds half the cache of a token
    assert two["memory"]["kv_per_token_per_gpu"] * 2 == one["memory"]["kv_per_token_per_gpu"] == 2 * 32 * 8 * 128 * 2
    t = two["throughput"]
    assert (t["bandwidth_utilization"], t["compute_utilization"]) == (0.8, 0.5) and t["bound"] == "memory"
    assert t["tp_efficiency"] == pytest.approx(0.9) == two["deployment"]["tp_efficiency"]
    assert t["decode_efficiency"] == pytest.approx(0.8 * 0.9)
    text = " ".join(run(CONFIGS / "llama-3-8b.json", "--tp", 2).output.split())
    assert "decode efficiency (of peak bandwidth) │ 72% = 80% MBU × 0.90 tensor-parallel" in text


@pytest.mark.parametrize("recipe,gpu,says", [
    ("w4a8-int8", "h100-sxm", "W4A8-INT8 runs in vLLM on CPUs (Arm KleidiAI) and Intel XPUs only"),
    ("w4a8-fp8-static", "a100-80g", "static W4A8-FP8 runs in TensorRT-LLM's W4A8_AWQ kernels on Ada and Hopper only"),
    ("w4a8-fp8-static-kv8", "b200", "B200 180GB is Blackwell"),
    ("w4a8-fp8", "l4", "W4A8-FP8 runs in vLLM on Hopper only"),
])
def test_plan_says_when_the_gpu_cannot_run_a_w4a8_recipe(model_dir, recipe, gpu, says):
    r = run(model_dir, "--recipe", recipe, "--gpu", gpu, "--json")
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert any(n.startswith(f"{recipe} on ") and says in n for n in doc["notes"]), doc["notes"]
    r = run(model_dir, "--recipe", recipe, "--gpu", gpu)
    assert says in " ".join(r.output.split())


@pytest.mark.parametrize("recipe,gpu", [("w4a8-fp8-static", "h100-sxm"), ("w4a8-fp8-static-kv8", "l4"),
                                        ("w4a8-fp8", "h200")])
def test_plan_has_no_w4a8_warning_where_it_runs(model_dir, recipe, gpu):
    doc = json.loads(run(model_dir, "--recipe", recipe, "--gpu", gpu, "--json").output)
    assert not any(n.startswith(f"{recipe} on ") for n in doc["notes"]), doc["notes"]
    assert any("W4A8" in n for n in doc["serving"]["notes"])  # where it runs, in the README's serving lines
