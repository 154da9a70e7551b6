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
                   "dtype": str(source.dtype).replace("torch.", ""), "files_sha256": hashes},
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
    if starved:
        total = sum(len(c) for c in stats.expert_tokens.values())
        shown = ", ".join(f"{k} ({v})" for k, v in list(starved.items())[:8]) + (", ..." if len(starved) > 8 else "")
        none = sum(1 for v in starved.values() if v == 0)
        note = (f"{len(starved)} of {total} experts received fewer than {n} calibration tokens: {shown}"
                + (f"; {none} received none (GPTQ used RTN for them, smoothing s = 1)" if none else "")
                + "; raise --num-samples or use more varied calibration text")
        for w in writers:
            w.notes.append(note)
    return {"expert_tokens": stats.expert_tokens, "min_expert_tokens": n, "starved_experts": starved}
