"""Quantize the reference tiny Llama with NVIDIA ModelOpt and record what its exporters write, so qtk's
TensorRT-LLM and hf-modelopt outputs can be held against the real tool without installing it in CI.

    python tests/trtllm/make_modelopt_reference.py [--out tests/trtllm/data/modelopt_reference.json]

Needs nvidia-modelopt (CPU is enough). It pins torch/transformers loosely, so install it in its own venv
that sees qtk's packages, e.g. .venv-modelopt with a .pth file pointing at .venv's site-packages.
Writes a JSON manifest: versions, the model spec, and per case the config(s) plus every tensor's
safetensors dtype and shape per rank file. Values are not recorded: calibration differs by design.
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
    ap.add_argument("--out", type=Path, default=REFERENCE)
    args = ap.parse_args(argv)

    import modelopt
    import modelopt.torch.quantization as mtq
    import torch
    import transformers
    from modelopt.torch.export import export_hf_checkpoint, export_tensorrt_llm_checkpoint
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    dtype = getattr(torch, MODEL["dtype"])
    calib = torch.randint(3, 90, (4, 32))
    manifest = {
        "generator": "tests/trtllm/make_modelopt_reference.py",
        "versions": {"modelopt": modelopt.__version__, "torch": torch.__version__.split("+")[0], "transformers": transformers.__version__},
        "model": MODEL,
        "cases": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_dir = make_reference_model(tmp / "model")
        quantized: dict[tuple, object] = {}
        for case, (_, configs, target, tp) in CASES.items():
            key = tuple(configs)
            if key not in quantized:  # quantize once per scheme, export as often as needed
                model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
                with torch.no_grad():
                    model = mtq.quantize(model, modelopt_config(configs), lambda m: [m(calib[i: i + 1]) for i in range(len(calib))])
                quantized[key] = model.to(dtype)
            model = quantized[key]
            out = tmp / case.replace("/", "-")
            if target == "trtllm":
                export_tensorrt_llm_checkpoint(model, "llama", dtype, out, inference_tensor_parallel=tp)
                summary = summarize_trtllm(out)
            else:
                export_hf_checkpoint(model, dtype=dtype, export_dir=out)
                summary = summarize_hf(out)
            manifest["cases"][case] = {"modelopt_configs": configs, **summary}
            print(f"{case}: {sum(len(r) for r in summary.get('ranks', {'m': summary.get('tensors', {})}).values())} tensors")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=False) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
