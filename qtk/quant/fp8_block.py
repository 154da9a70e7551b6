"""FP8 block scaling (DeepSeek-V3 style): weights in 128×128 blocks with one scale each, activations
quantized dynamically per token per group of 128 input channels.

Weights: scale = amax(block) / 448, shape [ceil(out/128), ceil(in/128)]; a ragged last block row or
column is scaled over its real elements only (compressed-tensors pads with zeros, which cannot raise
an amax). q = fp8_e4m3(w / scale), dequantized w ≈ q · scale. compressed-tensors writes it as
``float-quantized`` with ``strategy: block, block_structure: [128, 128]`` (``weight`` float8_e4m3fn
[out, in], ``weight_scale`` in the model dtype); Hugging Face's own format (``quant_method: fp8``)
stores the same multiplier as ``weight_scale_inv`` float32.

Arithmetic follows compressed-tensors 0.20 bit for bit: the scale is amax/448 rounded to its storage
dtype (a bf16 scale for a bf16 weight), an all-zero block gets that dtype's eps, and w / scale runs in
torch's promoted dtype of the two (bf16 ÷ bf16 rounds to bf16 before the fp8 cast). With float32
inputs this is plain float32 arithmetic, which is what vLLM's kernels do.
"""

from __future__ import annotations

import torch

from qtk.quant.e4m3 import to_float32

FP8_E4M3_MAX = 448.0
FP8_BLOCK = (128, 128)
FP8_ACT_GROUP = 128
_FP8 = torch.float8_e4m3fn


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w [out, in] -> zero-padded [R, C, bm, bn] with R = ceil(out/bm), C = ceil(in/bn)."""
    bm, bn = block
    out, inp = w.shape
    R, C = -(-out // bm), -(-inp // bn)
    w = torch.nn.functional.pad(w, (0, C * bn - inp, 0, R * bm - out))
    return w.reshape(R, bm, C, bn).transpose(1, 2)


def _unblock(b: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """[R, C, bm, bn] -> [out, in], dropping the padding."""
    R, C, bm, bn = b.shape
    return b.transpose(1, 2).reshape(R * bm, C * bn)[: shape[0], : shape[1]].contiguous()


def fp8_block_scales(w: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                     scale_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Per-block scales of w [out, in] -> scale_dtype (default w's dtype) [ceil(out/bm), ceil(in/bn)]."""
    scale_dtype = scale_dtype or w.dtype
    amax = _blocks(w.detach(), block).abs().amax(dim=(-2, -1))  # [R, C], exact in w's dtype
    s = (amax.float() / FP8_E4M3_MAX).to(scale_dtype)
    return torch.where(s == 0, torch.finfo(scale_dtype).eps, s)


def fp8_block_quantize(w: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK) -> torch.Tensor:
    """float8_e4m3fn [out, in] = fp8(w / scale) per block; scale [ceil(out/bm), ceil(in/bn)]."""
    b = _blocks(w, block) / scale[:, :, None, None]  # [R, C, bm, bn]
    return _unblock(b.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8), tuple(w.shape))


def fp8_block_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                         dtype: torch.dtype | None = None) -> torch.Tensor:
    """w ≈ q · scale per block: float8_e4m3fn [out, in] -> dtype (default the scale's) [out, in]."""
    dtype = dtype or scale.dtype
    b = _blocks(to_float32(q), block) * scale.float()[:, :, None, None]
    return _unblock(b, tuple(q.shape)).to(dtype)


def fp8_group_fake_quant(x: torch.Tensor, group_size: int | None = FP8_ACT_GROUP) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] with dynamic FP8 scales per token per group of group_size
    input channels (None = the whole row: per token, W4A8-FP8 and FP8-dynamic). Returns x's dtype.

    As compressed-tensors simulates it: scale = amax/448 in x's dtype (eps where 0), q = fp8(x / scale). When
    group_size does not divide n the last group is partial (ceil(n/g) groups, its scale over its real elements), as
    vLLM's native QuantFP8 computes it (zero padding cannot raise an amax); compressed-tensors' own fake-quant and
    vLLM's CUDA quantizer refuse such an n, which is why qtk's targets do (qtk.model.config_check.fp8_block_misfit)."""
    n = x.shape[-1]
    g = n if group_size is None else group_size
    G = -(-n // g)
    xp = torch.nn.functional.pad(x, (0, G * g - n)) if G * g != n else x
    xg = xp.reshape(*x.shape[:-1], G, g)  # [..., G, g]
    amax = xg.detach().abs().amax(-1, keepdim=True)
    s = (amax.float() / FP8_E4M3_MAX).to(x.dtype)
    s = torch.where(s == 0, torch.finfo(x.dtype).eps, s)
    q = (xg / s).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).to(x.dtype)
    return (q * s).reshape(*x.shape[:-1], G * g)[..., :n]
