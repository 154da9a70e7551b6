"""The decision tree behind `qtk plan --recommend`: which recipe to use on this deployment.

Recipes are read from the recipes directory (plus any the user gives) and classified by their schemes,
never by name. Every weight scheme is tried with and without an 8-bit KV cache, so a recipe that exists only
as a combination (say INT4 weights + FP8 KV) is found and written out as a recipe file. Order: compress the
weights first (8-bit), then the KV cache, then 4-bit weights; the first class with a recipe that fits with
headroom wins, and within a class the more accurate, better-supported recipe. FP8 is only considered on
GPUs with FP8 tensor cores, FP4 (NVFP4, MXFP4) only on Blackwell's FP4 tensor cores, MXFP8 only on Blackwell's
block-scaled FP8 tensor cores (elsewhere vLLM runs it weight-only), W4A8-FP8 only on Hopper
(vLLM's kernel is SM90-only), static W4A8-FP8 on Ada and Hopper (TensorRT-LLM's W4A8_AWQ), W4A8-INT8 on none of the
table's GPUs (vLLM runs it on CPUs and Intel XPUs): FP4 on Blackwell, FP8 on Hopper / Ada, INT8 / INT4 on Ampere.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from qtk.quant.scheme import Strategy
from qtk.plan.hardware import GB
from qtk.plan.memory import MemoryPlan, ModelShape, WeightBytes
from qtk.plan.deployment import Deployment, check_deployment, evaluate
from qtk.plan.serving import TensorCores, weight_label, w4a8_kind  # noqa: F401 (w4a8_kind: part of the tree's vocabulary)
from qtk.recipe.params import STEP_PARAMS

DEFAULT_MIN_HEADROOM = 0.10  # of the budget: the activation and overhead figures are estimates
RISKY_WORKLOADS = ("math", "code")
GRANULARITY = {"group": 0, "tensor_group": 0, "block": 1, "channel": 1, "tensor": 2}


@dataclass(frozen=True)
class RecipeClass:
    """What decides a recipe's place in the tree, read from its schemes."""

    weight_bits: int
    fp8: bool  # FP8 weights or activations: needs FP8 tensor cores
    fp4: bool  # FP4 weights or activations (NVFP4, MXFP4): needs Blackwell's FP4 tensor cores
    mxfp8: bool  # MXFP8 weights: needs Blackwell's block-scaled FP8 tensor cores (vLLM runs them W8A8-MX there)
    w4a8: bool  # int4 weights with 8-bit activations (W4A8-FP8 or W4A8-INT8): ranked after native 8-bit formats
    w4a8_kind: str | None  # "fp8-dynamic" (vLLM, Hopper), "fp8-static" (TensorRT-LLM W4A8_AWQ, Ada/Hopper), "int8"
    kv8: bool
    weight_only: bool
    calibrated: str | None  # the first step that looks at calibration data (its needs_data), None for round-to-nearest
    iterative: bool  # a step repeats passes over every layer (AutoRound): ranked after a one-pass solver of its class
    granularity: int
    symmetric: bool
    static_activations: bool

    @classmethod
    def of(cls, recipe) -> "RecipeClass":
        w, a = recipe.weights, recipe.activations
        cores = TensorCores.of(recipe)  # what the engines run it on (qtk.plan.serving)
        return cls(
            weight_bits=w.num_bits,
            fp8=cores.fp8,
            fp4=cores.fp4,
            mxfp8=cores.mxfp8,
            w4a8=w.type == "int" and w.num_bits == 4 and a is not None,
            w4a8_kind=w4a8_kind(recipe),
            kv8=recipe.kv_cache is not None,
            weight_only=cores.weight_only,
            calibrated=next((s for s in recipe.step_names if STEP_PARAMS[s].needs_data), None),
            iterative=any(STEP_PARAMS[s].iterative for s in recipe.step_names),
            granularity=GRANULARITY.get(w.strategy, 3),
            symmetric=w.symmetric,
            static_activations=recipe.static_activations,
        )

    @property
    def tier(self) -> tuple[int, int]:
        # fewer bits = later; at equal bits an untouched KV cache comes first
        return (-self.weight_bits, int(self.kv8))

    def preference(self) -> tuple:
        """Within a tier (same memory class), smaller is better."""
        # float weights (FP8, FP4) run natively where they are allowed at all, and keep more precision than int
        return (0 if (self.fp8 or self.fp4) and not self.w4a8 else 1, 0 if self.calibrated else 1, 0 if self.weight_only else 1,
                self.granularity, 0 if self.symmetric else 1, 1 if self.static_activations else 0, int(self.iterative))


