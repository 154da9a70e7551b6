"""intel/auto-round itself on the calibration token ids benchmarks/autoround.py gives qtk, as a peer: run in a
throwaway virtual environment that has PyPI `auto-round` (never a qtk dependency), e.g.

    python -m venv /tmp/ar-peer && echo "$PWD/.venv/lib/python3.11/site-packages" > /tmp/ar-peer/lib/python3.11/site-packages/qtk.pth
    /tmp/ar-peer/bin/pip install --no-deps auto-round py-cpuinfo
    /tmp/ar-peer/bin/python benchmarks/_autoround_peer.py --model DIR --ids calib-ids.pt --out OUT --iters 50 --group-size 64

Writes OUT/vllm (auto-round's llm_compressor format: a compressed-tensors checkpoint that qtk's reader and simulation
open like qtk's own) and OUT/timings.json. --scheme W4A16: symmetric, the given group size; --scheme NVFP4: auto-round's
own NVFP4 scheme (W4A4, groups of 16, activations quantized while it learns, static global input scale); auto-round's
defaults otherwise (lr 1/iters, minmax tuning, best-loss tracking, batches of --batch-size windows).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--ids", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--scheme", choices=["W4A16", "NVFP4"], default="W4A16")
    a = ap.parse_args()
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(a.threads)
    ids = torch.load(a.ids, weights_only=True)
    batches = [ids[i:i + a.batch_size] for i in range(0, len(ids), a.batch_size)]
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(a.model)
    t0 = time.perf_counter()
    scheme = {"bits": 4, "group_size": a.group_size, "sym": True} if a.scheme == "W4A16" else {"scheme": a.scheme}
    ar = AutoRound(model, tok, **scheme, iters=a.iters, nsamples=len(ids),
                   seqlen=ids.shape[1], batch_size=a.batch_size, dataset=batches, device_map="cpu")
    ar.quantize_and_save(str(Path(a.out) / "vllm"), format="llm_compressor")
    (Path(a.out) / "timings.json").write_text(json.dumps({"total_in_process": time.perf_counter() - t0}))


if __name__ == "__main__":
    main()
