"""ModelOpt unified Hugging Face layouts (docs/formats.md, hf-modelopt), per quantized Linear X in HF names:

    FP8        X.weight fp8 [out, in], X.weight_scale f32 0-dim, X.input_scale f32 0-dim (amax / 448)
    W4A16_AWQ  X.weight uint8 [out/2, in] (int4 pairs, as TensorRT-LLM), X.weight_scale f32 [out, groups],
               X.pre_quant_scale [in] (ones; only on Linears whose input is no norm output, as ModelOpt writes it)
    W4A8_AWQ   as W4A16_AWQ (weight_scale the real int4 group scale: w = q · weight_scale), plus X.weight_scale_2 f32
               0-dim = max |q·s| of the fused group / 448 (the FP8 range the engine maps the weights into) and
               X.input_scale f32 0-dim = input amax / 448, both one per fused group
    NVFP4, W4A16_NVFP4
               X.weight uint8 [out, in/2] (e2m1 codes, low nibble first, as compressed-tensors), X.weight_scale fp8
               [out, in/16], X.weight_scale_2 f32 0-dim = 1/global scale (ModelOpt stores the inverse of
               compressed-tensors' gs: w = q · weight_scale · weight_scale_2), X.input_scale f32 0-dim = amax/2688
               (NVFP4 only); the fp8 group scales are qtk's, i.e. fp8(amax(group) / (6 · weight_scale_2))
"""

from __future__ import annotations

from typing import Mapping

import torch

from qtk.errors import UsageError
from qtk.export.codecs.trtllm import pack_int4_pairs, unpack_int4_pairs, w4a8_weight_amax
from qtk.quant.formats.nvfp4 import GLOBAL
from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import FP8_MAX, QuantScheme

SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", ".k_scale", ".v_scale")
NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
_FP4_INPUT_MAX = 448.0 * 6.0  # ModelOpt's NVFP4 input scale is amax / (448 · 6)


def scalar(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # ModelOpt writes per-tensor scales as 0-dim tensors


def encode(algo: str, qt: QTensor, amax: float | None, prequant: bool, dtype: torch.dtype,
           weight_amax: float | None = None) -> dict[str, torch.Tensor]:
    """amax: the calibrated input range (FP8, NVFP4, W4A8_AWQ); prequant: write an identity pre_quant_scale
    (W4A16_AWQ, W4A8_AWQ); weight_amax: W4A8_AWQ's max |q·s| over the fused group."""
    if algo == "FP8":
        return {"weight": qt.values, "weight_scale": scalar(float(qt.scale.reshape(()))),
                "input_scale": scalar(amax / FP8_MAX if amax > 0 else 1.0)}
    if algo in NVFP4_ALGOS:
        out = {"weight": pack_fp4(qt.values), "weight_scale": qt.scale.to(torch.float8_e4m3fn),
               "weight_scale_2": scalar(1.0 / float(qt.extra[GLOBAL].reshape(())))}
        if algo == "NVFP4":
            out["input_scale"] = scalar(amax / _FP4_INPUT_MAX if amax > 0 else 1.0)
        return out
    # the full int4 grid (docs/grids.md): TensorRT-LLM decodes q * s for every code -8..7
    out = {"weight": pack_int4_pairs(qt.values).view(torch.uint8), "weight_scale": qt.scale.to(torch.float32)}
    if prequant:
        out["pre_quant_scale"] = torch.ones(qt.shape[1], dtype=dtype)
    if algo == "W4A8_AWQ":
        wa = w4a8_weight_amax(qt) if weight_amax is None else weight_amax
        out["weight_scale_2"] = scalar(wa / FP8_MAX if wa > 0 else 1.0)
        out["input_scale"] = scalar(amax / FP8_MAX if amax > 0 else 1.0)
    return out


def decode(algo: str, t: Mapping[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype, where: str = "") -> QTensor:
    scale = t["weight_scale"].float()
    if algo in NVFP4_ALGOS:
        gs = 1.0 / t["weight_scale_2"].float().reshape(1)
        return QTensor(unpack_fp4(t["weight"]), scale, scheme, None, None, dtype, {GLOBAL: gs})
    if algo == "FP8":
        return QTensor(t["weight"], scale.reshape(1), scheme, None, None, dtype)
    if "pre_quant_scale" in t and not bool((t["pre_quant_scale"] == 1).all()):
        raise UsageError(f"{where}: pre_quant_scale is not all ones (AWQ scales kept outside the weights)",
                         "qtk simulates checkpoints whose smoothing is folded into the weights, as qtk writes them")
    return QTensor(unpack_int4_pairs(t["weight"]), scale, scheme, None, None, dtype)
