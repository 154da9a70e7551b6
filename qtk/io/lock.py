"""An exclusive advisory lock on a directory, held by one process for as long as it writes there: the lock file holds
the holder's PID, so a second writer can say who is in the way. POSIX flock; where the filesystem has no locks (or the
platform no fcntl) the lock is a no-op."""

from __future__ import annotations

import errno
import os
from pathlib import Path


class LockHeld(Exception):
    """Another process holds the lock. holder: its PID as written in the lock file ("" when unreadable)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class DirLock:
    """acquire() takes DIR/<name> exclusively (raises LockHeld when another process has it); release() removes the
    file and lets go."""

    def __init__(self, directory: Path, name: str):
        self.path = Path(directory) / name
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
                    return
                raise LockHeld(holder) from None
            try:  # the holder before us may have removed the file after we opened it: lock the current one
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            self.path.unlink(missing_ok=True)  # while still held, so no one locks a file about to vanish
            os.close(self._fd)
            self._fd = None
