"""The Python API behind the CLI: convert(), gate_outputs(), inspect() and plan(). cli.py only parses and renders."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from qtk.checks import Check
from qtk.convert import ConvertResult, Interrupted  # noqa: F401 (part of the API)
from qtk.errors import CheckFailed, QtkError, UsageError  # noqa: F401 (raised by every call, as api.UsageError)
from qtk.recipe import Recipe, load_recipe

if TYPE_CHECKING:
    from qtk.pipeline import LayerDone


def convert(
    model: str | Path,
    recipe: str | Path | Recipe,
    out: str | Path,
    *,
    targets: Sequence[str] = ("vllm",),
    calib: str | None = None,
    calib_ids=None,
    text_field: str | None = None,
    split: str | None = None,
    num_samples: int | None = None,
    seq_len: int | None = None,
    seed: int | None = None,
    overwrite: bool = False,
    tp: int = 1,
    pp: int = 1,
    max_shard_bytes: int = 5 * 10**9,
    batch_size: int = 8,
    allow_pickle: bool = False,
    trust_remote_code: bool = False,
    hash_source: bool = True,
    resume: bool = False,
    device: str | None = "cpu",
    max_device_memory: int | None = None,
    on_stage: Callable[[str], None] | None = None,
    on_layer: Callable[[int, int, LayerDone], None] | None = None,
) -> ConvertResult:
    """Quantize `model` with `recipe` and write one checkpoint per target under `out/<target>/`.

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
    the device; the rest wait in pinned host memory. Started by torchrun (WORLD_SIZE > 1), every process calls
    this with the same arguments: each calibrates on its share of the windows and rank 0 alone writes.
    """
    from qtk.convert import ConvertJob, ConvertOptions

    r = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    options = ConvertOptions(targets=targets, calib=calib, calib_ids=calib_ids, text_field=text_field, split=split,
                             num_samples=num_samples, seq_len=seq_len, seed=seed, overwrite=overwrite, tp=tp, pp=pp,
                             max_shard_bytes=max_shard_bytes, batch_size=batch_size, allow_pickle=allow_pickle,
                             trust_remote_code=trust_remote_code, hash_source=hash_source, resume=resume,
                             device=device, max_device_memory=max_device_memory)
    return ConvertJob(model, r, out, options, on_stage=on_stage, on_layer=on_layer).run()


def gate_outputs(outputs: dict[str, Path], baseline: str | Path, tasks_file: str | Path, report_dir: str | Path, *,
                 on_output: Callable[[str, Path], None] | None = None, **gate_options) -> dict:
    """Gate every output of a conversion against `baseline` (what `qtk convert --gate` runs): run_gate on each, with
    its JSON, JUnit and Markdown reports written to report_dir/gate-<target>.{json,xml,md}. Returns target ->
    qtk.eval.api.GateResult, in the outputs' order; the caller renders them and decides the exit code.

    on_output(target, path) is called before each; gate_options go to run_gate (threads=, progress=, on_task=, ...)."""
    from qtk.eval.api import run_gate

    results = {}
    for t, path in outputs.items():
        if on_output:
            on_output(t, path)
        base = Path(report_dir) / f"gate-{t}"
        results[t] = run_gate(path, baseline, tasks_file, json_path=f"{base}.json", junit=f"{base}.xml",
                              markdown=f"{base}.md", **gate_options)
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


def inspect(path: str | Path, source: str | Path | None = None) -> InspectReport:
    """Summarise a written checkpoint and check it from its bytes (qtk.checks): tensors against the config, every
    quantized Linear decoded through the format's reader and compared with the source model's weights, KV and
    activation scales, dense tensors. `source` is the model it was converted from; by default the path qtk.json
    records, and the comparison is reported as skipped when neither is readable."""
    from qtk.checks import check_checkpoint
    from qtk.export import open_checkpoint

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
        "layers": ck.hf_config.get("num_hidden_layers"),
        "source": str(src.path) if src is not None else f"not compared ({note})",
    }
    m = ck.manifest
    if m:
        summary["recipe"] = (m.get("recipe") or {}).get("name")
    return InspectReport(Path(path), ck.format, summary, rep.modules, rep.checks, rep.errors)


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


def _expected_quantized(ck) -> list[str]:
    """Linears of every decoder layer per the architecture table, less the checkpoint's own exclusions."""
    from qtk.checks import expected_quantized

    return expected_quantized(ck, ck.arch, None)


