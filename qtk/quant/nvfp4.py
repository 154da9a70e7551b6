"""NVFP4: FP4 e2m1 values in groups of 16 along the input dim, one FP8 e4m3 scale per group, and one
fp32 global scale per tensor (NVIDIA Blackwell's block-scaled FP4; compressed-tensors strategy
``tensor_group``, format ``nvfp4-pack-quantized``).

Conventions, as compressed-tensors 0.20 computes them (``generate_gparam``, ``calculate_qparams``,
``_quantize``/``_dequantize``) and llm-compressor writes them:
- global scale gs = 448 · 6 / amax(tensor) (fp32 [1]; it MULTIPLIES the local scales, so a larger tensor
  range gives a smaller gs). Stored as ``weight_global_scale`` / ``input_global_scale``; vLLM inverts it
  on load (its kernels take 1/gs). ModelOpt stores the inverse instead (``weight_scale_2`` = amax/2688).
- group scale s = fp8_e4m3(gs · amax(group) / 6), clamped to ±448; a scale that is 0 in fp8 becomes 0.125
  (compressed-tensors' eps for an fp8 scale dtype). Stored as ``weight_scale`` float8_e4m3fn [out, in/16].
- q = e2m1(x / (s / gs)), dequantized x ≈ q · (s / gs): the effective scale s / gs is formed first, in fp32.
- amax/6 and 2688/amax are computed in the dtype of the observed tensor (bf16 weights round them to
  bf16 first), because compressed-tensors runs them on the tensors it is given; the result is bit-equal
  to its output for fp32, bf16 and fp16 inputs.

Activations (W4A4): the global input scale is static (calibrated amax), the group scales are dynamic,
computed per token per group of 16 at run time with the same rule (``dynamic: local``). This follows
compressed-tensors' order of operations (what transformers + compressed-tensors run); vLLM's emulation
(``ref_nvfp4_quant``) forms fp32 amax·(1/6) and multiplies by the reciprocal of s/gs, which can differ
in the last bit of a scale for bf16 inputs.
"""

from __future__ import annotations

import torch

from qtk.quant.fp4 import FP4_MAX, fp4_decode, fp4_encode

NVFP4_GROUP = 16
FP8_E4M3_MAX = 448.0
_FP8 = torch.float8_e4m3fn
_ZERO_SCALE = 0.125  # what compressed-tensors stores for a group whose fp8 scale is 0


def _grouped(x: torch.Tensor, group: int = NVFP4_GROUP) -> torch.Tensor:
    """x [..., n] -> [..., n/group, group]."""
    n = x.shape[-1]
    if n % group:
        raise ValueError(f"NVFP4 groups of {group} do not divide the last dim {n}")
    return x.reshape(*x.shape[:-1], n // group, group)


def nvfp4_global_scale(amax: torch.Tensor | float) -> torch.Tensor:
    """gs = 448·6 / amax -> float32 [1]; amax 0 or non-finite gives 1.0 (compressed-tensors' fallback).

    The division runs in amax's dtype (a bf16 amax gives a bf16-rounded gs), as compressed-tensors does."""
    a = torch.as_tensor(amax).detach().abs().amax().reshape(1)
    if not a.is_floating_point():
        a = a.float()
    a = a.clamp(min=torch.finfo(a.dtype).tiny)
    gs = torch.nan_to_num(FP8_E4M3_MAX * FP4_MAX / a, nan=1.0, posinf=1.0, neginf=1.0)
    return gs.to(torch.float32)


def nvfp4_weight_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """One global scale for weights the engines fuse into one GEMM (q/k/v, gate/up): that of their joint amax.

    Equal to the smallest of their separate global scales, which is how llm-compressor unifies them."""
    if not weights:
        raise ValueError("nvfp4_weight_global_scale needs at least one weight")
    amax = torch.stack([w.detach().abs().amax().to(weights[0].dtype) for w in weights]).amax()
    return nvfp4_global_scale(amax)


def nvfp4_group_scales(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Group scales of x [..., n] under global_scale [1] -> float8_e4m3fn [..., n/16]."""
    amax = _grouped(x.detach()).abs().amax(-1)  # [..., n/16], exact in x's dtype
    local = (amax.float() / FP4_MAX).to(x.dtype)  # amax/6 rounded to the observed dtype
    s = (global_scale.float().reshape(()) * local.float()).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(_FP8).float()
    return torch.where(s == 0, _ZERO_SCALE, s).to(_FP8)


def _effective(scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """s / gs in fp32, [..., G, 1] to broadcast over a group."""
    return (scale.float() / global_scale.float().reshape(())).unsqueeze(-1)


def nvfp4_quantize(x: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """e2m1 codes of x [..., n] with group scales [..., n/16] and global scale [1] -> uint8 [..., n]."""
    y = _grouped(x.float()) / _effective(scale, global_scale)
    return fp4_encode(y.clamp(-FP4_MAX, FP4_MAX)).reshape(x.shape)


def nvfp4_dequantize(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ≈ e2m1(codes) · (s / gs): codes uint8 [..., n] -> dtype [..., n]."""
    return (_grouped(fp4_decode(codes)) * _effective(scale, global_scale)).reshape(codes.shape).to(dtype)


def nvfp4_fake_quant(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """Quantize-dequantize activations x [..., n] as the engines run W4A4: dynamic per-token group scales of
    16 under the static (calibrated) global input scale. Returns x's dtype."""
    scale = nvfp4_group_scales(x, global_scale)
    return nvfp4_dequantize(nvfp4_quantize(x, scale, global_scale), scale, global_scale, x.dtype)

