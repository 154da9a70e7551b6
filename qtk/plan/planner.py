"""A full plan for one model, recipe and deployment: weights, KV cache, fit, throughput, cost,
conversion memory and the serving flags. The pieces live in deployment/memory/cost/hardware/serving."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.plan.cost import Cost, Throughput, cost, throughput
from qtk.plan.deployment import (  # noqa: F401 (Deployment, evaluate: re-exported, the plan's vocabulary)
    Deployment,
    check_deployment,
    evaluate,
    serving_dtype,
)
from qtk.errors import CheckFailed, UsageError
from qtk.plan.hardware import DEFAULT_GPU, GB
from qtk.plan.memory import (DEFAULT_UTILIZATION, ConversionMemory, MemoryPlan, ModelShape, WeightBytes, conversion_memory,
                             normalize_dtype)
from qtk.plan.serving import TensorCores, activation_type, serving_commands, w4a8_kind


# what no fit asks of the deployment, in qtk plan's own words
FEWER = "use more GPUs (--tp), a shorter --context or a lower --concurrency"


@dataclass(frozen=True)
class PlanOptions:
    """The deployment to plan for and how (qtk plan's options; qtk.api.plan takes them whole or as keywords).

    gpu: a GPU of qtk.plan.hardware's table, with gpu_mem (GB), gpu_bw (TB/s) and price (USD per GPU-hour) overriding
    its figures; tp GPUs (tp_efficiency: throughput kept per doubling), context tokens per request, concurrency
    requests at once, utilization the engine's share of GPU memory, overhead_gb the fixed engine overhead per GPU,
    dtype the serving dtype of dense tensors. recommend: pick the recipe (qtk.plan.decide) that fits with `headroom`
    of the budget free, for `workload`. api_price: USD per 1M output tokens of an API, for the break-even volume.
    convert_on ("cpu" | "gpu") and convert_processes: where the conversion's time and memory are estimated."""

    gpu: str = DEFAULT_GPU
    gpu_mem: float | None = None
    gpu_bw: float | None = None
    price: float | None = None
    tp: int = 1
    tp_efficiency: float | None = None
    context: int = 4096
    concurrency: int = 8
    utilization: float = DEFAULT_UTILIZATION
    overhead_gb: float = 1.5
    dtype: str | None = None
    recommend: bool = False
    headroom: float = 0.10
    workload: str = "general"
    api_price: float | None = None
    convert_on: str = "cpu"
    convert_processes: int = 1

    def __post_init__(self):
        if self.overhead_gb < 0:
            raise UsageError(f"--overhead-gb must be >= 0, got {self.overhead_gb}", "e.g. --overhead-gb 1.5")
        if not 0 <= self.headroom < 1:
            raise UsageError(f"--headroom must be in [0, 1), got {self.headroom}", "e.g. --headroom 0.1")
        if self.api_price is not None and self.api_price <= 0:
            raise UsageError(f"--api-price must be positive, got {self.api_price}",
                             "give USD per 1M output tokens, e.g. --api-price 0.6")

    def deployment(self) -> Deployment:
        from qtk.plan.hardware import get_gpu

        return Deployment(gpu=get_gpu(self.gpu, mem_gb=self.gpu_mem, bandwidth_tb_s=self.gpu_bw, price=self.price),
                          context=self.context, concurrency=self.concurrency, tp=self.tp, utilization=self.utilization,
                          overhead=int(self.overhead_gb * GB), tp_efficiency_per_doubling=self.tp_efficiency,
                          dtype=self.dtype)


class NoRecipeFits(CheckFailed):
    """--recommend found no recipe that fits; `decision` holds every recipe's reason, for the report."""

    def __init__(self, decision):
        super().__init__(decision.reason, FEWER)
        self.decision = decision


@dataclass
class Plan:
    shape: ModelShape
    deployment: Deployment
    recipe_name: str
    recipe: object | None
    weights: WeightBytes
    memory: MemoryPlan
    throughput: Throughput
    cost: Cost
    conversion: ConversionMemory
    serving: dict
    notes: list[str] = field(default_factory=list)
    recommendation: object | None = None  # decide.Decision when --recommend
    convert_estimate: object | None = None  # convert_cost.ConversionEstimate: time and peaks of `qtk convert`

    def check_fit(self) -> None:
        """CheckFailed (exit 1) when the deployment does not hold what the plan needs, naming what would fit."""
        m = self.memory
        if m.fits:
            return
        fix = (f"serve at most {m.max_concurrency} concurrent (--concurrency {m.max_concurrency})" if m.max_concurrency
               else "use more GPUs (--tp), a shorter --context, or a smaller recipe (try --recommend)")
        raise CheckFailed(f"{self.recipe_name} does not fit on {self.deployment.describe()}: needs "
                          f"{m.needed / GB:.1f} GB per GPU of {m.budget / GB:.1f} GB", fix)

    def as_dict(self) -> dict:
        s = self.shape
        d = {
            "model": {"model_type": s.model_type, "params": self.weights.params, "layers": s.layers, "hidden": s.hidden,
                      "heads": s.heads, "kv_heads": s.kv_heads, "head_dim": s.head_dim, "vocab": s.vocab,
                      "experts": s.experts, "top_k": s.top_k, "mla_kv_lora_rank": s.kv_lora_rank,
                      "sliding_window_layers": sum(1 for w in s.windows if w), "tied_embeddings": s.tied,
                      "max_position_embeddings": s.max_position, "dtype": self.weights.dtype},
            "recipe": self.recipe_name,
            "deployment": self.deployment.as_dict(),
            "weights": self.weights.as_dict(),
            "memory": self.memory.as_dict(),
            "throughput": self.throughput.as_dict(),
            "cost": self.cost.as_dict(),
            "conversion": self.conversion.as_dict(),
            "conversion_estimate": self.convert_estimate.as_dict() if self.convert_estimate is not None else None,
            "serving": self.serving,
            "notes": self.notes,
        }
        if self.recommendation is not None:
            d["recommendation"] = self.recommendation.as_dict()
        return d


def plan_notes(s: ModelShape, recipe, dep: Deployment, m: MemoryPlan, *, recommended: bool = False) -> list[str]:
    """Warnings a reader should see next to the numbers (the INT4 one comes from the decision when recommended)."""
    notes = list(s.notes)
    fp4 = recipe is not None and TensorCores.of(recipe).fp4
    if fp4 and not dep.gpu.fp4:
        notes.append(f"FP4 recipe on {dep.gpu.label}: FP4 tensor cores are Blackwell's ({dep.gpu.generation} has none); "
                     "vLLM falls back to weight-only FP4 Marlin kernels (activations unquantized) or refuses — "
                     "prefer an FP8 or INT4 recipe")
    elif recipe is not None and (recipe.weights.type == "float" or activation_type(recipe) == "float") and not dep.gpu.fp8:
        notes.append(f"FP8 recipe on {dep.gpu.label}: no FP8 tensor cores ({dep.gpu.generation}); engines fall back "
                     "to slower weight-only kernels or refuse — prefer an INT8 recipe")
    if recipe is not None:
        from qtk.plan.decide import w4a8_excluded

        why = w4a8_excluded(w4a8_kind(recipe), dep.gpu)
        if why:
            notes.append(f"{recipe.name} on {dep.gpu.label}: {why}")
    if recipe is not None and recipe.weights.num_bits < 8 and not recommended:
        notes.append(f"INT{recipe.weights.num_bits} weights are risky for math/code workloads: gate the checkpoint with qtk eval")
    if s.max_position and dep.context > s.max_position:
        notes.append(f"context {dep.context} exceeds the model's max_position_embeddings ({s.max_position})")
    if not dep.gpu.bf16:
        notes.append(f"{dep.gpu.label} has no bf16: served in fp16 (same bytes)")
    if normalize_dtype(dep.dtype, s.dtype) != s.dtype or (s.dtype == "float32" and dep.dtype is None):
        notes.append(f"checkpoint dtype {s.dtype}, served as {serving_dtype(s, dep)}")
    if s.is_mla:
        notes.append("MLA: the cache holds one latent (kv_lora_rank + rope dims) per token per layer, replicated across tp ranks")
        if recipe is not None and recipe.kv_cache is not None:
            notes.append(f"{recipe.name} quantizes the KV cache, which qtk convert refuses for MLA (vLLM caches the "
                         "compressed latent, not per-head K and V): choose a recipe without kv_cache")
    if any(s.windows):
        sliding = [w for w in s.windows if w]
        notes.append(f"{len(sliding)} of {s.layers} layers use a sliding window of {max(sliding)} tokens: their KV is capped")
    if dep.tp > 1 and not s.is_mla and s.kv_heads < dep.tp:
        notes.append(f"{s.kv_heads} KV heads on {dep.tp} GPUs: each GPU holds a replicated copy of one KV head")
    if not m.fits and m.max_concurrency:
        notes.append(f"does not fit at {dep.concurrency} concurrent: at most {m.max_concurrency} at {dep.context} tokens")
    return notes


def make_plan(s: ModelShape, recipe, dep: Deployment, *, recipe_name: str | None = None, api_usd_per_1m: float | None = None,
              decision=None, model_path: str = "CHECKPOINT", convert_on: str = "cpu", convert_processes: int = 1) -> Plan:
    """Everything `qtk plan` reports for one recipe (None: the unquantized model)."""
    check_deployment(s, dep)
    w, m = evaluate(s, recipe, dep)
    tput = throughput(s, w, m, dep.gpu, tp=dep.tp, concurrency=dep.concurrency, context=dep.context,
                      activation_type=activation_type(recipe), tp_eff=dep.tp_eff)
    c = cost(tput, dep.gpu, dep.tp, api_usd_per_1m)
    conv = conversion_memory(s, recipe)
    name = recipe_name or (recipe.name if recipe is not None else f"none ({w.dtype})")
    serving = serving_commands(s, recipe, m, dep, model_path=model_path)
    notes = plan_notes(s, recipe, dep, m, recommended=decision is not None)
    from qtk.plan.convert_cost import estimate_conversion
    from qtk.plan.memory import DTYPE_BYTES, model_tensors

    source_bytes = sum(x.numel for x in model_tensors(s)) * DTYPE_BYTES[s.dtype]
    est = estimate_conversion(s, recipe, conv, source_bytes, w.total, gpu=dep.gpu if convert_on == "gpu" else None,
                              processes=convert_processes)
    return Plan(s, dep, name, recipe, w, m, tput, c, conv, serving, notes, decision, est)


def gb(n: float) -> str:
    return f"{n / GB:.2f} GB"
