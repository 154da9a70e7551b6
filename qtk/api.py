"""The Python API behind the CLI: convert() and inspect(). cli.py only parses and renders."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

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
    from qtk.checks import PostChecks
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
        checks = PostChecks(source, r)
        stats = run(source, r, ids, [*writers, checks], batch_size=batch_size, on_layer=on_layer, resume=state)
        timings.update(stats.timings)
        failures = checks.finish()
        if failures:
            raise CheckFailed(f"post-conversion check failed: {'; '.join(failures[:3])}",
                              "nothing was written; report this with the model config and recipe")
        stage("writing")
        t0 = time.perf_counter()
        manifest = {
            "qtk_version": __version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "recipe": {"name": r.name, "hash": r.hash, "text": r.text, "summary": r.summary()},
            "source": {"path": str(source.path), "model_type": source.config_dict.get("model_type"),
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
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class InspectReport:
    path: Path
    format: str
    summary: dict
    modules: dict[str, str]  # module -> "int8 [out,in]" etc.
    checks: list[Check] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)


def inspect(path: str | Path) -> InspectReport:
    """Summarise a written checkpoint and check it: coverage, scales, KV scales, packed weights, NaN/Inf."""
    import torch

    from qtk.export import open_checkpoint

    ck = open_checkpoint(path)
    checks: list[Check] = []
    mods = ck.modules()
    expected = _expected_quantized(ck)
    missing = [m for m in expected if m not in set(mods)]
    checks.append(Check("every targeted Linear is quantized", not missing,
                        f"{len(mods)} quantized" if not missing else f"not quantized: {', '.join(missing[:5])}"))
    bad_scale, constant, module_desc = [], [], {}
    for m in mods:
        qt = ck.qtensor(m)
        module_desc[m] = f"{str(qt.values.dtype).replace('torch.', '')} {list(qt.shape)} {qt.scheme.describe()}"
        if not (torch.isfinite(qt.scale).all() and (qt.scale > 0).all()):
            bad_scale.append(m)
        v = qt.values.float()
        if v.numel() > 1 and bool((v == v.reshape(-1)[0]).all()):
            constant.append(m)
    checks.append(Check("weight scales finite and positive", not bad_scale, ", ".join(bad_scale[:5])))
    checks.append(Check("quantized weights not constant", not constant, ", ".join(constant[:5])))
    n_layers = int(ck.hf_config.get("num_hidden_layers", 0))
    if ck.kv_cache:
        scales = [ck.kv_scales(i) for i in range(n_layers)]
        absent = [i for i, s in enumerate(scales) if s is None]
        checks.append(Check("KV scales present for every layer", not absent, f"missing in layers {absent[:8]}" if absent else f"{n_layers} layers"))
        vals = [x for s in scales if s for x in s]
        # scales floored at 1.0 by the format (TensorRT-LLM FP8 KV, ModelOpt's convention) cannot show calibration
        all_one = bool(vals) and all(abs(x - 1.0) < 1e-12 for x in vals) and getattr(ck, "kv_scale_floor", None) != 1.0
        nonpos = [x for x in vals if not (x > 0 and x == x and x != float("inf"))]
        checks.append(Check("KV scales calibrated (not all 1.0, finite, positive)", not all_one and not nonpos,
                            "all k/v scales are 1.0: uncalibrated" if all_one else ("non-finite or non-positive scale" if nonpos else "")))
    if ck.activations is not None and not ck.activations.dynamic:
        no_in = [m for m in mods if ck.input_scale(m) is None]
        checks.append(Check("static activation scales present", not no_in, ", ".join(no_in[:5])))
    nonfinite = [n for n, t in ck.dense_state_dict().items() if t.is_floating_point() and not torch.isfinite(t).all()]
    checks.append(Check("dense tensors finite", not nonfinite, ", ".join(nonfinite[:5])))
    summary = {
        "format": ck.format,
        "weights": ck.weights_scheme.describe(),
        "activations": ck.activations.describe() if ck.activations else "none (16-bit)",
        "kv_cache": ck.kv_cache or "16-bit",
        "quantized_modules": len(mods),
        "size_bytes": ck.size_bytes(),
        "model_type": ck.hf_config.get("model_type"),
        "layers": n_layers,
    }
    if ck.manifest:
        summary["recipe"] = ck.manifest.get("recipe", {}).get("name")
    return InspectReport(Path(path), ck.format, summary, module_desc, checks)


def _expected_quantized(ck) -> list[str]:
    """Linears of every decoder layer per the architecture table, less the checkpoint's own exclusions."""
    from qtk.model.arch import arch_for
    from qtk.pipeline import matches

    arch = arch_for(ck.hf_config.get("model_type"), ck.hf_config)
    ignore = ck.ignore_patterns()
    names = [f"{arch.layers}.{i}.{lin}" for i in range(int(ck.hf_config["num_hidden_layers"])) for lin in arch.linears]
    return [n for n in names if not matches(n, ignore)]


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
