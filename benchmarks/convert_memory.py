"""Peak RSS of `qtk convert` against model size: same width, growing depth, plus a wider model.

    python benchmarks/convert_memory.py [--recipe int8-kv8] [--repeats 3]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import dir_bytes, make_tiny_model, median, qtk_exe, run_measured, write_calib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="int8-kv8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args()
    shapes = [dict(layers=n, hidden=1024, intermediate=2816, heads=16, kv_heads=4) for n in (2, 8, 24)]
    shapes.append(dict(layers=4, hidden=2048, intermediate=5632, heads=16, kv_heads=4))
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=200)
        for s in shapes:
            m = make_tiny_model(td / f"m{s['layers']}x{s['hidden']}", **s)
            size = dir_bytes(m)
            rss = []
            for r in range(a.repeats):
                out = td / f"o{r}"
                _, peak = run_measured([qtk_exe(), "convert", str(m), "--recipe", a.recipe, "-o", str(out), "--overwrite",
                                        "--calib", str(calib), "--num-samples", "16", "--seq-len", "128", "--no-hash"])
                rss.append(peak)
            layer = size / s["layers"]
            rows.append({**s, "model_mb": size / 1e6, "layer_mb": layer / 1e6, "peak_rss_mb": median(rss) / 1e6})
            print(f"layers {s['layers']:3d} hidden {s['hidden']:5d}: model {size / 1e6:8.1f} MB, one layer {layer / 1e6:6.1f} MB, "
                  f"peak RSS (median of {a.repeats}) {median(rss) / 1e6:8.1f} MB", flush=True)
    base = rows[0]
    for r in rows[1:3]:
        grow = r["peak_rss_mb"] - base["peak_rss_mb"]
        print(f"{r['layers']} vs {base['layers']} layers: model +{r['model_mb'] - base['model_mb']:.0f} MB, peak RSS {grow:+.1f} MB")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
