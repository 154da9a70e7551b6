"""What `qtk tune` searches over: the candidate schemes (from recipes, filtered by what the targets and the GPU run),
each unit's exact byte cost under each (the byte counts `qtk plan` uses), the budget (a deployment's memory or a
weight-byte limit; an 8-bit KV cache is one more choice when the KV cache counts), and the recipe YAML an assignment
is written as."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

import yaml

from qtk.errors import CheckFailed, UsageError
from qtk.plan.memory import ModelShape, checkpoint_tensors, kv_bytes_per_request, normalize_dtype
from qtk.bounds import load_yaml
from qtk.recipe import Recipe, load_recipe, parse_recipe_text
from qtk.recipe.params import STEP_PARAMS, Phase
from qtk.tune.frontier import Frontier, Option, frontier
from qtk.tune.sensitivity import Candidate, Sensitivity

DENSE = "bf16"  # the candidate that keeps a unit in 16 bits (the model dtype)
DEFAULT_CANDIDATES = ("w4a16-gptq", "w8a16", DENSE)
EXACT_UNITS = 48  # up to this many units the frontier is exact; above, bucketed (frontier.py states the bound)


@dataclass(frozen=True)
class CandidateSet:
    candidates: list[Candidate]
    recipes: dict[str, Recipe]  # candidate name -> its recipe (not for the dense one)
    solver: object | None  # GPTQParams of the tuned recipe's GPTQ step (None: round to nearest)
    solver_step: object | None  # the GPTQ step as its recipe wrote it ({"gptq": {...}}), copied into the tuned recipe
    calibration: object  # the Calibration the tuned recipe (and the sensitivity pass) uses
    notes: list[str]


def load_candidates(names: list[str], gpu=None) -> CandidateSet:
    """The candidates named on --candidates: built-in recipe names or YAML files, and 'bf16'. Each must be weight-only
    and solved by rtn or gptq (one recipe solves every module; GPTQ, if any candidate uses it, solves them all)."""
    if not names or any(not n.strip() for n in names):
        raise UsageError("--candidates is empty or has an empty name", f"e.g. --candidates {','.join(DEFAULT_CANDIDATES)}")
    if len(set(names)) != len(names):
        raise UsageError(f"--candidates names a recipe twice ({','.join(names)})", "name each candidate once")
    cands, recipes, notes = [], {}, []
    solver = solver_step = None
    calibration = None
    for name in names:
        if name == DENSE:
            cands.append(Candidate(DENSE, None))
            continue
        r = load_recipe(name)
        if r.activations is not None:
            raise UsageError(f"candidate {name} quantizes activations ({r.activations.describe()}); qtk tune mixes "
                             "weight-only schemes", f"drop {name} from --candidates (e.g. {','.join(DEFAULT_CANDIDATES)})")
        if r.mixed:
            raise UsageError(f"candidate {name} is itself mixed-precision (overrides)", "give uniform recipes as candidates")
        other = [s.name for s in r.algorithm if STEP_PARAMS[s.name].phase is not Phase.SOLVE]
        if other:
            raise UsageError(f"candidate {name} runs {', '.join(other)}, which transforms the whole layer; qtk tune "
                             "mixes schemes solved by rtn or gptq", f"drop {name} from --candidates or use its rtn/gptq variant")
        solvers = [s.name for s in r.algorithm if s.name not in ("rtn", "gptq")]
        if solvers:  # its solver would otherwise be dropped silently: the tuned recipe rounds with rtn or gptq
            raise UsageError(f"candidate {name} is solved by {', '.join(solvers)}; qtk tune mixes schemes solved by rtn "
                             "or gptq", f"drop {name} from --candidates or use its rtn/gptq variant (e.g. w4a16-gptq)")
        if gpu is not None and r.weights.type == "float" and not gpu.fp8:
            notes.append(f"{name} dropped: {gpu.label} has no FP8 tensor cores")
            continue
        if any(c.scheme == r.default_scheme for c in cands):
            notes.append(f"{name} dropped: same weight scheme as an earlier candidate")
            continue
        step = r.step("gptq")
        if step is not None and solver is None:
            solver, solver_step, calibration = step.params, _gptq_doc(r), r.calibration
        cands.append(Candidate(name, r.default_scheme))
        recipes[name] = r
    if not any(not c.dense for c in cands):
        raise UsageError("--candidates has no quantized scheme " + (f"({'; '.join(notes)})" if notes else ""),
                         "add e.g. w4a16-gptq or w8a16")
    if calibration is None:
        calibration = next(iter(recipes.values())).calibration
    return CandidateSet(cands, recipes, solver, solver_step, calibration, notes)


# ---- bytes


@dataclass(frozen=True)
class Costs:
    base: int  # bytes outside the units (embeddings, norms, lm_head, kept modules)
    units: list[dict[str, int]]  # per unit: candidate name -> bytes
    dtype: str


def _module_of(tensor: str) -> str:
    return tensor.rsplit(".", 1)[0] if re.search(r"\.(weight\w*|input_scale|bias)$", tensor) else tensor


def unit_costs(shape: ModelShape, sens: Sensitivity, cset: CandidateSet, dtype: str | None = None) -> Costs:
    """Each unit's checkpoint bytes under each candidate, from qtk plan's tensor list (checkpoint_tensors)."""
    dtype = normalize_dtype(dtype, shape.dtype)
    where: dict[str, int] = {}
    for k, u in enumerate(sens.units):
        if u.label == "experts":
            where[f"experts:{u.layer}"] = k
        for m in u.modules:
            where[m] = k
    base = None
    units = [dict() for _ in sens.units]
    for c in cset.candidates:
        r = None if c.dense else Recipe(name=c.name, weights=c.scheme.weights, ignore=("lm_head",))
        per = [0] * len(sens.units)
        rest = 0
        for t in checkpoint_tensors(shape, r, dtype):
            m = _module_of(t.name)
            if ".experts." in m:
                layer = re.search(r"layers\.(\d+)\.", m)
                k = where.get(f"experts:{int(layer.group(1))}") if layer else None
            else:
                k = where.get(m)
            if k is None:
                rest += t.nbytes
            else:
                per[k] += t.nbytes
        if base is not None and rest != base:
            raise AssertionError(f"bytes outside the units differ between candidates ({base} vs {rest})")
        base = rest
        for k, b in enumerate(per):
            units[k][c.name] = b
    return Costs(base, units, dtype)


# ---- the budget and the frontier


@dataclass(frozen=True)
class KVOption:
    name: str  # "16-bit" | "fp8" | "int8"
    kv_type: str | None  # recipe kv_cache type: None, "float", "int"
    bytes: int  # what it costs in the budget's units (tp × per-GPU KV bytes + its scales)
    damage: float


@dataclass(frozen=True)
class Budget:
    """What the assignment must fit: `limit` bytes of weights (+ KV options' bytes when the KV cache counts)."""

    limit: int
    what: str  # how the limit was derived, for messages
    kv: tuple[KVOption, ...]  # empty: the KV cache does not count (weight budget)
    deployment: object | None = None
    fixed: int = 0  # bytes of the limit taken by activations and overhead (deployment), for messages


def deployment_budget(shape: ModelShape, dep, kv_damage: dict[str, float]) -> Budget:
    """From qtk plan's model of the deployment: per GPU, weights/tp + KV cache + activations + overhead must stay
    within memory × utilization. Activations and overhead do not depend on the scheme; the rest is summed over the
    tp GPUs (weights are split across them), so the search works in checkpoint bytes."""
    from qtk.plan.deployment import serving_dtype
    from qtk.plan.memory import DTYPE_BYTES, activation_bytes

    dtype = serving_dtype(shape, dep)
    budget = int(dep.gpu.mem_bytes * dep.utilization)
    act = activation_bytes(shape, DTYPE_BYTES[dtype], dep.concurrency, dep.tp, dep.batched_tokens)
    room = budget - act - dep.overhead
    kv16 = kv_bytes_per_request(shape, dep.context, DTYPE_BYTES[dtype], dep.tp) * dep.concurrency
    kv8 = kv_bytes_per_request(shape, dep.context, 1, dep.tp) * dep.concurrency
    kind = "fp8" if dep.gpu.fp8 else "int8"
    opts = [KVOption("16-bit", None, kv16 * dep.tp, 0.0)]
    if kind in kv_damage:
        scales = 2 * 4 * shape.layers  # k_scale, v_scale float32 per layer, in the checkpoint
        opts.append(KVOption(kind, "float" if kind == "fp8" else "int", kv8 * dep.tp + scales, kv_damage[kind]))
    return Budget(room * dep.tp, f"{dep.describe()} (memory × {dep.utilization:g} minus activations and overhead)",
                  tuple(opts), dep, budget - room)


def build_frontier(sens: Sensitivity, costs: Costs, budget: Budget, uniform_only: bool = False) -> Frontier:
    """The bytes-vs-damage frontier over every unit's candidates (and the KV option). Bytes include the fixed part,
    so a point's bytes are the checkpoint's (plus the KV cache, when it counts). uniform_only: one candidate for
    every unit (targets that hold one scheme)."""
    names = [c.name for c in sens.candidates]
    groups = [[Option(costs.units[k][n], u.damage[n]) for n in names] for k, u in enumerate(sens.units)]
    if uniform_only:
        groups = [[Option(sum(g[i].bytes for g in groups), sum(g[i].damage for g in groups)) for i in range(len(names))]]
    groups.append([Option(costs.base, 0.0)])
    if budget.kv:
        groups.append([Option(o.bytes, o.damage) for o in budget.kv])
    resolution = 0
    if len(groups) > EXACT_UNITS:
        lo = sum(min(o.bytes for o in g) for g in groups)
        hi = sum(max(o.bytes for o in g) for g in groups)
        resolution = max(1, (hi - lo) // 4096)
    return frontier(groups, resolution)


@dataclass(frozen=True)
class Assignment:
    """One point of the frontier in names: unit index -> candidate name, and the KV option."""

    choice: tuple[str, ...]
    kv: KVOption | None
    bytes: int
    damage: float


def assignment(point, sens: Sensitivity, budget: Budget, uniform_only: bool = False) -> Assignment:
    names = [c.name for c in sens.candidates]
    ch = list(point.choice)
    kv = budget.kv[ch.pop()] if budget.kv else None
    ch.pop()  # the fixed part
    choice = tuple(names[ch[0]] for _ in sens.units) if uniform_only else tuple(names[i] for i in ch)
    return Assignment(choice, kv, point.bytes, point.damage)


def uniform_points(sens: Sensitivity, costs: Costs, budget: Budget) -> list[tuple[str, int, float]]:
    """Each candidate on every unit (with each KV option when the KV cache counts): (label, bytes, predicted damage)."""
    out = []
    for c in sens.candidates:
        b = costs.base + sum(u[c.name] for u in costs.units)
        d = sum(u.damage[c.name] for u in sens.units)
        for kv in budget.kv or (None,):
            label = c.name if kv is None or kv.kv_type is None else f"{c.name}+kv8"
            out.append((label, b + (kv.bytes if kv else 0), d + (kv.damage if kv else 0.0)))
    return out


# ---- the recipe an assignment is written as


def _scheme_doc(s) -> dict:
    d = {"num_bits": s.num_bits, "type": s.type, "symmetric": s.symmetric, "strategy": str(s.strategy)}
    if s.group_size is not None:
        d["group_size"] = s.group_size
    if s.observer != "minmax":
        d["observer"] = s.observer
    return d


def recipe_text(a: Assignment, sens: Sensitivity, cset: CandidateSet, name: str, ignore=("lm_head",)) -> str:
    """The recipe YAML of an assignment: the most common scheme as the default, one override per other scheme
    listing its modules by full name (so precedence never depends on pattern order), 16-bit units in ignore."""
    by: dict[str, list[str]] = {}
    for u, c in zip(sens.units, a.choice):
        by.setdefault(c, []).extend(u.modules)
    quantized = {c: mods for c, mods in by.items() if c != DENSE}
    if not quantized:
        raise UsageError("this point keeps every Linear in 16 bits: there is nothing to convert", "use a smaller budget")
    default = max(quantized, key=lambda c: (len(quantized[c]), -list(by).index(c)))
    cands = {c.name: c for c in cset.candidates}
    algo = [cset.solver_step] if cset.solver_step is not None else ["rtn"]
    cal = cset.calibration
    doc = {
        "name": name,
        "description": f"Mixed precision chosen by qtk tune: {len(sens.units)} units, "
                       + ", ".join(f"{sum(1 for x in a.choice if x == c)} {c}" for c in dict.fromkeys(a.choice))
                       + (f", {a.kv.name} KV cache" if a.kv is not None and a.kv.kv_type else "")
                       + f"; predicted damage {a.damage:.4g}.",
        "weights": _scheme_doc(cands[default].scheme.weights),
    }
    if a.kv is not None and a.kv.kv_type is not None:
        doc["kv_cache"] = {"num_bits": 8, "type": a.kv.kv_type}
    doc["algorithm"] = algo
    doc["ignore"] = list(ignore) + by.get(DENSE, [])
    doc["calibration"] = {"dataset": cal.dataset, "num_samples": cal.num_samples, "seq_len": cal.seq_len,
                          "seed": cal.seed, "text_field": cal.text_field}
    overrides = [{"targets": mods, "weights": _scheme_doc(cands[c].scheme.weights)}
                 for c, mods in quantized.items() if c != default]
    if overrides:
        doc["overrides"] = overrides
    return yaml.safe_dump(doc, sort_keys=False, width=120)


def _gptq_doc(r: Recipe):
    """The recipe's GPTQ step as written in its YAML (a built-in or a user's file), so the tuned recipe runs it alike."""
    doc = load_yaml(r.text, f"recipe {r.name}") if r.text else None
    steps = (doc or {}).get("algorithm", [])
    for s in steps if isinstance(steps, list) else [steps]:
        if s == "gptq" or (isinstance(s, dict) and "gptq" in s):
            return s
    return "gptq"


def parse_tuned(text: str, origin: str) -> Recipe:
    return parse_recipe_text(text, origin)


def with_calibration(cset: CandidateSet, dataset=None, num_samples=None, seq_len=None, seed=None, text_field=None) -> CandidateSet:
    """The candidate set with the tuned recipe's calibration overridden by the command line's options."""
    c = cset.calibration
    c = replace(c, dataset=dataset or c.dataset, num_samples=num_samples or c.num_samples, seq_len=seq_len or c.seq_len,
                seed=c.seed if seed is None else seed, text_field=text_field or c.text_field)
    return replace(cset, calibration=c)


def smallest(costs: Costs, budget: Budget) -> int:
    """The fewest bytes any assignment takes (every unit at its cheapest, the cheapest KV option)."""
    return costs.base + sum(min(u.values()) for u in costs.units) + (min(o.bytes for o in budget.kv) if budget.kv else 0)


def infeasible(need: int, budget: Budget) -> CheckFailed:
    """Exit 1 naming the smallest budget anything meets (`need` bytes)."""
    if budget.deployment is not None:
        dep = budget.deployment
        per_gpu = -(-need // dep.tp) + budget.fixed
        return CheckFailed(f"no assignment fits {budget.what}: the smallest needs {per_gpu / 2**30:.2f} GiB per GPU "
                           f"({need / 2**30:.2f} GiB of weights and KV cache over {dep.tp} GPU(s)) of the "
                           f"{dep.gpu.mem_bytes * dep.utilization / 2**30:.2f} GiB usable",
                           "use more GPUs (--tp), a shorter --context or a lower --concurrency")
    return CheckFailed(f"no assignment fits {budget.what}: the smallest is {need} bytes ({need / 1e6:.2f} MB)",
                       f"use --max-weight-bytes {need} or more, or add a smaller scheme to --candidates")
