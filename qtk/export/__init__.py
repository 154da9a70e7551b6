"""Writers (one per target, keyed by target name) and readers for the same formats.

A writer consumes the pipeline's records (dense tensors, LayerResults) and never modifies them; a reader
turns a written directory back into a Checkpoint in Hugging Face names, so `qtk inspect` and `qtk eval`
test the bytes on disk. Registries are plain dicts filled by decorators on import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path

from qtk.errors import CheckFailed, QtkError, UsageError
from qtk.registry import Registry

WRITERS = Registry("writer")  # target -> its Writer class
READERS = Registry("reader")  # format -> its Checkpoint class
# modules that register writers/readers; imported lazily so `import qtk` stays light
_MODULES = ("qtk.export.vllm", "qtk.export.gptq", "qtk.export.awq", "qtk.export.trtllm", "qtk.export.modelopt",
            "qtk.export.hf_fp8")
# the registered targets, for --help without importing the writers (a test keeps it equal to WRITERS)
TARGETS = ("vllm", "trtllm", "hf-modelopt", "gptq", "awq", "hf-fp8")


register_writer = WRITERS.decorator(lambda cls: cls.target)
register_reader = READERS.decorator(lambda cls: cls.format)


def _load_all() -> None:
    for m in _MODULES:
        importlib.import_module(m)


def writer_for(target: str) -> type:
    _load_all()
    if target not in WRITERS:
        raise UsageError(f"unknown target '{target}'", f"available targets: {', '.join(sorted(WRITERS))}")
    return WRITERS[target]


def available_targets() -> list[str]:
    _load_all()
    return sorted(WRITERS)


def accepting_targets(source, recipe, options, exclude=()) -> list[str]:
    """The targets whose writer's own check accepts this recipe, model and options (vllm, the default, first)."""
    ok = []
    for t in sorted(available_targets(), key=lambda t: (t != "vllm", t)):
        if t in exclude:
            continue
        try:
            _check(t, source, recipe, options)
        except UsageError:
            continue
        ok.append(t)
    return ok


def _check(target: str, source, recipe, options) -> None:
    """One writer's check, after the one every writer shares: a vision-language model only to a writer that keeps its
    vision tower and projector out of quantization."""
    w = writer_for(target)
    if source.arch.multimodal and not w.multimodal:
        raise UsageError(f"target {target} does not write vision-language models ({source.arch.name}): qtk writes them "
                         "to --target vllm only, whose config excludes the vision tower and projector from quantization")
    online = recipe.online_steps
    if online and not w.online_transforms:  # no fix of its own: check_targets names the targets that accept
        raise UsageError(f"target {target} cannot apply the online rotation of recipe {recipe.name} ({online[0]}): "
                         "its engine has no run-time transform of a Linear's input")
    w.check(source, recipe, options)


def check_targets(source, recipe, options, targets) -> None:
    """Every requested writer's check, before any work. A writer that refuses without a fix of its own (fix=None:
    only another target would help) gets the targets that do accept the recipe, computed by asking their checks."""
    for t in targets:
        try:
            _check(t, source, recipe, options)
        except UsageError as e:
            if e.fix is not None:
                raise
            ok = accepting_targets(source, recipe, options, exclude=set(targets))
            fix = ("use " + " or ".join(f"--target {o}" for o in ok) if ok
                   else "no target accepts this recipe for this model: change the recipe (qtk recipes list)")
            raise UsageError(e.problem, fix) from None


@dataclass(frozen=True)
class ExportOptions:
    max_shard_bytes: int = 5 * 10**9
    tp: int = 1
    pp: int = 1


def open_checkpoint(path: str | Path):
    """Detect the format of a written checkpoint directory and open it with its reader."""
    _load_all()
    p = Path(path)
    if not p.is_dir():
        raise UsageError(f"checkpoint directory {p} does not exist", "give the directory qtk convert wrote (e.g. out/vllm)")
    for reader in READERS.values():
        if reader.detect(p):
            try:
                return reader(p)
            except QtkError:
                raise
            except (KeyError, TypeError, ValueError, AttributeError, IndexError, OSError) as e:
                # a config edited or damaged: one line naming what is wrong, not a traceback
                raise CheckFailed(f"{p}: its {reader.format} configuration is malformed ({e.__class__.__name__}: "
                                  f"{' '.join(str(e).split())[:160]})", "the checkpoint is damaged or was edited: re-run qtk convert") from None
    raise UsageError(f"{p} is not a checkpoint qtk can read", f"readable formats: {', '.join(sorted(READERS))}")
