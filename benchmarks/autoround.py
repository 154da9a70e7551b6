"""AutoRound (the `autoround` step) on the real model: held-out perplexity of w4a16-autoround next to w4a16-gptq and
round-to-nearest (w4a16), converted from the same calibration token ids, and what the autoround step costs next to
GPTQ's step (time and peak memory, per step, summed over the layers).

    QTK_REAL_MODEL_DIR=... nice .venv/bin/python benchmarks/autoround.py [--recipes w4a16 w4a16-gptq w4a16-autoround]
        [--iters 200] [--batch-size 8] [--num-samples 16] [--seq-len 512] [--text a|b]

A recipe name may carry a variant: `NAME:target=layer` sets the solver step's parameters (autoround's, gptq's or awq's;
here autoround's target: the layer's own float outputs instead of the float model's stream; `w4a16-gptq:full_range=true`
GPTQ on the full-range grid) or the weights scheme's (`w4a16:observer=full_range`: round-to-nearest on that grid), `NAME+rotate` lists the offline rotations (R1/R2,
seed 0) before its steps, as benchmarks/rotation.py's `+ rotate` (any of its variants; or benchmarks/real_model.py's
`+quipN`: every quantized Linear's input rotated online in blocks of N), and `NAME/autoround` solves the built-in recipe's
formats with autoround instead of its own solver (e.g. `nvfp4/autoround`: NVFP4 W4A4 learned; `nvfp4/awq,autoround`:
AWQ's scales first); `NAME/float-weights` converts nothing and scores the float model with only the recipe's
activation quantization (what no weight solver goes below without changing the activations;
`NAME/float-weights:o_proj,down_proj` quantizes only those Linears' inputs). --text b calibrates and scores on the second text
set (benchmarks/real_model.py's), into benchmarks/results/autoround_b.json and its own table. --peer-python runs
intel/auto-round itself on the same ids (benchmarks/_autoround_peer.py): W4A16, or with --peer-scheme NVFP4 its own
NVFP4 W4A4 scheme, beside `nvfp4/autoround`.

Model, texts, calibration ids, group sizes (64 for int4: 128 does not divide hidden 576) and the perplexity method
are benchmarks/real_model.py's (held-out perplexity through qtk's reader and simulated model, fp32); the measured
child processes and per-step timing (seconds, peak extra RSS) are benchmarks/rotation.py's. --iters overrides the
autoround step's iterations (its learning rate stays 1/iters, auto-round's rule); --batch-size is the conversion's
calibration batch, which is also AutoRound's batch per step (auto-round's default 8). On the shared 2-core machine
the defaults (200 iterations of 8 windows per layer) take hours: the reduced settings used are in the JSON and in
docs/real-model.md. Output: benchmarks/results/autoround.json and the table in docs/real-model.md between its
autoround markers.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import real_model as rm  # noqa: E402  (model, texts, recipes' group sizes, perplexity)
import rotation as rot  # noqa: E402  (per-step timing)
import vs_llmcompressor as vsl  # noqa: E402  (measured child processes)

RECIPES = ("w4a16", "w4a16-gptq", "w4a16-autoround")


def child(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(prog="autoround.py _qtk")
    for k in ("--model", "--ids", "--recipe", "--out", "--batch-size"):
        ap.add_argument(k, required=True)
    a = ap.parse_args(argv)
    import torch

    from qtk.api import convert
    from qtk.recipe import parse_recipe

    steps = rot.timed_steps()
    doc = json.loads(Path(a.recipe).read_text())
    recipe = parse_recipe(doc, json.dumps(doc), doc["name"])
    ids = torch.load(a.ids, weights_only=True)
    t0 = time.perf_counter()
    res = convert(a.model, recipe, a.out, targets=["vllm"], calib_ids=ids if recipe.needs_calibration else None,
                  hash_source=False, batch_size=int(a.batch_size))
    (Path(a.out) / "timings.json").write_text(json.dumps({**res.timings, "total_in_process": time.perf_counter() - t0,
                                                           "steps": steps}))


def with_iters(doc: dict, iters: int | None) -> dict:
    """The recipe with the autoround step's iterations set (lr then 1/iters, as the step's default)."""
    if iters is None:
        return doc
    algo = [{"autoround": {**s["autoround"], "iters": iters}} if isinstance(s, dict) and "autoround" in s else s
            for s in doc["algorithm"]]
    return {**doc, "algorithm": algo}


def variant_doc(name: str, in_features) -> dict:
    """The recipe document a benchmark name stands for: a built-in recipe, `+rotate` for the offline rotations listed
    first, `:key=value,...` for the solver step's parameters, autoround's or gptq's (values read as YAML)."""
    import yaml

    base, _, params = name.partition(":")
    base, plus, extra = base.partition("+")
    base, slash, solver = base.partition("/")
    doc = rm.qtk_recipe_doc(base, in_features)
    if slash:  # the recipe's steps before its solver, then `solver` (autoround: the recipe's formats, learned;
        # `awq,gptq`: several steps in that order)
        kept = [s for s in doc.get("algorithm", []) if (next(iter(s)) if isinstance(s, dict) else s)
                not in ("rtn", "gptq", "awq", "autoround")]
        doc["algorithm"] = [*kept, *({n: {}} for n in solver.split(","))]
    if plus:  # one of rotation.py's variants, or real_model.py's (`quipN`, `@SEED`)
        doc = rot.rotated(doc, extra) if extra in rot.VARIANTS else \
            {**doc, "algorithm": [*rm.rotation_steps(extra, name), *doc["algorithm"]]}
    if params:  # the solver step's parameters (autoround, gptq or awq), or the weights scheme's (observer=...)
        kv = {k: yaml.safe_load(v) for k, v in (p.split("=", 1) for p in params.split(","))}
        doc["weights"] = {**doc["weights"], **{k: v for k, v in kv.items() if k in _scheme_keys()}}
        algo = [s if isinstance(s, dict) else {s: {}} for s in doc["algorithm"]]
        doc["algorithm"] = [{n: {**(p or {}), **{k: v for k, v in kv.items() if takes(n, k)}}} for (n, p), in
                            (a.items() for a in algo)]
    return {**doc, "name": _file_safe(name)}


