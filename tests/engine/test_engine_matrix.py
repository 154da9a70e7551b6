"""Every built-in recipe's vLLM checkpoint, loaded and run by the real vLLM (its CPU build).

Where vLLM's CPU backend has a kernel, the checkpoint must run, generate, and its per-token log-probs must agree with
qtk's simulation of the same bytes within qtk.eval.engine_check.BOUNDS. Where it has none, vLLM's own refusal must
be the one qtk.plan.serving.vllm_cpu_support names, so a vLLM release that adds a kernel fails this test and says so.
The example model (examples/tiny-llama) for every recipe it can hold; FP8 blocks need Linears that tile by 128, so
those run on a random Llama of hidden 256 built here."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from qtk.eval.engine_check import check_windows, compare
from qtk.eval.engines import load_tokenizer
from qtk.eval.vllm_process import cpu_flags
from qtk.plan.decide import w4a8_kind
from qtk.plan.serving import vllm_cpu_support
from qtk.recipe import builtin_recipes, load_recipe

HERE = Path(__file__).resolve().parent
EXAMPLE = HERE.parents[1] / "examples" / "tiny-llama"
# the vllm target writes every built-in recipe but static W4A8 (TensorRT-LLM's W4A8_AWQ, refused by name)
RECIPES = sorted(r for r in builtin_recipes() if w4a8_kind(load_recipe(r)) != "fp8-static")
AMX = "amx_tile" in cpu_flags()


@pytest.fixture(scope="session")
def sources(tmp_path_factory):
    from models import make_tiny_model

    wide = make_tiny_model(tmp_path_factory.mktemp("wide") / "wide-llama", hidden=256, intermediate=512)
    return {"example": EXAMPLE, "wide": wide}


@pytest.fixture(scope="session")
def checkpoint(sources, tmp_path_factory):
    """recipe -> its vllm output (converted once per session)."""
    from qtk import api

    done: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("ckpt")

    def get(recipe: str) -> Path:
        if recipe not in done:
            src = sources["wide" if load_recipe(recipe).weights.strategy == "block" else "example"]
            res = api.convert(src, recipe, root / recipe, num_samples=16, seq_len=128, hash_source=False)
            done[recipe] = res.outputs["vllm"]
        return done[recipe]

    return get


@pytest.fixture(scope="session")
def windows(sources):
    """recipe's source model -> 4 windows of 256 tokens of qtk's shipped corpus in its tokenizer."""
    cache = {}

    def get(path: Path):
        key = str(path)
        if key not in cache:
            cache[key] = check_windows(load_tokenizer(path), num=4, seq_len=256)
        return cache[key]

    return get


def test_unquantized_model_runs_as_transformers_computes_it(vllm, windows, record):
    """The engine's numerical floor: the bf16 model in vLLM against transformers (float32) on the same windows."""
    c = compare(EXAMPLE, windows(EXAMPLE), vllm, baseline=True)
    record("(unquantized)", c.line())
    assert c.status == "runs", c.reason
    assert not c.disagreements, c.disagreements
    # vLLM in bf16 is as far from transformers in float32 as transformers in bf16 is
    assert c.noise_dtype == "bfloat16" and c.mean_abs_dlogp < 1.25 * c.noise_mean_abs_dlogp


@pytest.mark.parametrize("recipe", RECIPES)
def test_recipe_runs_in_vllm_or_vllm_says_why(vllm, checkpoint, windows, record, recipe):
    want = vllm_cpu_support(load_recipe(recipe), amx=AMX)
    path = checkpoint(recipe)
    src = Path(json.loads((path / "qtk.json").read_text())["source"]["path"])
    c = compare(path, windows(src), vllm)
    record(recipe, ("runs: " + c.line()) if c.status == "runs" else f"{c.status}: {c.reason[:160]}")
    if not want.measured:  # a kernel choice this CPU's instruction sets make that the tests have not run: report it
        pytest.skip(f"vLLM on this CPU (AMX) picks kernels qtk has not measured: {c.line()}")
    if c.status == "runs":
        assert want.runs, (f"vLLM {vllm.version} now runs {recipe} on this CPU ({', '.join(c.schemes)}), where "
                           f"qtk.plan.serving.vllm_cpu_support says: {want.detail} — update it and the README column")
        assert not c.disagreements, f"{recipe}: engine and simulation disagree: {'; '.join(c.disagreements)} ({c.line()})"
        recipe_kv = load_recipe(recipe).kv_cache is not None
        assert str(c.kv_cache_dtype).startswith("fp8") == recipe_kv, c.kv_cache_dtype  # the checkpoint's own KV scheme
        text = vllm.generate([windows(src)[0][:64]], 8, [])
        assert len(text) == 1 and text[0], "vLLM generated nothing"
    else:
        assert c.status == "refused", c.reason
        assert not want.runs, f"qtk says vLLM's CPU backend runs {recipe} ({want.detail}), but it refused: {c.reason}"
        assert re.search(want.refusal, c.reason), f"vLLM refused {recipe} for another reason than qtk names: {c.reason}"


def test_fp8_kv_cache_bytes_are_what_qtk_simulates(vllm):
    """vLLM's CPU attention writes its FP8 KV cache as e4m3 of x times the reciprocal of the scale, truncated toward
    zero and saturated at 448 (the GPU kernels round to nearest). qtk's engine check simulates exactly that
    (qtk.model.simulate.fp8_toward_zero); here the kernel's own bytes are compared with it, code for code."""
    import torch

    from qtk.model.simulate import FP8_DTYPE, fp8_toward_zero

    out = subprocess.run([sys.executable, str(HERE / "kv_probe.py")], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    assert probe["cases"], "the probe wrote no cases"
    differ = 0
    for case in probe["cases"]:
        x = torch.tensor(case["x"], dtype=torch.float32)
        inv = torch.tensor(1.0, dtype=torch.float32) / torch.tensor(case["scale"], dtype=torch.float32)
        want = fp8_toward_zero(x * inv).to(FP8_DTYPE).view(torch.uint8).tolist()
        assert case["codes"] == want, f"scale {case['scale']}: vLLM's codes differ from qtk's truncation"
        differ += case["codes"] != (x * inv).clamp(-448, 448).to(FP8_DTYPE).view(torch.uint8).tolist()
    assert differ, "vLLM's codes are round-to-nearest's in every case: it no longer truncates; update kv_fake_quant"