def w4a8_excluded(kind: str | None, gpu) -> str | None:
    """Why a W4A8 recipe cannot run on `gpu` (None: it can, or it is no W4A8)."""
    if kind == "fp8-dynamic" and not gpu.w4a8_fp8:
        return f"W4A8-FP8 runs in vLLM on Hopper only (SM90 CUTLASS kernel); {gpu.label} is {gpu.generation}"
    if kind == "fp8-static" and not gpu.w4a8_awq:
        return (f"static W4A8-FP8 runs in TensorRT-LLM's W4A8_AWQ kernels on Ada and Hopper only; {gpu.label} is "
                f"{gpu.generation}")
    if kind == "int8" and not gpu.w4a8_int8:
        return (f"W4A8-INT8 runs in vLLM on CPUs (Arm KleidiAI) and Intel XPUs only: no kernel runs INT8 activations "
                f"with int4 weights on {gpu.label} (serve w4a8-fp8 on Hopper, w4a16-gptq elsewhere)")
    return None


@dataclass
class Considered:
    name: str
    recipe: object | None
    error: str | None = None
    klass: RecipeClass | None = None
    weights: WeightBytes | None = None
    memory: MemoryPlan | None = None
    status: str = ""  # chosen | passed | excluded | no-fit | tight | error
    reason: str = ""
    derived_from: str | None = None  # a KV-cache variant of this recipe, not a file of its own

    def as_dict(self) -> dict:
        d = {"recipe": self.name, "status": self.status, "reason": self.reason}
        if self.derived_from:
            d["derived_from"] = self.derived_from
        if self.weights is not None:
            d.update(weights_bytes=self.weights.total, needed_bytes_per_gpu=self.memory.needed,
                     budget_bytes_per_gpu=self.memory.budget, headroom_fraction=round(self.memory.headroom_fraction, 4),
                     fits=self.memory.fits, max_concurrency=self.memory.max_concurrency)
        return d


@dataclass
class Decision:
    chosen: str | None
    reason: str
    candidates: list[Considered]
    warnings: list[str] = field(default_factory=list)
    baseline: MemoryPlan | None = None  # the unquantized model, for reference

    @property
    def candidate(self) -> Considered | None:
        return next((c for c in self.candidates if c.name == self.chosen), None)

    @property
    def recipe(self):
        c = self.candidate
        return c.recipe if c is not None else None

    @property
    def recipe_yaml(self) -> str | None:
        """The recipe file to convert with, when the choice is a combination no shipped recipe spells out."""
        c = self.candidate
        return c.recipe.text if c is not None and c.derived_from else None

    def as_dict(self) -> dict:
        d = {"chosen": self.chosen, "reason": self.reason, "warnings": self.warnings,
             "candidates": [c.as_dict() for c in self.candidates]}
        if self.recipe_yaml:
            d["recipe_yaml"] = self.recipe_yaml
        if self.baseline is not None:
            d["baseline"] = {"fits": self.baseline.fits, "needed_bytes_per_gpu": self.baseline.needed,
                             "headroom_fraction": round(self.baseline.headroom_fraction, 4)}
        return d


def shipped_recipes() -> dict[str, object]:
    """Every recipe in the recipes directory: name -> Recipe, or the error that stopped it loading."""
    from qtk.errors import QtkError
    from qtk.recipe import builtin_recipes, load_recipe

    out: dict[str, object] = {}
    for name, path in builtin_recipes().items():
        try:
            out[name] = load_recipe(path)
        except QtkError as e:
            out[name] = e
    return out


