"""Where and how a model is served (GPU × tp, context, concurrency, engine settings) and what a recipe needs there:
weights and per-GPU memory. Shared by the planner and the serving flags (serving.py), which both build on it."""

from __future__ import annotations

from dataclasses import dataclass

from qtk.errors import UsageError
from qtk.plan.hardware import GPU, tp_efficiency
from qtk.plan.memory import (
    DEFAULT_BATCHED_TOKENS,
    DEFAULT_OVERHEAD_BYTES,
    DEFAULT_UTILIZATION,
    MemoryPlan,
    ModelShape,
    WeightBytes,
    kv_bytes_of,
    normalize_dtype,
    plan_memory,
    weight_bytes,
)


@dataclass(frozen=True)
class Deployment:
    """Where and how the model is served: GPU × tp, context, concurrency and vLLM-style settings."""

    gpu: GPU
    context: int = 4096
    concurrency: int = 8
    tp: int = 1
    utilization: float = DEFAULT_UTILIZATION
    overhead: int = DEFAULT_OVERHEAD_BYTES
    tp_efficiency_per_doubling: float | None = None
    batched_tokens: int = DEFAULT_BATCHED_TOKENS
    dtype: str | None = None  # serving dtype override

    def __post_init__(self):
        if self.context < 1:
            raise UsageError(f"--context must be at least 1 token, got {self.context}", "e.g. --context 4096")
        if self.concurrency < 1:
            raise UsageError(f"--concurrency must be at least 1, got {self.concurrency}", "e.g. --concurrency 8")
        if self.tp < 1:
            raise UsageError(f"--tp must be at least 1, got {self.tp}", "e.g. --tp 2 for two GPUs")
        if not 0 < self.utilization <= 1:
            raise UsageError(f"--gpu-memory-utilization must be in (0, 1], got {self.utilization}", "vLLM's default is 0.9")
        if self.tp_efficiency_per_doubling is not None and not 0 < self.tp_efficiency_per_doubling <= 1:
            raise UsageError(f"--tp-efficiency must be in (0, 1], got {self.tp_efficiency_per_doubling}", "e.g. 0.9 for NVLink")

    @property
    def tp_eff(self) -> float:
        return tp_efficiency(self.gpu, self.tp, self.tp_efficiency_per_doubling)

    def describe(self) -> str:
        return f"{self.tp}× {self.gpu.label}, {self.context}-token context, {self.concurrency} concurrent"

    def as_dict(self) -> dict:
        return {"gpu": self.gpu.as_dict(), "tp": self.tp, "context": self.context, "concurrency": self.concurrency,
                "gpu_memory_utilization": self.utilization, "overhead_bytes": self.overhead,
                "tp_efficiency": round(self.tp_eff, 4), "batched_tokens": self.batched_tokens}


def serving_dtype(s: ModelShape, dep: Deployment) -> str:
    """The dtype dense tensors are served in: vLLM runs float32 checkpoints in bf16 (fp16 without bf16)."""
    d = normalize_dtype(dep.dtype, s.dtype)
    if d == "float32" and dep.dtype is None:
        d = "bfloat16"
    if d == "bfloat16" and not dep.gpu.bf16:
        d = "float16"  # same bytes; T4 has no bf16
    return d


def check_deployment(s: ModelShape, dep: Deployment) -> None:
    """Refuse a tensor-parallel size the engines cannot split this model over (the check `qtk convert` applies
    to the trtllm target, so the plan never prints a --tensor-parallel-size that fails at load)."""
    from qtk.model.config_check import check_tensor_parallel

    check_tensor_parallel(dep.tp, s.heads, s.kv_heads, s.intermediate)


def evaluate(s: ModelShape, recipe, dep: Deployment) -> tuple[WeightBytes, MemoryPlan]:
    """Weights and per-GPU memory of `recipe` (None: unquantized) on the deployment."""
    dtype = serving_dtype(s, dep)
    w = weight_bytes(s, recipe, dtype)
    m = plan_memory(s, w, mem_bytes=dep.gpu.mem_bytes, kv_bytes=kv_bytes_of(recipe, dtype), context=dep.context,
                    concurrency=dep.concurrency, tp=dep.tp, utilization=dep.utilization, overhead=dep.overhead,
                    batched_tokens=dep.batched_tokens)
    return w, m
