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

from qtk.convert import calibration, manifest, output
from qtk.convert.options import ConvertOptions
from qtk.errors import CheckFailed, QtkError
from qtk.io import faults
from qtk.io.atomic import fsync_tree

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
        self.writers: list = []
        self.t_start = time.perf_counter()

    def run(self) -> ConvertResult:
        self.prepare()
        self.output.open()  # OUT created and locked for the run; what killed runs left there is swept
        try:
            ids, calib_info = calibration.calibration_ids(self.source, self.recipe, self.options, self.stage, self.timings)
            self.open_writers(calib_info)
            stats = self.quantize(ids)
            m = self.finish(calib_info, stats)
            self.self_check()
            self.commit(m)
        except BaseException as e:
            self.output.rollback()
            err = self.failure(e)
            if err is e:
                raise
            raise err from None
        return ConvertResult(outputs=self.finals, notes={w.target: w.notes for w in self.writers}, timings=self.timings,
                             manifest=m, messages=self.messages)

    # ---- the steps

    def prepare(self) -> None:
        """Everything that can be refused before any data is read or any tensor loaded: targets, the model, OUT,
        ignore and override patterns, each writer's check, group sizes, the calibration's size, the tensors."""
        from qtk.export import check_targets, writer_for
        from qtk.model.source import ModelSource
        from qtk.pipeline import check_group_size, check_ignore

        r, o = self.recipe, self.options
        self.export_options = o.export
        self.writer_classes = {t: writer_for(t) for t in self.targets}
        self.source = ModelSource(self.model, allow_pickle=o.allow_pickle, trust_remote_code=o.trust_remote_code)
        self.finals = output.final_paths(self.source, self.out, self.targets, o.overwrite)
        check_ignore(self.source, r)
        check_targets(self.source, r, self.export_options, self.writer_classes)  # refuse unsupported combinations first
        check_group_size(self.source, r)  # from the headers, before calibration data is loaded
        calibration.warn_unused(r, o)
        calibration.check_size(self.source, r, o)
        self.source.skeleton()  # every tensor checked against the config (names, shapes) before any work
        self.output = output.OutputContext(self.out, self.targets, self.source.path, o.overwrite)

    def open_writers(self, calib_info: dict) -> None:
        from qtk.convert.resume import resume_state

        o = self.options
        if o.resume:
            self.state = resume_state(self.source, self.recipe, self.out, calib_info, self.targets, self.export_options,
                                      o.batch_size, self.stage, self.messages)
        self.writers = [self.writer_classes[t](self.output.tmps[t], self.source, self.recipe, self.export_options)
                        for t in self.targets]

    def quantize(self, ids):
        from qtk.pipeline import run

        if self.options.hash_source:
            self.stage("hashing source")
            t0 = time.perf_counter()
            self.hashes = self.source.file_hashes()
            self.timings["hash_source"] = time.perf_counter() - t0
        else:
            self.hashes = {}
        self.stage("quantizing layers")
        stats = run(self.source, self.recipe, ids, self.writers, batch_size=self.options.batch_size,
                    on_layer=self.on_layer, resume=self.state)
        self.timings.update(stats.timings)
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

        t0 = time.perf_counter()
        for t, w in zip(self.targets, self.writers):  # judged from the bytes just written, before anything is renamed
            self.stage(f"checking {t}")
            rep = check_checkpoint(open_checkpoint(w.dir), source=self.source, recipe=self.recipe)
            if not rep.ok:
                raise CheckFailed(f"post-conversion check of the {t} output failed: {'; '.join(rep.failures()[:2])}",
                                  "nothing was written; report this with the model config and recipe")
        self.timings["self_check"] = time.perf_counter() - t0

    def commit(self, m: dict) -> None:
        """Final timings into every qtk.json, everything flushed, then the atomic renames."""
        self.timings["total"] = time.perf_counter() - self.t_start
        for w in self.writers:
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
