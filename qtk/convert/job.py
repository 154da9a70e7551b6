"""One conversion as small named steps (docs/architecture.md, `qtk convert`, step by step):

    prepare       open the model, check every option, path, pattern and target against it (no data read)
    calibrate     the calibration token ids (convert/calibration.py)
    open_writers  resume state (convert/resume.py) and one writer per target, in the output context's temp dirs
    quantize      the per-layer loop (qtk.pipeline.run) streams every LayerResult into every writer
    finish        the manifest (convert/manifest.py), each writer's config, side files, README
    self_check    the checks `qtk inspect` runs, on each finished temporary output (qtk.checks)
    commit        final qtk.json, fsync, rename into place (convert/output.py); or, on any failure, roll back

`qtk.api.convert` builds the options and runs this job; nothing else here is public API.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from qtk import interrupts
from qtk.convert import calibration, manifest, output
from qtk.convert.options import ConvertOptions
from qtk.errors import CheckFailed, QtkError, UsageError
from qtk.io import faults
from qtk.io.atomic import BackgroundFlush, fsync_tree

if TYPE_CHECKING:
    from qtk.pipeline import LayerDone
    from qtk.recipe import Recipe


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


def check_before_work(source, recipe, export_options, writer_classes) -> None:
    """What a recipe is refused for on this model and these targets from config.json and the headers alone (no data
    read): ignore and override patterns, the KV cache, the source's own format, each target's writer check, group sizes.
    `prepare` runs it; scripts/target_matrix.py asks it for every family x recipe x target (docs/families.md)."""
    from qtk.export import check_targets
    from qtk.pipeline import check_group_size, check_ignore, check_source_format
    from qtk.pipeline.targets import check_kv_cache

    check_ignore(source, recipe)
    check_kv_cache(source, recipe)
    check_source_format(source, recipe)
    check_targets(source, recipe, export_options, writer_classes)  # refuse unsupported combinations first
    check_group_size(source, recipe)  # from the headers, before calibration data is loaded


class ConvertJob:
    """Quantize `model` with `recipe` into one checkpoint per target under `out/<target>/` (see qtk.api.convert)."""

    def __init__(self, model: str | Path, recipe: Recipe, out: str | Path, options: ConvertOptions,
                 on_stage: Callable[[str], None] | None = None,
                 on_layer: Callable[[int, int, LayerDone], None] | None = None):
        self.model, self.recipe, self.out, self.options = model, recipe, Path(out), options
        self.stage = on_stage or (lambda s: None)
        self.on_layer = on_layer
        self.targets = list(options.targets)
        self.timings: dict[str, float] = {}
        self.messages: list[str] = []
        self.state = None  # the resume state, with --resume
        self.images = None  # the image inputs of image+text calibration windows (qtk.calib_images)
        self.writers: list = []
        self.t_start = time.perf_counter()
        self.flushing: BackgroundFlush | None = None

    def run(self) -> ConvertResult:
        self.prepare()
        # opening the model (config, headers, checks; the meta skeleton for a calibrated recipe): the part of `total` that does not grow with its size
        self.timings["prepare"] = time.perf_counter() - self.t_start
        self.join()
        try:
            if self.writes:
                self.output.open()  # OUT created and locked for the run; what killed runs left there is swept
            try:
                ids, calib_info, self.images = calibration.calibration_inputs(self.source, self.recipe, self.options,
                                                                              self.stage, self.timings)
                ids = self.share(ids)
                self.open_writers(calib_info)
                stats = self.quantize(ids)
                m = None
                if self.writes:
                    m = self.finish(calib_info, stats)
                    # the written tensors go to disk while the self-check reads them back from the page cache
                    self.flushing = BackgroundFlush([w.dir for w in self.writers])
                    self.self_check()
                    self.engine_check(m)
                    self.commit(m)
                m = self.reducer.broadcast_object(m)  # every process ends when the output is in place, with its manifest
            except BaseException as e:
                if self.writes:
                    self.wait_flush(quiet=True)  # never a flush still running in a directory the rollback removes
                    self.output.rollback()
                err = self.failure(e)
                if self.reducer.world_size > 1:
                    err = self.distributed_failure(err)
                if err is e:
                    raise
                raise err from None
        finally:
            if self.owns_group:
                from qtk.pipeline.distributed import destroy

                destroy()
        return ConvertResult(outputs=self.finals, notes={w.target: w.notes for w in self.writers}, timings=self.timings,
                             manifest=m, messages=self.messages)

    # ---- several processes (torchrun)

    def join(self) -> None:
        """The device of this process and, under torchrun (WORLD_SIZE > 1), the process group: rank 0 writes, every
        rank calibrates on its share of the windows. One process: the LOCAL reducer, nothing joined."""
        from qtk.pipeline.device import parse_device
        from qtk.pipeline.distributed import env_world_size, init_process_group
        from qtk.steps import LOCAL

        import torch.distributed as dist

        self.device = parse_device(self.options.device)
        # a group the caller joined (several conversions in one set of processes) is left to the caller
        self.owns_group = env_world_size() > 1 and not (dist.is_available() and dist.is_initialized())
        self.reducer = init_process_group(self.device) if env_world_size() > 1 else LOCAL
        self.rank = self.reducer.rank
        self.writes = self.rank == 0

    def share(self, ids):
        """This process's calibration windows, whole micro-batches of --batch-size (all of them in one process)."""
        if ids is None or self.reducer.world_size == 1:
            return ids
        if self.images is not None:
            raise UsageError("image+text calibration runs in one process", "run it without torchrun, or calibrate from text")
        from qtk.pipeline.distributed import split_windows

        return split_windows(ids, self.rank, self.reducer.world_size, self.options.batch_size)

    def distributed_failure(self, err: BaseException) -> BaseException:
        """A collective broken by a peer that left becomes that peer's error (PeerFailed); this process's own failure
        is recorded for the others before it leaves."""
        from qtk.pipeline.distributed import PeerFailed, is_collective_error, peer_failure, record_failure

        if is_collective_error(err):
            return peer_failure(self.rank)
        if not isinstance(err, PeerFailed):
            record_failure(self.rank, "interrupted" if isinstance(err, KeyboardInterrupt) else _one_line(err))
        return err

    # ---- the steps

    def prepare(self) -> None:
        """Everything that can be refused before any data is read or any tensor loaded: targets, the model, OUT,
        ignore and override patterns, each writer's check, group sizes, the calibration's size, the tensors."""
        from qtk.export import writer_for
        from qtk.model.source import ModelSource

        r, o = self.recipe, self.options
        self.export_options = o.export
        self.writer_classes = {t: writer_for(t) for t in self.targets}
        self.source = ModelSource(self.model, allow_pickle=o.allow_pickle, trust_remote_code=o.trust_remote_code)
        self.finals = output.final_paths(self.source, self.out, self.targets, o.overwrite, o.also_writes)
        if o.resume:
            from qtk.convert.resume import check_state_dir

            check_state_dir(self.out)
        check_before_work(self.source, r, self.export_options, self.writer_classes)
        calibration.warn_unused(r, o)
        calibration.check_size(self.source, r, o)
        # every tensor checked against the config (names, shapes) before any work: by the layout config.json implies
        # where nothing is calibrated (no transformers import, no skeleton), else by the skeleton the layers run on
        from qtk.pipeline.stream import streams

        self.source.layout() if streams(r, None) else self.source.skeleton()
        from qtk.steps import source_view

        # read through what the recipe's steps make of the tensors outside the layers (a rotation's embeddings)
        self.source = source_view(self.source, r)
        self.output = output.OutputContext(self.out, self.targets, self.source.path, o.overwrite)

    def open_writers(self, calib_info: dict) -> None:
        from qtk.convert.resume import resume_state

        o = self.options
        if not self.writes:  # only rank 0 writes outputs and resume state
            return
        if o.resume:
            self.state = resume_state(self.source, self.recipe, self.out, calib_info, self.targets, self.export_options,
                                      o.batch_size, self.stage, self.messages, world_size=self.reducer.world_size)
        self.writers = [self.writer_classes[t](self.output.tmps[t], self.source, self.recipe, self.export_options)
                        for t in self.targets]
        for w in self.writers:  # what the source view says about the model it presents (an untied lm_head)
            w.notes += getattr(self.source, "notes", [])

    def quantize(self, ids):
        from qtk.pipeline import run
        from qtk.pipeline.stream import run_data_free, streams

        if self.options.hash_source and self.writes:
            self.stage("hashing source")
            t0 = time.perf_counter()
            self.hashes = self.source.file_hashes()
            self.timings["hash_source"] = time.perf_counter() - t0
        else:
            self.hashes = {}
        self.stage("quantizing layers")
        o = self.options

        def on_layer(done, total, layer):
            faults.fault_point("quantize: a layer computed")  # a run may die between layers (tests; every rank)
            interrupts.check()
            if self.on_layer:
                self.on_layer(done, total, layer)

        if streams(self.recipe, ids):  # nothing to calibrate: tensors stream layer by layer, no modules (one process
            # does it all: the others of a torchrun have nothing to share)
            stats = run_data_free(self.source, self.recipe, self.writers, on_layer=on_layer, resume=self.state,
                                  device=self.device, overlap=o.overlap) if self.writes else None
        else:
            stats = run(self.source, self.recipe, ids, self.writers, batch_size=o.batch_size, on_layer=on_layer,
                        resume=self.state, device=self.device, reducer=self.reducer,
                        max_device_memory=o.max_device_memory, overlap=o.overlap, images=self.images)
        if stats is None:
            from qtk.pipeline import PipelineStats

            stats = PipelineStats()
        self.timings.update(stats.timings)
        self.measured = stats.measured  # what the data-free stream measured against the source, for the self-check
        return stats

    def finish(self, calib_info: dict, stats) -> dict:
        """Each writer's config, side files and README, from the manifest of this run."""
        self.stage("writing")
        t0 = time.perf_counter()
        m = manifest.build(self.source, self.recipe, self.hashes, calib_info, stats, self.timings, self.writers)
        for t, w in zip(self.targets, self.writers):
            w.finish(m)
            w.write_readme(m, self.finals[t])
        self.timings["write"] = time.perf_counter() - t0
        return m

    def self_check(self) -> None:
        """The checks `qtk inspect` runs, on each finished temporary output: a writer that wrote something other than
        what was measured (a dropped g_idx, a wrong scale, metadata that decodes differently) fails here, exit 1."""
        from qtk.checks import check_checkpoint
        from qtk.export import open_checkpoint
        from qtk.io.safetensors import mapped_reads, reusing_read_buffers

        t0 = time.perf_counter()
        # the written tensors mapped from the page cache, not copied (qtk.io.safetensors.mapped_reads: this run's
        # own temporary output, which nothing else writes); what the decoders make goes into the buffers the last
        # module's left (same sizes layer after layer), at most one source layer's bytes idle
        idle = self.source.layout().largest_layer_numel() * self.source.dtype.itemsize
        for t, w in zip(self.targets, self.writers):  # judged from the bytes just written, before anything is renamed
            self.stage(f"checking {t}")
            with reusing_read_buffers(idle), mapped_reads():
                rep = check_checkpoint(open_checkpoint(w.dir), source=self.source, recipe=self.recipe,
                                       measured=self.measured, finite=w.checked_in_place())
            if not rep.ok:
                raise CheckFailed(f"post-conversion check of the {t} output failed: {'; '.join(rep.failures()[:2])}",
                                  "nothing was written; report this with the model config and recipe")
        self.timings["self_check"] = time.perf_counter() - t0

    def engine_check(self, m: dict) -> None:
        """--verify-engine: each output the engine loads, run in the installed engine on a few token windows against
        qtk's simulation of the same bytes (qtk.eval.engine_check). A disagreement beyond the bounds is CheckFailed
        (exit 1, nothing written); an engine that cannot run the checkpoint here (no kernel on this hardware, an
        engine that does not start) is one line of the run's messages, and the manifest records what happened."""
        engine = self.options.verify_engine
        if not engine:
            return
        from qtk.calib import load_texts
        from qtk.eval.engine_check import ENGINE_TARGETS, check_windows, verify_engine
        from qtk.eval.vllm_process import EngineUnavailable, VLLMProcess

        t0 = time.perf_counter()
        self.stage(f"starting {engine} for the engine check")
        texts = load_texts(self.options.calib, self.options.text_field or "text", self.options.split) \
            if self.options.calib not in (None, "default") and self.images is None else None
        windows = check_windows(self.source.tokenizer(), texts=texts,
                                max_len=self.source.config_dict.get("max_position_embeddings") or None)
        results = {}
        try:
            proc = VLLMProcess()
        except EngineUnavailable as e:
            proc, why = None, e.problem
        try:
            for t, w in zip(self.targets, self.writers):
                if t not in ENGINE_TARGETS[engine]:
                    continue
                if proc is None:
                    results[t] = {"status": "unavailable", "reason": why}
                    self.messages.append(f"engine check: {engine} cannot run here ({why}); the {t} output was not run")
                    continue
                self.stage(f"running the {t} output in {engine}")
                c = verify_engine(w.dir, engine=engine, windows=windows, proc=proc)
                results[t] = c.to_json()
                where = f"{engine} {proc.version} on {proc.device}"
                if c.status == "runs" and c.disagreements:
                    raise CheckFailed(f"engine check: {where} and qtk's simulation of the {t} output disagree "
                                      f"({'; '.join(c.disagreements)}; {c.line()})",
                                      "nothing was written; report this with the model config and recipe")
                if c.status == "runs":
                    self.messages.append(f"engine check: the {t} output runs in {where} as qtk simulates it ({c.line()})")
                else:
                    self.messages.append(f"engine check: {where} cannot run the {t} output here ({c.reason[:300]})")
        finally:
            if proc is not None:
                proc.close()
        m["engine_check"] = results
        self.timings["engine_check"] = time.perf_counter() - t0

    def wait_flush(self, quiet: bool = False) -> None:
        """Wait for the background flush started after `finish`; an error of it (a full disk) is raised here, unless
        `quiet` (a failure already being reported)."""
        flushing, self.flushing = self.flushing, None
        if flushing is not None:
            try:
                flushing.wait()
            except BaseException:
                if not quiet:
                    raise

    def commit(self, m: dict) -> None:
        """Final timings into every qtk.json, everything flushed, then the atomic renames. The written tensors are
        flushed before the clock stops (the background flush that ran beside the self-check waited for, then each
        tree fsync'd again: only what came after it), so `total` is the time until the checkpoint's data is on disk
        (what the user waits for; benchmarks/convert_io.py compares it with reading the source and writing the bytes
        once, fsync'd); `flush` is the part of it spent waiting for the disk after the self-check."""
        t0 = time.perf_counter()
        interrupts.check()  # Ctrl-C during the self-check, swallowed by a finalizer: nothing is renamed
        self.wait_flush()
        for w in self.writers:
            fsync_tree(w.dir)
        self.timings["flush"] = time.perf_counter() - t0
        self.timings["total"] = time.perf_counter() - self.t_start
        for w in self.writers:  # the manifest, then the tree again (only the manifest is left to flush)
            faults.fault_point("commit: write qtk.json")
            w.write_manifest({**m, "timings": self.timings})
            fsync_tree(w.dir)
        for t in self.targets:
            self.output.commit(t)
        if self.state is not None:
            self.state.discard()
        self.output.close()  # after a success nothing of earlier runs is left: resume state, dead temporary directories

    # ---- failure

    def failure(self, e: BaseException) -> BaseException:
        """What a failure is reported as, after the rollback: Ctrl-C with resume state kept, a full disk or a refused
        write (one line), else the error itself."""
        state_dir = self.state.dir if self.state is not None else None
        if self.state is not None and isinstance(e, KeyboardInterrupt):  # the per-layer state is kept for --resume
            return Interrupted(f"interrupted after {self.state.completed} of {self.source.num_layers} layers; partial "
                               f"state kept in {self.state.dir}", "rerun the same command with --resume to continue")
        return output.write_error(e, self.out, state_dir) or e


def _one_line(e: BaseException) -> str:
    """An error as the line `qtk` prints for it (problem — fix), for another process to report."""
    if isinstance(e, QtkError):
        return str(e)
    return f"{type(e).__name__}: {e}".splitlines()[0]
