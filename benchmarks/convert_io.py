"""FP8 conversion time divided by the time to read the source and write the output once (goal <= 1.5).

    python benchmarks/convert_io.py [--repeats 3]
    python benchmarks/convert_io.py --recipes fp8-dynamic w8a16 w4a16   # every data-free recipe (issue 13)

The I/O floor is measured on the same files: every source tensor read into memory (safetensors),
then the converted checkpoint's tensors written once with safetensors and fsync'd. Page cache is
warm for both (the source is read once before timing). Reported for `fp8-dynamic` (no calibration:
pure streaming), and for `fp8` (static activation scales: includes the calibration forward passes).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from _common import dir_bytes, make_tiny_model, median, qtk_exe, run_measured, write_calib


def io_floor(src: Path, out: Path, tmp: Path) -> float:
    from safetensors.torch import load_file, save_file

    t0 = time.perf_counter()
    for p in sorted(src.glob("*.safetensors")):
        load_file(str(p))
    t_read = time.perf_counter() - t0
    tensors = {}
    for p in sorted(out.glob("*.safetensors")):
        tensors.update(load_file(str(p)))
    t0 = time.perf_counter()
    dst = tmp / "floor.safetensors"
    save_file(tensors, str(dst))
    with open(dst, "rb") as f:
        os.fsync(f.fileno())
    t_write = time.perf_counter() - t0
    dst.unlink()
    return t_read + t_write


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--recipes", nargs="+", default=None,
                    help="data-free recipes to time with --no-hash (default: fp8-dynamic with and without hashing, and fp8)")
    a = ap.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=200)
        m = make_tiny_model(td / "m", layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=16, kv_heads=4)
        size = dir_bytes(m)
        print(f"model: {a.layers} layers, hidden {a.hidden}: {size / 1e6:.0f} MB bf16", flush=True)
        runs = [(r, ["--no-hash"]) for r in a.recipes] if a.recipes else [
            ("fp8-dynamic", []), ("fp8-dynamic", ["--no-hash"]),
            ("fp8", ["--num-samples", "8", "--seq-len", "64", "--calib", str(calib)])]
        for recipe, extra in runs:
            label = recipe + (" --no-hash" if "--no-hash" in extra else "")
            conv, floors, walls = [], [], []
            for r in range(a.repeats):
                out = td / "o"
                wall, _ = run_measured([qtk_exe(), "convert", str(m), "--recipe", recipe, "-o", str(out), "--overwrite", *extra])
                # the conversion itself, as the manifest times it (process start-up and imports excluded)
                conv.append(json.loads((out / "vllm" / "qtk.json").read_text())["timings"]["total"])
                walls.append(wall)
                floors.append(io_floor(m, out / "vllm", td))
            ratio = median(conv) / median(floors)
            results[label] = {"convert_s": median(conv), "process_wall_s": median(walls), "io_floor_s": median(floors), "ratio": ratio,
                              "output_mb": dir_bytes(out / "vllm") / 1e6}
            print(f"{label:24s} convert {median(conv):6.2f}s (process {median(walls):.2f}s incl. imports), read+write once {median(floors):6.2f}s, "
                  f"ratio {ratio:5.2f}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
