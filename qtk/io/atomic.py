"""Files that survive a crash whole or not at all: each is written, flushed and fsynced before the rename that
publishes it, and the directory entry is fsynced after."""

from __future__ import annotations

import hashlib
import os
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
