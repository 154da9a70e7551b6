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


def write_text(p: Path, text: str) -> str:
    """Write `text` to `p`, flushed to disk; returns the sha256 of the bytes written."""
    data = text.encode()
    with open(p, "wb") as f:
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
