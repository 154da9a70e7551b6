"""qtk tune on the example model: the tuned checkpoint against the uniform recipes at two budgets, and the cost of
tuning against one GPTQ conversion plus the gate runs tune makes (goal: ratio <= 3).

    python benchmarks/tune.py [--candidates w4a16,w8a16,bf16] [--budgets 800000,1049000] [--limit 100]
                              [--num-samples 64 --seq-len 128] [--max-rounds 4]

For each uniform candidate recipe: convert (same calibration as tune), gate against examples/tasks.yaml, record bytes
and verdict. For each budget: qtk tune with that --max-weight-bytes; its final bytes, verdict and rounds. Cost:
tune's wall time / (one w4a16-gptq conversion + rounds × one gate run with the baseline cached), both measured here in the same process.
Writes benchmarks/results/tune.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-llama"
TASKS = ROOT / "examples" / "tasks.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--budgets", default="800000,1049000")
    ap.add_argument("--limit", type=int, default=100)
    ap.add_argument("--num-samples", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--max-rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--candidates", default="w4a16,w8a16,bf16")
    ap.add_argument("--strict", action="store_true", help="judge point estimates (qtk eval --strict)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "tune.json"))
    a = ap.parse_args()

    import torch

    from qtk import api
    from qtk.eval.api import run_gate
    from qtk.plan.memory import ModelShape, read_config, weight_bytes
    from qtk.recipe import load_recipe

    torch.set_num_threads(a.threads)
    shape = ModelShape.from_config(read_config(EXAMPLE))
    res: dict = {"model": "examples/tiny-llama", "tasks": "examples/tasks.yaml", "limit": a.limit,
                 "calibration": [a.num_samples, a.seq_len], "strict": a.strict, "uniform": {}, "tuned": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the reference conversion: w4a16-gptq with the same calibration
        t0 = time.perf_counter()
        api.convert(EXAMPLE, "w4a16-gptq", tmp / "ref", num_samples=a.num_samples, seq_len=a.seq_len, hash_source=False)
        t_gptq = time.perf_counter() - t0
        res["gptq_convert_s"] = round(t_gptq, 2)
        # warm the baseline cache, so no measurement below pays for the baseline's evaluation
        cands = a.candidates.split(",")
        for name in [c for c in cands if c != "bf16"]:
            t0 = time.perf_counter()
            data = load_recipe(name).needs_calibration
            out = api.convert(EXAMPLE, name, tmp / name, num_samples=a.num_samples if data else None,
                              seq_len=a.seq_len if data else None, hash_source=False).outputs["vllm"]
            t_conv = time.perf_counter() - t0
            t0 = time.perf_counter()
            g = run_gate(out, EXAMPLE, TASKS, limit=a.limit, threads=a.threads, strict=a.strict)
            t_gate = time.perf_counter() - t0
            res["uniform"][name] = {"bytes": weight_bytes(shape, load_recipe(name)).total, "passed": g.passed,
                                    "failures": g.failures, "convert_s": round(t_conv, 2), "gate_s": round(t_gate, 2)}
            print(name, res["uniform"][name], flush=True)
        res["uniform"]["bf16"] = {"bytes": weight_bytes(shape, None).total, "passed": True}
        # the gate again, now with the baseline cached (what every tune round pays)
        t0 = time.perf_counter()
        run_gate(tmp / cands[0] / "vllm", EXAMPLE, TASKS, limit=a.limit, threads=a.threads, strict=a.strict)
        gate_cached = time.perf_counter() - t0
        for b in [int(x) for x in a.budgets.split(",")]:
            t0 = time.perf_counter()
            try:
                r = api.tune(EXAMPLE, TASKS, tmp / f"tune-{b}", candidates=cands, max_weight_bytes=b, max_rounds=a.max_rounds,
                             num_samples=a.num_samples, seq_len=a.seq_len, limit=a.limit, threads=a.threads, strict=a.strict,
                             progress=lambda s: print(f"  [{b}] {s}", flush=True) if s.startswith(("round", "sens", "front")) else None)
                rep = r.report
            except Exception as e:  # a budget nothing passes within is a result too
                rep = {"error": str(e), "trials": [], "final": None, "timings": {}}
            t = time.perf_counter() - t0
            rounds = len(rep["trials"])
            ref = t_gptq + rounds * gate_cached
            fin = rep.get("final") or {}
            counts: dict[str, int] = {}
            for c in (fin.get("units") or {}).values():
                counts[c] = counts.get(c, 0) + 1
            res["tuned"][str(b)] = {
                "passed": bool(fin), "bytes": fin.get("bytes"), "units": counts, "kv": fin.get("kv_cache"),
                "rounds": [{"bytes": x["bytes"], "damage": round(x["damage"], 5), "passed": x["passed"],
                            "failures": x["failures"]} for x in rep["trials"]],
                "tune_s": round(t, 1), "sensitivity_s": round(rep.get("timings", {}).get("sensitivity", 0), 1),
                "reference_s": round(ref, 1), "ratio": round(t / ref, 2) if ref else None,
                "frontier_points": len(rep.get("frontier", [])), "error": rep.get("error"),
            }
            print(b, res["tuned"][str(b)], flush=True)
        res["gate_cached_s"] = round(gate_cached, 2)
    Path(a.out).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
