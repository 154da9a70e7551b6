"""qtk's native whole-buffer scans (qtk/quant/native/scan.py): CRC-32C against a bitwise reference and its known
check value, across the three-stream split and its joins; the NaN/Inf scan against torch.isfinite for every bf16 and
fp16 value; and the fallbacks (zlib's CRC, torch's scan) where the kernels are off."""

import random
import zlib

import numpy as np
import pytest
import torch

import qtk.quant.native as native
from qtk.io.safetensors import save_file, SafetensorsFile
from qtk.quant import finite
from qtk.quant.native import scan
from qtk.quant.qtensor import QTensor, qtensor_digest
from qtk.quant.scheme import QuantScheme

pytestmark = pytest.mark.skipif(native.library() is None, reason="qtk's native kernels are not built here (no C compiler)")


def crc32c_reference(data: bytes, crc: int = 0) -> int:
    """Bit by bit, reflected polynomial 0x82f63b78 (RFC 3720)."""
    c = crc ^ 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
    return c ^ 0xFFFFFFFF


def test_crc32c_check_value_and_reference():
    assert scan.crc32c(b"123456789") == 0xE3069283
    assert scan.crc32c(b"") == 0
    rng = random.Random(0)
    # below and across the three-stream threshold (3 x 4096), with every tail length mod 8 and mod 3
    for n in (1, 7, 8, 9, 4095, 3 * 4096 - 1, 3 * 4096, 3 * 4096 + 1, 3 * 4096 + 7, 3 * 4096 + 23, 40001):
        data = rng.randbytes(n)
        assert scan.crc32c(data) == crc32c_reference(data), n


def test_crc32c_continues_from_a_value():
    data = np.random.default_rng(1).integers(0, 256, 1 << 20, dtype=np.uint8)
    whole = scan.crc32c(data)
    for cut in (0, 1, 8191, 12288, 500000, len(data) - 3):
        assert scan.crc32c(data[cut:], scan.crc32c(data[:cut])) == whole, cut
    flipped = data.copy()
    flipped[777777] ^= 0x10
    assert scan.crc32c(flipped) != whole


def test_crc32c_reads_readonly_buffers_without_copy_errors():
    data = bytes(range(256)) * 100
    assert scan.crc32c(memoryview(data)) == scan.crc32c(bytearray(data)) == crc32c_reference(data)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_finite_scan_every_16_bit_value(dtype):
    values = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    want = torch.isfinite(values.float())
    got = torch.tensor([scan.all_finite(values[i:i + 1]) for i in range(values.numel())])
    assert torch.equal(got, want)
    assert scan.all_finite(values[want]) is True


def test_finite_scan_float32_and_positions():
    bits = torch.from_numpy(np.random.default_rng(2).integers(-2**31, 2**31, 20000, dtype=np.int64).astype(np.int32))
    for x in bits.view(torch.float32):
        assert scan.all_finite(x.reshape(1)) == bool(torch.isfinite(x))
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = torch.randn(3 * 65536 + 5).to(dtype)
        assert scan.all_finite(x) is True
        for pos in (0, 65535, 65536, 2 * 65536 + 1, x.numel() - 1):  # each thread's range, its first and last element
            for bad in (float("nan"), float("inf"), float("-inf")):
                y = x.clone()
                y[pos] = bad
                assert scan.all_finite(y) is False, (dtype, pos, bad)


def test_finite_scan_declines_what_it_does_not_cover():
    assert scan.all_finite(torch.ones(4, dtype=torch.float64)) is None
    assert scan.all_finite(torch.ones(4, 4)[:, ::2]) is None  # not contiguous


def test_all_finite_on_stored_tensors_with_and_without_kernels(tmp_path, monkeypatch):
    x = torch.randn(1000, 300).to(torch.bfloat16)
    bad = x.clone()
    bad[999, 299] = float("nan")
    save_file({"x": x, "bad": bad}, tmp_path / "t.safetensors")
    f = SafetensorsFile(tmp_path / "t.safetensors")
    for kernels in (True, False):
        if not kernels:
            monkeypatch.setattr(scan, "library", lambda: None)
        assert finite.all_finite(f.stored("x")) and finite.all_finite(x)
        assert not finite.all_finite(f.stored("bad")) and not finite.all_finite(bad)


def _qt(seed: int) -> QTensor:
    g = torch.Generator().manual_seed(seed)
    return QTensor(values=torch.randint(-8, 8, (64, 256), generator=g, dtype=torch.int8),
                   scale=torch.rand(64, 2, generator=g),
                   scheme=QuantScheme(num_bits=4, type="int", strategy="group", group_size=128), dtype=torch.bfloat16)


def _digest_with(update, qt) -> int:
    """The digest's byte stream (scheme, dtype and shape; then each tensor's name, dtype, shape and bytes) under a
    CRC `update(data, crc)`."""
    crc = update(repr((qt.scheme, str(qt.dtype), tuple(qt.shape))).encode(), 0)
    for name, t in (("values", qt.values), ("scale", qt.scale), ("zero_point", None), ("g_idx", None)):
        if t is None:
            crc = update(f"{name}: none".encode(), crc)
            continue
        crc = update(f"{name}: {t.dtype} {list(t.shape)}".encode(), crc)
        crc = update(t.reshape(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc


def test_qtensor_digest_is_crc32c_with_kernels_and_zlib_without(monkeypatch):
    qt = _qt(0)
    changed = _qt(0)
    changed.values[63, 255] = changed.values[63, 255] ^ 1
    with_kernels = qtensor_digest(qt)
    assert with_kernels == _digest_with(crc32c_reference, qt)
    assert qtensor_digest(_qt(0)) == with_kernels and qtensor_digest(changed) != with_kernels
    monkeypatch.setattr(scan, "library", lambda: None)
    without = qtensor_digest(qt)
    assert without == _digest_with(zlib.crc32, qt) != with_kernels
    assert qtensor_digest(changed) != without
