"""Shared helpers for the benchmarks: building random models of a given shape, timing, peak RSS."""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from models import make_tiny_model, run_measured, write_calib  # noqa: E402,F401


def qtk_exe() -> str:
    return os.path.join(os.path.dirname(sys.executable), "qtk")


def median(xs):
    return statistics.median(xs)


def dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in Path(d).rglob("*.safetensors"))