def takes(step: str, key: str) -> bool:
    """Whether the recipe step `step` (autoround, gptq or awq) has the parameter `key`."""
    from dataclasses import fields

    from qtk.recipe.params import STEP_PARAMS

    return step in ("autoround", "gptq", "awq") and key in {f.name for f in fields(STEP_PARAMS[step])}


def _scheme_keys() -> set[str]:
    from dataclasses import fields

    from qtk.quant.scheme import QuantScheme

    return {f.name for f in fields(QuantScheme)}


def _file_safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)


def losses(out: Path) -> dict:
    """Per layer, the autoround record's first and lowest single-batch loss (and with keep: all, the kept
    parameters' loss over every batch), from the checkpoint's qtk.json."""
    m = json.loads((out / "vllm" / "qtk.json").read_text())
    recs = {k: v["autoround"] for k, v in m["stats"]["algorithm"].items() if "autoround" in v}
    return {k: {"initial": round(v["initial_loss"], 6), "best": round(v["best_loss"], 6), "best_iter": v["best_iter"],
                **({"kept_all_batches": round(v["kept_loss"], 6)} if v.get("kept_loss") else {})}
            for k, v in sorted(recs.items(), key=lambda kv: int(kv[0]))}


def threads_used(report: dict) -> str:
    """The thread counts the rows ran with (each entry's `threads`): a different --threads changes only the order
    of float sums, so rows of several counts share one table."""
    n = sorted({e["threads"] for e in report["recipes"].values() if "threads" in e})
    if len(n) == 1:
        return f"{n[0]} thread{'s' if n[0] > 1 else ''}"
    return f"{', '.join(map(str, n))} threads (each row's in the JSON)" if n else "threads not recorded"


