"""Quantize the reference tiny Llama with NVIDIA ModelOpt and record what its exporters write, so qtk's
TensorRT-LLM and hf-modelopt outputs can be held against the real tool without installing it in CI.

    python tests/trtllm/make_modelopt_reference.py [--out tests/trtllm/data/modelopt_reference.json]
    python tests/trtllm/make_modelopt_reference.py --next [--out tests/formats_reference/modelopt_reference.json]

Needs nvidia-modelopt (CPU is enough). It pins torch/transformers loosely, so install it in its own venv
that sees qtk's packages, e.g. .venv-modelopt with a .pth file pointing at .venv's site-packages.
Writes a JSON manifest: versions, the model spec, and per case the config(s) plus every tensor's
safetensors dtype and shape per rank file. Values are not recorded: calibration differs by design.

--next records issue 14's formats (NVFP4, W4A8_AWQ, FP8 block, MXFP4/MXFP8) on tests/formats_reference's model
and calibration ids instead, and keeps the bytes of one Linear's tensors (layer 0 v_proj, or the fused qkv of
the TensorRT-LLM checkpoint) and of layer 0's KV scales, so their value conventions can be checked too.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trtllm_helpers import CASES, MODEL, REFERENCE, make_reference_model, summarize_hf, summarize_trtllm  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "formats_reference"))
import reference_model  # noqa: E402

# issue 14's formats (--next): case -> (qtk recipe: none yet, ModelOpt configs, target, tp)
NEXT_CASES = {
    "trtllm/nvfp4/tp1": (None, ["NVFP4_DEFAULT_CFG"], "trtllm", 1),
    "trtllm/nvfp4/tp2": (None, ["NVFP4_DEFAULT_CFG"], "trtllm", 2),
    "trtllm/nvfp4-kv8/tp1": (None, ["NVFP4_DEFAULT_CFG", "FP8_KV_CFG"], "trtllm", 1),
    "trtllm/nvfp4-a16/tp1": (None, ["W4A16_NVFP4_CFG"], "trtllm", 1),
    "trtllm/w4a8-awq/tp1": (None, ["W4A8_AWQ_BETA_CFG"], "trtllm", 1),
    "trtllm/w4a8-awq-kv8/tp1": (None, ["W4A8_AWQ_BETA_CFG", "FP8_KV_CFG"], "trtllm", 1),
    "trtllm/fp8-block-wo/tp1": (None, ["FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"], "trtllm", 1),  # ModelOpt's only FP8 block
    "trtllm/mxfp4/tp1": (None, ["MXFP4_DEFAULT_CFG"], "trtllm", 1),
    "trtllm/mxfp8/tp1": (None, ["MXFP8_DEFAULT_CFG"], "trtllm", 1),
    "hf/nvfp4": (None, ["NVFP4_DEFAULT_CFG"], "hf-modelopt", 1),
    "hf/nvfp4-kv8": (None, ["NVFP4_DEFAULT_CFG", "FP8_KV_CFG"], "hf-modelopt", 1),
    "hf/nvfp4-a16": (None, ["W4A16_NVFP4_CFG"], "hf-modelopt", 1),
    "hf/w4a8-awq": (None, ["W4A8_AWQ_BETA_CFG"], "hf-modelopt", 1),
    "hf/fp8-block-wo": (None, ["FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG"], "hf-modelopt", 1),
    "hf/mxfp4": (None, ["MXFP4_DEFAULT_CFG"], "hf-modelopt", 1),
    "hf/mxfp8": (None, ["MXFP8_DEFAULT_CFG"], "hf-modelopt", 1),
}
NEXT_REFERENCE = reference_model.HERE / "modelopt_reference.json"


def sample_tensors(out: Path, target: str) -> dict:
    """The bytes of one Linear's tensors and of layer 0's KV scales (--next)."""
    from safetensors import safe_open

    if target == "trtllm":
        files, keep = [out / "rank0.safetensors"], ("transformer.layers.0.attention.qkv.",
                                                     "transformer.layers.0.attention.kv_cache_scaling_factor")
    else:
        files = sorted(out.glob("*.safetensors"))
        keep = (reference_model.SAMPLE_LINEAR + ".", "model.layers.0.self_attn.k_proj.k_scale",
                "model.layers.0.self_attn.v_proj.v_scale")
    sample = {}
    for p in files:
        with safe_open(str(p), "pt") as f:
            sample.update({n: reference_model.encode_sample(f.get_tensor(n)) for n in f.keys() if n.startswith(keep)})
    return dict(sorted(sample.items()))


def modelopt_config(names: list[str]) -> dict:
    import modelopt.torch.quantization as mtq

    cfg = copy.deepcopy(getattr(mtq, names[0]))
    for extra in names[1:]:
        if extra == "INT8_KV":  # ModelOpt has no named INT8 KV config: 8-bit integer K/V BMM quantizers
            cfg["quant_cfg"].append({"quantizer_name": "*[kv]_bmm_quantizer", "cfg": {"num_bits": 8, "axis": None}})
        else:
            cfg["quant_cfg"].extend(copy.deepcopy(getattr(mtq, extra)["quant_cfg"]))
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help=f"default {REFERENCE} ({NEXT_REFERENCE} with --next)")
    ap.add_argument("--next", action="store_true", help="issue 14's formats on tests/formats_reference's model")
    args = ap.parse_args(argv)
    cases = NEXT_CASES if args.next else CASES
    args.out = args.out or (NEXT_REFERENCE if args.next else REFERENCE)

    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    spec = reference_model.SPEC if args.next else MODEL
    dtype = getattr(torch, spec["dtype"])
    calib = reference_model.calibration_ids() if args.next else torch.randint(3, 90, (4, 32))
    manifest = {
        "generator": "tests/trtllm/make_modelopt_reference.py" + (" --next" if args.next else ""),
        "versions": {"modelopt": modelopt.__version__, "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
        "model": spec,
        "cases": {},
    }
    if args.next:
        manifest["calibration"] = reference_model.CALIB
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = (reference_model.build if args.next else make_reference_model)(tmp / "model")
        quantized: dict[tuple, object] = {}
        for case, (_, configs, target, tp) in cases.items():
            # quantize once per scheme, export as often as needed (--next: once per target too, since a failed
            # export may leave the model half-converted)
            key = (tuple(configs), target) if args.next else tuple(configs)
            if key not in quantized:
                model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
                with torch.no_grad():
                    model = mtq.quantize(model, modelopt_config(configs), lambda m: [m(calib[i: i + 1]) for i in range(len(calib))])
                quantized[key] = model.to(dtype)
            model = quantized[key]
            out = tmp / case.replace("/", "-")
            try:
                if target == "trtllm":
                    export_tensorrt_llm_checkpoint(model, "llama", dtype, out, inference_tensor_parallel=tp)
                    summary = summarize_trtllm(out)
                else:
                    export_hf_checkpoint(model, dtype=dtype, export_dir=out)
                    summary = summarize_hf(out)
            except Exception as e:  # --next records what ModelOpt cannot export (a fact for qtk's refusals)
                if not args.next:
                    raise
                manifest["cases"][case] = {"modelopt_configs": configs, "error": f"{type(e).__name__}: {e}"}
                print(f"{case}: ModelOpt failed: {manifest['cases'][case]['error']}")
                continue
            if args.next:
                summary["sample"] = sample_tensors(out, target)
            manifest["cases"][case] = {"modelopt_configs": configs, **summary}
            print(f"{case}: {sum(len(r) for r in summary.get('ranks', {'m': summary.get('tensors', {})}).values())} tensors")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
