"""compressed-tensors layouts (docs/formats.md, vllm): which format a module's scheme is stored in, and its tensors.

    pack-quantized   weight_packed int32 [out, ceil(in·bits/32)], weight_scale [out, groups] (model dtype),
                     weight_shape int64 [2], weight_zero_point int32 packed along out (asymmetric only)
    int-quantized    weight int8 [out, in], weight_scale (model dtype)
    float-quantized  weight float8_e4m3fn [out, in], weight_scale float32
    any              weight_g_idx int32 [in] in older checkpoints (actorder group), read but never written
"""

from __future__ import annotations

from typing import Mapping

import torch

from qtk.quant.pack import pack_ct, pack_ct_zero_point, unpack_ct, unpack_ct_zero_point
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme

FORMATS = ("pack-quantized", "int-quantized", "float-quantized")


def ct_format(scheme) -> str:
    """The compressed-tensors format of a module's ModuleScheme (weights and activations)."""
    if scheme.weights.is_fp8:
        return "float-quantized"
    if scheme.activations is not None:
        return "int-quantized"
    return "pack-quantized"


def encode(qt: QTensor, dtype: torch.dtype, fmt: str) -> dict[str, torch.Tensor]:
    s = qt.scheme
    if fmt == "pack-quantized":
        out = {
            "weight_packed": pack_ct(qt.values, s.num_bits),
            "weight_scale": qt.scale.to(dtype),
            "weight_shape": torch.tensor(list(qt.shape), dtype=torch.int64),
        }
        if qt.zero_point is not None:
            out["weight_zero_point"] = pack_ct_zero_point(qt.zero_point.reshape(qt.scale.shape), s.num_bits)
        return out
    scale_dtype = torch.float32 if s.is_fp8 else dtype
    return {"weight": qt.values, "weight_scale": qt.scale.to(scale_dtype)}


def decode(t: Mapping[str, torch.Tensor], scheme: QuantScheme, dtype: torch.dtype) -> QTensor:
    """The QTensor of one module from its stored tensors (packed or not, as found)."""
    scale = t["weight_scale"].float()
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
