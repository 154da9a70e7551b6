"""Peak RSS of a calibrated (w4a16-gptq) conversion of tiny MoE models against depth: it should follow one layer, not
the model. Before qtk.pipeline.memory.bound_kernel_caches, oneDNN's GEMM primitive caches kept one entry per expert
input shape and the peak grew by tens of MB per layer.

    python benchmarks/moe_depth.py [--families qwen3_moe gpt_oss] [--layers 2 6 12] [--json F]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from _common import dir_bytes, make_tiny_model, qtk_exe, run_measured, write_calib


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", nargs="+", default=["qwen3_moe", "gpt_oss"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 6, 12])
    ap.add_argument("--recipe", default="w4a16-gptq")
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        calib = write_calib(td / "calib.jsonl", n=100)
        for fam in a.families:
            extra = (dict(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=768) if fam == "qwen3_moe" else
                     dict(num_local_experts=16, num_experts_per_tok=4, sliding_window=128, head_dim=64))
            for n in a.layers:
                m = make_tiny_model(td / f"{fam}-{n}", model_type=fam, layers=n, hidden=768, intermediate=768, heads=8,
                                    kv_heads=4, **extra)
                wall, peak = run_measured([qtk_exe(), "convert", str(m), "--recipe", a.recipe, "-o", str(td / f"o-{fam}-{n}"),
                                           "--calib", str(calib), "--num-samples", "16", "--seq-len", "128", "--no-hash"])
                row = {"family": fam, "recipe": a.recipe, "layers": n, "experts": 16, "hidden": 768,
                       "bf16_layer_mb": dir_bytes(m) / n / 1e6, "peak_rss_mb": peak / 1e6, "wall_s": wall}
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
