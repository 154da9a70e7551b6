"""Peak RSS of converting gpt-oss's MXFP4 source (each layer's fused experts as uint8 e2m1 blocks with E8M0 scales, as
OpenAI ships it) against the same conversion of its dequantized BF16 model: same width, growing depth. The experts
are decoded one expert at a time as the layers stream, so the peak should follow one layer, not the model.

    python benchmarks/convert_mxfp4_source.py [--recipes w4a16 w4a16-gptq] [--layers 2 6] [--json F]

Each conversion runs in its own process; the peak RSS is the kernel's ru_maxrss for that child.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from _common import make_tiny_model, source_vs_dequantized
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

    def make(td: Path, n: int):
        orig = make_tiny_model(td / f"orig{n}", model_type="gpt_oss", layers=n, hidden=a.hidden,
                               intermediate=a.intermediate, heads=8, kv_heads=4, head_dim=64,
                               num_local_experts=a.experts, num_experts_per_tok=4, sliding_window=128)
        return make_mxfp4_source(orig, td / f"mxfp4-{n}")

    source_vs_dequantized(a, make, "mxfp4-source",
                          {"hidden": a.hidden, "experts": a.experts, "intermediate": a.intermediate})


if __name__ == "__main__":
    main()
