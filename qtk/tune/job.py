"""`qtk tune` as one job: candidates and budget checked before any work, one calibration pass for the sensitivities,
the frontier, then the gate loop — convert a point with the normal convert job, gate it with `qtk eval` (the cached
baseline is reused between rounds), and bisect along the frontier for the cheapest point that passes — and the
outputs: the checkpoints, the recipe that reproduces them, the report (JSON, Markdown, PNG) and the final plan.

qtk.api.tune is the public entry; nothing else here is public API."""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from qtk.errors import CheckFailed, UsageError
from qtk.tune.search import (
    DEFAULT_CANDIDATES,
    Budget,
    assignment,
    build_frontier,
    deployment_budget,
    infeasible,
    smallest,
    load_candidates,
    parse_tuned,
    recipe_text,
    uniform_points,
    unit_costs,
    with_calibration,
)



@dataclass
class Trial:
    """One point the gate loop converted and gated."""

    round: int
    index: int  # on the frontier
    bytes: int
    damage: float
    passed: bool
    failures: list[str]
    seconds: float


@dataclass
class TuneResult:
    outputs: dict[str, Path]  # target -> the final checkpoint
    recipe_path: Path
    report: dict
    passed: bool
    trials: list[Trial] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)


def run_tune(model, tasks_file, out, *, candidates: Sequence[str] = DEFAULT_CANDIDATES, targets: Sequence[str] = ("vllm",),
             gpu: str | None = None, context: int = 4096, concurrency: int = 8, tp: int = 1,
             max_weight_bytes: int | None = None, max_rounds: int = 6, calib: str | None = None,
             num_samples: int | None = None, seq_len: int | None = None, seed: int | None = None,
             text_field: str | None = None, limit: int | None = None, tasks: list[str] | None = None,
             strict: bool = False, overwrite: bool = False, threads: int | None = None, batch_size: int = 8,
             progress: Callable[[str], None] | None = None) -> TuneResult:
    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    from qtk.convert import ConvertOptions
    from qtk.eval.tasks import load_task_file
    from qtk.export import ExportOptions, check_targets, writer_for
    from qtk.model.source import ModelSource
    from qtk.pipeline import check_group_size
    from qtk.plan.hardware import get_gpu
    from qtk.plan.memory import ModelShape, read_config

    # ---- everything refusable before any work
    if (gpu is None) == (max_weight_bytes is None):
        raise UsageError("qtk tune needs one budget: --gpu (with --context/--concurrency) or --max-weight-bytes",
                         "e.g. --gpu h100-80g --context 8192 --concurrency 16, or --max-weight-bytes 40GB")
    if max_rounds < 1:
        raise UsageError(f"--max-rounds must be at least 1, got {max_rounds}", "e.g. --max-rounds 6")
    if max_weight_bytes is not None and max_weight_bytes <= 0:
        raise UsageError(f"--max-weight-bytes must be positive, got {max_weight_bytes}", "e.g. --max-weight-bytes 40GB")
    targets = list(dict.fromkeys(targets))
    for t in targets:
        writer_for(t)
    load_task_file(tasks_file)
    gpu_spec = get_gpu(gpu) if gpu is not None else None
    cset = load_candidates(list(candidates), gpu_spec)
    cset = with_calibration(cset, calib, num_samples, seq_len, seed, text_field)
    notes = list(cset.notes)
    source = ModelSource(model)
    shape = ModelShape.from_config(read_config(model))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not overwrite:
        raise UsageError(f"output directory {out} exists and is not empty", "choose another -o or pass --overwrite")
    if out.resolve() == source.path.resolve() or source.path.resolve() in out.resolve().parents:
        raise UsageError(f"-o {out} is inside the model directory", "write the tuned outputs elsewhere")
    eopts = ExportOptions(tp=tp)
    # each candidate must be servable by every target; mixing them must be too, or only uniform points are tried
    kept = []
    for c in cset.candidates:
        if c.dense:
            kept.append(c)
            continue
        r = cset.recipes[c.name]
        try:
            check_targets(source, r, eopts, targets)
            check_group_size(source, r)
        except UsageError as e:
            notes.append(f"{c.name} dropped: {e.problem}")
            continue
        kept.append(c)
    if not any(not c.dense for c in kept):
        raise UsageError(f"no candidate can be written for --target {' --target '.join(targets)} on this model "
                         f"({'; '.join(notes)})", "give other --candidates or targets")
    cset = type(cset)(kept, cset.recipes, cset.solver, cset.solver_step, cset.calibration, notes)
    uniform_only = _refuses_mixed(source, cset, eopts, targets, notes)
    dep = None
    if gpu_spec is not None:
        from qtk.plan.deployment import Deployment, check_deployment

        dep = Deployment(gpu=gpu_spec, context=context, concurrency=concurrency, tp=tp)
        check_deployment(shape, dep)

    # ---- the budget against the smallest assignment, from bytes alone (before any data is read)
    from qtk.convert import calibration
    from qtk.pipeline import target_linears
    from qtk.recipe import Recipe
    from qtk.tune.sensitivity import Sensitivity, UnitSensitivity, measure, units_of

    first = next(c for c in cset.candidates if not c.dense)
    probe = Recipe(name="tune", weights=first.scheme.weights, calibration=cset.calibration,
                   algorithm=cset.recipes[first.name].algorithm)
    layout = Sensitivity(cset.candidates, [
        UnitSensitivity(i, u.label, tuple(source.layer_prefix(i) + t for t in u.linears), {})
        for i in range(source.num_layers) for u in units_of(source.arch, target_linears(source, probe, i))])
    costs = unit_costs(shape, layout, cset, None if dep is None else _serving_dtype(shape, dep))
    kv_kinds = (("fp8" if gpu_spec.fp8 else "int8"),) if gpu_spec is not None else ()
    budget = (deployment_budget(shape, dep, {k: 0.0 for k in kv_kinds}) if dep is not None else
              Budget(max_weight_bytes, f"--max-weight-bytes {max_weight_bytes}", ()))
    if smallest(costs, budget) > budget.limit:
        raise infeasible(smallest(costs, budget), budget)

    # ---- one calibration pass
    ids, _ = calibration.calibration_ids(source, _needs_data(probe), ConvertOptions(), say, timings)
    say("sensitivity pass")
    t0 = time.perf_counter()
    sens = measure(source, cset.candidates, ids, solver=cset.solver, kv_kinds=kv_kinds, batch_size=batch_size,
                   on_layer=lambda i, n: say(f"sensitivity: layer {i}/{n}"))
    timings["sensitivity"] = time.perf_counter() - t0
    assert [u.modules for u in sens.units] == [u.modules for u in layout.units]

    # ---- the frontier
    if dep is not None:
        budget = deployment_budget(shape, dep, sens.kv_damage)
    f = build_frontier(sens, costs, budget, uniform_only)
    points = [p for p in f.points if p.bytes <= budget.limit]
    # the all-16-bit point has nothing to convert
    points = [p for p in points if any(c != "bf16" for c in assignment(p, sens, budget, uniform_only).choice)]
    if not points:
        raise CheckFailed(f"within {budget.what} only the unquantized model fits", "nothing to tune: serve the model as it is")
    say(f"frontier: {len(f)} points, {len(points)} within the budget")

    # ---- gate loop: bisect for the cheapest passing point, starting from the least damaging one within the budget
    out.mkdir(parents=True, exist_ok=True)
    rounds_dir = out / "rounds"
    trials: list[Trial] = []
    passing: dict[int, Path] = {}
    name = f"tuned-{Path(model).resolve().name}"
    # invariant: every point above hi is no better to try; hi passes once tried (bisect on the frontier index, which
    # orders points by bytes and, inversely, by predicted damage)
    lo, hi = 0, len(points) - 1
    idx = hi
    for rnd in range(1, max_rounds + 1):
        p = points[idx]
        a = assignment(p, sens, budget, uniform_only)
        text = recipe_text(a, sens, cset, name)
        rdir = rounds_dir / f"round-{rnd}"
        say(f"round {rnd}/{max_rounds}: point {idx + 1}/{len(points)} of the frontier within the budget, "
            f"{p.bytes / 1e6:.3f} MB, predicted damage {p.damage:.4g}")
        t0 = time.perf_counter()
        passed, failures = _convert_and_gate(model, text, rdir, targets, tasks_file, tp=tp, limit=limit, tasks=tasks,
                                             strict=strict, threads=threads, batch_size=batch_size, say=say)
        trials.append(Trial(rnd, idx, p.bytes, p.damage, passed, failures, time.perf_counter() - t0))
        say(f"round {rnd}: gate {'passed' if passed else 'failed: ' + '; '.join(failures)}")
        if passed:
            passing[idx] = rdir
            hi = idx
        elif idx == len(points) - 1:
            break  # the least damaging point within the budget fails: nothing within it is predicted to pass
        else:
            lo = idx + 1  # upgrade: a point with fewer damaging units
        if lo >= hi:
            break
        idx = (lo + hi) // 2
    timings["gate_loop"] = sum(t.seconds for t in trials)

    # ---- outputs
    passed = bool(passing)
    final_idx = min(passing) if passed else None
    report = _report(model, tasks_file, targets, cset, sens, costs, budget, f, points, trials, final_idx, uniform_only,
                     notes, timings, shape, dep)
    recipe_path = out / "recipe.yaml"
    outputs: dict[str, Path] = {}
    if passed:
        p = points[final_idx]
        a = assignment(p, sens, budget, uniform_only)
        recipe_path.write_text(recipe_text(a, sens, cset, name))
        for t in targets:
            dst = out / t
            if dst.exists():
                shutil.rmtree(dst)
            (passing[final_idx] / t).rename(dst)
            outputs[t] = dst
        if dep is not None:
            from qtk.plan.planner import make_plan

            plan = make_plan(shape, parse_tuned(recipe_path.read_text(), str(recipe_path)), dep,
                             model_path=str(outputs[targets[0]]))
            report["plan"] = plan.as_dict()
            (out / "plan.json").write_text(json.dumps(plan.as_dict(), indent=2, default=str) + "\n")
    for d in rounds_dir.glob("round-*"):  # keep each round's gate reports, not its checkpoints
        for t in targets:
            if (d / t).is_dir():
                shutil.rmtree(d / t)
    timings["total"] = time.perf_counter() - t_start
    report["timings"] = timings
    from qtk.tune.report import write_markdown, write_plot

    (out / "tune.json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(report, out / "tune.md")
    if write_plot(report, out / "frontier.png") is False:
        notes.append("frontier.png not drawn: matplotlib is not installed (pip install matplotlib)")
    return TuneResult(outputs, recipe_path, report, passed, trials, notes, timings)


def _needs_data(r):
    """The probe recipe for drawing calibration ids: the sensitivity pass always needs data."""
    from dataclasses import replace

    from qtk.recipe.schema import Step

    return r if r.needs_calibration else replace(r, algorithm=(Step("gptq", _gptq_params()),))


def _gptq_params():
    from qtk.recipe.params import GPTQParams

    return GPTQParams()


def _serving_dtype(shape, dep) -> str:
    from qtk.plan.deployment import serving_dtype

    return serving_dtype(shape, dep)


def _refuses_mixed(source, cset, eopts, targets, notes) -> bool:
    """Whether some target holds one scheme only (awq, hf-modelopt): asked of the targets' own checks with a mixed
    recipe of the candidates."""
    from qtk.export import check_targets
    from qtk.recipe import Recipe
    from qtk.recipe.rules import ModuleScheme, Override

    q = [c for c in cset.candidates if not c.dense]
    if len(q) < 2:
        return False
    arch = source.arch
    r = Recipe(name="tune-mixed", weights=q[0].scheme.weights,
               overrides=(Override((source.layer_prefix(0) + arch.linears[-1],), ModuleScheme(q[1].scheme.weights)),))
    try:
        check_targets(source, r, eopts, targets)
    except UsageError as e:
        notes.append(f"only uniform points are tried: {e.problem}")
        return True
    return False


def _convert_and_gate(model, text, rdir: Path, targets, tasks_file, *, tp, limit, tasks, strict, threads, batch_size, say):
    """Convert the recipe `text` (written to rdir/recipe.yaml, parsed back: the file is what runs) and gate the first
    target's output. Returns (passed, failures)."""
    from qtk.convert import ConvertJob, ConvertOptions
    from qtk.eval.api import run_gate

    rdir.mkdir(parents=True, exist_ok=True)
    path = rdir / "recipe.yaml"
    path.write_text(text)
    recipe = parse_tuned(path.read_text(), str(path))
    opts = ConvertOptions(targets=list(targets), overwrite=True, tp=tp, batch_size=batch_size)
    ConvertJob(model, recipe, rdir, opts, on_stage=lambda s: say(f"  convert: {s}")).run()
    g = run_gate(rdir / targets[0], model, tasks_file, limit=limit, tasks=tasks, strict=strict, threads=threads,
                 json_path=rdir / "gate.json", markdown=rdir / "gate.md", progress=lambda s: say(f"  eval: {s}"))
    return g.passed, list(g.failures)


def _report(model, tasks_file, targets, cset, sens, costs, budget, f, points, trials, final_idx, uniform_only, notes,
            timings, shape, dep) -> dict:
    from qtk import __version__

    final = None
    if final_idx is not None:
        a = assignment(points[final_idx], sens, budget, uniform_only)
        final = {"bytes": a.bytes, "damage": a.damage, "kv_cache": a.kv.name if a.kv else "16-bit",
                 "units": {f"{u.layer}.{u.label}": c for u, c in zip(sens.units, a.choice)}}
    return {
        "qtk_version": __version__,
        "model": str(model),
        "tasks": str(tasks_file),
        "targets": list(targets),
        "candidates": [c.name for c in sens.candidates],
        "estimate": "1/n Σ_tokens ‖ΔW x‖² = tr(ΔW H ΔWᵀ)/2 per unit, quantized upstream (propagated with "
                    f"{sens.propagated_with}); KV: the same at o_proj",
        "budget": {"limit_bytes": budget.limit, "what": budget.what,
                   "kv_options": [{"name": o.name, "bytes": o.bytes, "damage": o.damage} for o in budget.kv]},
        "fixed_bytes": costs.base,
        "units": [{"layer": u.layer, "unit": u.label, "modules": list(u.modules), "damage": u.damage,
                   "bytes": costs.units[k]} for k, u in enumerate(sens.units)],
        "kv_damage": sens.kv_damage,
        "frontier": [{"bytes": p.bytes, "damage": p.damage} for p in f.points],
        "uniform": [{"recipe": n, "bytes": b, "damage": d} for n, b, d in uniform_points(sens, costs, budget)],
        "uniform_only": uniform_only,
        "trials": [{"round": t.round, "bytes": t.bytes, "damage": t.damage, "passed": t.passed,
                    "failures": t.failures, "seconds": round(t.seconds, 2)} for t in trials],
        "passed": final is not None,
        "final": final,
        "notes": notes,
    }
