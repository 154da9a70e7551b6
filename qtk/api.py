"""The Python API behind the CLI: convert(), gate_outputs(), inspect() and plan(). cli.py only parses and renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from qtk.checks import Check
from qtk.convert import ConvertOptions, ConvertResult, Interrupted  # noqa: F401 (part of the API)
from qtk.errors import CheckFailed, QtkError, UsageError  # noqa: F401 (raised by every call, as api.UsageError)
from qtk.recipe import Recipe, load_recipe

if TYPE_CHECKING:
    from qtk.pipeline import LayerDone


def convert(model: str | Path, recipe: str | Path | Recipe, out: str | Path, options: ConvertOptions | None = None, *,
            on_stage: Callable[[str], None] | None = None,
            on_layer: Callable[[int, int, LayerDone], None] | None = None, **fields) -> ConvertResult:
    """Quantize `model` with `recipe` and write one checkpoint per target under `out/<target>/`.

    options: a qtk.convert.ConvertOptions, or its fields as keywords (targets=, calib=, calib_ids=, num_samples=,
    seq_len=, seed=, overwrite=, tp=, device=, verify_engine=, also_writes=, ...), range-checked when built.

    Each target is written to a temporary directory and renamed when complete; on any failure
    (including Ctrl-C) nothing that looks like a finished output is left behind, and OUT is left as it was.

    calib_ids: pre-tokenized calibration samples, an integer tensor [num_samples, seq_len], used as they are
    (instead of calib / num_samples / seq_len / seed), e.g. to give several tools the exact same tokens.
    on_stage(text) names each stage; on_layer(done, total, qtk.pipeline.LayerDone) follows each decoder layer
    with its statistics (relative weight error per Linear, GPTQ loss). Warnings go to the "qtk" logger.
    The steps are qtk.convert.ConvertJob's.

    device: auto | cpu | cuda | cuda:N, where layers, calibration activations and solvers live (the API defaults to
    the CPU, whose output is byte-identical to earlier releases; `qtk convert` defaults to auto). A GPU asked for
    and not visible is refused up front (UsageError). max_device_memory: bytes of calibration activations kept on
    the device; the rest wait in pinned host memory. verify_engine "vllm": before anything is renamed into place, each
    vllm / hf-fp8 output is run in the installed vLLM and compared with qtk's simulation (CheckFailed when they
    disagree; a line in `messages` when vLLM cannot run it here). also_writes: names in `out` the caller writes
    afterwards (e.g. gate_reports(targets) before gate_outputs), refused before any work as the outputs are (a link
    there, the model there). Started by torchrun (WORLD_SIZE > 1), every process calls
    this with the same arguments: each calibrates on its share of the windows and rank 0 alone writes.
    """
    from qtk.convert import ConvertJob

    r = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    return ConvertJob(model, r, out, _options(ConvertOptions, options, fields, "convert"), on_stage=on_stage,
                      on_layer=on_layer).run()


def _options(cls, options, fields: dict, what: str):
    """An options object given whole, or built from its fields given as keywords (the API's keyword form)."""
    if options is not None and fields:
        raise TypeError(f"{what}: give an options object or its fields as keywords, not both ({', '.join(fields)})")
    return options if options is not None else cls(**fields)


def gate_reports(targets: Sequence[str]) -> list[str]:
    """The reports gate_outputs writes in its report_dir: gate-<target>.{json,xml,md}."""
    return [f"gate-{t}.{ext}" for t in targets for ext in ("json", "xml", "md")]


def gate_outputs(outputs: dict[str, Path], baseline: str | Path, tasks_file: str | Path, report_dir: str | Path, *,
                 on_output: Callable[[str, Path], None] | None = None, **gate_options) -> dict:
    """Gate every output of a conversion against `baseline` (what `qtk convert --gate` runs): run_gate on each, with
    its JSON, JUnit and Markdown reports written to report_dir/gate-<target>.{json,xml,md}. Returns target ->
    qtk.eval.api.GateResult, in the outputs' order; the caller renders them and decides the exit code.

    on_output(target, path) is called before each; gate_options go to run_gate (threads=, progress=, on_task=, ...).
    The reports are files qtk names in report_dir: each is written without following a link there
    (qtk.io.outdir.write_file)."""
    from qtk.eval.api import run_gate

    results = {}
    for t, path in outputs.items():
        if on_output:
            on_output(t, path)
        base = Path(report_dir) / f"gate-{t}"
        results[t] = run_gate(path, baseline, tasks_file, json_path=f"{base}.json", junit=f"{base}.xml",
                              markdown=f"{base}.md", report_root=report_dir, **gate_options)
    return results


@dataclass
class InspectReport:
    path: Path
    format: str
    summary: dict
    modules: dict[str, str]  # module -> "int8 [out,in]" etc.
    checks: list[Check] = field(default_factory=list)
    errors: dict[str, float] = field(default_factory=dict)  # module -> relative error against the source, from disk

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def inspect(path: str | Path, source: str | Path | None = None, engine: str | None = None) -> InspectReport:
    """Summarise a written checkpoint and check it from its bytes (qtk.checks): tensors against the config, every
    quantized Linear decoded through the format's reader and compared with the source model's weights, KV and
    activation scales, dense tensors. `source` is the model it was converted from; by default the path qtk.json
    records, and the comparison is reported as skipped when neither is readable. engine "vllm": the checkpoint is
    also run in the installed vLLM against qtk's simulation (qtk.eval.engine_check), a failed check when they
    disagree, a skipped one naming why when vLLM cannot run it here."""
    from qtk.checks import check_checkpoint
    from qtk.export import open_checkpoint
    from qtk.model.config_check import text_config

    ck = open_checkpoint(path)
    src, note = _inspect_source(ck, source)
    rep = check_checkpoint(ck, source=src, source_note=note)
    summary = {
        "format": ck.format,
        "weights": ck.describe_weights(),
        "activations": ck.describe_activations() or "none (16-bit)",
        "kv_cache": ck.kv_cache or "16-bit",
        "quantized_modules": len(rep.modules),
        "size_bytes": ck.size_bytes(),
        "model_type": ck.hf_config.get("model_type"),
        "layers": text_config(ck.hf_config).get("num_hidden_layers"),
        "source": str(src.path) if src is not None else f"not compared ({note})",
    }
    m = ck.manifest
    if m:
        summary["recipe"] = (m.get("recipe") or {}).get("name")
    checks = list(rep.checks)
    if engine is not None:
        checks.append(_engine_check(ck, engine))
    return InspectReport(Path(path), ck.format, summary, rep.modules, checks, rep.errors)


def _engine_check(ck, engine: str) -> Check:
    from qtk.eval.engine_check import ENGINE_TARGETS, verify_engine

    name = f"runs in {engine} as qtk simulates it"
    if engine not in ENGINE_TARGETS:
        raise UsageError(f"--engine {engine}: qtk runs checkpoints in vllm only", "use --engine vllm")
    if ck.format not in ENGINE_TARGETS[engine]:
        return Check(name, True, f"{engine} does not load {ck.format} checkpoints", skipped=True)
    c = verify_engine(ck.path, engine=engine)
    if c.status != "runs":
        return Check(name, True, f"{engine} cannot run it here: {c.reason[:300]}", skipped=True)
    where = f"{engine} {c.engine_version} on {c.device}"
    if c.disagreements:
        return Check(name, False, f"{where}: {'; '.join(c.disagreements)} ({c.line()})")
    return Check(name, True, f"{where}: {c.line()}")


def _inspect_source(ck, source):
    """(ModelSource | None, why not): an explicit source must open (exit 2 otherwise); the recorded one is used
    when it still holds the model that was converted."""
    import hashlib

    from qtk.model.source import ModelSource

    if source is not None:
        return ModelSource(source), ""
    rec = (ck.manifest or {}).get("source") or {}
    p = rec.get("path")
    if not p:
        return None, "qtk.json records no source path; give --source MODEL"
    p = Path(p)
    if not p.is_dir():
        return None, f"the recorded source {p} is not there; give --source MODEL"
    want = (rec.get("files_sha256") or {}).get("config.json")
    cfg = p / "config.json"
    if want and cfg.is_file() and hashlib.sha256(cfg.read_bytes()).hexdigest() != want:
        return None, f"{p}/config.json is not the one converted; give --source MODEL"
    try:
        return ModelSource(p), ""
    except QtkError as e:
        return None, f"the recorded source {p} cannot be read ({e.problem}); give --source MODEL"


def plan(model: str | Path, recipe=None, options=None, **fields):
    """Memory, throughput, cost and serving flags for `model` (a directory or its config.json) from the config alone;
    what `qtk plan` renders. Returns a qtk.plan.planner.Plan (its .check_fit() raises CheckFailed when it does not
    fit; its .recommendation holds the reasons when recommending).

    recipe: a recipe (name, YAML file or Recipe; None or "none": the unquantized model), or with recommend a list of
    your recipes, considered beside the shipped ones. options: a qtk.plan.planner.PlanOptions, or its fields as
    keywords (gpu=, context=, concurrency=, tp=, recommend=, workload=, headroom=, ...). With recommend, the decision
    tree (qtk.plan.decide) picks the recipe and that one is planned; NoRecipeFits (a CheckFailed carrying the
    decision) when none fits."""
    from qtk.plan.decide import recommend as pick
    from qtk.plan.memory import ModelShape, read_config
    from qtk.plan.planner import NoRecipeFits, PlanOptions, make_plan

    o = _options(PlanOptions, options, fields, "plan")
    given = [] if recipe is None else list(recipe) if isinstance(recipe, (list, tuple)) else [recipe]
    given = [r for r in given if not (isinstance(r, str) and r == "none")]
    if not o.recommend and len(given) > 1:
        raise UsageError(f"--recipe given {len(given)} times", "plan one recipe at a time, or add --recommend to choose among them")
    shape = ModelShape.from_config(read_config(model))
    dep = o.deployment()
    recipes = [r if isinstance(r, Recipe) else load_recipe(r) for r in given]
    if o.recommend:
        shipped = _shipped_names()
        extra = {}
        for g, r in zip(given, recipes):  # a user's recipe named as a shipped one keeps the name it was given
            extra[r.name if r.name not in extra and r.name not in shipped else str(g)] = r
        decision = pick(shape, dep, min_headroom=o.headroom, workload=o.workload, extra=extra)
        if decision.chosen is None:
            raise NoRecipeFits(decision)
        return make_plan(shape, decision.recipe, dep, recipe_name=decision.chosen, api_usd_per_1m=o.api_price,
                         decision=decision, convert_on=o.convert_on, convert_processes=o.convert_processes)
    return make_plan(shape, recipes[0] if recipes else None, dep, api_usd_per_1m=o.api_price, convert_on=o.convert_on,
                     convert_processes=o.convert_processes)


def _shipped_names() -> set[str]:
    from qtk.recipe import builtin_recipes

    return set(builtin_recipes())


# ---- qtk tune


def tune(model: str | Path, tasks_file: str | Path, out: str | Path, options=None, *,
         progress: Callable[[str], None] | None = None, **fields):
    """The cheapest per-module mix of the candidates (recipe names or files, and 'bf16') that fits the budget and
    passes the accuracy gate of `tasks_file` against `model`. options: a qtk.tune.job.TuneOptions, or its fields as
    keywords (candidates=, targets=, gpu=, context=, concurrency=, tp=, max_weight_bytes=, max_rounds=, calib=, ...).

    Budget: gpu= (with context/concurrency/tp: qtk plan's deployment model; an 8-bit KV cache is part of the search)
    or max_weight_bytes=. One calibration pass estimates every unit's damage, the frontier gives the least damage for
    every size, and each round converts one point and gates it (at most max_rounds), bisecting the frontier for the
    cheapest point that passes. Writes out/<target>/, out/recipe.yaml (reproduces it with `qtk convert --recipe`),
    out/tune.{json,md}, out/frontier.png, out/plan.json (with gpu=), out/rounds/round-N/gate.{json,md}.
    Returns qtk.tune.job.TuneResult; raises CheckFailed when no budget point fits or none tried passes the gate."""
    from qtk.tune.job import TuneOptions, run_tune

    return run_tune(model, tasks_file, out, _options(TuneOptions, options, fields, "tune"), progress)
