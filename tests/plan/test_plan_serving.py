"""Serving flags: the vLLM and TensorRT-LLM settings that implement a plan, and the README section."""

import math

from plan_helpers import CONFIGS, config

from qtk.plan.hardware import get_gpu
from qtk.plan.memory import ModelShape
from qtk.plan.planner import Deployment, evaluate
from qtk.plan.serving import serving_commands, serving_section
from qtk.recipe import load_recipe


def test_section_for_an_int8_kv8_checkpoint():
    md = serving_section(config("llama-3-8b"), load_recipe("int8-kv8"), gpu="a100-80g", context=4096,
                         concurrency=8, tp=1, model_path="out/vllm")
    assert md.startswith("## Serving\n")
    assert ("vllm serve out/vllm --kv-cache-dtype fp8 --gpu-memory-utilization 0.9 --max-num-seqs 8 "
            "--max-model-len 4096 --tensor-parallel-size 1") in md
    assert "trtllm-build --checkpoint_dir TRTLLM_CHECKPOINT --output_dir ENGINE_DIR --max_batch_size 8 --max_seq_len 4096" in md
    assert "--kv_cache_free_gpu_memory_fraction" in md and "--tp_size 1" in md
    assert "| weights | 9.08 |" in md  # int8 Linears + bf16 embeddings and lm_head
    assert "INT8 cache" in md and "fits with" in md


def test_recipe_by_name_or_none_and_config_by_path():
    unquantized = serving_section(CONFIGS / "llama-3-8b.json", None, gpu="h100-80g", context=8192, concurrency=4, tp=2)
    assert "--kv-cache-dtype auto" in unquantized and "--tensor-parallel-size 2" in unquantized
    assert "--tp_size 2" in unquantized and "tp_size 2 (one rank file per GPU)" in unquantized
    assert "recipe `unquantized`" in unquantized
    assert "--kv-cache-dtype auto" in serving_section(config("llama-3-8b"), "w8a16")


def test_trtllm_fraction_gives_the_same_kv_pool_as_vllm():
    s = ModelShape.from_config(config("llama-3-8b"))
    dep = Deployment(gpu=get_gpu("a100-80g"), context=4096, concurrency=8)
    r = load_recipe("w4a16")
    _, m = evaluate(s, r, dep)
    f = serving_commands(s, r, m, dep)["trtllm_kv_cache_free_gpu_memory_fraction"]
    rest = m.weights + m.activations + m.overhead
    pool = m.budget - rest
    free = dep.gpu.mem_bytes - rest
    assert f * free <= pool < (f + 0.01) * free
    assert f == math.floor(100 * pool / free) / 100


def test_a_plan_that_does_not_fit_serves_the_most_that_fits():
    md = serving_section(config("llama-3.1-70b"), "w4a16", gpu="h100-80g", context=32768, concurrency=64)
    s = ModelShape.from_config(config("llama-3.1-70b"))
    _, m = evaluate(s, load_recipe("w4a16"), Deployment(gpu=get_gpu("h100-80g"), context=32768, concurrency=64))
    assert not m.fits and m.max_concurrency >= 1
    assert f"--max-num-seqs {m.max_concurrency} " in md and f"--max_batch_size {m.max_concurrency} " in md
    assert "does not fit" in md
