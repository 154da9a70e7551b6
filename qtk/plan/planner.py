"""A full plan for one model, recipe and deployment: weights, KV cache, fit, throughput, cost,
conversion memory and the serving flags. The pieces live in deployment/memory/cost/hardware/serving."""

from __future__ import annotations

from dataclasses import dataclass, field

from qtk.plan.cost import Cost, Throughput, cost, throughput
from qtk.plan.deployment import (  # noqa: F401 (Deployment, evaluate: re-exported, the plan's vocabulary)
    Deployment,
    activation_type,
    check_deployment,
    evaluate,
    serving_dtype,
)
from qtk.plan.hardware import GB
from qtk.plan.memory import ConversionMemory, MemoryPlan, ModelShape, WeightBytes, conversion_memory, normalize_dtype
from qtk.plan.serving import serving_commands


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
    fp4 = recipe is not None and (recipe.weights.is_fp4 or activation_type(recipe) == "fp4")
    if fp4 and not dep.gpu.fp4:
        notes.append(f"FP4 recipe on {dep.gpu.label}: FP4 tensor cores are Blackwell's ({dep.gpu.generation} has none); "
                     "vLLM falls back to weight-only FP4 Marlin kernels (activations unquantized) or refuses — "
                     "prefer an FP8 or INT4 recipe")
    elif recipe is not None and (recipe.weights.type == "float" or activation_type(recipe) == "float") and not dep.gpu.fp8:
        notes.append(f"FP8 recipe on {dep.gpu.label}: no FP8 tensor cores ({dep.gpu.generation}); engines fall back "
                     "to slower weight-only kernels or refuse — prefer an INT8 recipe")
    if recipe is not None:
        from qtk.plan.decide import w4a8_excluded, w4a8_kind

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
