"""Throughput and cost: a roofline for decode (memory bandwidth vs. compute), a compute-bound prefill
estimate, cost per 1K tokens, and the monthly volume above which self-hosting beats an API price.

Estimates, stated with their assumptions: achieved bandwidth and compute are fixed fractions of the
datasheet peaks (MBU, MFU), and every sequence is assumed to sit at the full context (worst case).
"""

from __future__ import annotations

from dataclasses import dataclass

from qtk.plan.hardware import GPU
from qtk.plan.memory import MemoryPlan, ModelShape, WeightBytes, kv_bytes_per_request

MBU = 0.8  # achieved / peak memory bandwidth in decode kernels
MFU = 0.5  # achieved / peak tensor throughput in large GEMMs
HOURS_PER_MONTH = 730


@dataclass(frozen=True)
class Throughput:
    """Aggregate tokens/s of one deployment (all tp GPUs together)."""

    decode_tokens_per_s: float
    per_sequence_tokens_per_s: float
    step_ms: float
    bound: str  # memory | compute
    bytes_per_step: int  # per GPU: weights touched + every sequence's KV
    prefill_tokens_per_s: float
    ttft_s: float  # one full-context prompt on an idle deployment
    # the factors the roofline applies to the datasheet peaks
    bandwidth_utilization: float = MBU
    compute_utilization: float = MFU
    tp_efficiency: float = 1.0
    decode_efficiency: float = MBU  # of the binding peak in a decode step: MBU (or MFU) × tp_efficiency

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def active_params(s: ModelShape, w: WeightBytes) -> int:
    """Parameters one token multiplies through: routed experts count top_k of experts, the
    embedding lookup and the vision tower count nothing."""
    p = w.params - s.vocab * s.hidden - s.vision_params
    if s.is_moe and s.experts:
        p -= w.expert_params * (1 - s.top_k / s.experts)
    return int(p)


def throughput(s: ModelShape, w: WeightBytes, mem: MemoryPlan, gpu: GPU, *, tp: int, concurrency: int,
               context: int, activation_type: str | None, tp_eff: float) -> Throughput:
    """Decode roofline at `concurrency` sequences of `context` tokens, and prefill speed."""
    b = max(concurrency, 1)
    read = w.total - w.vision
    if s.is_moe and s.experts:
        # a step with b tokens touches 1 - (1 - k/E)^b of each layer's experts
        touched = 1 - (1 - s.top_k / s.experts) ** b
        read = read - w.experts + w.experts * touched
    per_gpu = int(read / tp) + b * kv_bytes_per_request(s, context, mem.kv_bytes, tp)
    mem_time = per_gpu / (gpu.bandwidth * MBU)
    flops_token = 2 * active_params(s, w)
    peak = gpu.peak_flops(activation_type) * MFU
    compute_time = flops_token * b / tp / peak
    step = max(mem_time, compute_time) / tp_eff
    decode = b / step
    # prefill: GEMMs plus causal attention (QK and AV over half the context on average)
    v_dim = s.v_head_dim if s.is_mla else s.head_dim
    attn_flops = 2 * s.layers * s.heads * (s.qk_head_dim + v_dim) * context / 2
    prefill = peak * tp * tp_eff / (flops_token + attn_flops)
    bound = "memory" if mem_time >= compute_time else "compute"
    return Throughput(decode_tokens_per_s=decode, per_sequence_tokens_per_s=decode / b, step_ms=step * 1e3,
                      bound=bound, bytes_per_step=per_gpu, prefill_tokens_per_s=prefill, ttft_s=context / prefill,
                      tp_efficiency=tp_eff, decode_efficiency=(MBU if bound == "memory" else MFU) * tp_eff)


@dataclass(frozen=True)
class Cost:
    """What the deployment costs to run flat out, and where it beats an API."""

    price_per_hour: float  # all GPUs of the deployment
    usd_per_1k_output: float
    usd_per_1k_input: float
    monthly_cost: float
    monthly_capacity_tokens: float  # output tokens at full load, always on
    api_usd_per_1m: float | None
    breakeven_tokens_per_month: float | None  # None: self-hosting never beats the API price

    def as_dict(self) -> dict:
        return {k: getattr(self, k) for k in self.__dataclass_fields__}


def cost(tput: Throughput, gpu: GPU, tp: int, api_usd_per_1m: float | None = None) -> Cost:
    """Cost per 1K tokens at full load and the self-hosting break-even volume against an API."""
    hourly = gpu.price_per_hour * tp
    per_out = hourly / (tput.decode_tokens_per_s * 3600) * 1000 if tput.decode_tokens_per_s else float("inf")
    per_in = hourly / (tput.prefill_tokens_per_s * 3600) * 1000 if tput.prefill_tokens_per_s else float("inf")
    monthly = hourly * HOURS_PER_MONTH
    capacity = tput.decode_tokens_per_s * 3600 * HOURS_PER_MONTH
    breakeven = None
    if api_usd_per_1m:
        # an always-on deployment is a fixed cost; it wins above monthly / API price per token, and only
        # if one more replica is still cheaper per token than the API at full load
        if per_out * 1000 < api_usd_per_1m:
            breakeven = monthly / (api_usd_per_1m / 1e6)
    return Cost(price_per_hour=hourly, usd_per_1k_output=per_out, usd_per_1k_input=per_in, monthly_cost=monthly,
                monthly_capacity_tokens=capacity, api_usd_per_1m=api_usd_per_1m, breakeven_tokens_per_month=breakeven)
