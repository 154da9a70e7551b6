"""Fingerprints of what `qtk convert` writes: a hash of every written tensor and each config's quantization section,
for every built-in recipe on fixed models, with every target that accepts the recipe.

They pin the bytes on disk across a refactoring: a change to the convert core that should change nothing must leave
every fingerprint identical (tests/test_fingerprints.py). Regenerate (and review the diff) only when an output is
meant to change, and say why in the commit message:

    .venv/bin/python tests/fingerprints.py --update
    .venv/bin/python tests/fingerprints.py --update --only ID   # add or retake the cases whose id contains ID

Calibration runs on one thread, as the tests do: the results of calibrated recipes depend on the order of float
additions in the CPU's GEMM kernels, so they are compared byte for byte on the machine signature they were taken on
(torch, instruction set, CPU vendor and model) and by names, dtypes, shapes and configs elsewhere (see
tests/test_fingerprints.py).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DATA = HERE / "data" / "fingerprints.json"
EXAMPLE = ROOT / "examples" / "tiny-llama"
CALIB = {"num_samples": 8, "seq_len": 64, "seed": 0}

# name -> how to build it (None: the shipped example model)
MODELS = {
    "tiny-llama-example": None,
    "random-llama": {"model_type": "llama", "layers": 2, "hidden": 128, "intermediate": 256, "heads": 4, "kv_heads": 2, "seed": 3},
    "random-mixtral": {"model_type": "mixtral", "layers": 2, "hidden": 128, "intermediate": 128, "heads": 4, "kv_heads": 2,
                       "seed": 4, "num_local_experts": 4, "num_experts_per_tok": 2},
}
# model -> recipes to run (None: every built-in recipe); extra cases with options
RECIPES = {"random-mixtral": ("w4a16-gptq", "fp8", "int8-kv8")}
EXTRA = [{"model": "random-llama", "recipe": "int8-kv8", "targets": ["trtllm"], "options": {"tp": 2}}]


def cpu_model() -> str:
    """The CPU's vendor and model (Linux: /proc/cpuinfo): GEMM libraries pick other kernels on other CPUs of one
    instruction set (an AVX512 AMD EPYC sums differently from an AVX512 Xeon), so bytes of calibrated cases are
    compared only on the CPU they were taken on."""
    try:
        info = {}
        for line in Path("/proc/cpuinfo").read_text().splitlines()[:32]:
            if ":" in line:
                k, v = line.split(":", 1)
                info.setdefault(k.strip(), v.strip())
        return " ".join(info.get(k, "") for k in ("vendor_id", "model name")).strip() or platform.processor()
    except OSError:
        return platform.processor()


def machine() -> dict:
    import torch

    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "machine": platform.machine(), "cpu": cpu_model()}


def build_model(name: str, root: Path) -> Path:
    spec = MODELS[name]
    if spec is None:
        return EXAMPLE
    sys.path.insert(0, str(HERE))
    from models import make_tiny_model

    spec = dict(spec)
    return make_tiny_model(root / name, **spec)


def tensor_digest(t) -> list:
    """[dtype, shape, sha256 of the bytes]."""
    import torch

    flat = t.contiguous().reshape(-1)
    raw = flat.view(torch.uint8) if flat.numel() else flat
    return [str(t.dtype).replace("torch.", ""), list(t.shape), hashlib.sha256(raw.numpy().tobytes()).hexdigest()[:32]]


def fingerprint_dir(d: Path) -> dict:
    """Every tensor of every safetensors file (by tensor name, per file for multi-rank outputs) and the
    quantization sections of the configs; README.md and qtk.json (timings, paths) are left out."""
    from safetensors import safe_open

    out: dict = {"tensors": {}, "configs": {}}
    for p in sorted(d.glob("*.safetensors")):
        key = p.name if p.name.startswith("rank") else "model"
        with safe_open(str(p), framework="pt") as f:
            for n in f.keys():
                out["tensors"].setdefault(key, {})[n] = tensor_digest(f.get_tensor(n))
    cfg = json.loads((d / "config.json").read_text())
    out["configs"]["config.json"] = cfg.get("quantization_config") or cfg.get("quantization")
    for extra in ("hf_quant_config.json", "quant_cfg.json"):
        if (d / extra).is_file():
            out["configs"][extra] = json.loads((d / extra).read_text())
    _drop_versions(out["configs"])
    return out


def _drop_versions(cfg) -> None:
    """Library versions written into configs are not the output's content."""
    if isinstance(cfg, dict):
        for k in list(cfg):
            if k in ("version", "producer"):
                cfg.pop(k)
            else:
                _drop_versions(cfg[k])


def accepted_targets(model: Path, recipe: str, options: dict) -> list[str]:
    """The targets that accept the recipe for this model: the checks convert runs for each target (the shared ones,
    such as an online rotation's, and the writer's own), in the order of TARGETS."""
    from qtk.export import TARGETS, ExportOptions, accepting_targets
    from qtk.model.source import ModelSource
    from qtk.recipe import load_recipe

    ok = set(accepting_targets(ModelSource(model), load_recipe(recipe), ExportOptions(**options)))
    return [t for t in TARGETS if t in ok]


def cases(root: Path, stored: dict | None = None) -> list[dict]:
    """Every (model, recipe, targets, options) case; targets from `stored` when given (so a test does not depend on
    how acceptance is computed)."""
    from qtk.recipe import builtin_recipes

    from qtk.recipe import load_recipe

    out = []
    for name in MODELS:
        for recipe in RECIPES.get(name) or builtin_recipes():
            if load_recipe(recipe).weights.strategy == "block":
                continue  # FP8 blocks do not tile these models' 64-row k/v projections: qtk refuses them (as vLLM does)
            out.append({"model": name, "recipe": recipe, "targets": None, "options": {}})
    out += [dict(c) for c in EXTRA]
    for c in out:
        c["id"] = f"{c['model']}:{c['recipe']}" + "".join(f":{k}{v}" for k, v in c["options"].items())
        if stored is not None and c["id"] in stored:
            c["targets"] = stored[c["id"]]["targets"]
    return out


def run_case(case: dict, models: dict[str, Path], work: Path) -> dict:
    from qtk import api

    model = models[case["model"]]
    targets = case["targets"] or accepted_targets(model, case["recipe"], case["options"])
    out = work / case["id"].replace(":", "_")
    api.convert(model, case["recipe"], out, targets=targets, hash_source=False, overwrite=True, **CALIB, **case["options"])
    return {"targets": targets, "outputs": {t: fingerprint_dir(out / t) for t in targets}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help=f"rewrite {DATA.relative_to(ROOT)}")
    ap.add_argument("--only", help="run the cases whose id contains this text")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    result = {"machine": machine(), "calibration": CALIB, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        models = {n: build_model(n, tmp / "models") for n in MODELS}
        for c in cases(tmp):
            if args.only and args.only not in c["id"]:
                continue
            print(c["id"], flush=True)
            result["cases"][c["id"]] = run_case(c, models, tmp / "out")
    if args.only and args.update and DATA.is_file():
        # add or retake only the selected cases; a case taken on another machine than the file's records its own
        # signature, against which tests/test_fingerprints.py compares its calibrated bytes
        stored = json.loads(DATA.read_text())
        for cid, case in result["cases"].items():
            stored["cases"][cid] = case if machine() == stored["machine"] else {**case, "machine": machine()}
        result = stored
    text = json.dumps(result, indent=1, sort_keys=True) + "\n"
    if args.update:
        DATA.parent.mkdir(parents=True, exist_ok=True)
        DATA.write_text(text)
        print(f"wrote {DATA}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
