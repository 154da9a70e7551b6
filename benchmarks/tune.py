"""qtk tune on the example model or the real one: the tuned checkpoint against the uniform recipes at two budgets,
and the cost of tuning against one GPTQ conversion plus the gate runs tune makes (goal: ratio <= 3).

    python benchmarks/tune.py [--candidates w4a16,w8a16,bf16] [--budgets 800000,1049000] [--limit 100]
                              [--num-samples 64 --seq-len 128] [--max-rounds 4]
    python benchmarks/tune.py --model real [--budgets ...] [--limit 16]     # SmolLM2-135M (docs/real-model.md)

--model real: scripts/real_model.py's model ($QTK_REAL_MODEL_DIR), the gate examples/real_text/tasks.yaml
(perplexity on held-out passages, strict), candidates examples/real_text/recipes/w4a16-g64.yaml,w8a16,bf16 (int4
needs group 64: 576 is not a multiple of 128), calibration 16 x 256 tokens of examples/real_text/calib.jsonl, and no
GPTQ reference conversion unless --reference names one (w4a16-gptq at group 64 takes most of an hour on 2 CPU cores),
so no cost ratio. Writes benchmarks/results/tune_real.json and copies each budget's frontier plot beside it.

For each uniform candidate recipe: convert (same calibration as tune), gate against examples/tasks.yaml, record bytes
and verdict. For each budget: qtk tune with that --max-weight-bytes; its final bytes, verdict and rounds. Cost:
tune's wall time / (one w4a16-gptq conversion + rounds × one gate run with the baseline cached), both measured here in the same process.
Writes benchmarks/results/tune.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import ROOT  # noqa: E402

EXAMPLE = ROOT / "examples" / "tiny-llama"
TASKS = ROOT / "examples" / "tasks.yaml"
REAL_TEXT = ROOT / "examples" / "real_text"
# per --model: model dir (None: built by scripts/real_model.py), tasks, candidates, budgets, calibration, reference
SETUPS = {
    "tiny": dict(model=EXAMPLE, tasks=TASKS, candidates="w4a16,w8a16,bf16", budgets="800000,1049000", limit=100,
                 num_samples=64, seq_len=128, calib=None, reference="w4a16-gptq", out="tune.json"),
    "real": dict(model=None, tasks=REAL_TEXT / "tasks.yaml",
                 candidates=f"{REAL_TEXT / 'recipes' / 'w4a16-g64.yaml'},w8a16,bf16", budgets="100000000,125000000",
                 limit=16, num_samples=16, seq_len=256, calib=str(REAL_TEXT / "calib.jsonl"), reference="none",
                 out="tune_real.json"),
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(SETUPS), default="tiny", help="examples/tiny-llama or the real model")
    ap.add_argument("--budgets")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--num-samples", type=int)
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--max-rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--candidates")
    ap.add_argument("--reference", help="recipe converted once for the cost ratio; 'none' skips it")
    ap.add_argument("--strict", action="store_true", help="judge point estimates (qtk eval --strict; always with --model real)")
    ap.add_argument("--out")
    a = ap.parse_args()
    setup = SETUPS[a.model]
    for k in ("budgets", "limit", "num_samples", "seq_len", "candidates", "reference"):
        if getattr(a, k) is None:
            setattr(a, k, setup[k])
    out_json = Path(a.out or ROOT / "benchmarks" / "results" / setup["out"])
    if a.model == "real":
        sys.path.insert(0, str(ROOT / "scripts"))
        from real_model import real_model_dir

        model = real_model_dir(build_if_missing=False)
        if model is None:
            sys.exit("error: the real model is not built — run python scripts/real_model.py (set QTK_REAL_MODEL_DIR)")
        a.strict = True  # the gate file is written for point estimates (its comment says why)
    else:
        model = setup["model"]
    tasks, calib = setup["tasks"], setup["calib"]

    import torch

    from qtk import api
    from qtk.eval.api import run_gate
    from qtk.plan.memory import ModelShape, read_config, weight_bytes
    from qtk.recipe import load_recipe

    torch.set_num_threads(a.threads)
    shape = ModelShape.from_config(read_config(model))
    res: dict = {"model": "examples/tiny-llama" if a.model == "tiny" else model.name,
                 "tasks": str(Path(tasks).relative_to(ROOT)), "limit": a.limit, "candidates": [Path(c).stem for c in a.candidates.split(",")],
                 "calibration": [a.num_samples, a.seq_len] + ([str(Path(calib).relative_to(ROOT))] if calib else []),
                 "strict": a.strict, "threads": a.threads, "uniform": {}, "tuned": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # the reference conversion (w4a16-gptq) with the same calibration
        t_gptq = None
        if a.reference != "none":
            t0 = time.perf_counter()
            api.convert(model, a.reference, tmp / "ref", calib=calib, num_samples=a.num_samples, seq_len=a.seq_len,
                        hash_source=False)
            t_gptq = time.perf_counter() - t0
            res["gptq_convert_s"] = round(t_gptq, 2)
        # warm the baseline cache, so no measurement below pays for the baseline's evaluation
        cands = a.candidates.split(",")
        for name in [c for c in cands if c != "bf16"]:
            t0 = time.perf_counter()
            data = load_recipe(name).needs_calibration
            out = api.convert(model, name, tmp / Path(name).stem, calib=calib if data else None,
                              num_samples=a.num_samples if data else None, seq_len=a.seq_len if data else None,
                              hash_source=False).outputs["vllm"]
            t_conv = time.perf_counter() - t0
            t0 = time.perf_counter()
            g = run_gate(out, model, tasks, limit=a.limit, threads=a.threads, strict=a.strict)
            t_gate = time.perf_counter() - t0
            res["uniform"][Path(name).stem] = {"bytes": weight_bytes(shape, load_recipe(name)).total, "passed": g.passed,
                                    "failures": g.failures, "convert_s": round(t_conv, 2), "gate_s": round(t_gate, 2)}
            print(name, res["uniform"][Path(name).stem], flush=True)
        res["uniform"]["bf16"] = {"bytes": weight_bytes(shape, None).total, "passed": True}
        # the gate again, now with the baseline cached (what every tune round pays; only the cost ratio needs it)
        gate_cached = None
        if t_gptq is not None:
            t0 = time.perf_counter()
            run_gate(tmp / Path(cands[0]).stem / "vllm", model, tasks, limit=a.limit, threads=a.threads, strict=a.strict)
            gate_cached = time.perf_counter() - t0
        for b in [int(x) for x in a.budgets.split(",")]:
            t0 = time.perf_counter()
            try:
                r = api.tune(model, tasks, tmp / f"tune-{b}", candidates=cands, max_weight_bytes=b, max_rounds=a.max_rounds,
                             calib=calib, num_samples=a.num_samples, seq_len=a.seq_len, limit=a.limit, threads=a.threads, strict=a.strict,
                             progress=lambda s: print(f"  [{b}] {s}", flush=True) if s.startswith(("round", "sens", "front")) else None)
                rep = r.report
            except Exception as e:  # a budget nothing passes within is a result too
                rep = {"error": str(e), "trials": [], "final": None, "timings": {}}
            t = time.perf_counter() - t0
            rounds = len(rep["trials"])
            ref = t_gptq + rounds * gate_cached if t_gptq is not None else None
            fin = rep.get("final") or {}
            counts: dict[str, int] = {}
            for c in (fin.get("units") or {}).values():
                counts[Path(c).stem] = counts.get(Path(c).stem, 0) + 1
            res["tuned"][str(b)] = {
                "passed": bool(fin), "bytes": fin.get("bytes"), "units": counts, "kv": fin.get("kv_cache"),
                "rounds": [{"bytes": x["bytes"], "damage": round(x["damage"], 5), "passed": x["passed"],
                            "failures": x["failures"]} for x in rep["trials"]],
                "tune_s": round(t, 1), "sensitivity_s": round(rep.get("timings", {}).get("sensitivity", 0), 1),
                "reference_s": round(ref, 1) if ref else None, "ratio": round(t / ref, 2) if ref else None,
                "frontier_points": len(rep.get("frontier", [])), "error": rep.get("error"),
            }
            if "uniform" in rep:
                res["tuned"][str(b)]["uniform_damage"] = {Path(u["recipe"]).stem: round(u["damage"], 5) for u in rep["uniform"]}
            png = tmp / f"tune-{b}" / "frontier.png"
            if png.is_file():  # the plot outlives the temporary directory beside the JSON
                keep = out_json.with_name(f"{out_json.stem}_frontier_{b}.png")
                shutil.copyfile(png, keep)
                res["tuned"][str(b)]["frontier_png"] = str(keep.relative_to(ROOT) if keep.is_relative_to(ROOT) else keep)
            print(b, res["tuned"][str(b)], flush=True)
            out_json.write_text(json.dumps(res, indent=2) + "\n")  # each budget as it finishes: a long run keeps its results
        res["gate_cached_s"] = round(gate_cached, 2) if gate_cached is not None else None
    out_json.write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
