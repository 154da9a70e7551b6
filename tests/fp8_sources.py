"""FP8-block sources built in the tests, as DeepSeek-V3 and the Qwen3 "FP8" releases ship them (Hugging Face
`quant_method: fp8` with `weight_block_size`): every decoder-layer Linear stored as float8_e4m3fn with a float32
`weight_scale_inv` per block (amax / 448; the weight is q * s), everything else in 16 bits; and the BF16 model such a
source stands for, dequantized here block by block, independently of qtk."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FP8_MAX = 448.0
QUANT_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}


def read_tensors(d: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory's safetensors files, by name."""
    out = {}
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def _side_files(src: Path, dst: Path) -> None:
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(p, dst / p.name)


def quantize_blocks(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 codes, float32 scales [ceil(out/bn), ceil(in/bk)]) of a 2-D weight; partial edge blocks take the amax
    of what they hold."""
    bn, bk = block
    rows, cols = w.shape
    R, C = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(R * bn, C * bk, dtype=torch.float32)
    padded[:rows, :cols] = w.float()
    blocks = padded.view(R, bn, C, bk)
    amax = blocks.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(R * bn, C * bk)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


def is_layer_linear(name: str, layers: str = "model.layers.") -> bool:
    return name.startswith(layers) and name.endswith("_proj.weight")


def make_fp8_block_source(src: Path, dst: Path, block=(128, 128), quantized=is_layer_linear) -> Path:
    """The FP8-block form of the 16-bit model in `src`, written to `dst`."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    out = {}
    for name, t in read_tensors(Path(src)).items():
        if quantized(name) and t.dim() == 2:
            q, s = quantize_blocks(t, block)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = {**QUANT_CONFIG, "weight_block_size": list(block)}
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _side_files(Path(src), dst)
    return dst


def dequantized_reference(fp8: Path, dst: Path) -> Path:
    """The BF16 model an FP8-block source stands for: each block's codes as float32 times its scale, then one rounding
    to the model dtype (transformers' Fp8Dequantize), block by block."""
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(fp8) / "config.json").read_text())
    bn, bk = cfg.pop("quantization_config")["weight_block_size"]
    dtype = getattr(torch, cfg.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    stored = read_tensors(Path(fp8))
    out = {}
    for name, t in stored.items():
        if name.endswith("_scale_inv"):
            continue
        s = stored.get(name + "_scale_inv")
        if s is None:
            out[name] = t
            continue
        w = torch.empty(t.shape, dtype=torch.float32)
        for i in range(s.shape[0]):
            for j in range(s.shape[1]):
                w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk] = t[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].float() * s[i, j]
        out[name] = w.to(dtype)
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    _side_files(Path(fp8), dst)
    return dst
