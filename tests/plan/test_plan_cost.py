"""Throughput roofline and cost: the formulas, and that they respond to the inputs the right way."""

import math

import pytest
from plan_helpers import shape

from qtk.errors import UsageError
from qtk.plan.cost import HOURS_PER_MONTH, MBU, MFU, active_params, cost
from qtk.plan.hardware import GPUS, get_gpu, tp_efficiency
from qtk.plan.memory import kv_bytes_per_request
from qtk.plan.planner import Deployment, make_plan
from qtk.recipe import load_recipe


def plan(s, recipe=None, gpu="h100-sxm", api=None, **kw):
    g = gpu if not isinstance(gpu, str) else get_gpu(gpu)
    return make_plan(s, load_recipe(recipe) if recipe else None, Deployment(gpu=g, **kw), api_usd_per_1m=api)


def test_batch_one_decode_reads_weights_and_kv_at_achieved_bandwidth():
    s = shape("llama-3-8b")
    p = plan(s, context=4096, concurrency=1)
    t = p.throughput
    assert t.bytes_per_step == p.weights.total + kv_bytes_per_request(s, 4096, 2)
    assert t.bound == "memory"
    assert t.decode_tokens_per_s == pytest.approx(GPUS["h100-sxm"].bandwidth * MBU / t.bytes_per_step)


def test_decode_scales_with_bandwidth_and_with_fewer_weight_bytes():
    s = shape("llama-3-8b")
    slow = plan(s, gpu=get_gpu("h100-sxm", bandwidth_tb_s=1.0), concurrency=1).throughput
    fast = plan(s, gpu=get_gpu("h100-sxm", bandwidth_tb_s=2.0), concurrency=1).throughput
    assert fast.decode_tokens_per_s == pytest.approx(2 * slow.decode_tokens_per_s)
    w4 = plan(s, "w4a16", concurrency=1).throughput
    assert w4.decode_tokens_per_s > 2.5 * plan(s, concurrency=1).throughput.per_sequence_tokens_per_s


def test_large_batches_become_compute_bound_and_fp8_raises_the_roof():
    s = shape("llama-3-8b")
    p = plan(s, context=64, concurrency=1024)
    big = p.throughput
    assert big.bound == "compute"
    flops = 2 * active_params(s, p.weights)
    h100 = GPUS["h100-sxm"]
    assert big.decode_tokens_per_s == pytest.approx(h100.bf16_tflops * 1e12 * MFU / flops)
    fp8 = plan(s, "fp8-dynamic", context=64, concurrency=1024).throughput
    assert fp8.bound == "compute"
    assert fp8.decode_tokens_per_s / big.decode_tokens_per_s == pytest.approx(h100.fp8_tflops / h100.bf16_tflops)


def test_moe_decode_reads_only_routed_experts():
    s = shape("mixtral-8x7b")
    p = plan(s, concurrency=1, context=128)
    w = p.weights
    expected = w.total - w.experts + w.experts * 2 / 8  # top-2 of 8 experts per token
    assert p.throughput.bytes_per_step == int(expected) + kv_bytes_per_request(s, 128, 2)
    # with many sequences nearly every expert is touched
    many = plan(s, concurrency=64, context=128).throughput
    assert many.bytes_per_step > 0.99 * w.total
    # one token multiplies through 2 of 8 experts, not the embedding
    assert active_params(s, w) == w.params - 32000 * 4096 - w.expert_params * 6 // 8


def test_prefill_and_time_to_first_token():
    s = shape("llama-3-8b")
    t = plan(s, context=4096).throughput
    attn = 2 * 32 * 32 * (128 + 128) * 4096 / 2
    per_token = 2 * active_params(s, plan(s).weights) + attn
    assert t.prefill_tokens_per_s == pytest.approx(GPUS["h100-sxm"].bf16_tflops * 1e12 * MFU / per_token)
    assert t.ttft_s == pytest.approx(4096 / t.prefill_tokens_per_s)


def test_tensor_parallel_efficiency():
    h100, pcie = GPUS["h100-sxm"], GPUS["h100-pcie"]
    assert tp_efficiency(h100, 1) == 1.0
    assert tp_efficiency(h100, 2) == pytest.approx(0.9)
    assert tp_efficiency(h100, 4) == pytest.approx(0.81)
    assert tp_efficiency(pcie, 2) == pytest.approx(0.75)
    assert tp_efficiency(h100, 2, 0.5) == pytest.approx(0.5)


def test_cost_per_token_and_break_even():
    s = shape("llama-3-8b")
    p = plan(s, gpu=get_gpu("h100-sxm", price=2.0), tp=2, api=0.6)
    c, t = p.cost, p.throughput
    assert c.price_per_hour == 4.0
    assert c.usd_per_1k_output == pytest.approx(4.0 / (t.decode_tokens_per_s * 3600) * 1000)
    assert c.monthly_cost == pytest.approx(4.0 * HOURS_PER_MONTH)
    assert c.breakeven_tokens_per_month == pytest.approx(c.monthly_cost / 0.6e-6)
    assert c.breakeven_tokens_per_month < c.monthly_capacity_tokens
    # an API cheaper per token than the deployment at full load is never beaten
    never = cost(t, get_gpu("h100-sxm", price=2.0), 2, api_usd_per_1m=c.usd_per_1k_output * 1000 / 2)
    assert never.breakeven_tokens_per_month is None


def test_gpu_table_and_overrides():
    assert get_gpu("H100_80G") == GPUS["h100-sxm"] == get_gpu("h100")
    assert not get_gpu("a100-80g").fp8 and not get_gpu("t4").fp8 and get_gpu("l4").fp8
    assert {"a100-40g", "a100-80g", "h100-sxm", "h100-pcie", "h200", "b200", "l4", "t4", "rtx-4090", "rtx-5090",
            "mi300x"} <= set(GPUS)
    g = get_gpu("a100-80g", mem_gb=40, bandwidth_tb_s=1.5, price=1.0)
    assert (g.mem_bytes, g.bandwidth, g.price_per_hour) == (40 * 10**9, 1.5e12, 1.0)
    with pytest.raises(UsageError, match="unknown GPU 'v100'"):
        get_gpu("v100")
    with pytest.raises(UsageError, match="--gpu-mem"):
        get_gpu("h100", mem_gb=0)
    assert math.isclose(get_gpu(None, mem_gb=24).mem_bytes, 24e9)
    with pytest.raises(UsageError, match="no GPU given"):
        get_gpu(None)