def render(report: dict) -> str:
    s = report["settings"]
    text = f"Text set {s['text']} (calib.jsonl to calibrate, heldout.jsonl scored). " if s.get("text") else ""
    learned = any("autoround" in e.get("steps", {}) or e.get("peer") for e in report["recipes"].values())
    iters = f"; autoround with {s['iters']} iterations per layer (lr 1/iters)" if learned else ""
    lines = [f"{text}{s['num_samples']} x {s['seq_len']} calibration token ids shared by every conversion (batches of "
             f"{s['batch_size']}){iters}; held-out perplexity "
             f"over {report['perplexity_tokens']} tokens in windows of {s['ppl_seq_len']} (unquantized: {report['unquantized_perplexity']:.3f}); "
             f"`nice`, {threads_used(report)} on a shared 2-core machine (times are indicative).", "",
             "| recipe | held-out ppl | convert wall s | convert peak RSS MB | solver step s | solver step peak +RSS MB "
             "| layer output MSE, first -> kept (mean over layers) |", "|---|---|---|---|---|---|---|"]
    notes: list[str] = []
    for name, e in report["recipes"].items():
        st = e.get("steps", {})
        solver = next((n for n in ("autoround", "gptq", "awq", "rtn") if n in st), None)
        group = f" (group {e['group_size']})" if e.get("group_size") else ""
        ls = e.get("layer_losses")
        mse = "—"
        if ls:
            first = sum(v["initial"] for v in ls.values()) / len(ls)
            best = sum(v["best"] for v in ls.values()) / len(ls)
            mse = f"{first:.4g} -> {best:.4g}"
        label = f"{e['peer']} (peer){group}" if e.get("peer") else f"`{name}`{group}"
        if e.get("measured_with"):  # code other than the file's command ran it: the note under the table says which
            if e["measured_with"] not in notes:
                notes.append(e["measured_with"])
            label += f" [{notes.index(e['measured_with']) + 1}]"
        if e.get("activations_only"):
            sites = floor_sites(name)[1]
            what = f"only the inputs of {', '.join(sites)} quantized" if sites else \
                "the recipe's activation quantization alone"
            lines.append(f"| `{name}` (float weights, {what}) | {e['perplexity']:.3f} | — | — | — | — | — |")
            continue
        lines.append(f"| {label} | {e['perplexity']:.3f} | {e['wall_s']:.0f} | {e['peak_rss_mb']:.0f} | "
                     f"{'—' if solver is None else format(st[solver]['s'], '.1f') + f' ({solver})'} | "
                     f"{'—' if solver is None else format(st[solver]['peak_extra_rss_mb'], '.0f')} | {mse} |")
    if notes:
        lines += ["", *(f"- [{i}] {n}" for i, n in enumerate(notes, 1))]
    return "\n".join(lines)


MARK = "autoround"  # the table's markers in docs/real-model.md (autoround-b for --text b)


