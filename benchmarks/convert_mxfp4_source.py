"""Peak RSS of converting gpt-oss's MXFP4 source (each layer's fused experts as uint8 e2m1 blocks with E8M0 scales, as
OpenAI ships it) against the same conversion of its dequantized BF16 model: same width, growing depth. The experts
are decoded one expert at a time as the layers stream, so the peak should follow one layer, not the model.

    python benchmarks/convert_mxfp4_source.py [--recipes w4a16 w4a16-gptq] [--layers 2 6] [--json F]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import dir_bytes, make_tiny_model, run_measured, qtk_exe, write_calib
from mxfp4_sources import make_mxfp4_source


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=["w4a16", "w4a16-gptq"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 6])
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--intermediate", type=int, default=768)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=100)
        for n in a.layers:
            orig = make_tiny_model(td / f"orig{n}", model_type="gpt_oss", layers=n, hidden=a.hidden,
                                   intermediate=a.intermediate, heads=8, kv_heads=4, head_dim=64,
                                   num_local_experts=a.experts, num_experts_per_tok=4, sliding_window=128)
            mx, ref = make_mxfp4_source(orig, td / f"mxfp4-{n}")
            for recipe in a.recipes:
                for label, model in (("mxfp4-source", mx), ("bf16-dequantized", ref)):
                    out = td / f"o-{label}-{recipe}-{n}"
                    wall, peak = run_measured([qtk_exe(), "convert", str(model), "--recipe", recipe, "-o", str(out),
                                               "--overwrite", "--calib", str(calib), "--num-samples", "16",
                                               "--seq-len", "128", "--no-hash"])
                    row = {"source": label, "recipe": recipe, "layers": n, "hidden": a.hidden, "experts": a.experts,
                           "intermediate": a.intermediate, "source_mb": dir_bytes(model) / 1e6,
                           "bf16_model_mb": dir_bytes(ref) / 1e6, "bf16_layer_mb": dir_bytes(ref) / n / 1e6,
                           "peak_rss_mb": peak / 1e6, "wall_s": wall}
                    rows.append(row)
                    print(f"{label:17s} {recipe:11s} layers {n:2d}: on disk {row['source_mb']:7.1f} MB "
                          f"(bf16 {row['bf16_model_mb']:7.1f}), peak RSS {row['peak_rss_mb']:7.1f} MB, {wall:6.1f} s",
                          flush=True)
    lo, hi = min(a.layers), max(a.layers)
    for recipe in a.recipes:
        for label in ("mxfp4-source", "bf16-dequantized"):
            r0 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (label, recipe, lo))
            r1 = next(r for r in rows if (r["source"], r["recipe"], r["layers"]) == (label, recipe, hi))
            print(f"{label} {recipe}: {hi} vs {lo} layers: bf16 model +{r1['bf16_model_mb'] - r0['bf16_model_mb']:.0f} MB, "
                  f"peak RSS {r1['peak_rss_mb'] - r0['peak_rss_mb']:+.1f} MB (one bf16 layer {r0['bf16_layer_mb']:.0f} MB)")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
