"""The Python API behind the CLI: convert() and inspect(). cli.py only parses and renders."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

from qtk.checks import Check
from qtk.errors import CheckFailed, QtkError, UsageError
from qtk.recipe import Recipe, load_recipe

if TYPE_CHECKING:
    from qtk.pipeline import LayerDone


class Interrupted(QtkError):
    """Ctrl-C during a resumable run: state kept, exit 130."""

    exit_code = 130


@dataclass
class ConvertResult:
    outputs: dict[str, Path]
    notes: dict[str, list[str]]
    timings: dict[str, float]
    manifest: dict
    messages: list[str] = field(default_factory=list)  # about the run, not the outputs (e.g. where a resume began)


def _versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("qtk", "torch", "transformers", "safetensors", "compressed-tensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def _write_error(e: BaseException, out: Path, state_dir: Path | None = None) -> UsageError | None:
    """A full disk or a write refused while writing the output is the user's to fix: one line, not a traceback.
    state_dir: the resume state, which is kept."""
    import errno

    if not isinstance(e, OSError):
        return None
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        if state_dir is not None:
            return UsageError(f"no space left on the device while writing {out}; the partial output was removed, "
                              f"the finished layers are kept in {state_dir}",
                              "free space there, then rerun the same command with --resume to continue")
        return UsageError(f"no space left on the device while writing {out}; the partial output was removed",
                          "free space there (the output needs about the quantized model's size) or choose another -o")
    name = e.filename
    inside = name is None or (isinstance(name, (str, os.PathLike)) and Path(out).resolve() in Path(name).resolve().parents)
    if e.errno in (errno.EACCES, errno.EPERM, errno.EROFS) and inside:
        return UsageError(f"cannot write to {out} ({e.strerror})", "choose a writable output directory with -o")
    return None


def _fsync_dir(d: Path) -> None:
    """Flush every file of a finished output and the directory itself, before it is renamed into place."""
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
    """
    import qtk.resume
    from qtk import __version__
    from qtk.export import ExportOptions, check_targets, writer_for
    from qtk.model.source import ModelSource
    from qtk.output import OutputDir
    from qtk.pipeline import check_group_size, check_ignore, run

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
    if max_shard_bytes < 1:
        raise UsageError(f"--max-shard-size must be positive (got {max_shard_bytes} bytes)", "use e.g. --max-shard-size 5GB")
    options = ExportOptions(max_shard_bytes=max_shard_bytes, tp=tp, pp=pp)
    writer_classes = {t: writer_for(t) for t in targets}

    source = ModelSource(model, allow_pickle=allow_pickle, trust_remote_code=trust_remote_code)
    out = Path(out)
    finals = _check_output_paths(source, out, targets, overwrite)
    check_ignore(source, r)
    check_targets(source, r, options, writer_classes)  # refuse unsupported combinations before any work
    check_group_size(source, r)  # from the headers, before calibration data is loaded
    _warn_unused_calibration(r, calib=calib, calib_ids=calib_ids, text_field=text_field, split=split,
                             num_samples=num_samples, seq_len=seq_len, seed=seed)
    if r.needs_calibration and calib_ids is None:
        c = r.calibration
        _check_calibration_size(source, c.num_samples if num_samples is None else num_samples,
                                c.seq_len if seq_len is None else seq_len)
    source.skeleton()  # every tensor checked against the config (names, shapes) before any work

    od = OutputDir(out, targets, source.path, overwrite)
    od.open()  # OUT created and locked for the run; what killed runs left there is swept
    state = None
    messages: list[str] = []
    try:
        ids, calib_info = _calibration(source, r, calib, calib_ids, text_field, split, num_samples, seq_len, seed, stage,
                                       timings)
        if resume:
            state = _resume_state(source, r, out, calib_info, targets, options, batch_size, stage, messages)
        writers = [writer_classes[t](od.tmps[t], source, r, options) for t in targets]
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
        timings["write"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        for t, w in zip(targets, writers):  # judged from the bytes just written, before anything is renamed into place
            stage(f"checking {t}")
            _self_check(t, w.dir, source, r)
        timings["self_check"] = time.perf_counter() - t0
        timings["total"] = time.perf_counter() - t_start
        for w in writers:  # final timings, then the atomic rename
            qtk.resume.fault_point("commit: write qtk.json")
            w.write_manifest({**manifest, "timings": timings})
            _fsync_dir(w.dir)
        for t in targets:
            od.commit(t)
        if state is not None:
            state.discard()
        od.close()  # after a success nothing of earlier runs is left: resume state, dead temporary directories
    except BaseException as e:
        od.rollback()
        write_error = _write_error(e, out, state.dir if state is not None else None)
        if state is not None and isinstance(e, KeyboardInterrupt):  # the per-layer state is kept for --resume
            raise Interrupted(f"interrupted after {state.completed} of {source.num_layers} layers; partial state kept in {state.dir}",
                              "rerun the same command with --resume to continue") from None
        if write_error:
            raise write_error from None
        raise
    return ConvertResult(outputs=finals, notes={w.target: w.notes for w in writers}, timings=timings, manifest=manifest,
                         messages=messages)


def _check_output_paths(source, out: Path, targets: list[str], overwrite: bool) -> dict[str, Path]:
    """OUT/<target> for each target, after refusing what could overwrite an output or the source model."""
    from qtk.output import check_paths

    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file", "-o names a directory (each target goes to OUT/<target>/): choose another path")
    check_paths(source.path, out, targets)
    finals = {t: out / t for t in targets}
    for t, final in finals.items():
        if os.path.lexists(final) and not overwrite:
            raise UsageError(f"output {final} already exists", "pass --overwrite to replace it, or choose another -o")
    return finals


# bytes per calibration token besides its hidden states: its id in a tensor and, while sampling, in a Python list
_BYTES_PER_TOKEN_ID = 80


def _check_calibration_size(source, num_samples: int, seq_len: int) -> None:
    """Refuse windows the model cannot take or memory cannot hold, before any text is read: every window's hidden
    states stay in memory for the whole run (the current layer's inputs and outputs)."""
    import torch

    max_pos = getattr(source.config, "max_position_embeddings", None)
    if max_pos and seq_len > max_pos:
        raise UsageError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings {max_pos}", f"use --seq-len {max_pos} or less")
    hidden = int(source.config.hidden_size)
    item = torch.finfo(torch.float32 if source.dtype == torch.float16 else source.dtype).bits // 8
    per_window = seq_len * (2 * hidden * item + _BYTES_PER_TOKEN_ID)
    avail = _available_memory()
    if avail is not None and num_samples * per_window > avail:
        raise UsageError(f"--num-samples {num_samples} x --seq-len {seq_len} needs about {num_samples * per_window / 2**30:.1f} GiB "
                         f"for calibration activations (hidden_size {hidden}), more than the {avail / 2**30:.1f} GiB available",
                         f"use at most about {max(1, avail // per_window)} samples at this --seq-len, or a shorter --seq-len")


def _available_memory() -> int | None:
    """Bytes of memory this process can still take: MemAvailable, bounded by a cgroup v2 limit; None if unknown."""
    try:
        avail = next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                     if line.startswith("MemAvailable:"))
    except (OSError, ValueError, StopIteration):
        return None
    try:
        limit, used = ((Path("/sys/fs/cgroup") / f).read_text().strip() for f in ("memory.max", "memory.current"))
        if limit != "max":
            avail = min(avail, int(limit) - int(used))
    except (OSError, ValueError):
        pass
    return avail