def write_doc(table: str) -> None:
    rm.write_marked(MARK, table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="*", default=list(RECIPES), help="none with --peer-python: the peer alone")
    ap.add_argument("--iters", type=int, default=None, help="the autoround step's iterations (default: the recipe's)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-tokens", type=int, default=4096)
    ap.add_argument("--ppl-seq-len", type=int, default=512, help="held-out window length (the other tables' 512)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (recorded per entry: rows of several counts "
                    "share one results file)")
    ap.add_argument("--replace", action="store_true", help="start the results file over when it holds entries "
                    "measured with other settings (refused otherwise)")
    ap.add_argument("--peer-python", type=Path, default=None,
                    help="a python with PyPI auto-round installed (a throwaway venv): also run intel/auto-round itself "
                         "on the same ids (benchmarks/_autoround_peer.py)")
    ap.add_argument("--peer-scheme", choices=["W4A16", "NVFP4"], default="W4A16",
                    help="the peer's scheme: W4A16 (w4a16-autoround's group size) or its own NVFP4 (W4A4)")
    ap.add_argument("--text", choices=sorted(rm.TEXT_SETS), default="a",
                    help="text set (benchmarks/real_model.py's): a = licences / US Constitution, b = Debian handbook / "
                         "Python tutorial")
    ap.add_argument("--work", type=Path, default=None, help="[benchmarks/results/tmp/autoround, autoround_b with --text b]")
    ap.add_argument("--json", type=Path, default=None, help="[benchmarks/results/autoround.json, autoround_b.json with "
                    "--text b]")
    a = ap.parse_args()
    global MARK
    rm.TEXT = rm.ROOT / "examples" / rm.TEXT_SETS[a.text][0]
    suffix = "" if a.text == "a" else f"_{a.text}"
    a.work = a.work or HERE / "results" / "tmp" / f"autoround{suffix}"
    a.json = a.json or HERE / "results" / f"autoround{suffix}.json"
    MARK = a.json.stem.replace("_", "-")  # each results file its own table in docs/real-model.md
    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[k] = str(a.threads)
    import torch
    from transformers import AutoModelForCausalLM

    from qtk.calib import ids_hash

    model, cfg, in_features, tok, ids, ids_file = rm.model_and_ids(a, a.work)
    settings = {"num_samples": a.num_samples, "seq_len": a.seq_len, "seed": a.seed, "batch_size": a.batch_size,
                "iters": a.iters or 200, "ppl_seq_len": a.ppl_seq_len, "calib_ids_sha256_16": ids_hash(ids),
                **({"text": f"examples/{rm.TEXT.name}"} if a.text != "a" else {})}
    prev = json.loads(a.json.read_text()) if a.json.is_file() else {}
    results = rm.kept_entries(a.json, prev, settings, prev.get("settings", {}), a.replace)
    windows, _ = rm.heldout_windows(tok, a.ppl_tokens, a.ppl_seq_len)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    base_ppl = rm.perplexity(base, windows)
    del base
    print(f"unquantized perplexity {base_ppl:.4f}", flush=True)
    peer = "auto-round (peer)" if a.peer_scheme == "W4A16" else f"auto-round {a.peer_scheme} (peer)"
    runs = [*a.recipes, *([peer] if a.peer_python else [])]
    for name in runs:
        if name == peer:
            results[name] = {**run_peer(a, model, ids_file, in_features, windows), "threads": a.threads}
            print(name, results[name], flush=True)
            save(a, results, settings, model, windows, base_ppl)
            continue
        if FLOOR in name:  # the recipe's activation quantization alone, on the float weights
            t0 = time.perf_counter()
            base_name, sites = floor_sites(name)
            ppl = activations_only_ppl(model, rm.qtk_recipe_doc(base_name, in_features), ids, windows,
                                       a.batch_size, sites)
            results[name] = {"perplexity": round(ppl, 4), "wall_s": round(time.perf_counter() - t0, 1), "steps": {},
                             "activations_only": True, "threads": a.threads}
            print(name, results[name], flush=True)
            save(a, results, settings, model, windows, base_ppl)
            continue
        doc = with_iters(variant_doc(name, in_features), a.iters)
        out = a.work / doc["name"]
        rfile = a.work / f"{doc['name']}.recipe.json"
        rfile.write_text(json.dumps(doc))
        shutil.rmtree(out, ignore_errors=True)
        wall, rss = vsl.run_measured([sys.executable, str(Path(__file__).resolve()), "_qtk", "--model", str(model),
                                      "--ids", str(ids_file), "--recipe", str(rfile), "--out", str(out),
                                      "--batch-size", str(a.batch_size)], a.work / f"{doc['name']}.log")
        t = json.loads((out / "timings.json").read_text())
        ppl = rm.checkpoint_ppl(out / "vllm", windows)
        steps = {k: {"s": round(v["s"], 2), "peak_extra_rss_mb": round(v["peak_extra_rss_mb"]), "layers": v["layers"]}
                 for k, v in t["steps"].items()}
        results[name] = {"perplexity": round(ppl, 4), "wall_s": round(wall, 1), "peak_rss_mb": round(rss / 1e6),
                         "group_size": doc["weights"].get("group_size"), "steps": steps, "threads": a.threads,
                         "algorithm": doc["algorithm"], **({"layer_losses": losses(out)} if "autoround" in steps else {})}
        print(name, {k: v for k, v in results[name].items() if k != "layer_losses"}, flush=True)
        save(a, results, settings, model, windows, base_ppl)


FLOOR = "/float-weights"  # `RECIPE/float-weights[:SITE,...]`: activations_only_ppl


def floor_sites(name: str) -> tuple[str, list[str]]:
    """`RECIPE/float-weights[:SITE,...]` -> (RECIPE, [SITE, ...]; empty: every quantized input)."""
    recipe, _, sites = name.partition(FLOOR)
    return recipe, [s for s in sites.lstrip(":").split(",") if s]


