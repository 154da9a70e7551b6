"""The Python API behind the CLI: convert() and inspect(). cli.py only parses and renders."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from qtk.checks import Check
from qtk.errors import CheckFailed, QtkError, UsageError


class Interrupted(QtkError):
    """Ctrl-C during a resumable run: state kept, exit 130."""

    exit_code = 130
from qtk.recipe import Recipe, load_recipe


@dataclass
class ConvertResult:
    outputs: dict[str, Path]
    notes: dict[str, list[str]]
    timings: dict[str, float]
    manifest: dict


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("qtk", "torch", "transformers", "safetensors", "compressed-tensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _write_error(e: BaseException, out: Path) -> UsageError | None:
    """A full disk or a write refused while writing the output is the user's to fix: one line, not a traceback."""
    import errno

    if not isinstance(e, OSError):
        return None
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return UsageError(f"no space left on the device while writing {out}; the partial output was removed",
                          "free space there (the output needs about the quantized model's size) or choose another -o")
    name = e.filename
    inside = name is None or (isinstance(name, (str, os.PathLike)) and Path(out).resolve() in Path(name).resolve().parents)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and inside:
        return UsageError(f"cannot write to {out} ({e.strerror})", "choose a writable output directory with -o")
    return None


def _fsync_dir(d: Path) -> None:
    for p in d.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def convert(
    model: str | Path,
    recipe: str | Path | Recipe,
    out: str | Path,
    *,
    targets: Sequence[str] = ("vllm",),
    calib: str | None = None,
    calib_ids=None,
    text_field: str | None = None,
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
    on_stage: Callable[[str], None] | None = None,
    on_layer: Callable[[int, int], None] | None = None,
) -> ConvertResult:
    """Quantize `model` with `recipe` and write one checkpoint per target under `out/<target>/`.

    Each target is written to a temporary directory and renamed when complete; on any failure
    (including Ctrl-C) nothing that looks like a finished output is left behind.

    calib_ids: pre-tokenized calibration samples, an integer tensor [num_samples, seq_len], used as they are
    (instead of calib / num_samples / seq_len / seed), e.g. to give several tools the exact same tokens.
    """
    import torch

    from qtk import __version__
    from qtk.calib import calibration_ids, ids_hash, load_texts
    from qtk.export import ExportOptions, writer_for
    from qtk.model.source import ModelSource
    from qtk.pipeline import check_group_size, run

    stage = on_stage or (lambda s: None)
    timings: dict[str, float] = {}
    t_start = time.perf_counter()
    r = recipe if isinstance(recipe, Recipe) else load_recipe(recipe)
    targets = list(dict.fromkeys(targets or ["vllm"]))
    if tp < 1 or pp < 1:
        raise UsageError(f"--tp and --pp must be >= 1 (got tp={tp}, pp={pp})", "use e.g. --tp 2")
    for flag, v, least, example in (("--num-samples", num_samples, 1, 64), ("--seq-len", seq_len, 2, 256), ("--batch-size", batch_size, 1, 8)):
        if v is not None and v < least:  # checked even when the recipe needs no calibration: a typo should not pass silently
            raise UsageError(f"{flag} must be >= {least} (got {v})", f"use e.g. {flag} {example}")
    options = ExportOptions(max_shard_bytes=max_shard_bytes, tp=tp, pp=pp)
    writer_classes = {t: writer_for(t) for t in targets}

    source = ModelSource(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file", "-o names a directory (each target goes to OUT/<target>/): choose another path")
    src_abs, out_abs = source.path.resolve(), out.resolve()
    if out_abs == src_abs or src_abs in out_abs.parents:
        raise UsageError(f"output {out} is inside the model directory", "write the output somewhere else; qtk never modifies its input")
    finals = {t: out / t for t in targets}
    for t, final in finals.items():
        if final.exists() and not overwrite:
            raise UsageError(f"output {final} already exists", "pass --overwrite to replace it, or choose another -o")
    for t, cls in writer_classes.items():
        cls.check(source, r, options)  # refuse unsupported combinations before any work
    check_group_size(source, r)  # from the headers, before calibration data is loaded

    calib_info: dict = {"used": False}
    ids = None
    if r.needs_calibration and calib_ids is not None:
        ids = torch.as_tensor(calib_ids)
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.is_floating_point() or ids.is_complex():
            raise UsageError(f"calib_ids must be an integer tensor [num_samples, seq_len >= 2], got {ids.dtype} {list(ids.shape)}",
                             "pass token ids shaped [num_samples, seq_len], e.g. from qtk.calib.calibration_ids")
        if calib is not None or num_samples is not None or seq_len is not None or seed is not None:
            raise UsageError("calib_ids is given together with calib / num_samples / seq_len / seed",
                             "give either pre-tokenized calib_ids or the options that make them, not both")
        vocab = getattr(source.config, "vocab_size", None)
        if vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise UsageError(f"calib_ids holds ids outside the model's vocabulary [0, {vocab})", "tokenize with this model's tokenizer")
        ids = ids.long()
        calib_info = {"used": True, "dataset": "calib_ids (pre-tokenized)", "num_samples": ids.shape[0],
                      "seq_len": ids.shape[1], "seed": None, "token_hash": ids_hash(ids)}
    elif r.needs_calibration:
        stage("calibration data")
        t0 = time.perf_counter()
        c = r.calibration
        spec = calib or c.dataset
        texts = load_texts(spec, text_field or c.text_field)
        n = c.num_samples if num_samples is None else num_samples
        T = c.seq_len if seq_len is None else seq_len
        s = c.seed if seed is None else seed
        if n <= 0 or T < 2:
            raise UsageError(f"--num-samples must be > 0 and --seq-len >= 2 (got {n}, {T})", "use e.g. --num-samples 64 --seq-len 256")
        max_pos = getattr(source.config, "max_position_embeddings", None)
        if max_pos and T > max_pos:
            raise UsageError(f"--seq-len {T} exceeds the model's max_position_embeddings {max_pos}", f"use --seq-len {max_pos} or less")
        ids = calibration_ids(source.tokenizer(), texts, n, T, s)
        calib_info = {"used": True, "dataset": spec, "num_samples": n, "seq_len": T, "seed": s, "token_hash": ids_hash(ids)}
        timings["calibration_data"] = time.perf_counter() - t0

    try:
        out.mkdir(parents=True, exist_ok=True)
        tmps = {t: Path(os.path.join(out, f".{t}.qtk-tmp-{os.getpid()}")) for t in targets}
        for d in tmps.values():
            if d.exists():
                shutil.rmtree(d)
            d.mkdir()
    except OSError as e:
        raise UsageError(f"cannot write to {out} ({e.strerror})", "choose a writable output directory with -o") from None

    state = None
    if resume:
        from qtk.resume import ResumeState, run_key

        files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in source.files}
        key = run_key(recipe=r.text, source=str(source.path.resolve()), files=files, calibration=calib_info,
                      targets=targets, options=options, batch_size=batch_size, version=__version__)
        state = ResumeState(out, key)
        if state.completed:
            stage(f"resuming after layer {state.completed}")

    try:
        writers = [writer_classes[t](tmps[t], source, r, options) for t in targets]
        if hash_source:
            stage("hashing source")
            t0 = time.perf_counter()
            hashes = source.file_hashes()
            timings["hash_source"] = time.perf_counter() - t0
        else:
            hashes = {}
        stage("quantizing layers")
        stats = run(source, r, ids, writers, batch_size=batch_size, on_layer=on_layer, resume=state)
        timings.update(stats.timings)
        stage("writing")
        t0 = time.perf_counter()
        manifest = {
            "qtk_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "recipe": {"name": r.name, "hash": r.hash, "text": r.text, "summary": r.summary()},
            "source": {"path": str(source.path.resolve()), "model_type": source.config_dict.get("model_type"),
                       "dtype": str(source.dtype).replace("torch.", ""), "files_sha256": hashes},
            "calibration": calib_info,
            "versions": _versions(),
            "stats": {"weight_error": stats.weight_error, "kv_amax": stats.kv_amax, "input_amax": stats.input_amax,
                      "algorithm": stats.records, **_expert_stats(stats, r, writers)},
            "timings": timings,
        }
        for t, w in zip(targets, writers):
            w.finish(manifest)
            w.write_readme(manifest, finals[t])
            _fsync_dir(w.dir)
        timings["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t, w in zip(targets, writers):  # judged from the bytes just written, before anything is renamed into place
            stage(f"checking {t}")
            _self_check(t, w.dir, source, r)
        timings["self_check"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        for w in writers:  # final timings, then the atomic rename
            w.write_manifest({**manifest, "timings": timings})
        for t, w in zip(targets, writers):
            final = finals[t]
            if final.exists():
                trash = final.with_name(f".{t}.qtk-old-{os.getpid()}")
                os.replace(final, trash)
                os.replace(tmps[t], final)
                shutil.rmtree(trash, ignore_errors=True)
            else:
                os.replace(tmps[t], final)
    except BaseException as e:
        for d in tmps.values():
            shutil.rmtree(d, ignore_errors=True)
        write_error = _write_error(e, out)
        if state is not None:  # keep the per-layer state: `--resume` continues from it
            if isinstance(e, KeyboardInterrupt):
                raise Interrupted(f"interrupted after {state.completed} of {source.num_layers} layers; partial state kept in {state.dir}",
                                  "rerun the same command with --resume to continue") from None
            if write_error:
                raise write_error from None
            raise
        try:
            out.rmdir()  # only if we created it and it is empty
        except OSError:
            pass
        if write_error:
            raise write_error from None
        raise
    if state is not None:
        state.discard()
    del torch
    return ConvertResult(outputs=finals, notes={w.target: w.notes for w in writers}, timings=timings, manifest=manifest)


def _self_check(target: str, directory: Path, source, recipe: Recipe) -> None:
    """The checks `qtk inspect` runs, on a finished temporary output: a writer that wrote something other than what
    was measured (a dropped g_idx, a wrong scale, metadata that decodes differently) fails here, exit 1."""
    from qtk.checks import check_checkpoint
    from qtk.export import open_checkpoint

    rep = check_checkpoint(open_checkpoint(directory), source=source, recipe=recipe)
    if not rep.ok:
        raise CheckFailed(f"post-conversion check of the {target} output failed: {'; '.join(rep.failures()[:2])}",
                          "nothing was written; report this with the model config and recipe")


def _expert_stats(stats, recipe: Recipe, writers) -> dict:
    """MoE: calibration tokens per expert, and the experts under the recipe's minimum, also as a note on every
    output (README, manifest, CLI): an expert calibration barely reached has scales resting on little data."""
    if not stats.expert_tokens:
        return {}
    from qtk.model.moe import starved_experts

    n = recipe.calibration.min_expert_tokens
    starved = starved_experts(stats.expert_tokens, n)
    if starved:
        total = sum(len(c) for c in stats.expert_tokens.values())
        shown = ", ".join(f"{k} ({v})" for k, v in list(starved.items())[:8]) + (", ..." if len(starved) > 8 else "")
        none = sum(1 for v in starved.values() if v == 0)
        note = (f"{len(starved)} of {total} experts received fewer than {n} calibration tokens: {shown}"
                + (f"; {none} received none (GPTQ used RTN for them, smoothing s = 1)" if none else "")
                + "; raise --num-samples or use more varied calibration text")
        for w in writers:
            w.notes.append(note)
    return {"expert_tokens": stats.expert_tokens, "min_expert_tokens": n, "starved_experts": starved}


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
        "weights": ck.weights_scheme.describe(),
        "activations": ck.activations.describe() if ck.activations else "none (16-bit)",
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
    from qtk.checks import checkpoint_arch, expected_quantized

    return expected_quantized(ck, checkpoint_arch(ck), None)


def plan(model: str | Path, recipe: str | Path | Recipe | None = None, *, gpu: str = "h100-80g", context: int = 4096,
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
            raise CheckFailed(f"nothing fits: {decision.reason}", "use more GPUs (tp), a shorter context or fewer requests")
        recipe = decision.recipe
    r = load_recipe(recipe) if isinstance(recipe, (str, Path)) else recipe
    return make_plan(shape, r, dep, decision=decision, recipe_name=decision.chosen if decision else None)
