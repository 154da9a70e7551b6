"""`qtk tune` as one job: candidates and budget checked before any work, one calibration pass for the sensitivities,
the frontier, then the gate loop — convert a point with the normal convert job, gate it with `qtk eval` (the cached
baseline is reused between rounds), and bisect along the frontier for the cheapest point that passes — and the
outputs: the checkpoints, the recipe that reproduces them, the report (JSON, Markdown, PNG) and the final plan.

OUT is checked before any work as convert checks its own (qtk.io.outdir.check_output over every name tune writes:
nothing it replaces holds the model, no link there) and held under convert's exclusive lock from before the
calibration pass to the end; everything tune writes in OUT goes through qtk.io.outdir, never through a link.

qtk.api.tune is the public entry; nothing else here is public API."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from qtk.errors import CheckFailed, UsageError
from qtk.io import outdir
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

# what tune writes in OUT besides a checkpoint per target (and its lock)
FILES = ("recipe.yaml", "tune.json", "tune.md", "frontier.png", "plan.json", "rounds")


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


@dataclass(frozen=True)
class TuneOptions:
    """What qtk tune searches and how (its options; qtk.api.tune takes them whole or as keywords).

    candidates: recipe names or files (and "bf16") each unit may get; targets: the checkpoint formats to write. The
    budget, one of: gpu (with context, concurrency, tp: qtk plan's deployment model; the KV-cache format is searched
    too) or max_weight_bytes. max_rounds: convert + gate rounds. calib, num_samples, seq_len, seed, text_field: the
    calibration (default: the first GPTQ candidate's). limit, tasks, strict: the gate's (as qtk eval's). overwrite:
    write into a non-empty OUT. threads: the gate's torch threads. batch_size: calibration batches."""

    candidates: Sequence[str] = DEFAULT_CANDIDATES
    targets: Sequence[str] = ("vllm",)
    gpu: str | None = None
    context: int = 4096
    concurrency: int = 8
    tp: int = 1
    max_weight_bytes: int | None = None
    max_rounds: int = 6
    calib: str | None = None
    num_samples: int | None = None
    seq_len: int | None = None
    seed: int | None = None
    text_field: str | None = None
    limit: int | None = None
    tasks: list[str] | None = None
    strict: bool = False
    overwrite: bool = False
    threads: int | None = None
    batch_size: int = 8

    def __post_init__(self):  # refused before any work, as convert's options are
        if (self.gpu is None) == (self.max_weight_bytes is None):
            raise UsageError("qtk tune needs one budget: --gpu (with --context/--concurrency) or --max-weight-bytes",
                             "e.g. --gpu h100-80g --context 8192 --concurrency 16, or --max-weight-bytes 40GB")
        if self.max_rounds < 1:
            raise UsageError(f"--max-rounds must be at least 1, got {self.max_rounds}", "e.g. --max-rounds 6")
        if self.max_weight_bytes is not None and self.max_weight_bytes <= 0:
            raise UsageError(f"--max-weight-bytes must be positive, got {self.max_weight_bytes}",
                             "e.g. --max-weight-bytes 40GB")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(self.targets)))


@dataclass
class _Search:
    """What the search works with once everything refusable is refused: the source and its shape, the candidates
    each target can write, whether only uniform points can be written, the deployment (with gpu=) and the notes."""

    source: object
    shape: object
    out: Path
    cset: object
    uniform_only: bool
    dep: object
    gpu: object
    notes: list[str]


@dataclass
class _Frontier:
    """The search's terms: each unit's damage per candidate (sens), the bytes (costs), the budget, the whole
    frontier (f) and its points within the budget that quantize something (points)."""

    sens: object
    costs: object
    budget: object
    f: object
    points: list


def run_tune(model, tasks_file, out, options: TuneOptions, progress: Callable[[str], None] | None = None) -> TuneResult:
    """qtk tune (see the module docstring and qtk.api.tune): _prepare refuses what it can before any work,
    _layout_budget checks the budget against the smallest assignment from bytes alone; then, with OUT locked, one
    calibration pass for the sensitivities (_sensitivities), the frontier within the budget (_frontier_points), the
    gate loop (_gate_loop) and the outputs (_write_outputs)."""
    say = progress or (lambda s: None)
    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    s = _prepare(model, tasks_file, out, options)
    probe, layout, costs, budget, kv_kinds = _layout_budget(s, options)

    # ---- from here on OUT is created and locked: a second tune or convert on it stops at once, naming this one
    with outdir.OutDir(s.out):
        sens = _sensitivities(s, probe, layout, kv_kinds, options, say, timings)
        if s.dep is not None:
            budget = deployment_budget(s.shape, s.dep, sens.kv_damage)
        fr = _frontier_points(sens, costs, budget, s.uniform_only, say)
        name = f"tuned-{Path(model).resolve().name}"
        trials, passing = _gate_loop(model, tasks_file, s, options, fr, name, say)
        timings["gate_loop"] = sum(t.seconds for t in trials)
        return _write_outputs(model, tasks_file, s, options, fr, trials, passing, name, timings, t_start)