def _calibration(source, r: Recipe, calib, calib_ids, text_field, split, num_samples, seq_len, seed, stage, timings):
    """The calibration token ids [num_samples, seq_len] (None when the recipe needs none) and their manifest entry."""
    import torch

    from qtk.calib import ChatTemplate, calibration_ids, ids_hash, load_texts

    if not r.needs_calibration:
        return None, {"used": False}
    if calib_ids is not None:
        ids = torch.as_tensor(calib_ids)
        if ids.dim() != 2 or ids.shape[0] < 1 or ids.shape[1] < 2 or ids.is_floating_point() or ids.is_complex():
            raise UsageError(f"calib_ids must be an integer tensor [num_samples, seq_len >= 2], got {ids.dtype} {list(ids.shape)}",
                             "pass token ids shaped [num_samples, seq_len], e.g. from qtk.calib.calibration_ids")
        if any(v is not None for v in (calib, num_samples, seq_len, seed, text_field, split)):
            raise UsageError("calib_ids is given together with calib / num_samples / seq_len / seed / text_field / split",
                             "give either pre-tokenized calib_ids or the options that make them, not both")
        vocab = getattr(source.config, "vocab_size", None)
        if vocab and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise UsageError(f"calib_ids holds ids outside the model's vocabulary [0, {vocab})", "tokenize with this model's tokenizer")
        ids = ids.long()
        return ids, {"used": True, "dataset": "calib_ids (pre-tokenized)", "num_samples": ids.shape[0],
                     "seq_len": ids.shape[1], "seed": None, "token_hash": ids_hash(ids)}
    stage("calibration data")
    t0 = time.perf_counter()
    c = r.calibration
    spec = calib or c.dataset
    field_ = text_field or c.text_field
    chat = ChatTemplate(source.tokenizer)  # applied to a field that holds chat turns
    texts = load_texts(spec, field_, split, chat=chat)
    n = c.num_samples if num_samples is None else num_samples
    T = c.seq_len if seq_len is None else seq_len
    s = c.seed if seed is None else seed
    if n <= 0 or T < 2:
        raise UsageError(f"--num-samples must be > 0 and --seq-len >= 2 (got {n}, {T})", "use e.g. --num-samples 64 --seq-len 256")
    ids = calibration_ids(chat.tokenizer, texts, n, T, s)
    timings["calibration_data"] = time.perf_counter() - t0
    info = {"used": True, "dataset": spec, "text_field": field_, "split": split, "num_samples": n, "seq_len": T,
            "seed": s, "token_hash": ids_hash(ids)}
    if chat.conversations:
        info["chat_template"] = {"applied": True, "conversations": chat.conversations, "sha256": chat.template_sha256,
                                 "note": f"each '{field_}' conversation read was rendered with the model's chat template "
                                         "(texts are read only as far as the windows need)"}
    return ids, info


