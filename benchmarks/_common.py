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


def source_vs_dequantized(a, make, label: str, extra: dict | None = None) -> list[dict]:
    """The peak-RSS benchmark every quantized-source script runs: for each depth in a.layers, `make(td, n)` builds a
    source of n layers and the BF16 model it stands for (source, dequantized); each recipe in a.recipes converts both,
    each in its own process (the kernel's ru_maxrss for that child, the median of a.repeats). Prints a line per
    conversion and, per recipe, the change from the shallowest to the deepest model; writes a.json. `extra`: fields
    every row carries (the script's shape options)."""
    import json
    import tempfile

    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=100)
        for n in a.layers:
            src, ref = make(td, n)
            for recipe in a.recipes:
                for name, model in ((label, src), ("bf16-dequantized", ref)):
                    rss, wall = [], []
                    for _ in range(getattr(a, "repeats", 1)):
                        w, peak = run_measured([qtk_exe(), "convert", str(model), "--recipe", recipe, "-o",
                                                str(td / f"o-{name}-{recipe}-{n}"), "--overwrite", "--calib", str(calib),
                                                "--num-samples", "16", "--seq-len", "128", "--no-hash"])
                        rss.append(peak)
                        wall.append(w)
                    row = {"source": name, "recipe": recipe, "layers": n, **(extra or {}),
                           "source_mb": dir_bytes(model) / 1e6, "bf16_model_mb": dir_bytes(ref) / 1e6,
                           "bf16_layer_mb": dir_bytes(ref) / n / 1e6, "peak_rss_mb": median(rss) / 1e6,
                           "wall_s": median(wall)}
                    rows.append(row)
                    print(f"{name:17s} {recipe:11s} layers {n:2d}: on disk {row['source_mb']:7.1f} MB "
                          f"(bf16 {row['bf16_model_mb']:7.1f}), peak RSS {row['peak_rss_mb']:7.1f} MB, "
                          f"{row['wall_s']:6.1f} s", flush=True)
    lo, hi = min(a.layers), max(a.layers)
    for recipe in a.recipes:
        for name in (label, "bf16-dequantized"):
            r0 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (name, recipe, lo))
            r1 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (name, recipe, hi))
            print(f"{name} {recipe}: {hi} vs {lo} layers: bf16 model +{r1['bf16_model_mb'] - r0['bf16_model_mb']:.0f} MB, "
                  f"peak RSS {r1['peak_rss_mb'] - r0['peak_rss_mb']:+.1f} MB (one bf16 layer {r0['bf16_layer_mb']:.0f} MB)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))
    return rows
