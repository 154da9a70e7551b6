"""The output directory of `qtk convert` while a run writes it: the output context.

OUT is created if absent (and removed again on failure only then), locked for the whole run (a second run on
the same OUT stops at once, naming the first), and swept of what killed runs left; each target is written to
`OUT/.<target>.qtk-tmp-<pid>` and renamed to `OUT/<target>` only when complete (commit), or removed (rollback).
Before any of that, `final_paths` runs the output check every command that writes shares
(`qtk.io.outdir.check_output`: nothing qtk replaces or removes may touch the source model, no link at a name qtk
owns, names it can write) and refuses an output that exists without --overwrite. `write_error` turns a full disk
or a refused write into the user's one-line error.
"""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

from qtk.convert.resume import STATE_DIR
from qtk.errors import UsageError
from qtk.io import faults, outdir
from qtk.io.atomic import fsync_dir
from qtk.io.outdir import LEFTOVER, LOCK, OutDir


def owned_names(targets, extra=()) -> list[str]:
    """What a conversion writes in OUT: its targets, its lock and resume state, and `extra` (convert --gate's
    reports)."""
    return [*targets, STATE_DIR, LOCK, *extra]


def final_paths(source, out: Path, targets, overwrite: bool, extra=()) -> dict[str, Path]:
    """OUT/<target> for each target, after refusing what could overwrite an output or the source model, or write
    through a link (extra: further names the caller writes in OUT)."""
    outdir.check_output(source.path, out, owned_names(targets, extra))
    if out.exists() and not out.is_dir():
        raise UsageError(f"output {out} is a file", "-o names a directory (each target goes to OUT/<target>/): choose another path")
    finals = {t: out / t for t in targets}
    for t, final in finals.items():
        if os.path.lexists(final) and not overwrite:
            raise UsageError(f"output {final} already exists", "pass --overwrite to replace it, or choose another -o")
    return finals


def write_error(e: BaseException, out: Path, state_dir: Path | None = None) -> UsageError | None:
    """A full disk or a write refused while writing the output is the user's to fix: one line, not a traceback.
    state_dir: the resume state, which is kept."""
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class OutputContext:
    """OUT for one run: open() creates and locks it, tmps[t] is where target t is written, commit(t) renames a
    finished target into place, rollback() leaves OUT as it was found, close() releases it after success."""

    def __init__(self, out: Path, targets, source: Path, overwrite: bool):
        self.out = Path(out)
        self.source = Path(source).resolve()
        self.overwrite = overwrite
        self.pid = os.getpid()
        self.tmps = {t: self.out / f".{t}.qtk-tmp-{self.pid}" for t in targets}
        self.finals = {t: self.out / t for t in targets}
        self.dir = OutDir(self.out)  # creates OUT (removed again on failure if it made it) and holds its lock

    def open(self) -> None:
        self.dir.open()
        try:
            for t, final in self.finals.items():  # again under the lock: another run may have finished meanwhile
                if os.path.lexists(final) and not self.overwrite:
                    raise UsageError(f"output {final} already exists", "pass --overwrite to replace it, or choose another -o")
            self.sweep()
            for d in self.tmps.values():  # new and empty (this PID's own, from a dead run that had it before, removed)
                outdir.fresh_dir(self.out, d.name)
        except OSError as e:
            self.rollback()
            raise UsageError(f"cannot write to {self.out} ({e.strerror})", "choose a writable output directory with -o") from None
        except BaseException:
            self.rollback()
            raise

    def sweep(self) -> None:
        """Remove what killed runs left in OUT, only where their PID is gone (or is ours, from an earlier life); a
        link at such a name, or a number that is no PID, is not qtk's and stays."""
        for p in self.out.iterdir():
            m = LEFTOVER.match(p.name)
            if not m or not outdir.is_pid(m.group(1)) or p.is_symlink():
                continue
            if int(m.group(1)) != self.pid and _pid_alive(int(m.group(1))):
                continue
            real = p.resolve()
            if real != self.source and real not in self.source.parents:
                outdir.remove_tree(self.out, p.name)

    def commit(self, t: str) -> None:
        """Rename target t's finished directory into place, replacing an old output (after moving it aside). A
        link planted at either name since the check before any work is refused, not replaced."""
        tmp, final = self.tmps[t], self.finals[t]
        if os.path.lexists(final):
            if not final.is_dir() or final.is_symlink():
                raise outdir.refusal(final)
            trash = self.out / f".{t}.qtk-old-{self.pid}"
            outdir.remove_tree(self.out, trash.name)  # this PID's own name; a link there is refused
            faults.fault_point("commit: move the old output aside")
            os.replace(final, trash)
            faults.fault_point("commit: rename the new output into place")
            os.replace(tmp, final)
            faults.fault_point("commit: remove the old output")
            shutil.rmtree(trash, ignore_errors=True)
        else:
            faults.fault_point("commit: rename the new output into place (no old one)")
            os.replace(tmp, final)
        fsync_dir(self.out)

    def rollback(self) -> None:
        """After a failure: remove this run's temporary directories, release OUT, and remove the directories
        this run created if they are empty (a directory that was there before stays, even when empty)."""
        for d in self.tmps.values():
            if not d.is_symlink():
                shutil.rmtree(d, ignore_errors=True)
        self.dir.rollback()

    def close(self) -> None:
        self.sweep()
        self.dir.close()
