"""The output directory of `qtk convert` while a run writes it.

OUT is created if absent (and removed again on failure only then), locked for the whole run (a second run on
the same OUT stops at once, naming the first), and swept of what killed runs left; each target is written to
`OUT/.<target>.qtk-tmp-<pid>` and renamed to `OUT/<target>` only when complete. Before any of that,
`check_paths` refuses every layout where replacing or deleting one of these paths could touch the source model.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

from qtk.errors import UsageError
from qtk import resume
from qtk.resume import STATE_DIR, fsync_dir

LOCK = ".qtk-lock"
# what a killed run leaves in OUT: .<target>.qtk-tmp-PID (being written), .<target>.qtk-old-PID (an old output
# moved aside while committing), .qtk-resume.tmp-PID (resume state being created)
LEFTOVER = re.compile(r"^\.(?:.+\.qtk-(?:tmp|old)|qtk-resume\.tmp)-(\d+)$")


def check_paths(source: Path, out: Path, targets) -> None:
    """Refuse (exit 2), before any work, an OUT whose <target> or resume state is, contains or lies inside the
    source model (symlinks resolved): --overwrite would delete the model, --resume could remove it as stale state."""
    src = Path(source).resolve()
    out_abs = Path(out).resolve()
    fix = "write the output somewhere else; qtk never modifies its input"
    if out_abs == src or src in out_abs.parents:
        raise UsageError(f"output {out} is inside the model directory", fix)
    for p in [Path(out) / t for t in targets] + [Path(out) / STATE_DIR]:
        real = p.resolve()
        if real == src:
            raise UsageError(f"output {p} is the model directory itself", fix)
        if real in src.parents:
            raise UsageError(f"output {p} contains the model directory {source}", fix)
        if src in real.parents:
            raise UsageError(f"output {p} is inside the model directory", fix)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


class OutputDir:
    """OUT for one run: open() creates and locks it, tmp(t) is where target t is written, commit() renames a
    finished target into place, rollback() leaves OUT as it was found, close() releases it after success."""

    def __init__(self, out: Path, targets, source: Path, overwrite: bool):
        self.out = Path(out)
        self.source = Path(source).resolve()
        self.overwrite = overwrite
        self.pid = os.getpid()
        self.tmps = {t: self.out / f".{t}.qtk-tmp-{self.pid}" for t in targets}
        self.finals = {t: self.out / t for t in targets}
        self.created: list[Path] = []  # directories this run made, deepest first: removed again on failure
        self._fd: int | None = None

    def open(self) -> None:
        try:
            p = self.out
            while not os.path.lexists(p):
                self.created.append(p)
                p = p.parent
            self.out.mkdir(parents=True, exist_ok=True)
            self._lock()
            for t, final in self.finals.items():  # again under the lock: another run may have finished meanwhile
                if os.path.lexists(final) and not self.overwrite:
                    raise UsageError(f"output {final} already exists", "pass --overwrite to replace it, or choose another -o")
            self.sweep()
            for d in self.tmps.values():
                shutil.rmtree(d, ignore_errors=True)  # this PID's own, from a dead run that had it before
                d.mkdir()
        except OSError as e:
            self.rollback()
            raise UsageError(f"cannot write to {self.out} ({e.strerror})", "choose a writable output directory with -o") from None
        except BaseException:
            self.rollback()
            raise

    def _lock(self) -> None:
        """An exclusive advisory lock on OUT/.qtk-lock, held until close/rollback; the file holds the PID."""
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return
        path = self.out / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
                    return
                who = f"qtk (PID {holder})" if holder.isdigit() else "another qtk run"
                raise UsageError(f"{who} is writing to {self.out}",
                                 "wait for it to finish, or choose another -o") from None
            try:  # the holder before us may have removed the file after we opened it: lock the current one
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{self.pid}\n".encode(), 0)
        self._fd = fd

    def _unlock(self) -> None:
        if self._fd is not None:
            (self.out / LOCK).unlink(missing_ok=True)  # while still held, so no one locks a file about to vanish
            os.close(self._fd)
            self._fd = None

    def sweep(self) -> None:
        """Remove what killed runs left in OUT, only where their PID is gone (or is ours, from an earlier life)."""
        for p in self.out.iterdir():
            m = LEFTOVER.match(p.name)
            if not m or (int(m.group(1)) != self.pid and _pid_alive(int(m.group(1)))):
                continue
            if p.is_dir() and not p.is_symlink():
                real = p.resolve()
                if real != self.source and real not in self.source.parents:
                    shutil.rmtree(p, ignore_errors=True)

    def commit(self, t: str) -> None:
        """Rename target t's finished directory into place, replacing an old output (after moving it aside)."""
        tmp, final = self.tmps[t], self.finals[t]
        if os.path.lexists(final):
            trash = self.out / f".{t}.qtk-old-{self.pid}"
            resume.fault_point("commit: move the old output aside")
            os.replace(final, trash)
            resume.fault_point("commit: rename the new output into place")
            os.replace(tmp, final)
            resume.fault_point("commit: remove the old output")
            shutil.rmtree(trash, ignore_errors=True)
        else:
            resume.fault_point("commit: rename the new output into place (no old one)")
            os.replace(tmp, final)
        fsync_dir(self.out)

    def rollback(self) -> None:
        """After a failure: remove this run's temporary directories, release OUT, and remove the directories
        this run created if they are empty (a directory that was there before stays, even when empty)."""
        for d in self.tmps.values():
            shutil.rmtree(d, ignore_errors=True)
        self._unlock()
        for d in self.created:
            try:
                d.rmdir()
            except OSError:
                break

    def close(self) -> None:
        self.sweep()
        self._unlock()