def with_kv_cache(recipe, kv_type: str | None, name: str):
    """`recipe` with an 8-bit KV cache of `kv_type` ('float': FP8, 'int': INT8), or with none (None), as the
    recipe file a user would write: the base recipe's YAML with its kv_cache and name replaced, parsed again."""
    import yaml

    from qtk.bounds import load_yaml
    from qtk.recipe import parse_recipe

    doc = load_yaml(recipe.text, f"recipe {recipe.name}") if recipe.text else None
    if not isinstance(doc, dict):  # a recipe built in code has no text: derive it from its fields
        from dataclasses import replace

        from qtk.recipe import parse_scheme

        kv = None if kv_type is None else parse_scheme({"num_bits": 8, "type": kv_type}, f"{name}: kv_cache", "kv_cache")
        return replace(recipe, name=name, kv_cache=kv, description=f"{recipe.name} with {_kv_words(kv_type)}")
    doc.pop("kv_cache", None)
    doc = {"name": name, "description": f"{recipe.name} with {_kv_words(kv_type)} (combined by qtk plan --recommend)",
           **{k: v for k, v in doc.items() if k not in ("name", "description")}}
    if kv_type is not None:
        doc["kv_cache"] = {"num_bits": 8, "type": kv_type}
    text = yaml.safe_dump(doc, sort_keys=False)
    return parse_recipe(doc, text, f"{name} (derived from {recipe.name})")


def _kv_words(kv_type: str | None) -> str:
    return {"float": "an FP8 KV cache", "int": "an INT8 KV cache", None: "a 16-bit KV cache"}[kv_type]


def kv_words(recipe) -> str:
    return _kv_words(None if recipe.kv_cache is None else recipe.kv_cache.type)


def _plan_key(recipe) -> tuple:
    """What decides a recipe's memory and accuracy (its name, text and calibration data do not)."""
    return recipe.weights, recipe.activations, recipe.kv_cache, recipe.algorithm, recipe.ignore


def kv_variants(recipes: Mapping[str, object], gpu) -> list[tuple[str, object, str | None]]:
    """Every recipe as given, plus each weight scheme with the KV option it lacks: an 8-bit KV cache (FP8 on GPUs
    with FP8, INT8 elsewhere: the same bytes) where it has none, a 16-bit one where it has one. Variants equal to a
    recipe already in the set are dropped. Returns (name, recipe or loading error, the recipe it derives from)."""
    out = [(n, r, None) for n, r in sorted(recipes.items())]
    seen = {_plan_key(r) for _, r, _ in out if not isinstance(r, Exception)}
    kv8 = "float" if gpu.fp8 else "int"
    for name, r, _ in list(out):
        if isinstance(r, Exception):
            continue
        v = with_kv_cache(r, None, f"{name}+kv16") if r.kv_cache is not None else with_kv_cache(r, kv8, f"{name}+kv8")
        if _plan_key(v) not in seen:
            seen.add(_plan_key(v))
            out.append((v.name, v, name))
    return out


