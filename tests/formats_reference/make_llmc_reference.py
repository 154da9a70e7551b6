"""Quantize the reference tiny Llama with llm-compressor's NVFP4, MXFP4, MXFP8, FP8-block and W4A8 schemes and
record what it writes, so qtk's primitives (and later its writers) can be held against the real tool in CI.

    benchmarks/.venv-llmc/bin/python tests/formats_reference/make_llmc_reference.py [--out PATH] [--case NAME ...]

Runs in llm-compressor's own venv, benchmarks/.venv-llmc (it pins its own transformers and compressed-tensors;
benchmarks/vs_llmcompressor.py's ensure_llmc_venv builds it, or run that benchmark once). Imports nothing from
qtk. The model is reference_model.SPEC, rebuilt from its seed; calibration ids are reference_model.CALIB.
Per case the manifest keeps config.json's quantization_config, every tensor's safetensors dtype and shape,
and, byte for byte, the tensors of one Linear (reference_model.SAMPLE_LINEAR: scales whole, packed weights'
first rows) plus layer 0's KV scales. Values otherwise are not recorded.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reference_model import (  # noqa: E402
    CALIB,
    LLMC_MANIFEST,
    SAMPLE_LINEAR,
    SPEC,
    build,
    calibration_ids,
    encode_sample,
    header,
    tensor_digest,
    weights,
)

FP8_KV = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

# case -> (llm-compressor preset scheme, 8-bit KV cache, quantization_format given to save_pretrained or None for
# the inferred one). Every case runs the same calibration ids: schemes that need none (weight-only, dynamic
# activations) ignore them.
CASES = {
    "nvfp4": ("NVFP4", False, None),  # W4A4: static global input scale, dynamic group scales
    "nvfp4-kv8": ("NVFP4", True, None),
    "nvfp4a16": ("NVFP4A16", False, None),
    "mxfp4a16": ("MXFP4A16", False, None),
    "mxfp4": ("MXFP4", False, None),
    "mxfp8": ("MXFP8", False, None),
    "fp8-block": ("FP8_BLOCK", False, None),
    "fp8-block-kv8": ("FP8_BLOCK", True, None),
    "w4afp8": ("W4AFP8", False, None),  # int4 g128 weights, dynamic per-token FP8 activations: int-quantized
    # what llm-compressor's W4AFP8 example saves "for vLLM compatibility" (vLLM's W4A8-FP8 reads weight_packed)
    "w4afp8-packed": ("W4AFP8", False, "pack-quantized"),
    "w4afp8-kv8": ("W4AFP8", True, None),
    "w4a8-int": ("W4A8", False, None),  # int4 g128 weights, dynamic per-token INT8 activations
}


def versions() -> dict[str, str]:
    import importlib.metadata as md

    v = {p: md.version(p) for p in ("llmcompressor", "compressed-tensors", "transformers", "torch")}
    pins = [r for r in (md.requires("llmcompressor") or []) if r.startswith(("compressed-tensors", "transformers", "torch"))]
    return {**v, "llmcompressor_requires": sorted(pins)}


def run_case(model_dir: Path, out: Path, scheme: str, kv: bool, fmt: str | None) -> None:
    import torch
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    ids = calibration_ids()
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype="auto")
    modifier = QuantizationModifier(targets="Linear", scheme=scheme, ignore=["lm_head"],
                                    kv_cache_scheme=dict(FP8_KV) if kv else None)
    oneshot(model=model, recipe=[modifier], dataset=data, num_calibration_samples=len(ids),
            max_seq_length=ids.shape[1], shuffle_calibration_samples=False, output_dir=None if fmt else str(out))
    if fmt:
        model.save_pretrained(str(out), save_compressed=True, quantization_format=fmt)


def summarize(out: Path) -> dict:
    from safetensors import safe_open

    cfg = json.loads((out / "config.json").read_text())
    tensors: dict = {}
    sample: dict = {}
    for p in sorted(out.glob("*.safetensors")):
        tensors.update(header(p))
        with safe_open(str(p), "pt") as f:
            for name in f.keys():
                kv_scale = name.startswith("model.layers.0.self_attn.") and name.endswith(("k_scale", "v_scale"))
                if name.startswith(SAMPLE_LINEAR + ".") or kv_scale:
                    sample[name] = encode_sample(f.get_tensor(name))
    return {"quantization_config": cfg.get("quantization_config"), "config_dtype": cfg.get("dtype", cfg.get("torch_dtype")),
            "files": sorted(p.name for p in out.iterdir() if p.is_file()), "tensors": dict(sorted(tensors.items())),
            "sample": dict(sorted(sample.items()))}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=LLMC_MANIFEST)
    ap.add_argument("--case", action="append", choices=sorted(CASES), help="only these cases (default: all)")
    args = ap.parse_args(argv)

    manifest = {
        "generator": "tests/formats_reference/make_llmc_reference.py",
        "versions": versions(),
        "model": SPEC,
        "calibration": CALIB,
        "sample_linear": SAMPLE_LINEAR,
        "sample_source_sha256": tensor_digest(weights()[SAMPLE_LINEAR + ".weight"]),
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build(Path(tmp) / "model")
        for case in args.case or list(CASES):
            scheme, kv, fmt = CASES[case]
            out = Path(tmp) / case
            run_case(model_dir, out, scheme, kv, fmt)
            manifest["cases"][case] = {"llmcompressor_scheme": scheme, "kv_cache_scheme": FP8_KV if kv else None,
                                       "quantization_format": fmt, **summarize(out)}
            print(f"{case}: {len(manifest['cases'][case]['tensors'])} tensors", flush=True)
    args.out.write_text(json.dumps(manifest, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
