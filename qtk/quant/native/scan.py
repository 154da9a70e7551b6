"""Python side of kernels.c's whole-buffer scans, at memory speed: CRC-32C of bytes (the QTensor digest the data-free
stream takes of each Linear and the self-check takes again of the bytes it reads back) and the NaN/Inf scan of a
float tensor (every source tensor as it is read, every dense tensor the self-check reads), and the count of
float32 values that are not powers of two (MX scales in the self-check). None where the kernels do
not apply (turned off, not built, an accelerator tensor, another dtype): the caller's torch or zlib path."""

from __future__ import annotations

import numpy as np
import torch

from qtk.quant.native import library, thread_count

_DT = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
CHECK_VALUE = 0xE3069283  # CRC-32C of b"123456789" (RFC 3720, iSCSI)


def crc32c(data, value: int = 0) -> int | None:
    """CRC-32C of a bytes-like object (bytes, a numpy array, a memoryview) continuing from `value` (a finished CRC;
    0 to start), or None without the kernels."""
    lib = library()
    if lib is None:
        return None
    view = memoryview(data)
    if not view.contiguous:
        return None
    arr = np.frombuffer(view.cast("B"), dtype=np.uint8)  # read-only buffers too, without a copy
    return int(lib.qtk_crc32c(arr.ctypes.data, arr.size, value)) if arr.size else value


def all_finite(t: torch.Tensor) -> bool | None:
    """Whether a float32 / bfloat16 / float16 CPU tensor holds no NaN or Inf, in one pass over its bits; None
    where the kernels do not apply."""
    lib = library()
    if lib is None or t.device.type != "cpu" or t.dtype not in _DT or not t.is_contiguous():
        return None
    if not t.numel():
        return True
    got = lib.qtk_all_finite(t.data_ptr(), t.numel(), _DT[t.dtype], thread_count())
    return None if got < 0 else bool(got)


def count_not_pow2(t: torch.Tensor) -> int | None:
    """How many values of a float32 CPU tensor are not positive finite powers of two (subnormal ones included; zero,
    negatives, Inf and NaN counted), in one pass over its bits; None where the kernels do not apply."""
    lib = library()
    if lib is None or t.device.type != "cpu" or t.dtype != torch.float32:
        return None
    t = t.contiguous()
    return int(lib.qtk_count_not_pow2(t.data_ptr(), t.numel(), thread_count())) if t.numel() else 0


def self_test(lib) -> str | None:
    """A problem with the scans (a CRC or a finiteness verdict that is not the known one), or None."""
    if lib.qtk_crc32c(b"123456789", 9, 0) != CHECK_VALUE:
        return "crc32c of the check string is not 0xe3069283"
    if lib.qtk_crc32c(b"56789", 5, lib.qtk_crc32c(b"1234", 4, 0)) != CHECK_VALUE:
        return "crc32c does not continue from an earlier value"
    for dtype in _DT:
        x = torch.linspace(-3, 3, 1000).to(dtype)
        for bad, want in ((None, 1), (float("inf"), 0), (float("-inf"), 0), (float("nan"), 0)):
            y = x.clone()
            if bad is not None:
                y[777] = bad
            if lib.qtk_all_finite(y.data_ptr(), y.numel(), _DT[dtype], 2) != want:
                return f"finite scan of {dtype} with {bad} is wrong"
    return None
