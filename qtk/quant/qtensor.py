"""QTensor: the quantized truth for one weight. Algorithms produce it; writers pack it; readers rebuild it."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Mapping

import torch

from qtk.quant.formats.base import Format, QParams, format_for
from qtk.quant.scheme import QuantScheme


@dataclass(frozen=True)
class QTensor:
    """Unpacked quantized values of a [out, in] weight and everything needed to dequantize them.

    values: the format's storage dtype (int8 in the signed range, also for int4/int2 and asymmetric;
            float8_e4m3fn), shape [out, in]
    scale: float32, [1] (tensor), [out, 1] (channel) or [out, in/group] (group)
    zero_point: float32 integers in the signed range, same shape as scale; None when symmetric
    g_idx: int32 [in], group of each input column (GPTQ act-order); None = column // group_size
    dtype: the source dtype (what dense tensors and int scales are stored in)
    extra: tensors a format needs beyond scale and zero point (e.g. a global scale), named by its spec
    """

    values: torch.Tensor
    scale: torch.Tensor
    scheme: QuantScheme
    zero_point: torch.Tensor | None = None
    g_idx: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)

    @property
    def format(self) -> Format:
        return format_for(self.scheme)

    @property
    def qparams(self) -> QParams:
        return QParams(self.scale, self.zero_point, self.extra)

    def dequantize(self) -> torch.Tensor:
        return self.format.dequantize(self.values, self.qparams, self.scheme, self.g_idx)

    def to(self, device) -> "QTensor":
        """The same QTensor with every tensor on `device` (the same object when they already are)."""
        device = torch.device(device)
        if self.values.device == device:
            return self
        move = (lambda t: None if t is None else t.to(device))
        return replace(self, values=self.values.to(device), scale=self.scale.to(device), zero_point=move(self.zero_point),
                       g_idx=move(self.g_idx), extra={k: v.to(device) for k, v in self.extra.items()})

    @classmethod
    def quantize(cls, w: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype | None = None) -> "QTensor":
        """Round-to-nearest with the scheme's observer. Int scales are rounded to the model dtype first,
        so the scale on disk is exactly the one that produced the values, and a bf16/fp16 model's int arithmetic
        is rounded as compressed-tensors rounds it (qtk.quant.formats.integer)."""
        dtype = dtype or w.dtype
        fmt = format_for(scheme)
        qp = fmt.qparams(w, scheme, dtype)
        return cls.of(fmt.quantize(w, qp, scheme, model_dtype=dtype), qp, scheme, dtype)

    @classmethod
    def of(cls, values: torch.Tensor, qp: QParams, scheme: QuantScheme, dtype: torch.dtype,
           g_idx: torch.Tensor | None = None) -> "QTensor":
        """A QTensor from stored values and the qparams that produced them."""
        return cls(values, qp.scale, scheme, qp.zero_point, g_idx, dtype, dict(qp.extra))


def qtensor_digest(qt) -> int:
    """A 32-bit checksum over everything that decides a QTensor's decoded weight: scheme, dtype, shape, and the
    bytes of its values, scale, zero point, g_idx and a format's extra tensors. CRC-32C from qtk's native kernels
    (qtk.quant.native.scan, several times zlib's speed), zlib's CRC-32 without them; one process
    always uses the same one, and a digest is only compared within the process that took it (the data-free stream's,
    against the self-check's of the bytes read back). A CRC catches any one changed byte (and any burst up to 32
    bits) at memory speed, unlike a cryptographic hash: this guards against writer bugs, not forgery."""
    import zlib

    from qtk.quant.native import scan

    update = scan.crc32c if scan.library() is not None else zlib.crc32
    crc = update(repr((qt.scheme, str(qt.dtype), tuple(qt.shape))).encode(), 0)
    for name, t in (("values", qt.values), ("scale", qt.scale), ("zero_point", qt.zero_point), ("g_idx", qt.g_idx),
                    *sorted(qt.extra.items())):
        if t is None:
            crc = update(f"{name}: none".encode(), crc)
            continue
        t = t.detach().cpu().contiguous()
        crc = update(f"{name}: {t.dtype} {list(t.shape)}".encode(), crc)
        crc = update(t.reshape(-1).view(torch.uint8).numpy(), crc)
    return crc
