"""The manifest every output carries (qtk.json): what was converted with what, from which bytes, on which data, with
which library versions, and the small per-layer statistics the checks and reports read back (docs/formats.md)."""

from __future__ import annotations

import time


def versions() -> dict[str, str]:
    import importlib.metadata as md

    out = {}
    for pkg in ("qtk", "torch", "transformers", "safetensors", "compressed-tensors"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = "not installed"
    return out


def build(source, recipe, hashes: dict, calib_info: dict, stats, timings: dict, writers) -> dict:
    """The manifest of one run (its timings are the final ones only when written: see the job's commit step).
    stats: the pipeline's PipelineStats; `stats.algorithm` keeps the records' exact JSON shape, which qtk.checks
    reads the smoothing scales from."""
    from qtk import __version__

    return {
        "qtk_version": __version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "recipe": {"name": recipe.name, "hash": recipe.hash, "text": recipe.text, "summary": recipe.summary()},
        "source": {"path": str(source.path.resolve()), "model_type": source.config_dict.get("model_type"),
                   "dtype": str(source.dtype).replace("torch.", ""), "files_sha256": hashes,
                   **({"quantization": source.quant.record()} if getattr(source, "quant", None) is not None else {})},
        "calibration": calib_info,
        "versions": versions(),
        "stats": {"weight_error": stats.weight_error, "kv_amax": stats.kv_amax, "input_amax": stats.input_amax,
                  "algorithm": stats.records, **expert_stats(stats, recipe, writers)},
        "timings": timings,
    }


def expert_stats(stats, recipe, writers) -> dict:
    """MoE: calibration tokens per expert, and the experts under the recipe's minimum, also as a note on every
    output (README, manifest, CLI): an expert calibration barely reached has scales resting on little data."""
    if not stats.expert_tokens:
        return {}
    from qtk.model.moe import starved_experts

    n = recipe.calibration.min_expert_tokens
    starved = starved_experts(stats.expert_tokens, n)
    treatment = expert_treatment(stats, recipe)
    if starved:
        total = sum(len(c) for c in stats.expert_tokens.values())
        shown = ", ".join(f"{k} ({v})" for k, v in list(starved.items())[:8]) + (", ..." if len(starved) > 8 else "")
        none = sum(1 for v in starved.values() if v == 0)
        rtn = sum(1 for t in treatment.values() if t["weights"].startswith("rtn:"))
        note = (f"{len(starved)} of {total} experts received fewer than {n} calibration tokens: {shown}"
                + (f"; {none} received none (smoothing s = 1 for them)" if none else "")
                + (f"; GPTQ rounded {rtn} of them to nearest (RTN), too few tokens for a Hessian" if rtn else "")
                + "; raise --num-samples or use more varied calibration text (stats.expert_treatment in qtk.json "
                  "says how each expert was quantized)")
        for w in writers:
            w.notes.append(note)
    return {"expert_tokens": stats.expert_tokens, "min_expert_tokens": n, "starved_experts": starved,
            "expert_treatment": treatment}


def expert_treatment(stats, recipe) -> dict[str, dict]:
    """Per routed expert (full name), what calibration gave it and what decided its quantization, from the layers'
    records: `tokens` (routed to it), `weights` ("gptq"; "rtn" where the recipe rounds to nearest; "rtn: <why>"
    where GPTQ had too few tokens for a Hessian), `smoothing` where the recipe smooths ("<step>"; "s = 1: <why>"
    where nothing was migrated into its up -> down pair) and `input_scale` where the recipe calibrates static input
    scales (every expert's is the max over the layer's experts, which vLLM's fused MoE runs them with)."""
    out: dict[str, dict] = {}
    for layer, recs in sorted(stats.records.items()):
        gptq = recs.get("gptq", {})
        smooth = {k: recs[k]["scales"] if k == "awq" else recs[k] for k in ("awq", "smoothquant") if k in recs}
        for block, counts in recs.get("expert_tokens", {}).items():
            rel_block = block.split(f".{layer}.", 1)[1]  # model.layers.3.mlp -> mlp
            for e, n in enumerate(counts):
                rel = f"{rel_block}.experts.{e}."
                t: dict = {"tokens": n}
                solves = {m: r for m, r in gptq.items() if m.startswith(rel)}
                fallback = next((r["reason"] for r in solves.values() if r.get("fallback") == "rtn"), None)
                t["weights"] = "rtn" if not solves else "gptq" if fallback is None else f"rtn: {fallback}"
                for step, scales in smooth.items():
                    pair = [v for m, v in scales.items() if m.startswith(rel)]
                    t["smoothing"] = step if any(v is not None for v in pair) else \
                        "s = 1: no calibration tokens" if n == 0 else "s = 1: the search kept the weights as they are"
                if recipe.static_activations:
                    t["input_scale"] = "max over the layer's experts"
                out[f"{block}.experts.{e}"] = t
    return out
