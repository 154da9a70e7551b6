"""GPTQ on the CPU in 2 processes (torchrun, gloo) against 1 process: the overhead of the distributed path.

    .venv/bin/python benchmarks/convert_dist.py [--layers 4] [--hidden 1024] [--repeats 1] [--json FILE]

The model is large enough that per-layer work (Hessians, solves) dominates start-up. Each process gets
OMP_NUM_THREADS = cores / processes, so both runs use the same cores; on a 2-core machine no speed-up is expected,
the ratio shows what splitting windows, reducing Hessians and broadcasting solves cost. Reported: the layer loop's
time from qtk.json (timings.layers) and the process wall time, and their ratios (2-process / 1-process).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import make_tiny_model, median, write_calib


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(cmd, threads: int) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": str(threads)})
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=2816)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--recipe", default="w4a16-gptq")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    cores = os.cpu_count() or 2
    bin_ = Path(sys.executable).parent
    rows = {}
    with tempfile.TemporaryDirectory() as td:
        td = Path(td)
        m = make_tiny_model(td / "m", layers=a.layers, hidden=a.hidden, intermediate=a.intermediate, heads=16, kv_heads=4)
        calib = write_calib(td / "calib.jsonl", n=200)
        args = ["convert", str(m), "-r", a.recipe, "--device", "cpu", "--calib", str(calib), "--num-samples",
                str(a.num_samples), "--seq-len", str(a.seq_len), "--no-hash", "--overwrite"]
        for procs in (1, 2):
            walls, loops = [], []
            for _ in range(a.repeats):
                out = td / f"o{procs}"
                if procs == 1:
                    cmd = [str(bin_ / "qtk"), *args, "-o", str(out)]
                else:
                    cmd = [str(bin_ / "torchrun"), "--nproc-per-node", str(procs), "--master-port", str(free_port()),
                           "-m", "qtk", *args, "-o", str(out)]
                walls.append(run(cmd, max(1, cores // procs)))
                loops.append(json.loads((out / "vllm" / "qtk.json").read_text())["timings"]["layers"])
            rows[procs] = {"wall_s": median(walls), "layers_s": median(loops)}
            print(f"{procs} process(es): layers {median(loops):.2f}s, wall {median(walls):.2f}s", flush=True)
    ratio = {"layers": rows[2]["layers_s"] / rows[1]["layers_s"], "wall": rows[2]["wall_s"] / rows[1]["wall_s"]}
    print(f"2-process / 1-process: layers {ratio['layers']:.2f}x, wall {ratio['wall']:.2f}x")
    if a.json:
        a.json.write_text(json.dumps({"runs": rows, "ratio": ratio, "cores": cores, "args": vars(a)}, indent=2, default=str))


if __name__ == "__main__":
    main()
