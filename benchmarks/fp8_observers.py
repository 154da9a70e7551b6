"""Static FP8 activation scales on the real model: qtk's observer against llm-compressor's moving-average one.

    nice .venv/bin/python benchmarks/fp8_observers.py [--num-samples 8] [--seq-len 512] [--ppl-tokens 2044]

qtk's static activation scale is amax / 448 with amax the largest |x| over every calibration token (the same
statistic as llm-compressor's "static_minmax", the observer its FP8 preset names). llm-compressor's "minmax"
observer, its default for static activations when a scheme names none, keeps a moving average instead: per
calibration batch (one sample: oneshot's default batch size) the batch's min and max, then
min <- min + 0.01 * (batch_min - min) (likewise max), amax = max(|min|, |max|).

To compare the statistics and nothing else, both are taken from the same activations: every targeted Linear's
input in the unquantized bf16 model, one calibration sample at a time (hooks, no quantization). The fp8
recipe's checkpoint is written once by qtk (same calibration ids); two copies get their input_scale tensors
replaced by each observer's amax / 448, and qtk's own checkpoint is scored too. Perplexity as in
benchmarks/real_model.py (qtk's simulated model: fp8 weights, activations fake-quantized with the static scales).
Output: benchmarks/results/fp8_observers.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

FP8_MAX = 448.0
AVG = 0.01  # llm-compressor's MinMaxObserver averaging_constant default


def observe(model_dir: Path, ids, targets: list[str]) -> dict[str, dict[str, float]]:
    """Per Linear: the running max of |x| and llm-compressor's moving-average amax, one sample per batch."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    stats: dict[str, dict] = {}

    def hook(name):
        def fn(mod, args):
            x = args[0].float()
            lo, hi = float(x.min()), float(x.max())
            s = stats.get(name)
            if s is None:
                stats[name] = {"static": max(-lo, hi), "min": lo, "max": hi}
            else:
                s["static"] = max(s["static"], -lo, hi)
                s["min"] += AVG * (lo - s["min"])  # lerp, as llm-compressor's MinMaxObserver
                s["max"] += AVG * (hi - s["max"])
        return fn

    handles = [model.get_submodule(n).register_forward_pre_hook(hook(n)) for n in targets]
    with torch.inference_mode():
        for row in ids:
            model(input_ids=row[None])
    for h in handles:
        h.remove()
    return {n: {"static": s["static"], "moving_average": max(-s["min"], s["max"])} for n, s in stats.items()}


def with_scales(src: Path, dst: Path, amax: dict[str, float]) -> Path:
    """A copy of the checkpoint src whose input_scale tensors are amax / 448 per module."""
    import torch
    from safetensors.torch import load_file, save_file

    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        sd = load_file(str(f))
        for k in [k for k in sd if k.endswith(".input_scale")]:
            sd[k] = torch.tensor(amax[k[: -len(".input_scale")]] / FP8_MAX, dtype=sd[k].dtype).reshape(sd[k].shape)
        save_file(sd, str(f), metadata={"format": "pt"})
    return dst


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-samples", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-tokens", type=int, default=2044)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=HERE / "results" / "tmp" / "fp8_observers")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "fp8_observers.json")
    a = ap.parse_args()
    t0 = time.perf_counter()
    import torch
    from transformers import AutoTokenizer

    import real_model as bench  # benchmarks/real_model.py: perplexity windows and scoring
    from qtk.api import convert
    from qtk.calib import calibration_ids, ids_hash, load_texts
    from qtk.export import open_checkpoint

    torch.set_num_threads(a.threads)
    model = bench._load_script("real_model").real_model_dir()
    tok = AutoTokenizer.from_pretrained(model)
    ids = calibration_ids(tok, load_texts(str(bench.TEXT / "calib.jsonl")), a.num_samples, a.seq_len, a.seed)
    windows, _ = bench.heldout_windows(tok, a.ppl_tokens, a.seq_len)
    a.work.mkdir(parents=True, exist_ok=True)
    out = a.work / "qtk-fp8"
    shutil.rmtree(out, ignore_errors=True)
    ck_dir = convert(model, "fp8", out, calib_ids=ids, hash_source=False).outputs["vllm"]
    ck = open_checkpoint(ck_dir)
    targets = ck.modules()
    obs = observe(model, ids, targets)
    qtk_amax = {m: float(ck.input_scale(m).float().max()) * FP8_MAX for m in targets}
    result = {"qtk_checkpoint": bench.checkpoint_ppl(ck_dir, windows)}
    for kind in ("static", "moving_average"):
        d = with_scales(ck_dir, a.work / f"fp8-{kind}", {m: obs[m][kind] for m in targets})
        result[kind] = bench.checkpoint_ppl(d, windows)
    ratio = [obs[m]["moving_average"] / obs[m]["static"] for m in targets]
    qtk_vs_static = [qtk_amax[m] / obs[m]["static"] for m in targets]
    report = {
        "benchmark": "benchmarks/fp8_observers.py", "command": " ".join(["nice", ".venv/bin/python", *sys.argv]),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "settings": {"num_samples": a.num_samples, "seq_len": a.seq_len, "seed": a.seed, "calib_ids_sha256_16": ids_hash(ids),
                     "heldout_tokens": windows.numel() - len(windows), "averaging_constant": AVG},
        "perplexity": {"qtk checkpoint (static amax, observed with earlier layers quantized)": round(result["qtk_checkpoint"], 4),
                       "static amax (llm-compressor static_minmax; unquantized-model activations)": round(result["static"], 4),
                       "moving average (llm-compressor minmax; unquantized-model activations)": round(result["moving_average"], 4)},
        "moving_average_over_static_amax": {"min": round(min(ratio), 4), "median": round(sorted(ratio)[len(ratio) // 2], 4),
                                            "max": round(max(ratio), 4)},
        "qtk_amax_over_unquantized_static_amax": {"min": round(min(qtk_vs_static), 4), "max": round(max(qtk_vs_static), 4)},
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