def untiled(s: ModelShape, recipe, tp: int = 1) -> str | None:
    """The first quantized Linear (name [out, in]: the rule) whose FP8 blocks vLLM cannot run at tensor-parallel size
    tp, or None: qtk.model.config_check.fp8_block_misfit (validate_fp8_block_shape; inputs in whole groups) on the
    GEMMs vLLM runs: q/k/v and gate/up merged and column-parallel, o_proj and down_proj row-parallel, MLA's
    down-projections replicated, experts in whole blocks per shard."""
    from itertools import groupby

    from qtk.model.config_check import fp8_block_misfit
    from qtk.plan.memory import model_tensors, scheme_of

    merged = ("attn_in", "mlp_in", "shared_in")
    row = ("o_in", "mlp_down", "shared_down")
    linears = [t for t in model_tensors(s) if t.role == "linear" and t.input_group != "lm_head"]
    for _, group in groupby(linears, key=lambda t: (t.layer, t.input_group)):
        group = list(group)
        m = scheme_of(recipe, group[0].name)
        if m is None or m.weights.strategy != Strategy.BLOCK:
            continue
        block = tuple(m.weights.block_structure)
        tag = group[0].input_group
        if s.is_mla and tag == "attn_in":  # q_a_proj / kv_a_proj_with_mqa replicated, q_proj column-parallel
            gemms = [([t], "column" if t.name.endswith(".q_proj") else "none") for t in group]
        elif tag in merged:
            gemms = [(group, "column")]
        else:
            gemms = [([t], "row" if tag in row else "experts" if tag.startswith("expert") else "column") for t in group]
        for ts, split in gemms:
            parts, in_f = [t.shape[0] for t in ts], ts[0].shape[1]
            if split == "experts":
                miss = (fp8_block_misfit(parts, in_f // tp, block, 1, split="experts") if tag == "expert_down"
                        else fp8_block_misfit([p // tp for p in parts], in_f, block, 1, split="experts"))
            else:
                shard = None
                if split == "column" and tp > 1 and len(ts) == 3 and 0 < s.kv_heads < tp:  # K/V heads copied
                    shard = [parts[0] // tp, parts[1] // s.kv_heads, parts[2] // s.kv_heads]
                miss = fp8_block_misfit(parts, in_f, block, tp if split != "none" else 1, split=split, shard_parts=shard)
            if miss is not None:
                t = ts[min(miss[0], len(ts) - 1)]
                return f"{t.name} {list(t.shape)}: {miss[1]}"
    return None


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _why_lower(c: RecipeClass, best: RecipeClass, best_name: str, gpu_label: str) -> str:
    """One line on why a recipe of the same memory class ranks below the chosen one."""
    if best.fp4 and not c.fp4:
        return (f"same memory class as {best_name}; FP4 (NVFP4) runs natively on {gpu_label}'s FP4 tensor cores and its "
                "16-element FP8-scaled groups keep more precision than INT4 groups of 128")
    if best.fp8 and not best.w4a8 and not c.fp8:
        return f"same memory class as {best_name}; FP8 runs natively on {gpu_label} and keeps more precision than INT8"
    if best.calibrated and not c.calibrated:
        return f"same memory class as {best_name}, which calibrates ({best.calibrated}) where this rounds to nearest"
    if best.weight_only and not c.weight_only:
        return f"same memory class as {best_name}; quantizing activations too adds accuracy risk for no memory gain"
    if best.mxfp8 and not c.mxfp8:
        return (f"same memory class as {best_name}; MXFP8 runs natively on {gpu_label} and scales every 32 weights and "
                "activations on their own (E8M0), finer than per-channel or 128x128-block FP8")
    if best.granularity < c.granularity:
        return f"same memory class as {best_name}, which has finer weight scales"
    if best.symmetric and not c.symmetric:
        return f"same memory class as {best_name}, which is symmetric: no zero points to store or apply"
    if not best.static_activations and c.static_activations:
        return f"same memory class as {best_name}, whose dynamic per-token activation scales are more robust than static ones"
    return f"same memory class as {best_name}, ranked first by name"


def recommend(s: ModelShape, dep: Deployment, recipes: Mapping[str, object] | None = None, *,
              min_headroom: float = DEFAULT_MIN_HEADROOM, workload: str = "general",
              extra: Mapping[str, object] | None = None, combine_kv: bool = True) -> Decision:
    """Pick a recipe for the deployment and give a one-line reason for every one passed over.

    recipes: the candidates (default: the shipped directory); extra: more recipes (the user's files), considered
    alongside; combine_kv: also try every weight scheme with the KV-cache option it lacks (see kv_variants)."""
    check_deployment(s, dep)
    recipes = {**(shipped_recipes() if recipes is None else recipes), **(extra or {})}
    gpu = dep.gpu
    pool = kv_variants(recipes, gpu) if combine_kv else [(n, r, None) for n, r in sorted(recipes.items())]
    cands: list[Considered] = []
    for name, r, parent in pool:
        if isinstance(r, Exception):
            cands.append(Considered(name, None, error=str(r), status="error", reason=f"could not be loaded: {r}"))
            continue
        k = RecipeClass.of(r)
        w, m = evaluate(s, r, dep)
        c = Considered(name, r, klass=k, weights=w, memory=m, derived_from=parent)
        if k.fp4 and not gpu.fp4:
            c.status = "excluded"
            c.reason = f"FP4 needs Blackwell's FP4 tensor cores (B200, RTX 50); {gpu.label} ({gpu.generation}) has none"
        elif k.mxfp8 and not gpu.mxfp8:
            c.status = "excluded"
            c.reason = (f"MXFP8 needs Blackwell's block-scaled FP8 tensor cores (B200, RTX 50); on {gpu.label} "
                        f"({gpu.generation}) vLLM runs it weight-only (Marlin MXFP8 or dequantized to bf16)")
        elif k.fp8 and not gpu.fp8:
            c.status = "excluded"
            c.reason = (f"FP8 needs FP8 tensor cores (Ada, Hopper, Blackwell, MI300); {gpu.label} ({gpu.generation}) "
                        "has none")
        elif w4a8_excluded(k.w4a8_kind, gpu):
            c.status = "excluded"
            c.reason = w4a8_excluded(k.w4a8_kind, gpu)
        elif (misfit := untiled(s, r, dep.tp)):
            c.status = "excluded"
            c.reason = f"vLLM cannot run FP8 blocks on {misfit} (at tp {dep.tp})"
        elif not m.fits:
            c.status = "no-fit"
            c.reason = f"does not fit: needs {m.needed / GB:.1f} GB per GPU of {m.budget / GB:.1f} GB"
        elif m.headroom_fraction < min_headroom:
            c.status = "tight"
            c.reason = f"fits with only {_pct(m.headroom_fraction)} headroom (wants {_pct(min_headroom)})"
        cands.append(c)

    _, base = evaluate(s, None, dep)
    ok = [c for c in cands if not c.status]
    if not ok:
        fitting = [c for c in cands if c.memory is not None and c.status in ("no-fit", "tight")]
        if fitting:
            best = min(fitting, key=lambda c: c.memory.needed)
            m = best.memory
            why = (f"nothing fits with {_pct(min_headroom)} headroom on {dep.describe()}: the smallest, {best.name}, "
                   f"needs {m.needed / GB:.1f} GB per GPU of {m.budget / GB:.1f} GB"
                   + (f" (at most {m.max_concurrency} concurrent at this context)" if m.max_concurrency else ""))
        else:
            why = f"no shipped recipe can run on {dep.gpu.label}"
        return Decision(None, why, cands, baseline=base)

    ok.sort(key=lambda c: (c.klass.tier, c.klass.preference(), c.name))
    best = ok[0]
    best.status = "chosen"
    k = best.klass
    wdesc = weight_label(best.recipe.weights)
    best.reason = (f"{wdesc} weights{' + 8-bit KV cache' if k.kv8 else ''} fit with {_pct(best.memory.headroom_fraction)} "
                   f"headroom ({best.memory.needed / GB:.1f} of {best.memory.budget / GB:.1f} GB per GPU); "
                   + (f"the unquantized model also fits ({_pct(base.headroom_fraction)} headroom)" if base.fits
                      else "the unquantized model does not fit")
                   + (f"; FP4 runs natively on {gpu.label}'s FP4 tensor cores" if k.fp4 else "")
                   + (f"; MXFP8 runs natively on {gpu.label}'s block-scaled FP8 tensor cores" if k.mxfp8 else ""))
    for c in ok[1:]:
        c.status = "passed"
        if c.klass.weight_bits < k.weight_bits:
            c.reason = f"{c.klass.weight_bits}-bit weights not needed: {best.name} fits with {k.weight_bits}-bit"
        elif c.klass.kv8 and not k.kv8:
            c.reason = f"KV-cache quantization not needed: {best.name} fits with a {best.weights.dtype} cache"
        else:
            c.reason = _why_lower(c.klass, k, best.name, gpu.label)

    warnings = []
    if k.weight_bits < 8:
        warnings.append(f"{wdesc} weights are risky for math/code workloads: gate {best.name} with qtk eval "
                        "on your tasks before serving")
        if workload in RISKY_WORKLOADS:
            warnings.append(f"--workload {workload}: consider an 8-bit recipe on more GPUs (--tp {dep.tp * 2}) instead")
    return Decision(best.name, best.reason, cands, warnings, base)
