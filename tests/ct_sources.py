"""compressed-tensors sources built in the tests: a 16-bit model converted by qtk's vllm target (the formats qtk writes
and reads back), and the BF16 model such a source stands for, decompressed by compressed-tensors itself inside
transformers (`CompressedTensorsConfig(dequantize=True)`), independently of qtk's decode."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file


def make_ct_source(bf16: Path, dst: Path, recipe: str, calib=None, **options) -> Path:
    """The vllm output (compressed-tensors) of converting `bf16` with `recipe`."""
    from qtk import api

    kw = dict(calib=str(calib)) if calib is not None else {}
    return api.convert(bf16, recipe, dst, num_samples=8, seq_len=32, hash_source=False, **kw, **options).outputs["vllm"]


def decompressed_reference(ct: Path, dst: Path) -> Path:
    """The BF16 model a compressed-tensors checkpoint stands for, as compressed-tensors decompresses it: every
    parameter of the model transformers loads with dequantize=True, saved beside the source's config.json
    without its quantization_config and the source's side files."""
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dst = Path(dst)
    dst.mkdir(parents=True)
    cfg = json.loads((Path(ct) / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    assert qc["quant_method"] == "compressed-tensors"
    m = AutoModelForCausalLM.from_pretrained(str(ct), quantization_config=CompressedTensorsConfig(dequantize=True),
                                             dtype=getattr(torch, cfg.get("dtype") or "bfloat16"))
    sd = {k: v.contiguous() for k, v in m.state_dict().items()}
    if cfg.get("tie_word_embeddings"):
        sd.pop("lm_head.weight", None)
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for p in Path(ct).iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in (
                "config.json", "model.safetensors.index.json", "qtk.json", "README.md"):
            shutil.copy2(p, dst / p.name)
    return dst
