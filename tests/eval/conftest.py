"""Shared fixtures for the qtk eval tests: one tiny random Llama, its checkpoints, and small task files."""

import random

import pytest
from models import write_jsonl

from qtk import api

NS, T = 8, 64  # calibration windows: small, the numbers only need to be consistent


def convert(model, recipe, out, calib_file, **kw):
    return api.convert(model, recipe, out, calib=str(calib_file), num_samples=NS, seq_len=T, **kw).outputs["vllm"]


@pytest.fixture(scope="package")
def ckpts(tiny_llama, calib_file, tmp_path_factory):
    """int8-kv8 (W8A8 dynamic + FP8 KV), a weight-only + 8-bit KV recipe for vLLM and TensorRT-LLM, and a deliberately
    broken 2-bit RTN one."""
    root = tmp_path_factory.mktemp("eval-ckpts")
    (root / "w8-kv8.yaml").write_text(
        "name: w8-kv8\nweights: {num_bits: 8, type: int, symmetric: true, strategy: channel}\n"
        "kv_cache: {num_bits: 8, type: int}\nalgorithm: [rtn]\nignore: [lm_head]\n"
        "calibration: {dataset: default, num_samples: 8, seq_len: 64}\n")
    (root / "w2.yaml").write_text(
        "name: w2-broken\nweights: {num_bits: 2, type: int, symmetric: true, strategy: tensor}\n"
        "algorithm: [rtn]\nignore: [lm_head]\n")
    w8 = api.convert(tiny_llama, root / "w8-kv8.yaml", root / "w8-kv8", targets=["vllm", "trtllm"], calib=str(calib_file),
                     num_samples=NS, seq_len=T).outputs
    return {
        "int8-kv8": convert(tiny_llama, "int8-kv8", root / "int8-kv8", calib_file),
        "w8-kv8": w8["vllm"],  # FP8 KV cache, k/v scales = amax/448
        "w8-kv8-trt": w8["trtllm"],  # INT8 KV cache, one factor per layer = max(k, v amax)/127
        "w2": convert(tiny_llama, root / "w2.yaml", root / "w2", calib_file),
    }


@pytest.fixture(scope="package")
def task_dir(tmp_path_factory):
    """Arithmetic (generate), multiple choice and perplexity data in the tiny models' character set."""
    d = tmp_path_factory.mktemp("tasks")
    rng = random.Random(7)
    add, mc = [], []
    for _ in range(24):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        add.append({"prompt": f"Q: {a}+{b}=", "reference": f" {a + b}"})
        mc.append({"context": f"Q: {a}+{b}=", "choices": [f" {a + b}", f" {a + b + 1}", f" {a - b}"], "answer": rng.randrange(3)})
    words = ["alpha", "beta", "gamma", "sort", "key", "value", "model"]
    ppl = [{"text": " ".join(rng.choice(words) for _ in range(rng.randint(8, 20)))} for _ in range(16)]
    write_jsonl(d / "add.jsonl", add)
    write_jsonl(d / "mc.jsonl", mc)
    write_jsonl(d / "ppl.jsonl", ppl)
    (d / "tasks.yaml").write_text(
        "defaults: {limit: 16}\n"
        "agreement: {max_kl: 0.05, min_top1: 80}\n"
        "tasks:\n"
        "  - {name: add, type: generate, data: add.jsonl, num_fewshot: 2, gate: {max_drop: 10}}\n"
        "  - {name: mc, type: multiple_choice, data: mc.jsonl, gate: {max_drop: 10}}\n"
        "  - {name: ppl, type: perplexity, data: ppl.jsonl, gate: {min_recovery: 0.95}}\n")
    return d
