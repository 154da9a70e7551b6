"""Peak RSS of converting an FP8-block source (float8_e4m3fn weights, a float32 weight_scale_inv per 128x128 block,
as DeepSeek-V3 and Qwen3-FP8 ship) against the same conversion of its dequantized BF16 model: same width, growing
depth. The source is dequantized tensor by tensor as the layers stream, so the peak should follow one layer, not the
model.

    python benchmarks/convert_fp8_source.py [--recipes nvfp4 w4a16-gptq] [--layers 2 8] [--repeats 1] [--json F]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import dir_bytes, make_tiny_model, median, qtk_exe, run_measured, write_calib
from fp8_sources import dequantized_reference, make_fp8_block_source


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["nvfp4", "w4a16-gptq"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=100)
        for n in a.layers:
            orig = make_tiny_model(td / f"orig{n}", layers=n, hidden=a.hidden, intermediate=a.intermediate, heads=16,
                                   kv_heads=4, tokenizer=True)
            fp8 = make_fp8_block_source(orig, td / f"fp8-{n}")
            ref = dequantized_reference(fp8, td / f"bf16-{n}")
            for recipe in a.recipes:
                for label, model in (("fp8-source", fp8), ("bf16-dequantized", ref)):
                    rss, wall = [], []
                    for r in range(a.repeats):
                        out = td / f"o-{label}-{recipe}-{n}"
                        w, peak = run_measured([qtk_exe(), "convert", str(model), "--recipe", recipe, "-o", str(out),
                                                "--overwrite", "--calib", str(calib), "--num-samples", "16",
                                                "--seq-len", "128", "--no-hash"])
                        rss.append(peak)
                        wall.append(w)
                    size = dir_bytes(model)
                    bf16_layer = dir_bytes(ref) / n
                    row = {"source": label, "recipe": recipe, "layers": n, "hidden": a.hidden,
                           "intermediate": a.intermediate, "source_mb": size / 1e6, "bf16_model_mb": dir_bytes(ref) / 1e6,
                           "bf16_layer_mb": bf16_layer / 1e6, "peak_rss_mb": median(rss) / 1e6, "wall_s": median(wall)}
                    rows.append(row)
                    print(f"{label:17s} {recipe:11s} layers {n:2d}: on disk {size / 1e6:7.1f} MB (bf16 {dir_bytes(ref) / 1e6:7.1f}), "
                          f"peak RSS {median(rss) / 1e6:7.1f} MB, {median(wall):6.1f} s", flush=True)
    lo, hi = min(a.layers), max(a.layers)
    for recipe in a.recipes:
        for label in ("fp8-source", "bf16-dequantized"):
            r0 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (label, recipe, lo))
            r1 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (label, recipe, hi))
            print(f"{label} {recipe}: {hi} vs {lo} layers: bf16 model +{r1['bf16_model_mb'] - r0['bf16_model_mb']:.0f} MB, "
                  f"peak RSS {r1['peak_rss_mb'] - r0['peak_rss_mb']:+.1f} MB (one bf16 layer {r0['bf16_layer_mb']:.0f} MB)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
