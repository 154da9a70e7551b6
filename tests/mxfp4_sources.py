"""gpt-oss MXFP4 sources built in the tests, as OpenAI ships gpt-oss (Hugging Face `quant_method: mxfp4`): each
layer's fused experts stored as `{gate_up_proj,down_proj}_blocks` (uint8 [E, out, in/32, 16], two e2m1 codes per byte,
the even element in the low nibble) and `_scales` (uint8 E8M0 [E, out, in/32], bias 127), everything else in bf16; and
the BF16 model such a source stands for, decoded here from the format's definition, independently of qtk."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

# OCP e2m1: code c (sign bit 3) -> value; transformers' integrations/mxfp4.py FP4_VALUES in the same order
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def mxfp4_encode(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., n] (n a multiple of 32) -> (blocks uint8 [..., n/32, 16], scales uint8 [..., n/32]) as OpenAI's
    checkpoints store them: per 32 values an E8M0 exponent s (2^(s-127) = 2^(floor(log2 amax) - 2), so the largest
    value lands in e2m1's top binade), each value the nearest e2m1 code of w / 2^(s-127), two codes per byte with the
    even element in the low nibble. Written here from the format's definition, independently of qtk."""
    x = w.float().unflatten(-1, (-1, 32))
    amax = x.abs().amax(-1)
    e = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -127)).clamp(-127, 127)
    y = x / torch.exp2(e)[..., None]
    codes = (y[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # nearest; ties to the lower code
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (e + 127).to(torch.uint8).contiguous()


def mxfp4_decode(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """The values those bytes stand for: e2m1(code) * 2^(s - 127) per 32, rows [..., n]."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()
    return (E2M1[codes] * torch.exp2(scales.float() - 127)[..., None]).flatten(-2).to(dtype)


def make_mxfp4_source(bf16, dst):
    """OpenAI's layout: each layer's fused experts as `{gate_up_proj,down_proj}_{blocks,scales}`, rows out-major
    ([E, 2I, H/32, 16]: the transpose of transformers' [E, H, 2I], gate/up rows interleaved), biases and the rest in
    bf16, quantization_config quant_method mxfp4. Returns (the MXFP4 source, the BF16 model it stands for)."""
    dst.mkdir()
    sd = load_file(str(bf16 / "model.safetensors"))
    deq = dict(sd)
    for k in [k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_encode(sd[k].transpose(1, 2))  # [E, out, in]
        del sd[k]
        sd[k + "_blocks"], sd[k + "_scales"] = blocks, scales
        deq[k] = mxfp4_decode(blocks, scales, torch.bfloat16).transpose(1, 2).contiguous()
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((bf16 / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}))
    ref = dst.parent / (dst.name + "-deq")
    ref.mkdir()
    save_file(deq, str(ref / "model.safetensors"), metadata={"format": "pt"})
    for p in bf16.iterdir():
        if p.suffix != ".safetensors" and p.name != "config.json":
            for d in (dst, ref):
                (d / p.name).write_bytes(p.read_bytes())
    (ref / "config.json").write_text(json.dumps(cfg))
    return dst, ref


