"""Legacy GPTQ layout (docs/formats.md, gptq), per quantized Linear X with b-bit weights:

    X.qweight int32 [in·b/32, out]    unsigned codes q + 2^(b-1), packed along in
    X.qzeros  int32 [groups, out·b/32] unsigned zero points, stored z - 1 in v1 ("gptq"), z in v2 ("gptq_v2")
    X.scales  fp16  [groups, out]
    X.g_idx   int32 [in]              group of each input column (column // group_size without act-order)

QTensors are in qtk's signed convention both ways: values and zero points minus 2^(b-1), scales exactly the fp16 on
disk (as float32), g_idx only when it is not the trivial one.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from qtk.errors import UsageError
from qtk.quant.pack import offset, pack_gptq_qweight, pack_gptq_qzeros, unpack_gptq_qweight, unpack_gptq_qzeros
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy

SUFFIXES = ("qweight", "qzeros", "scales", "g_idx")


def trivial_g_idx(in_features: int, group_size: int | None) -> torch.Tensor:
    """The group of each input column without act-order: column // group_size (all 0 per-channel)."""
    cols = torch.arange(in_features, dtype=torch.int32)
    return cols // group_size if group_size else torch.zeros_like(cols)


def per_group(t: torch.Tensor, out_features: int) -> torch.Tensor:
    """A QTensor scale / zero point ([1], [out, 1] or [out, groups]) as [out, groups]."""
    return t.reshape(-1, 1).expand(out_features, 1) if t.numel() == 1 else t.reshape(out_features, -1)


def g_idx_of(qt: QTensor) -> torch.Tensor:
    """The g_idx stored for a QTensor: its own (act-order), else the trivial one."""
    s = qt.scheme
    trivial = trivial_g_idx(qt.shape[1], s.group_size if s.strategy == Strategy.GROUP else None)
    return trivial if qt.g_idx is None else qt.g_idx.to(torch.int32)


def acts_in_order(qt: QTensor) -> bool:
    """True when the QTensor's groups are in column order (desc_act false)."""
    s = qt.scheme
    return torch.equal(g_idx_of(qt), trivial_g_idx(qt.shape[1], s.group_size if s.strategy == Strategy.GROUP else None))


def needs_v2(qt: QTensor) -> bool:
    """A zero point of 0 (unsigned), which v1's stored z - 1 cannot hold."""
    if qt.zero_point is None:
        return False
    zero = per_group(qt.zero_point, qt.shape[0])
    return bool((zero.to(torch.int64) + offset(qt.scheme.num_bits) == 0).any())


def encode(qt: QTensor, v1: bool, fp16_scales: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """fp16_scales: float32 [out, groups] -> the float16 stored (the writer counts what rounding changed)."""
    bits = qt.scheme.num_bits
    out_f = qt.shape[0]
    zero = None if qt.zero_point is None else per_group(qt.zero_point, out_f)
    scale = per_group(qt.scale, out_f)  # [out, groups]
    return {
        "qweight": pack_gptq_qweight(qt.values, bits),  # [in*bits/32, out]
        "qzeros": pack_gptq_qzeros(zero, bits, v1=v1, shape=tuple(scale.shape)),  # [groups, out*bits/32]
        "scales": fp16_scales(scale).t().contiguous(),  # [groups, out]
        "g_idx": g_idx_of(qt),  # [in]
    }


def decode(t: Mapping[str, torch.Tensor], scheme: QuantScheme, v1: bool, where: str = "") -> QTensor:
    bits, s = scheme.num_bits, scheme
    values = unpack_gptq_qweight(t["qweight"], bits)  # [out, in]
    out_f, in_f = values.shape
    scale = t["scales"].float().t().contiguous()  # [groups, out] -> [out, groups]
    zero = unpack_gptq_qzeros(t["qzeros"], bits, v1=v1)[:out_f].float()  # [out, groups]
    if s.symmetric and not zero.any():
        zero = None
    g_idx = t["g_idx"].to(torch.int32) if "g_idx" in t else None
    if g_idx is not None and torch.equal(g_idx, trivial_g_idx(in_f, s.group_size)):
        g_idx = None
    if g_idx is None and s.strategy == Strategy.GROUP and scale.shape[1] * s.group_size != in_f:
        raise UsageError(f"{where} has {scale.shape[1]} scale groups for {in_f} inputs",
                         f"the checkpoint does not match its group_size {s.group_size}")
    return QTensor(values, scale, s, zero, g_idx, torch.float16)  # the kernels dequantize in the scales' fp16


def rewrite_v1_qzeros(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """qzeros written in v1 re-encoded for v2 (z - 1 -> z): same shape and size, so it can be rewritten in place."""
    return pack_gptq_qzeros(unpack_gptq_qzeros(packed, bits, v1=True), bits, v1=False)
