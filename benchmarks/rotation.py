"""Offline Hadamard rotations on the real model: held-out perplexity of each base recipe and its rotated variant
(the same recipe with `rotate: {seed: 0}` listed first; w4a16-gptq's is the built-in w4a16-rot-gptq), converted from
the same calibration token ids, and what the rotate step costs next to GPTQ's step (time and peak memory, per step,
summed over the layers).

    QTK_REAL_MODEL_DIR=/work/main/.cache/real-model nice .venv/bin/python benchmarks/rotation.py \
        [--bases w4a16-gptq nvfp4-gptq w4a16 nvfp4-a16 w8a16] [--num-samples 16] [--seq-len 512]

Model, texts, calibration ids, group sizes (64 for int4: 128 does not divide hidden 576) and the perplexity
method are benchmarks/real_model.py's (its functions, reused): held-out perplexity through qtk's reader and
simulated model, fp32, activations fake-quantized as vLLM does. Each conversion is a child process measured for
wall time and peak RSS; inside it every step's run on every layer is timed, and its peak RSS measured
(/proc/self/clear_refs resets the high-water mark before each step; the figure is the peak during the step less
the RSS it started from). Output: benchmarks/results/rotation.json and the table in docs/real-model.md between
its rotation markers.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_model as rm  # noqa: E402  (model, texts, recipes' group sizes, perplexity)
import vs_llmcompressor as vsl  # noqa: E402  (measured child processes)

BASES = ("w4a16-gptq", "nvfp4-gptq")


# the rotations each base recipe is run with, listed before its own steps: offline R1/R2 (`rotate`), R4 on
# down_proj's input applied by the engine at run time (`rotate_online`: one Hadamard of the MLP width, or
# block-diagonal ones of an FP4 group's order), both, and every Linear's input within FP4 groups of 16
VARIANTS = {
    "rotate": [{"rotate": {"seed": 0}}],
    "rotate_online": [{"rotate_online": {"seed": 1}}],
    "rotate + rotate_online": [{"rotate": {"seed": 0}}, {"rotate_online": {"seed": 1}}],
    "rotate_online block 16": [{"rotate_online": {"seed": 1, "block": 16}}],
    "rotate_online all block 16": [{"rotate_online": {"seed": 1, "block": 16, "modules": "all"}}],
}


def rotated(doc: dict, variant: str = "rotate") -> dict:
    """The recipe with the variant's rotation steps listed first."""
    return {**doc, "name": f"{doc['name']} + {variant}", "algorithm": [*VARIANTS[variant], *doc["algorithm"]]}


def _file_name(name: str) -> str:
    return name.replace(" + ", "+").replace(" ", "-")


def _rss_kb(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def timed_steps() -> dict:
    """Wrap every registered step's run: seconds and peak extra RSS (MB) per step name, summed / maxed over layers."""
    from dataclasses import replace

    from qtk.steps import STEPS

    out: dict = {}
    for name in list(STEPS):
        d = STEPS[name]

        def run(ctx, params, _run=d.run, _name=name):
            try:
                Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
            except OSError:
                pass
            before = _rss_kb("VmRSS")
            t0 = time.perf_counter()
            r = _run(ctx, params)
            e = out.setdefault(_name, {"s": 0.0, "peak_extra_rss_mb": 0.0, "layers": 0})
            e["s"] += time.perf_counter() - t0
            e["layers"] += 1
            e["peak_extra_rss_mb"] = max(e["peak_extra_rss_mb"], (_rss_kb("VmHWM") - before) / 1024)
            return r

        STEPS.remove(name)
        STEPS.add(name, replace(d, run=run))
    return out


def child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="rotation.py _qtk")
    for k in ("--model", "--ids", "--recipe", "--out"):
        ap.add_argument(k, required=True)
    a = ap.parse_args(argv)
    import torch

    from qtk.api import convert
    from qtk.recipe import parse_recipe

    steps = timed_steps()
    doc = json.loads(Path(a.recipe).read_text())
    recipe = parse_recipe(doc, json.dumps(doc), _file_name(doc["name"]))
    ids = torch.load(a.ids, weights_only=True)
    t0 = time.perf_counter()
    res = convert(a.model, recipe, a.out, targets=["vllm"], calib_ids=ids if recipe.needs_calibration else None,
                  hash_source=False)
    (Path(a.out) / "timings.json").write_text(json.dumps({**res.timings, "total_in_process": time.perf_counter() - t0,
                                                           "steps": steps}))


