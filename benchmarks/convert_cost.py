"""The constants of `qtk plan`'s conversion estimate (qtk/plan/convert_cost.py), measured on this machine:

    .venv/bin/python benchmarks/convert_cost.py [--hidden 2048] [--json benchmarks/results/convert_cost.json]

- gemm_flops: bf16 matmuls of a decoder layer's shape, [tokens, hidden] @ [hidden, 4·hidden], what calibration
  forwards do (torch's default threads);
- solve_flops: fp32 GPTQ work on an [hidden, hidden] Hessian (Cholesky, inverse, the column sweep of [4·hidden, hidden]
  rows) timed through qtk.algorithms.gptq, counted as hidden³ + rows·hidden² flops (qtk.steps.gptq.solve_cost);
- read_bps / write_bps: a 512 MB safetensors file read with qtk's reader (page cache warm) and written with fsync.
On a GPU machine (`--device cuda`) gemm and solve run there; the disk figures are the machine's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def timed(fn, repeats=3, sync=lambda: None):
    fn()
    sync()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--io-mb", type=int, default=512)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    import torch
    from safetensors.torch import save_file

    from qtk.io.safetensors import SafetensorsFile

    from qtk.algorithms.gptq import gptq_quantize_shared
    from qtk.quant.scheme import QuantScheme
    from qtk.recipe.params import GPTQParams

    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    h, n = a.hidden, a.tokens
    x = torch.randn(n, h, dtype=torch.bfloat16, device=dev)
    w = torch.randn(4 * h, h, dtype=torch.bfloat16, device=dev)
    t = timed(lambda: x @ w.t(), sync=sync)
    gemm = 2 * n * h * 4 * h / t

    xs = torch.randn(4 * h, h, device=dev)
    H = xs.t() @ xs / xs.shape[0]
    W = torch.randn(4 * h, h, device=dev)
    scheme = QuantScheme(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    t = timed(lambda: gptq_quantize_shared([W], H.clone(), scheme, GPTQParams(), torch.bfloat16), repeats=1, sync=sync)
    solve = (h ** 3 + 4 * h * h ** 2) / t

    with tempfile.TemporaryDirectory() as td:
        p = Path(td) / "x.safetensors"
        big = {"t": torch.zeros(a.io_mb * 2**20 // 2, dtype=torch.bfloat16)}

        def write():
            save_file(big, str(p))
            with open(p, "rb") as f:
                os.fsync(f.fileno())

        tw = timed(write, repeats=2)
        tr = timed(lambda: SafetensorsFile(p).get_tensor("t"), repeats=2)  # qtk's positioned reads (no mmap)
    size = a.io_mb * 2**20
    out = {"device": a.device, "hidden": h, "tokens": n, "gemm_flops": gemm, "solve_flops": solve,
           "read_bps": size / tr, "write_bps": size / tw, "torch_threads": torch.get_num_threads()}
    print(json.dumps(out, indent=2))
    if a.json:
        a.json.write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
