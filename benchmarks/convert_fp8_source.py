"""Peak RSS of converting an already-quantized source against the same conversion of its dequantized BF16 model: same
width, growing depth. The source is dequantized tensor by tensor as the layers stream, so the peak should follow one
layer, not the model.

- `--source fp8` (default): an FP8-block source (float8_e4m3fn weights, a float32 weight_scale_inv per 128x128 block,
  as DeepSeek-V3 and Qwen3-FP8 ship).
- `--source ct`: a compressed-tensors source (qtk's own vllm output of `--ct-recipe`, e.g. w4a16's pack-quantized
  int4), its BF16 model as compressed-tensors decompresses it.

    python benchmarks/convert_fp8_source.py [--source fp8|ct] [--ct-recipe w4a16] [--recipes nvfp4 w4a16-gptq]
                                            [--layers 2 8] [--repeats 1] [--json F]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import make_tiny_model, source_vs_dequantized


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=("fp8", "ct"), default="fp8")
    ap.add_argument("--ct-recipe", default="w4a16", help="the recipe the compressed-tensors source is written with")
    ap.add_argument("--recipes", nargs="+", default=["nvfp4", "w4a16-gptq"])
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 8])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None, help="also write results here")
    a = ap.parse_args()

    def make(td: Path, n: int):
        orig = make_tiny_model(td / f"orig{n}", layers=n, hidden=a.hidden, intermediate=a.intermediate, heads=16,
                               kv_heads=4, tokenizer=True)
        if a.source == "ct":
            from ct_sources import decompressed_reference, make_ct_source

            ct = make_ct_source(orig, td / f"ct-{n}", a.ct_recipe)
            return ct, decompressed_reference(ct, td / f"bf16-{n}")
        from fp8_sources import dequantized_reference, make_fp8_block_source

        fp8 = make_fp8_block_source(orig, td / f"fp8-{n}")
        return fp8, dequantized_reference(fp8, td / f"bf16-{n}")

    label = f"ct-{a.ct_recipe}-source" if a.source == "ct" else "fp8-source"
    source_vs_dequantized(a, make, label, {"hidden": a.hidden, "intermediate": a.intermediate})


if __name__ == "__main__":
    main()