def frame_check(model_dir: Path, ids, layers=(0, 5, 15, 29)) -> dict:
    """Where a weight's error falls, per norm: with each element's error proportional to its weight's scale, the output
    error energy unrotated is Σ g_j² x̂_j² (x̂ the normalized input before the norm's scale g), rotated (g folded, the
    error spread evenly over the channels) mean(g²) Σ x̂_j²; their ratio, and the largest input channel with its g."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    stats = {}

    def hook(name):
        def f(mod, inp, out):
            x = inp[0].float()
            xh = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
            stats[name] = (xh.pow(2).mean((0, 1)).sqrt(), mod.weight.detach().float())
        return f

    for i in layers:
        for n in ("input_layernorm", "post_attention_layernorm"):
            m.model.layers[i].get_submodule(n).register_forward_hook(hook(f"layer {i} {n}"))
    with torch.no_grad():
        m(ids[:2, :256])
    out = {}
    for k, (rms, g) in stats.items():
        j = int(rms.argmax())
        out[k] = {"rotated_over_unrotated": round(float((g ** 2).mean() * (rms ** 2).sum() / (g ** 2 * rms ** 2).sum()), 3),
                  "largest_channel": j, "its_rms": round(float(rms[j]), 2), "median_rms": round(float(rms.median()), 3),
                  "its_g": round(float(g[j]), 4), "median_abs_g": round(float(g.abs().median()), 4)}
    return out


def render(report: dict) -> str:
    s = report["settings"]
    lines = [f"{s['num_samples']} x {s['seq_len']} calibration token ids shared by every conversion; held-out perplexity "
             f"over {report['perplexity_tokens']} tokens (unquantized: {report['unquantized_perplexity']:.3f}); "
             f"`nice`, {s['threads']} threads on a shared 2-core machine (times are indicative).", "",
             "| recipe | held-out ppl | convert wall s | convert peak RSS MB | rotate step s | rotate step peak +RSS MB "
             "| rotate_online step s | GPTQ step s | GPTQ step peak +RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, e in report["recipes"].items():
        st = e.get("steps", {})

        def step(n, k, fmt):
            return fmt.format(st[n][k]) if n in st else "—"

        group = f" (group {e['group_size']})" if e.get("group_size") else ""
        lines.append(f"| `{name}`{group} | {e['perplexity']:.3f} | {e['wall_s']:.0f} | "
                     f"{e['peak_rss_mb']:.0f} | {step('rotate', 's', '{:.1f}')} | "
                     f"{step('rotate', 'peak_extra_rss_mb', '{:.0f}')} | {step('rotate_online', 's', '{:.1f}')} | "
                     f"{step('gptq', 's', '{:.1f}')} | {step('gptq', 'peak_extra_rss_mb', '{:.0f}')} |")
    return "\n".join(lines)


def write_doc(table: str) -> None:
    rm.write_marked("rotation", table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bases", nargs="+", default=list(BASES), help="built-in recipes, each run as it is and rotated")
    ap.add_argument("--variants", nargs="+", default=["rotate"], choices=list(VARIANTS),
                    help="the rotations each base is run with (beside the base itself, unless --no-plain)")
    ap.add_argument("--no-plain", action="store_true", help="skip the base recipes themselves (kept from the JSON)")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--frame-check", action="store_true", help="only the per-norm error-energy estimate, into the JSON")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "tmp" / "rotation")
    ap.add_argument("--json", type=Path, default=HERE / "results" / "rotation.json")
    a = ap.parse_args()
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = str(a.threads)
    import torch
    from transformers import AutoModelForCausalLM

    from qtk.calib import ids_hash
    from qtk.convert.manifest import versions

    model, cfg, in_features, tok, ids, ids_file = rm.model_and_ids(a, a.work)
    if a.frame_check:
        report = json.loads(a.json.read_text())
        report["frame_check"] = frame_check(model, ids)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
        print(json.dumps(report["frame_check"], indent=1))
        return
    windows, _ = rm.heldout_windows(tok, a.ppl_tokens, a.seq_len)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    base_ppl = rm.perplexity(base, windows)
    del base
    print(f"unquantized perplexity {base_ppl:.4f}", flush=True)
    results = {}
    prev = json.loads(a.json.read_text()) if a.json.is_file() else {}
    if prev.get("settings", {}).get("calib_ids_sha256_16") == ids_hash(ids):
        results = dict(prev.get("recipes", {}))  # entries of bases not run this time are kept
    for base in a.bases:
        plain = rm.qtk_recipe_doc(base, in_features)
        for doc in ([] if a.no_plain else [plain]) + [rotated(plain, v) for v in a.variants]:
            name = doc["name"]
            out = a.work / _file_name(name)
            rfile = a.work / f"{_file_name(name)}.recipe.json"
            rfile.write_text(json.dumps(doc))
            import shutil

            shutil.rmtree(out, ignore_errors=True)
            wall, rss = vsl.run_measured([sys.executable, str(Path(__file__).resolve()), "_qtk", "--model", str(model),
                                          "--ids", str(ids_file), "--recipe", str(rfile), "--out", str(out)],
                                         a.work / f"{_file_name(name)}.log")
            t = json.loads((out / "vllm" / "timings.json").read_text()) if (out / "vllm" / "timings.json").is_file() \
                else json.loads((out / "timings.json").read_text())
            ppl = rm.checkpoint_ppl(out / "vllm", windows)
            steps = {k: {"s": round(v["s"], 2), "peak_extra_rss_mb": round(v["peak_extra_rss_mb"]), "layers": v["layers"]}
                     for k, v in t["steps"].items()}
            results[name] = {"perplexity": round(ppl, 4), "wall_s": round(wall, 1), "peak_rss_mb": round(rss / 1e6),
                             "group_size": doc["weights"].get("group_size"), "steps": steps}
            print(name, results[name], flush=True)
            report = {"benchmark": "benchmarks/rotation.py",
                      "command": " ".join(["nice", ".venv/bin/python", "benchmarks/rotation.py", *sys.argv[1:]]),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(),
                      "machine": {"cpus": os.cpu_count(), "loadavg_1_5_15_now": [round(x, 2) for x in os.getloadavg()]},
                      "model": {"name": "SmolLM2-135M-Instruct", **vsl.shape_of(model)},
                      "settings": {"num_samples": a.num_samples, "seq_len": a.seq_len, "seed": a.seed,
                                   "threads": a.threads, "calib_ids_sha256_16": ids_hash(ids)},
                      "perplexity_tokens": windows.numel() - len(windows),
                      "unquantized_perplexity": round(base_ppl, 4), "recipes": results}
            a.json.write_text(json.dumps(report, indent=2) + "\n")
            write_doc(render(report))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_qtk":
        child(sys.argv[2:])
    else:
        main()