def _prepare(model, tasks_file, out, options: TuneOptions) -> _Search:
    """Everything refusable before any work: the targets, the task file, the candidates (each must be writable by
    every target; mixing them must be too, or only uniform points are tried), OUT (checked as convert checks its own)
    and the deployment."""
    from qtk.eval.tasks import load_task_file
    from qtk.export import ExportOptions, check_targets, writer_for
    from qtk.model.source import ModelSource
    from qtk.pipeline import check_group_size
    from qtk.plan.hardware import get_gpu
    from qtk.plan.memory import ModelShape, read_config

    o = options
    targets = list(o.targets)
    for t in targets:
        writer_for(t)
    load_task_file(tasks_file)
    gpu_spec = get_gpu(o.gpu) if o.gpu is not None else None
    cset = load_candidates(list(o.candidates), gpu_spec)
    cset = with_calibration(cset, o.calib, o.num_samples, o.seq_len, o.seed, o.text_field)
    notes = list(cset.notes)
    source = ModelSource(model)
    shape = ModelShape.from_config(read_config(model))
    out = Path(out)
    outdir.check_output(source.path, out, [*targets, *FILES, outdir.LOCK], folders=["rounds"])
    if out.exists() and (not out.is_dir() or any(p.name != outdir.LOCK for p in out.iterdir())) and not o.overwrite:
        raise UsageError(f"output directory {out} exists and is not empty", "choose another -o or pass --overwrite")
    eopts = ExportOptions(tp=o.tp)
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

        dep = Deployment(gpu=gpu_spec, context=o.context, concurrency=o.concurrency, tp=o.tp)
        check_deployment(shape, dep)
    return _Search(source, shape, out, cset, uniform_only, dep, gpu_spec, notes)


def _layout_budget(s: _Search, options: TuneOptions):
    """The units every candidate is costed for, their bytes, and the budget, checked against the smallest assignment
    from bytes alone (before any data is read). Returns (the probe recipe calibration is drawn for, the layout, the
    costs, the budget, the KV-cache kinds searched)."""
    from qtk.pipeline import target_linears
    from qtk.recipe import Recipe
    from qtk.tune.sensitivity import Sensitivity, UnitSensitivity, units_of

    cset, source = s.cset, s.source
    first = next(c for c in cset.candidates if not c.dense)
    probe = Recipe(name="tune", weights=first.scheme.weights, calibration=cset.calibration,
                   algorithm=cset.recipes[first.name].algorithm)
    layout = Sensitivity(cset.candidates, [
        UnitSensitivity(i, u.label, tuple(source.layer_prefix(i) + t for t in u.linears), {})
        for i in range(source.num_layers) for u in units_of(source.arch.at(i), target_linears(source, probe, i))])
    costs = unit_costs(s.shape, layout, cset, None if s.dep is None else _serving_dtype(s.shape, s.dep))
    kv_kinds = (("fp8" if s.gpu.fp8 else "int8"),) if s.gpu is not None else ()
    budget = (deployment_budget(s.shape, s.dep, {k: 0.0 for k in kv_kinds}) if s.dep is not None else
              Budget(options.max_weight_bytes, f"--max-weight-bytes {options.max_weight_bytes}", ()))
    if smallest(costs, budget) > budget.limit:
        raise infeasible(smallest(costs, budget), budget)
    return probe, layout, costs, budget, kv_kinds


def _sensitivities(s: _Search, probe, layout, kv_kinds, options: TuneOptions, say, timings: dict):
    """One calibration pass: every unit's damage under every candidate (and the KV cache's)."""
    from qtk.convert import ConvertOptions, calibration
    from qtk.tune.sensitivity import measure

    ids, _ = calibration.calibration_for(s.source, _needs_data(probe), ConvertOptions(), say, timings)
    say("sensitivity pass")
    t0 = time.perf_counter()
    sens = measure(s.source, s.cset.candidates, ids, solver=s.cset.solver, kv_kinds=kv_kinds,
                   batch_size=options.batch_size, on_layer=lambda i, n: say(f"sensitivity: layer {i}/{n}"))
    timings["sensitivity"] = time.perf_counter() - t0
    assert [u.modules for u in sens.units] == [u.modules for u in layout.units]
    return sens


def _frontier_points(sens, costs, budget, uniform_only: bool, say) -> _Frontier:
    """The bytes-vs-damage frontier and its points within the budget that quantize something."""
    f = build_frontier(sens, costs, budget, uniform_only)
    points = [p for p in f.points if p.bytes <= budget.limit]
    # the all-16-bit point has nothing to convert
    points = [p for p in points if any(c != "bf16" for c in assignment(p, sens, budget, uniform_only).choice)]
    if not points:
        raise CheckFailed(f"within {budget.what} only the unquantized model fits", "nothing to tune: serve the model as it is")
    say(f"frontier: {len(f)} points, {len(points)} within the budget")
    return _Frontier(sens, costs, budget, f, points)


