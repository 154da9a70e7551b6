"""Legacy AWQ GEMM layout (docs/formats.md, awq), int4 group-wise only, per quantized Linear X:

    X.qweight int32 [in, out/8]      unsigned codes q + 8, packed along out in AWQ's order [0,2,4,6,1,3,5,7]
    X.qzeros  int32 [in/group, out/8] unsigned zero points, raw (no -1), same packing
    X.scales  fp16  [in/group, out]

Every AWQ kernel subtracts the stored zero point, so a symmetric QTensor is written with zero point 8 (unsigned) and
comes back with zero points of 0 — (q_u − 8)·s either way. Values and zero points are signed in the QTensor.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch

from qtk.errors import UsageError
from qtk.quant.pack import offset, pack_awq, unpack_awq
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme

BITS = 4
SUFFIXES = ("qweight", "qzeros", "scales")


def encode(qt: QTensor, fp16_scales: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    q_u = qt.values.to(torch.int64) + offset(BITS)  # [out, in], 0..15
    z_u = (torch.full(qt.scale.shape, offset(BITS), dtype=torch.int64) if qt.zero_point is None
           else qt.zero_point.to(torch.int64) + offset(BITS))  # [out, groups]
    return {
        "qweight": pack_awq(q_u.t(), BITS),  # [in, out/8]
        "qzeros": pack_awq(z_u.t(), BITS),  # [groups, out/8]
        "scales": fp16_scales(qt.scale).t().contiguous(),  # [groups, out]
    }


def decode(t: Mapping[str, torch.Tensor], scheme: QuantScheme, where: str = "") -> QTensor:
    s = scheme
    values = (unpack_awq(t["qweight"], BITS) - offset(BITS)).t().contiguous().to(torch.int8)  # [out, in]
    out_f, in_f = values.shape
    scale = t["scales"].float().t().contiguous()  # [groups, out] -> [out, groups]
    if scale.shape != (out_f, in_f // s.group_size) or in_f % s.group_size:
        raise UsageError(f"{where} scales {list(scale.shape)} do not fit a [{out_f}, {in_f}] weight "
                         f"with group_size {s.group_size}", "the checkpoint does not match its config")
    zero = None
    if "qzeros" in t:  # the kernels subtract it whatever zero_point says
        zero = (unpack_awq(t["qzeros"], BITS) - offset(BITS)).t().contiguous().float()  # [out, groups]
        if s.symmetric and not zero.any():
            zero = None
    return QTensor(values, scale, s, zero, None, torch.float16)  # the kernels dequantize in the scales' fp16