def plan(model: str | Path, recipe: str | Path | Recipe | None = None, *, gpu: str = "h100-sxm", context: int = 4096,
         concurrency: int = 8, tp: int = 1, recommend: bool = False, workload: str = "general"):
    """Memory, throughput, cost and serving flags for `model` (a directory or its config.json) from the config alone.

    recommend=True picks the recipe with the decision tree (qtk.plan.decide) and plans that one;
    returns a qtk.plan.planner.Plan (its .decision holds the reasons when recommending)."""
    from qtk.plan.decide import recommend as pick
    from qtk.plan.hardware import get_gpu
    from qtk.plan.memory import ModelShape, read_config
    from qtk.plan.planner import Deployment, make_plan

    shape = ModelShape.from_config(read_config(model))
    dep = Deployment(gpu=get_gpu(gpu), context=context, concurrency=concurrency, tp=tp)
    decision = None
    if recommend:
        decision = pick(shape, dep, workload=workload)
        if decision.chosen is None:
            raise CheckFailed(decision.reason, "use more GPUs (tp), a shorter context or fewer requests")
        recipe = decision.recipe
    r = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    return make_plan(shape, r, dep, decision=decision, recipe_name=decision.chosen if decision else None)


# ---- qtk tune (issue 15)


def tune(model: str | Path, tasks_file: str | Path, out: str | Path, *, candidates: Sequence[str] = ("w4a16-gptq", "w8a16", "bf16"),
         targets: Sequence[str] = ("vllm",), gpu: str | None = None, context: int = 4096, concurrency: int = 8, tp: int = 1,
         max_weight_bytes: int | None = None, max_rounds: int = 6, calib: str | None = None,
         num_samples: int | None = None, seq_len: int | None = None, seed: int | None = None,
         text_field: str | None = None, limit: int | None = None, tasks: list[str] | None = None, strict: bool = False,
         overwrite: bool = False, threads: int | None = None, batch_size: int = 8,
         progress: Callable[[str], None] | None = None):
    """The cheapest per-module mix of the `candidates` (recipe names or files, and 'bf16') that fits the budget and
    passes the accuracy gate of `tasks_file` against `model`.

    Budget: gpu= (with context/concurrency/tp: qtk plan's deployment model; an 8-bit KV cache is part of the search)
    or max_weight_bytes=. One calibration pass estimates every unit's damage, the frontier gives the least damage for
    every size, and each round converts one point and gates it (at most max_rounds), bisecting the frontier for the
    cheapest point that passes. Writes out/<target>/, out/recipe.yaml (reproduces it with `qtk convert --recipe`),
    out/tune.{json,md}, out/frontier.png, out/plan.json (with gpu=), out/rounds/round-N/gate.{json,md}.
    Returns qtk.tune.job.TuneResult; raises CheckFailed when no budget point fits or none tried passes the gate."""
    from qtk.tune.job import run_tune

    return run_tune(model, tasks_file, out, candidates=candidates, targets=targets, gpu=gpu, context=context,
                    concurrency=concurrency, tp=tp, max_weight_bytes=max_weight_bytes, max_rounds=max_rounds, calib=calib,
                    num_samples=num_samples, seq_len=seq_len, seed=seed, text_field=text_field, limit=limit, tasks=tasks,
                    strict=strict, overwrite=overwrite, threads=threads, batch_size=batch_size, progress=progress)
