"""Shared helpers for the benchmarks: building random models of a given shape, timing, peak RSS."""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from models import make_tiny_model, write_calib  # noqa: E402,F401


def qtk_exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "qtk")


def run_measured(args: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a child process, from the kernel's rusage for that child.

    posix_spawn, not fork: a forked child's peak RSS counts the parent's pages it inherited before exec
    (here: the models the benchmark just built), which would be charged to the conversion."""
    import tempfile

    with tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        pid = os.posix_spawn(args[0], args, dict(os.environ), file_actions=[
            (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0), (os.POSIX_SPAWN_DUP2, err.fileno(), 2)])
        _, status, ru = os.wait4(pid, 0)
        wall = time.perf_counter() - t0
        if os.waitstatus_to_exitcode(status) != 0:
            err.seek(0)
            raise RuntimeError(err.read().decode(errors="replace"))
    return wall, ru.ru_maxrss * 1024


def median(xs):
    return statistics.median(xs)


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*.safetensors"))
