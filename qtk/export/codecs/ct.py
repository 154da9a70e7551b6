"""compressed-tensors layouts (docs/formats.md, vllm): which format a module's scheme is stored in, and its tensors.

    pack-quantized   weight_packed int32 [out, ceil(in·bits/32)], weight_scale [out, groups] (model dtype),
                     weight_shape int64 [2], weight_zero_point int32 packed along out (asymmetric only)
    int-quantized    weight int8 [out, in], weight_scale (model dtype)
    float-quantized  weight float8_e4m3fn [out, in], weight_scale float32 holding model-dtype values (tensor /
                     channel); FP8 blocks: weight_scale in the model dtype [ceil(out/bm), ceil(in/bn)]
    nvfp4-pack-quantized  weight_packed uint8 [out, in/2] (e2m1 codes, element 2i in the low nibble),
                     weight_scale float8_e4m3fn [out, in/16], weight_global_scale float32 [1]; W4A4 adds
                     input_global_scale float32 [1] (no weight_shape)
    mxfp4-pack-quantized  weight_packed uint8 [out, in/2], weight_scale uint8 E8M0 codes [out, in/32]
    mxfp8-quantized  weight float8_e4m3fn [out, in], weight_scale uint8 E8M0 codes [out, in/32]
    any              weight_g_idx int32 [in] in older checkpoints (actorder group), read but never written

W4A8-FP8 (int4 groups with FP8 per-token activations) is pack-quantized: vLLM's CompressedTensorsW4A8Fp8 reads
weight_packed, as llm-compressor's W4AFP8 example saves it. W4A8-INT8 (int4 groups with INT8 per-token activations)
is int-quantized: weight int8 [out, in] holding the codes -8..7, as llm-compressor's W4A8 writes it and vLLM's
CompressedTensorsW4A8Int loads it (an int8 `weight` [out, in] and `weight_scale` [out, in/group]).
"""

from __future__ import annotations

from typing import Mapping

import torch

from qtk.io.safetensors import recycled_empty
from qtk.quant.fp4 import pack_fp4, unpack_fp4
from qtk.quant.formats.nvfp4 import GLOBAL
from qtk.quant.mx import e8m0_encode, e8m0_to_float
from qtk.quant.pack import pack_ct, pack_ct_zero_point, unpack_ct, unpack_ct_zero_point
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme

NVFP4, MXFP4, MXFP8 = "nvfp4-pack-quantized", "mxfp4-pack-quantized", "mxfp8-quantized"
FORMATS = ("pack-quantized", "int-quantized", "float-quantized", NVFP4, MXFP4, MXFP8)
# compressed-tensors' scale_dtype of the formats whose scales are not in the model dtype (written, and required
# by its MX compressors, which key on torch.uint8)
SCALE_DTYPE = {NVFP4: "torch.float8_e4m3fn", MXFP4: "torch.uint8", MXFP8: "torch.uint8"}


def ct_format(scheme) -> str:
    """The compressed-tensors format of a module's ModuleScheme (weights and activations)."""
    w = scheme.weights
    if w.is_nvfp4:
        return NVFP4
    if w.is_mx:
        return MXFP4 if w.num_bits == 4 else MXFP8
    if w.is_fp8:
        return "float-quantized"
    if scheme.activations is not None and not scheme.activations.is_fp8:  # W8A8 int8, W4A8-INT8; W4A8-FP8 stays packed
        return "int-quantized"
    return "pack-quantized"


def input_scale_key(scheme) -> str:
    """The tensor holding a module's static input scale: NVFP4's global input scale, else input_scale."""
    return "input_global_scale" if scheme.activations is not None and scheme.activations.is_nvfp4 else "input_scale"


def encode(qt: QTensor, dtype: torch.dtype, fmt: str) -> dict[str, torch.Tensor]:
    s = qt.scheme
    if fmt == NVFP4:
        return {"weight_packed": pack_fp4(qt.values), "weight_scale": qt.scale.to(torch.float8_e4m3fn),
                "weight_global_scale": qt.extra[GLOBAL].float().reshape(1)}
    if fmt == MXFP4:
        return {"weight_packed": pack_fp4(qt.values), "weight_scale": e8m0_encode(qt.scale)}
    if fmt == MXFP8:
        return {"weight": qt.values, "weight_scale": e8m0_encode(qt.scale)}
    if fmt == "pack-quantized":
        out = {
            "weight_packed": pack_ct(qt.values, s.num_bits),
            "weight_scale": qt.scale.to(dtype),
            "weight_shape": torch.tensor(list(qt.shape), dtype=torch.int64),
        }
        if qt.zero_point is not None:
            out["weight_zero_point"] = pack_ct_zero_point(qt.zero_point.reshape(qt.scale.shape), s.num_bits)
        return out
    # fp8 (tensor / channel): model-dtype values (llm-compressor's, bit for bit) stored float32, so compressed-tensors'
    # decompression q.to(scale.dtype) * scale is the exact product vLLM's fp8 GEMMs apply; blocks: model dtype, as ct
    scale_dtype = torch.float32 if s.is_fp8 and s.strategy != "block" else dtype
    return {"weight": qt.values, "weight_scale": qt.scale.to(scale_dtype)}


def _float(t: torch.Tensor) -> torch.Tensor:
    """t as float32, a copy in a recycled buffer (qtk.io.safetensors.recycled_empty: the self-check decodes layer
    after layer, each scale the size of the last layer's) unless it is float32 already."""
    if t.dtype == torch.float32:
        return t
    from qtk.quant.native.packing import e4m3_to_float

    fast = e4m3_to_float(t)  # NVFP4's fp8 group scales: torch converts float8 a value at a time
    return fast if fast is not None else recycled_empty(t.shape, torch.float32).copy_(t)


def decode(t: Mapping[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype) -> QTensor:
    """The QTensor of one module from its stored tensors (packed or not, as found)."""
    if scheme.is_nvfp4:
        values = unpack_fp4(t["weight_packed"])
        return QTensor(values, _float(t["weight_scale"]), scheme, dtype=dtype,
                       extra={GLOBAL: t["weight_global_scale"].float().reshape(1)})
    if scheme.is_mx:
        values = unpack_fp4(t["weight_packed"]) if scheme.num_bits == 4 else t["weight"]
        return QTensor(values, e8m0_to_float(t["weight_scale"]), scheme, dtype=dtype)
    scale = _float(t["weight_scale"])
    zero = None
    if "weight_packed" in t:
        out_f, in_f = t["weight_shape"].tolist()
        values = unpack_ct(t["weight_packed"], scheme.num_bits, in_f)
        if "weight_zero_point" in t:
            zero = unpack_ct_zero_point(t["weight_zero_point"], scheme.num_bits, out_f).float()
    else:
        values = t["weight"]
    # older compressed-tensors checkpoints (actorder "group") carry a g_idx; decoding without it would be wrong
    g_idx = t["weight_g_idx"].to(torch.int32) if "weight_g_idx" in t else None
    return QTensor(values, scale, scheme, zero, g_idx, dtype)