def _resume_state(source, r: Recipe, out: Path, calib_info, targets, options, batch_size, stage, messages: list[str]):
    """The resume state of this exact command in OUT (a different command's is removed, and that is logged)."""
    from qtk import __version__
    from qtk.resume import ResumeState, run_key

    files = {p.name: [p.stat().st_size, p.stat().st_mtime_ns] for p in source.files}
    key = run_key(recipe=r.text, source=str(source.path.resolve()), files=files, calibration=calib_info,
                  targets=targets, options=options, batch_size=batch_size, version=__version__)
    state = ResumeState(out, key, source.num_layers)  # logs "stale resume state ignored" when it removes one
    if state.completed:
        stage(f"resuming after layer {state.completed}")
        messages.append(f"resumed at layer {state.completed} of {source.num_layers}")
    return state


def _warn_unused_calibration(recipe: Recipe, **given) -> None:
    """A recipe that looks at no data ignores the calibration options: say so instead of silently dropping them."""
    if recipe.needs_calibration:
        return
    names = [f"--{k.replace('_', '-')}" if k != "calib_ids" else "calib_ids" for k, v in given.items() if v is not None]
    if names:
        import logging

        logging.getLogger("qtk.api").warning(
            "recipe %s uses no calibration data (no step looks at activations): %s %s ignored",
            recipe.name, ", ".join(names), "is" if len(names) == 1 else "are")


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
