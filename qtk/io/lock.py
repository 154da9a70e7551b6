"""An exclusive advisory lock on a directory, held by one process for as long as it writes there: the lock file holds
the holder's PID, so a second writer can say who is in the way. POSIX flock; where the filesystem has no locks (or the
platform no fcntl) the lock is a no-op.

The lock file is opened without following a link (O_NOFOLLOW: a link planted at its name is an ELOOP error, not a
way to write the PID into whatever it points at) and written only when it is a regular file with no other name (a
hard link would make the write land in another file too)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path


class LockHeld(Exception):
    """Another process holds the lock. holder: its PID as written in the lock file ("" when unreadable)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


class NotALockFile(Exception):
    """Something other than a lock file qtk made is at the lock's name. why: what it is."""

    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class DirLock:
    """acquire() takes DIR/<name> exclusively (raises LockHeld when another process has it, NotALockFile when the
    name holds something else, OSError ELOOP when it is a link); release() removes the file and lets go."""

    def __init__(self, directory: Path, name: str):
        self.path = Path(directory) / name
        self._fd: int | None = None

    def acquire(self) -> None:
        try:
            import fcntl
        except ImportError:  # not POSIX: no locking
            return
        while True:
            try:  # O_NONBLOCK: a FIFO at the name must not hang the open
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o644)
            except IsADirectoryError:
                raise NotALockFile("a folder") from None
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_nlink == 0:  # removed by the holder before us since we opened it
                os.close(fd)
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
                os.close(fd)
                raise NotALockFile("not a regular file" if not stat.S_ISREG(st.st_mode) else f"a file with {st.st_nlink} hard links")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
                    return
                raise LockHeld(holder) from None
            try:  # the holder before us may have removed the file after we opened it: lock the current one
                same = os.fstat(fd).st_ino == os.lstat(self.path).st_ino
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
            try:  # while still held, so no one locks a file about to vanish; only our own file, whatever is there now
                st, mine = os.lstat(self.path), os.fstat(self._fd)
                if (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
            os.close(self._fd)
            self._fd = None