def activations_only_ppl(model: Path, doc: dict, ids, windows, batch_size: int, sites: list[str] = ()) -> float:
    """Held-out perplexity of the float model with only the recipe's activation quantization: every quantized
    Linear's input fake-quantized as the engine does (fake_quant_activation), static scales from the largest input
    each Linear saw over the calibration ids (one forward, batches of batch_size), the weights left float. What no
    weight solver can go below without changing the activations (smoothing, rotations). `sites`: only the Linears
    of these names (the last part of the module name, e.g. o_proj), to say which inputs cost what."""
    import torch
    from transformers import AutoModelForCausalLM

    from qtk.quant.formats import fake_quant_activation, static_scale
    from qtk.recipe import parse_recipe

    recipe = parse_recipe(doc, json.dumps(doc), doc["name"])
    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    acts = {}
    for n, mod in m.named_modules():
        ms = recipe.scheme_for(n) if isinstance(mod, torch.nn.Linear) else None
        if ms is not None and ms.engine_activations is not None and (not sites or n.rsplit(".", 1)[-1] in sites):
            acts[n] = (mod, ms.engine_activations)
    if not acts:
        raise SystemExit(f"{doc['name']}: no quantized activations to measure")
    amax = {n: torch.zeros(()) for n in acts}

    def seen(n):
        return lambda mod, args: amax.__setitem__(n, torch.maximum(amax[n], args[0].detach().abs().amax()))

    hooks = [mod.register_forward_pre_hook(seen(n)) for n, (mod, _) in acts.items()]
    with torch.no_grad():
        for b in ids.split(batch_size):
            m(b)
    for h in hooks:
        h.remove()
    for n, (mod, act) in acts.items():
        scale = static_scale(amax[n], act) if act.has_static_scale else None
        mod.register_forward_pre_hook(lambda mod, args, act=act, scale=scale:
                                      (fake_quant_activation(args[0], act, scale), *args[1:]))
    return rm.perplexity(m, windows)


def run_peer(a, model: Path, ids_file: Path, in_features, windows) -> dict:
    """intel/auto-round on the same ids, W4A16 symmetric with the recipe's group size (or its NVFP4 scheme), the same
    iterations and batch: its compressed-tensors output read by qtk's reader and simulated for the same perplexity."""
    import subprocess

    doc = rm.qtk_recipe_doc("w4a16-autoround" if a.peer_scheme == "W4A16" else "nvfp4-autoround", in_features)
    out = a.work / f"auto-round-peer-{a.peer_scheme}"
    shutil.rmtree(out, ignore_errors=True)
    version = subprocess.run([str(a.peer_python), "-c", "import auto_round; print(auto_round.__version__)"],
                             capture_output=True, text=True, check=True).stdout.strip()
    wall, rss = vsl.run_measured([str(a.peer_python), str(HERE / "_autoround_peer.py"), "--model", str(model),
                                  "--ids", str(ids_file), "--out", str(out), "--iters", str(a.iters or 200),
                                  "--group-size", str(doc["weights"]["group_size"]), "--batch-size", str(a.batch_size),
                                  "--threads", str(a.threads), "--scheme", a.peer_scheme],
                                 a.work / f"auto-round-peer-{a.peer_scheme}.log")
    ck = out / "vllm"
    if not (ck / "config.json").is_file():  # auto-round saves under a subdirectory named after the model
        ck = next(d for d in ck.iterdir() if (d / "config.json").is_file())
    t = json.loads((out / "timings.json").read_text())
    return {"perplexity": round(rm.checkpoint_ppl(ck, windows), 4), "wall_s": round(wall, 1),
            "peak_rss_mb": round(rss / 1e6), "group_size": doc["weights"]["group_size"],
            "steps": {}, "peer": f"intel/auto-round {version}" + ("" if a.peer_scheme == "W4A16" else f" {a.peer_scheme}"),
            "in_process_s": round(t["total_in_process"], 1)}


def save(a, results: dict, settings: dict, model: Path, windows, base_ppl: float) -> None:
    """The JSON report and the table in docs/real-model.md, after each recipe."""
    from qtk.convert.manifest import versions

    prev = json.loads(a.json.read_text()) if a.json.is_file() else {}
    if prev.get("settings") == settings:  # what another run with the same settings wrote meanwhile is kept
        results = {**prev.get("recipes", {}), **results}
    report = {"benchmark": "benchmarks/autoround.py",
              "command": " ".join(["nice", ".venv/bin/python", "benchmarks/autoround.py", *sys.argv[1:]]),
              "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(),
              "machine": {"cpus": os.cpu_count(), "loadavg_1_5_15_now": [round(x, 2) for x in os.getloadavg()]},
              "model": {"name": "SmolLM2-135M-Instruct", **vsl.shape_of(model)}, "settings": settings,
              "perplexity_tokens": windows.numel() - len(windows),
              "unquantized_perplexity": round(base_ppl, 4), "recipes": results}
    a.json.write_text(json.dumps(report, indent=2) + "\n")
    write_doc(render(report))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_qtk":
        child(sys.argv[2:])
    else:
        main()
