"""The tiny Llama the format references are made from, rebuildable bit for bit in any venv.

Shared by make_llmc_reference.py (llm-compressor's venv: other transformers and compressed-tensors
versions, no qtk) and the tests in qtk's venv. Imports nothing from qtk. The weights come from one
torch.Generator in sorted parameter-name order, so they do not depend on how a transformers version
initialises a model; only torch's normal_/uniform_ streams matter (same torch 2.13 in both venvs).
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

HERE = Path(__file__).resolve().parent
LLMC_MANIFEST = HERE / "llmc_reference.json"

# widths for every new format at once: 384 and 640 are multiples of 128 (W4A8 groups, FP8 blocks along the
# input dim), 32 (MX) and 16 (NVFP4); 6 heads of 64 with 3 KV heads make k_proj/v_proj 192 rows, a ragged
# second block row for 128x128 FP8 blocks
SPEC = dict(model_type="llama", layers=2, hidden=384, intermediate=640, heads=6, kv_heads=3, vocab=128,
            dtype="bfloat16", seed=0)
CALIB = dict(samples=4, seq_len=32, low=3, seed=1)  # token ids uniform in [low, vocab)

# the Linear whose llm-compressor tensors are kept byte for byte: v_proj has the ragged 192 rows and is fused
# with q/k, whose larger amax (k_proj's) sets the shared NVFP4 global scale
SAMPLE_LINEAR = "model.layers.0.self_attn.v_proj"
SAMPLE_ROWS = 8  # rows of large tensors (packed weights) kept; small ones (scales) are kept whole
SAMPLE_MAX_BYTES = 8192


def weights(spec: dict = SPEC) -> dict:
    """{parameter name: tensor} of the model, in spec['dtype'] (HF Llama names)."""
    import torch

    h, i, v, L = spec["hidden"], spec["intermediate"], spec["vocab"], spec["layers"]
    kv = h // spec["heads"] * spec["kv_heads"]
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,), "lm_head.weight": (v, h)}
    for n in range(L):
        p = f"model.layers.{n}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i),
        })
    g = torch.Generator().manual_seed(spec["seed"])
    out = {}
    for name in sorted(shapes):
        t = torch.empty(shapes[name])
        if t.dim() == 2:  # larger, more varied weights than the default init, so quantization error is visible
            t.normal_(0, 0.08, generator=g)
        else:
            t.uniform_(0.6, 1.4, generator=g)
        out[name] = t.to(getattr(torch, spec["dtype"]))
    return out


def calibration_ids(spec: dict = SPEC, calib: dict = CALIB):
    import torch

    g = torch.Generator().manual_seed(calib["seed"])
    return torch.randint(calib["low"], spec["vocab"], (calib["samples"], calib["seq_len"]), generator=g)


def build(path: Path, spec: dict = SPEC) -> Path:
    """Save the model as a Hugging Face directory: config, safetensors and tests/models.py's char tokenizer."""
    import sys

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    sys.path.insert(0, str(HERE.parent))
    from models import save_char_tokenizer

    cfg = AutoConfig.for_model(spec["model_type"], vocab_size=spec["vocab"], hidden_size=spec["hidden"],
                               intermediate_size=spec["intermediate"], num_hidden_layers=spec["layers"],
                               num_attention_heads=spec["heads"], num_key_value_heads=spec["kv_heads"],
                               max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    model.load_state_dict(weights(spec), assign=True, strict=True)
    model.save_pretrained(str(path))
    save_char_tokenizer(Path(path))
    return Path(path)


def tensor_digest(t) -> str:
    """sha256 of a tensor's raw bytes (to tell 'another model' from 'another quantization')."""
    import torch

    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def header(p: Path) -> dict[str, list]:
    """{tensor: [safetensors dtype, shape]} from a safetensors header, without loading tensors."""
    with open(p, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        h = json.loads(f.read(n))
    h.pop("__metadata__", None)
    return {k: [v["dtype"], v["shape"]] for k, v in sorted(h.items())}


def encode_sample(t) -> dict:
    """A tensor as {dtype, shape, rows, hex}: its raw little-endian bytes, the first SAMPLE_ROWS rows when large."""
    import torch

    t = t.detach().contiguous()
    rows = t.shape[0] if t.dim() else 1
    if t.numel() * t.element_size() > SAMPLE_MAX_BYTES and t.dim() >= 2:
        t, rows = t[:SAMPLE_ROWS].contiguous(), SAMPLE_ROWS
    return {"dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "rows": rows,
            "hex": t.reshape(-1).view(torch.uint8).numpy().tobytes().hex()}  # reshape: a 0-dim tensor has no byte view


def decode_sample(s: dict):
    """Inverse of encode_sample (the kept rows only)."""
    import torch

    raw = torch.frombuffer(bytearray(bytes.fromhex(s["hex"])), dtype=torch.uint8)
    return raw.view(getattr(torch, s["dtype"])).reshape(s["shape"])
