"""Files that survive a crash whole or not at all: each is written, flushed and fsynced before the rename that
publishes it, and the directory entry is fsynced after."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path


def fsync_dir(d: Path) -> None:
    """Flush a directory's entries (a rename into it, a new file) to disk."""
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(d: Path) -> None:
    """Flush every file of a finished directory and the directory itself, before it is renamed into place."""
    for p in d.iterdir():
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    fsync_dir(d)


class BackgroundFlush:
    """fsync_tree of each directory in a background thread (fsync releases the GIL): the disk writes a finished
    output back while the caller reads it from the page cache (the convert self-check), instead of after it. wait()
    returns when everything is on disk and raises what the flush raised (EIO, ENOSPC)."""

    def __init__(self, dirs: list[Path]):
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(list(dirs),), name="qtk-flush", daemon=True)
        self.thread.start()

    def _run(self, dirs: list[Path]) -> None:
        try:
            for d in dirs:
                fsync_tree(d)
        except BaseException as e:  # noqa: BLE001 (handed to wait(), in the caller's thread)
            self.error = e

    def wait(self) -> None:
        self.thread.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise e


class WriteBack:
    """Files still being written, written back to disk as they grow: request(files) has a background thread
    fdatasync them (each a dup of its descriptor, so a file closed meanwhile is still the one flushed), one request
    at a time, a newer one replacing one not yet started. The data-free stream asks after every layer, so the disk
    writes layer i back while layer i+1 rounds: left to the kernel, a 6-layer Llama-3-8B output (3.4 GB) stayed
    dirty until the final fsync (the flush thresholds are a tenth of memory and 30 s), which then waited for all of
    it, and dirtying past the thresholds throttled the writing thread itself. close() raises what a flush raised
    (EIO, ENOSPC: the fsync that meets an error reports it once, so it is kept here for the caller).
    Durability is not this class's job: the caller still fsyncs every file before publishing it."""

    def __init__(self):
        self.error: BaseException | None = None
        self._cv = threading.Condition()
        self._next: list[int] | None = None  # dup'd descriptors waiting for the thread
        self._closed = False
        self.thread = threading.Thread(target=self._run, name="qtk-writeback", daemon=True)
        self.thread.start()

    def request(self, files) -> None:
        """Write back what `files` (open file objects) hold so far."""
        fds = [os.dup(f.fileno()) for f in files if not f.closed]
        with self._cv:
            if self._closed:
                raise RuntimeError("WriteBack is closed")
            stale, self._next = self._next, fds
            self._cv.notify()
        for fd in stale or ():
            os.close(fd)

    def _run(self) -> None:
        while True:
            with self._cv:
                while self._next is None and not self._closed:
                    self._cv.wait()
                if self._next is None:
                    return
                fds, self._next = self._next, None
            try:
                for fd in fds:
                    if self.error is None:
                        os.fdatasync(fd)
            except BaseException as e:  # noqa: BLE001 (handed to close(), in the caller's thread)
                self.error = e
            finally:
                for fd in fds:
                    os.close(fd)

    def close(self) -> None:
        """Wait for the flush in progress, drop one not started (the caller's final fsync writes that back, beside
        its next work); raise what a flush raised."""
        with self._cv:
            self._closed = True
            stale, self._next = self._next, None
            self._cv.notify_all()
        for fd in stale or ():
            os.close(fd)
        self.thread.join()
        if self.error is not None:
            e, self.error = self.error, None
            raise e


def write_text(p: Path, text: str) -> str:
    """Write `text` to the new file `p` (never through a link or into a file that is there), flushed to disk;
    returns the sha256 of the bytes written."""
    data = text.encode()
    with open(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return hashlib.sha256(data).hexdigest()


def sha256_file(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()
