"""Baseline cache: time of a second `qtk eval` run against the same baseline divided by the first (goal <= 0.55).

    python benchmarks/gate_cache.py [--repeats 3] [--threads 1] [--cli] [--hidden 512 --limit 40]

The first run evaluates baseline and candidate; the second finds the baseline's results in the cache and
evaluates only the candidate. Both are whole gate runs (task loading, held-out check, hashing, statistics,
JSON report). Model: examples/tiny-llama with examples/tasks.yaml when present, else a random tiny Llama with a
generated suite. In-process runs (imports and allocator warm, as in a long-lived CI worker) are the headline;
--cli also times two `qtk eval` processes, which adds the same interpreter start-up to both.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT, make_tiny_model, median, qtk_exe, write_calib  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-llama"
EXAMPLE_TASKS = ROOT / "examples" / "tasks.yaml"


def synthetic_suite(d: Path) -> Path:
    rng = random.Random(11)
    with open(d / "add.jsonl", "w") as f:
        for _ in range(100):
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            f.write(json.dumps({"prompt": f"Q: {a}+{b}=", "reference": f" {a + b}"}) + "\n")
    with open(d / "mc.jsonl", "w") as f:
        for _ in range(100):
            a, b = rng.randint(10, 999), rng.randint(10, 999)
            f.write(json.dumps({"context": f"Q: {a}+{b}=", "choices": [f" {a + b}", f" {a + b + 1}", f" {a + b + 10}"], "answer": 0}) + "\n")
    words = "the model reads a key and a value then sorts the list".split()
    with open(d / "ppl.jsonl", "w") as f:
        for _ in range(100):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(40))}) + "\n")
    (d / "tasks.yaml").write_text(
        "tasks:\n - {name: add, type: generate, data: add.jsonl, gate: {max_drop: 5}}\n"
        " - {name: mc, type: multiple_choice, data: mc.jsonl, gate: {max_drop: 5}}\n"
        " - {name: ppl, type: perplexity, data: ppl.jsonl, gate: {min_recovery: 0.95}}\n")
    return d / "tasks.yaml"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest for tiny models on a shared CPU)")
    ap.add_argument("--recipe", default="int8-kv8")
    ap.add_argument("--cli", action="store_true", help="also time two `qtk eval` processes")
    ap.add_argument("--hidden", type=int, default=0,
                    help="use a random Llama of this width (4 layers, synthetic tasks) instead of examples/tiny-llama")
    ap.add_argument("--limit", type=int, default=None, help="examples per task")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here (e.g. benchmarks/results/gate_cache.json)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    from qtk import api
    from qtk.eval.api import run_gate

    work = Path(tempfile.mkdtemp(prefix="qtk-gate-cache-"))
    if (EXAMPLE / "config.json").is_file() and EXAMPLE_TASKS.is_file() and not args.hidden:
        model, tasks, calib, label = EXAMPLE, EXAMPLE_TASKS, None, "examples/tiny-llama + examples/tasks.yaml"
    else:
        h = args.hidden or 128
        model = make_tiny_model(work / "model", hidden=h, intermediate=4 * h, layers=4)
        tasks, calib = synthetic_suite(work), str(write_calib(work / "calib.jsonl"))
        label = f"random Llama (hidden {h}, 4 layers) + synthetic suite"
    cand = api.convert(model, args.recipe, work / "out", calib=calib, overwrite=True).outputs["vllm"]

    kw = {"limit": args.limit}
    run_gate(cand, model, tasks, cache_dir=work / "warmup", json_path=work / "warmup.json", **kw)  # imports, kernels, page cache
    load_start = os.getloadavg()
    firsts, seconds, cpu_firsts, cpu_seconds = [], [], [], []
    for r in range(args.repeats):
        cache = work / f"cache{r}"
        t0, c0 = time.perf_counter(), time.process_time()
        a = run_gate(cand, model, tasks, cache_dir=cache, json_path=work / "a.json", **kw)
        t1, c1 = time.perf_counter(), time.process_time()
        b = run_gate(cand, model, tasks, cache_dir=cache, json_path=work / "b.json", **kw)
        t2, c2 = time.perf_counter(), time.process_time()
        assert not a.engine["baseline_cached"] and len(b.engine["baseline_cached"]) == len(b.tasks)
        assert [t.baseline for t in a.tasks] == [t.baseline for t in b.tasks]
        firsts.append(t1 - t0)
        seconds.append(t2 - t1)
        cpu_firsts.append(c1 - c0)
        cpu_seconds.append(c2 - c1)
    # wall time is what a user waits; CPU time of this (single-threaded) process is steadier on a shared machine
    out = {"benchmark": "gate_cache", "model": label, "recipe": args.recipe, "threads": args.threads,
           "first_s": round(median(firsts), 3), "second_s": round(median(seconds), 3),
           "ratio": round(median(seconds) / median(firsts), 3),
           "cpu_first_s": round(median(cpu_firsts), 3), "cpu_second_s": round(median(cpu_seconds), 3),
           "cpu_ratio": round(median(cpu_seconds) / median(cpu_firsts), 3), "goal": 0.55,
           "tasks": {t.name: t.n for t in a.tasks},
           "first_s_runs": [round(x, 3) for x in firsts], "second_s_runs": [round(x, 3) for x in seconds],
           "stages_first_s": {k: round(v, 3) for k, v in a.timings.items()},
           "stages_second_s": {k: round(v, 3) for k, v in b.timings.items()},
           "loadavg_start": [round(x, 2) for x in load_start], "loadavg_end": [round(x, 2) for x in os.getloadavg()],
           "command": "python benchmarks/gate_cache.py " + " ".join(sys.argv[1:])}
    if args.cli:
        cache = work / "cli-cache"
        env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            p = subprocess.run([qtk_exe(), "eval", str(cand), "--baseline", str(model), "--tasks", str(tasks),
                                "--cache-dir", str(cache)] + (["--limit", str(args.limit)] if args.limit else []),
                               env=env, capture_output=True, text=True)
            times.append(time.perf_counter() - t0)
            if p.returncode not in (0, 1):
                raise RuntimeError(p.stderr)
        out.update(cli_first_s=round(times[0], 3), cli_second_s=round(times[1], 3), cli_ratio=round(times[1] / times[0], 3))
    print(json.dumps(out))
    if args.json:
        args.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