def _gate_loop(model, tasks_file, s: _Search, options: TuneOptions, fr: _Frontier, name: str, say):
    """Bisect the frontier for the cheapest point that passes, starting from the least damaging one within the
    budget: each round converts one point and gates it. Returns the trials and the passing points (frontier index ->
    its round's folder below OUT)."""
    outdir.make_dir(s.out, "rounds")
    sens, budget, points = fr.sens, fr.budget, fr.points
    trials: list[Trial] = []
    passing: dict[int, str] = {}
    # invariant: every point above hi is no better to try; hi passes once tried (bisect on the frontier index, which
    # orders points by bytes and, inversely, by predicted damage)
    lo, hi = 0, len(points) - 1
    idx = hi
    for rnd in range(1, options.max_rounds + 1):
        p = points[idx]
        a = assignment(p, sens, budget, s.uniform_only)
        text = recipe_text(a, sens, s.cset, name)
        rdir = f"rounds/round-{rnd}"
        say(f"round {rnd}/{options.max_rounds}: point {idx + 1}/{len(points)} of the frontier within the budget, "
            f"{p.bytes / 1e6:.3f} MB, predicted damage {p.damage:.4g}")
        t0 = time.perf_counter()
        passed, failures = _convert_and_gate(model, text, s.out, rdir, tasks_file, options, say)
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
    return trials, passing


def _write_outputs(model, tasks_file, s: _Search, options: TuneOptions, fr: _Frontier, trials, passing: dict, name: str,
                   timings: dict, t_start: float) -> TuneResult:
    """The final checkpoint(s) moved to OUT/<target>, recipe.yaml, plan.json (with gpu=), each round's gate reports
    (not its checkpoints), tune.json, tune.md and frontier.png."""
    out, targets = s.out, list(options.targets)
    sens, budget, points = fr.sens, fr.budget, fr.points
    passed = bool(passing)
    final_idx = min(passing) if passed else None
    report = _report(model, tasks_file, targets, s, fr, trials, final_idx, timings)
    recipe_path = out / "recipe.yaml"
    outputs: dict[str, Path] = {}
    if passed:
        p = points[final_idx]
        a = assignment(p, sens, budget, s.uniform_only)
        outdir.write_file(out, "recipe.yaml", recipe_text(a, sens, s.cset, name).encode())
        for t in targets:
            outputs[t] = outdir.replace_dir(out, f"{passing[final_idx]}/{t}", t)
        if s.dep is not None:
            from qtk.plan.planner import make_plan

            plan = make_plan(s.shape, parse_tuned(recipe_path.read_text(), str(recipe_path)), s.dep,
                             model_path=str(outputs[targets[0]]))
            report["plan"] = plan.as_dict()
            outdir.write_file(out, "plan.json", (json.dumps(plan.as_dict(), indent=2, default=str) + "\n").encode())
    for t in trials:  # keep each round's gate reports, not its checkpoints
        for target in targets:
            outdir.remove_tree(out, f"rounds/round-{t.round}/{target}")
    timings["total"] = time.perf_counter() - t_start
    report["timings"] = timings
    from qtk.tune.report import write_markdown, write_plot

    outdir.write_file(out, "tune.json", (json.dumps(report, indent=2) + "\n").encode())
    write_markdown(report, out, "tune.md")
    if write_plot(report, out, "frontier.png") is False:
        s.notes.append("frontier.png not drawn: matplotlib is not installed (pip install matplotlib)")
    return TuneResult(outputs, recipe_path, report, passed, trials, s.notes, timings)


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


def _convert_and_gate(model, text, out: Path, rel: str, tasks_file, options: TuneOptions, say):
    """Convert the recipe `text` (written to OUT/rel/recipe.yaml, parsed back: the file is what runs) into the new
    folder OUT/rel (an earlier tune's round there is replaced) and gate the first target's output. Returns (passed,
    failures)."""
    from qtk.convert import ConvertJob, ConvertOptions
    from qtk.eval.api import run_gate

    targets = list(options.targets)
    rdir = outdir.fresh_dir(out, rel)
    path = outdir.write_file(out, f"{rel}/recipe.yaml", text.encode())
    recipe = parse_tuned(path.read_text(), str(path))
    opts = ConvertOptions(targets=targets, overwrite=True, tp=options.tp, batch_size=options.batch_size)
    ConvertJob(model, recipe, rdir, opts, on_stage=lambda s: say(f"  convert: {s}")).run()
    g = run_gate(rdir / targets[0], model, tasks_file, limit=options.limit, tasks=options.tasks, strict=options.strict,
                 threads=options.threads, json_path=rdir / "gate.json", markdown=rdir / "gate.md", report_root=out,
                 progress=lambda s: say(f"  eval: {s}"))
    return g.passed, list(g.failures)


def _report(model, tasks_file, targets, s: _Search, fr: _Frontier, trials, final_idx, timings) -> dict:
    from qtk import __version__

    sens, costs, budget, f, points, uniform_only = fr.sens, fr.costs, fr.budget, fr.f, fr.points, s.uniform_only

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
        "notes": s.notes,
    }
