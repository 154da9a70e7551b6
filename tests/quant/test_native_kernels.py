"""qtk's native CPU kernels (qtk/quant/native/kernels.c) against the torch path they replace: the same codes and scales
bit for bit (exhaustively for the fp8 and fp4 rounding of every bf16 and fp16 value in range), the relative error to
float64 rounding, results independent of the thread count, and a fallback to torch whenever they cannot be
trusted."""

import contextlib
import ctypes

import pytest
import torch

import qtk.quant.native as native
from qtk.quant.formats import kernel
from qtk.quant.native import rounding
from qtk.quant.error import ErrorSum, block_rows, relative_error
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme
from qtk.model.simulate import engine_weight

pytestmark = pytest.mark.skipif(native.library() is None, reason="qtk's native kernels are not built here (no C compiler)")

FP8 = QuantScheme(num_bits=8, type="float", strategy="channel")
INT8 = QuantScheme(num_bits=8, type="int", strategy="channel")
INT4_G128 = QuantScheme(num_bits=4, type="int", strategy="group", group_size=128)
INT4_G32 = QuantScheme(num_bits=4, type="int", strategy="group", group_size=32)
INT2_G64 = QuantScheme(num_bits=2, type="int", strategy="group", group_size=64)
BLOCK = QuantScheme(num_bits=8, type="float", strategy="block", block_structure=(128, 128))
BLOCK_SMALL = QuantScheme(num_bits=8, type="float", strategy="block", block_structure=(16, 96))  # ragged tiles below
MXFP4 = QuantScheme(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="e8m0")
NVFP4 = QuantScheme(num_bits=4, type="float", strategy="tensor_group", group_size=16)


def _same(values: torch.Tensor, ref: torch.Tensor) -> bool:
    return values.dtype == ref.dtype and torch.equal(values.view(torch.uint8), ref.view(torch.uint8))


def _codes(half: torch.dtype) -> torch.Tensor:
    """Every finite value of `half` with |x| <= 448, as rows of 256 whose first entry is 448: each row's fp8 scale is
    448 / 448 = 1, so every other entry is rounded to e4m3 as it is."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(half).float()
    x = bits[torch.isfinite(bits) & (bits.abs() <= 448)]
    x = torch.cat([x, torch.zeros((-x.numel()) % 255)])
    rows = x.reshape(-1, 255)
    return torch.cat([torch.full((rows.shape[0], 1), 448.0), rows], dim=1).to(half)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_fp8_rounding_of_every_half_value_is_torchs(half):
    w = _codes(half)
    ref = QTensor.quantize(w.float(), FP8, half)
    assert torch.equal(ref.scale, torch.ones_like(ref.scale))  # the premise: quotient = value
    for given in (w, w.float()):
        values, scale, _ = kernel.native_rtn(given, FP8, half, want_error=False)
        assert _same(values, ref.values) and torch.equal(scale, ref.scale)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_fp4_rounding_of_every_half_value_is_torchs(half):
    """Every value with |x| <= 6.9 in groups of 32 led by 6.0: each group's MX scale is 1 (6.9 rounds down to the
    power of two 4, whose scale is 2^(2-2)), so each value is rounded to e2m1 as it is, ties and saturation included."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(half).float()
    x = bits[torch.isfinite(bits) & (bits.abs() <= 6.9)]
    x = torch.cat([x, torch.zeros((-x.numel()) % 31)]).reshape(-1, 31)
    x = torch.cat([torch.full((x.shape[0], 1), 6.0), x], dim=1)
    w = torch.cat([x, torch.zeros((-x.shape[0]) % 8, 32)]).reshape(-1, 256).to(half)  # 8 groups a row
    ref = QTensor.quantize(w.float(), MXFP4, half)
    led = ref.scale[:-1]  # the padding's all-zero groups (last row) take the smallest scale
    assert torch.equal(led, torch.ones_like(led))
    values, scale, _ = kernel.native_rtn(w, MXFP4, half, want_error=False)
    assert _same(values, ref.values) and torch.equal(scale, ref.scale)


def _group_leaders(half: torch.dtype, group: int, limit: float) -> torch.Tensor:
    """Every finite value of `half` with |x| <= limit, one per group of `group` columns (the rest of each group a
    quarter of it), 256 columns a row: each group's amax is that value."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(half).float()
    x = bits[torch.isfinite(bits) & (bits.abs() <= limit)]
    x = torch.cat([x, torch.zeros((-x.numel()) % (256 // group))])
    groups = torch.cat([x[:, None], (x / 4)[:, None].expand(-1, group - 1)], dim=1)
    return groups.reshape(-1, 256).to(half)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_fp4_group_scales_of_every_half_amax_are_torchs(half):
    """The group scales of the 4-bit float formats for every amax the model dtype holds: NVFP4's e4m3 rounding of
    gs * amax / 6 over e4m3's whole range (subnormal, normal, clamped at 448; gs 1), MXFP4's power of two up to the
    largest float (where the rounded exponent saturates)."""
    from qtk.quant.formats.nvfp4 import GLOBAL, NVFP4Format

    w = _group_leaders(half, 16, 2700.0)  # 448 * 6 = 2688: past it the scale clamps
    extra = {GLOBAL: torch.tensor(1.0)}
    qp = NVFP4Format().row_qparams(w.float(), NVFP4, half, extra)
    ref = NVFP4Format().quantize(w.float(), qp, NVFP4)
    for given in (w, w.float()):
        values, scale, _ = kernel.native_rtn(given, NVFP4, half, extra, want_error=False)
        assert _same(values, ref) and torch.equal(scale, qp.scale.float())
    w = _group_leaders(half, 32, float("inf"))
    ref = QTensor.quantize(w.float(), MXFP4, half)
    values, scale, _ = kernel.native_rtn(w, MXFP4, half, want_error=False)
    assert _same(values, ref.values) and torch.equal(scale, ref.scale.float())


def _weights(rows=96, cols=256, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, cols, generator=g) * 0.05
    w[1] = 0.0  # a zero scale: the dtype's eps (1.0 in float32)
    w[2] *= 1e-39  # subnormal amax, scales and quotients
    w[3, 5] = 40.0  # one outlier: the rest of its row rounds to few codes
    w[4] = torch.linspace(-1.0, 1.0, cols)
    w[5, ::2] = -0.0
    return w


SCHEMES = {"fp8": FP8, "int8": INT8, "int4g128": INT4_G128, "int4g32": INT4_G32, "int2g64": INT2_G64, "block": BLOCK,
           "block16x96": BLOCK_SMALL, "mxfp4": MXFP4, "nvfp4": NVFP4}


@pytest.mark.parametrize("scheme", list(SCHEMES.values()), ids=list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("given", ["model-dtype", "float32"])
def test_codes_scales_and_error_are_the_torch_paths(scheme, dtype, given):
    w32 = _weights(rows=150 if scheme.strategy == "block" else 96).to(dtype).float()  # values of the model dtype
    w = w32 if given == "float32" else w32.to(dtype)
    ref = QTensor.quantize(w32, scheme, dtype)
    values, scale, sums = kernel.native_rtn(w, scheme, dtype, dict(ref.extra) or None)
    assert _same(values, ref.values) and torch.equal(scale, ref.scale) and ref.zero_point is None
    qt = QTensor(values, scale, scheme, None, None, dtype, dict(ref.extra))
    decoded = engine_weight(qt)
    assert sums.amax == float(decoded.abs().max())
    exact = float(torch.linalg.vector_norm(decoded.double() - w32.double()) / torch.linalg.vector_norm(w32.double()))
    err = ErrorSum().add_rows(sums.row_e, sums.row_w, block_rows(w32.shape)).value()
    assert err == pytest.approx(exact, rel=1e-12)  # float64 sums of exact squares: float64 rounding only
    assert err == relative_error(decoded, w32)  # the loop's figure (qtk_sq_rows) is the kernel's, bit for bit


@pytest.mark.parametrize("scheme", [INT4_G128, BLOCK_SMALL], ids=["int4g128", "block16x96"])
def test_results_do_not_depend_on_the_thread_count(scheme):
    w = _weights(rows=301, cols=384, seed=3).to(torch.bfloat16)
    one = kernel.native_rtn(w, scheme, torch.bfloat16, threads=1)
    for threads in (2, 3, 7):
        got = kernel.native_rtn(w, scheme, torch.bfloat16, threads=threads)
        assert torch.equal(got[0], one[0]) and torch.equal(got[1], one[1])
        assert torch.equal(got[2].row_e, one[2].row_e) and torch.equal(got[2].row_w, one[2].row_w)
        assert got[2].amax == one[2].amax
    d, r = torch.randn(301, 384), torch.randn(301, 384)
    assert all(torch.equal(a, b) for a, b in zip(rounding.sq_rows(d, r, threads=1), rounding.sq_rows(d, r, threads=5)))


def test_error_sums_are_float64_sums_of_the_float32_differences():
    """Eight lanes by column, combined pairwise; a row shorter than a lane group and a ragged tail included."""
    g = torch.Generator().manual_seed(5)
    for cols in (3, 8, 13, 4096):
        d, r = torch.randn(4, cols, generator=g), torch.randn(4, cols, generator=g)
        row_e, row_w = rounding.sq_rows(d, r)
        diff = (d - r).double()  # the difference rounded to float32 first, as the torch path forms it
        assert torch.allclose(row_e, (diff * diff).sum(1), rtol=1e-14, atol=0)
        assert torch.allclose(row_w, (r.double() ** 2).sum(1), rtol=1e-14, atol=0)
    rows = torch.arange(1.0, 11.0, dtype=torch.float64)
    assert rounding.block_sums(rows, 4) == [10.0, 26.0, 19.0]


def test_schemes_and_tensors_it_does_not_cover_fall_back():
    w = _weights().to(torch.bfloat16)
    assert kernel.native_rtn(w, QuantScheme(num_bits=4, type="int", strategy="group", group_size=128, symmetric=False),
                               torch.bfloat16) is None  # asymmetric
    assert kernel.native_rtn(w, QuantScheme(num_bits=8, type="float", strategy="tensor"), torch.bfloat16) is None
    assert kernel.native_rtn(w, QuantScheme(num_bits=4, type="int", strategy="group", group_size=128,
                                              observer="mse"), torch.bfloat16) is None
    assert kernel.native_rtn(w[:, :200], INT4_G128, torch.bfloat16) is None  # 200 columns: no whole groups
    assert kernel.native_rtn(w.to(torch.float16), FP8, torch.bfloat16) is None  # fp16 weights of a bf16 model
    assert kernel.native_rtn(w, NVFP4, torch.bfloat16) is None  # NVFP4 without its global scale
    assert kernel.native_rtn(w, QuantScheme(num_bits=8, type="float", strategy="group", group_size=32,
                                               scale_dtype="e8m0"), torch.bfloat16) is None  # MXFP8


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_weight_that_is_not_finite_is_left_to_the_torch_path(bad):
    w = _weights()
    w[7, 9] = bad
    assert kernel.native_rtn(w.to(torch.bfloat16), INT8, torch.bfloat16) is None


def test_a_scale_past_the_model_dtypes_range_is_left_to_the_torch_path():
    w = _weights()
    w[0, 0] = 3e7  # amax / 127.5 is past float16's 65504: the scale rounds to Inf
    assert kernel.native_rtn(w, INT8, torch.float16) is None
    assert torch.isinf(QTensor.quantize(w, INT8, torch.float16).scale).any()  # what the torch path then refuses


class _Tampered:
    """The real kernels, with one code changed after each call."""

    def __init__(self, lib):
        self.lib = lib

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def qtk_rtn(self, args, threads):
        used = self.lib.qtk_rtn(args, threads)
        a = ctypes.cast(args, ctypes.POINTER(native.RTNArgs)).contents
        ctypes.cast(a.values, ctypes.POINTER(ctypes.c_uint8))[0] ^= 1
        return used


def test_the_self_test_catches_a_kernel_that_disagrees_with_torch():
    lib = native.library()
    assert kernel.self_test(lib) is None
    assert "differ" in kernel.self_test(_Tampered(lib))


def test_the_kernels_can_be_turned_off_and_a_missing_compiler_falls_back(fresh_library, monkeypatch):
    monkeypatch.setenv("QTK_NATIVE", "0")
    assert native.library() is None
    native.library.cache_clear()
    monkeypatch.setenv("QTK_NATIVE", "1")
    monkeypatch.setenv("CC", "qtk-no-such-compiler")
    assert native.library() is None
    native.library.cache_clear()
    monkeypatch.setenv("CC", "false")  # a compiler that fails: a warning and the torch path, no partial library
    assert native.library() is None
    assert not list((native.cache_dir()).glob("*.so"))


def test_the_self_test_compares_with_torch_alone_and_loads_once(fresh_library, monkeypatch):
    """The torch reference the self-test runs reaches code that takes the kernels where they apply (MX scales
    decode through a byte table): inside the self-test library() is None, so the kernels load once and are compared
    with torch, not with themselves (a re-entered load recursed until Python's limit, then fell back)."""
    calls, real = [], native._checked_library
    monkeypatch.setattr(native, "_checked_library", lambda: (calls.append(1), real())[1])
    seen = []
    real_test = kernel.self_test
    # the rounding kernel is checked by the formats, whose arithmetic is the reference: inside that check it is not
    # trusted (the reference never reaches it), and the library is not loaded again
    monkeypatch.setattr(kernel, "self_test", lambda lib: (seen.append(kernel.trusted(lib)), real_test(lib))[1])
    lib = native.library()
    assert lib is not None and len(calls) == 1
    assert kernel.trusted(lib) and seen == [False] and native.library() is lib and len(calls) == 1


def test_a_build_lands_in_the_cache_once(fresh_library, monkeypatch):
    monkeypatch.delenv("CC", raising=False)
    lib = native.library()
    assert lib is not None
    built = list(native.cache_dir().glob("kernels-*.so"))
    assert len(built) == 1 and not list(native.cache_dir().glob(".kernels-*"))
    native.library.cache_clear()
    mtime = built[0].stat().st_mtime_ns
    assert native.library() is not None and built[0].stat().st_mtime_ns == mtime  # loaded, not rebuilt


def test_nibble_unpacking_is_the_torch_paths():
    """FP4 codes and compressed-tensors int4 words, unpacked natively, equal the torch path's unpacking (and pack's
    inverse), odd widths and padding words included."""
    from qtk.quant.fp4 import pack_fp4
    from qtk.quant.native.packing import unpack_nibbles
    from qtk.quant.pack import pack_ct, unpack_ct, unpack_words

    g = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert torch.equal(unpack_nibbles(packed, 64), codes)  # leading dims kept
    torch_way = torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(3, 5, 64)
    assert torch.equal(unpack_nibbles(packed, 64), torch_way)
    for cols in (7, 8, 33, 4096):
        q = torch.randint(-8, 8, (11, cols), generator=g, dtype=torch.int8)
        words = pack_ct(q, 4)  # rows padded to whole int32 words
        got = unpack_ct(words, 4, cols)
        assert got.dtype == torch.int8 and torch.equal(got, q)
        assert torch.equal(got, (unpack_words(words, 4, cols) - 8).to(torch.int8))
    assert unpack_nibbles(packed.to(torch.int16), 64) is None and unpack_nibbles(packed, 129) is None


def test_nibble_packing_is_the_torch_paths(torch_path, monkeypatch):
    """FP4 codes and compressed-tensors int4 values packed natively give the torch path's bytes (pack_words' int32
    words for int4, odd widths and padding words included), and unpack back."""
    from qtk.quant.fp4 import pack_fp4
    from qtk.quant.native import packing
    from qtk.quant.pack import pack_ct, pack_words, unpack_ct

    g = torch.Generator().manual_seed(8)
    fp4 = torch.randint(0, 16, (3, 5, 64), generator=g, dtype=torch.uint8)
    ints = {cols: torch.randint(-8, 8, (11, cols), generator=g, dtype=torch.int8) for cols in (1, 7, 8, 33, 4096)}
    ints[64] = torch.tensor([[-8, 7] * 32], dtype=torch.int8)  # the extremes
    by_torch = (pack_fp4(fp4), {c: pack_ct(q, 4) for c, q in ints.items()})  # the fixture: kernels off
    monkeypatch.setattr(packing, "library", native.library)
    assert packing.pack_nibbles(fp4, 32) is not None  # the kernels on again
    assert torch.equal(pack_fp4(fp4), by_torch[0])
    for cols, q in ints.items():
        words = pack_ct(q, 4)
        assert words.dtype == torch.int32 and torch.equal(words, by_torch[1][cols]), cols
        assert torch.equal(words, pack_words((q.to(torch.int64) + 8), 4)), cols
        assert torch.equal(unpack_ct(words, 4, cols), q), cols
    assert packing.pack_nibbles(fp4.to(torch.int16), 32) is None and packing.pack_nibbles(fp4, 31) is None


def test_e4m3_decoding_is_torchs_for_every_code():
    """The self-check's native decode of fp8 scales gives torch's float32 for all 256 e4m3 codes, bit for bit (the
    NaN codes 0x7f and 0xff stay NaN: a NaN scale on disk must fail the check), in any shape; other dtypes: None."""
    from qtk.quant.formats.base import as_float32 as _float
    from qtk.quant.native.packing import e4m3_to_float

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn)
    want = codes.float()
    for t in (codes, codes.repeat(40).reshape(80, 128)):
        got = e4m3_to_float(t)
        assert got.shape == t.shape and torch.equal(got.view(torch.int32), t.float().view(torch.int32))
    assert torch.isnan(e4m3_to_float(codes)[[0x7F, 0xFF]]).all()
    assert torch.equal(_float(codes).view(torch.int32), want.view(torch.int32))  # what the ct codec decodes with
    assert e4m3_to_float(want) is None and e4m3_to_float(codes.view(torch.uint8)) is None


def test_e8m0_decoding_through_the_byte_table_is_the_definition_for_every_code():
    """MX scales decoded by the native byte table are the definition's float32 for all 256 E8M0 codes, bit for bit
    (255 stays NaN, 0 is the subnormal 2^-127), in any shape; codes that are not uint8 or a table that is not float32
    [256] are refused."""
    from qtk.quant.formats import mx
    from qtk.quant.native.packing import bytes_to_float

    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    want = mx.e8m0_decode(codes).view(torch.int32)
    assert int(want[0]) == 0x00400000 and int(want[127]) == 0x3F800000 and torch.isnan(want.view(torch.float32)[255])
    for t in (codes, codes.flip(0).repeat(40).reshape(80, 128)):
        got = mx.e8m0_to_float(t)
        assert got.shape == t.shape and torch.equal(got.view(torch.int32), mx.e8m0_decode(t).view(torch.int32))
    table = torch.randn(256)
    assert torch.equal(bytes_to_float(codes.flip(0), table), table.flip(0))
    assert bytes_to_float(codes.view(torch.int8), table) is None
    with pytest.raises(ValueError, match="float32"):
        bytes_to_float(codes, table.double())


def test_the_power_of_two_count_is_frexps_on_every_exponent_and_edge():
    """count_not_pow2 (the self-check's test of MX scales) agrees with frexp's mantissa == 0.5 on every exponent
    field with no, one and several mantissa bits, both signs, zero, Inf and NaN, and subnormals with one or two
    bits; counted over threads and odd lengths."""
    from qtk.quant.native.scan import count_not_pow2

    e = torch.arange(256, dtype=torch.int64) << 23
    mant = torch.tensor([0, 1, 1 << 22, 3, (1 << 23) - 1, 1 << 10, (1 << 10) | 1], dtype=torch.int64)
    bits = (e[:, None] | mant[None, :]).reshape(-1)
    bits = torch.cat([bits, bits | (1 << 31)]).to(torch.int32)  # int64 -> int32 wraps the sign bit in
    x = bits.view(torch.float32)
    want = int((torch.frexp(x).mantissa != 0.5).sum())
    assert count_not_pow2(x) == want and 0 < want < x.numel()
    big = x.repeat(300)[: 300 * x.numel() - 7]  # more than one thread's range, not a multiple of the split
    assert count_not_pow2(big) == int((torch.frexp(big).mantissa != 0.5).sum())
    assert count_not_pow2(torch.tensor([2.0**-140, 2.0**-127, 1.0, 2.0**127])) == 0
    assert count_not_pow2(x.double()) is None


def test_int8_words_pack_and_unpack_as_the_torch_path():
    """compressed-tensors' 8-bit words (each value + 128 in a byte) through the recycled-buffer path equal pack_words'
    int32 words and unpack back, with and without the stream's buffer reuse."""
    from qtk.io.safetensors import reusing_read_buffers
    from qtk.quant.pack import pack_ct, pack_words, unpack_ct

    g = torch.Generator().manual_seed(3)
    for reuse in (False, True):
        for cols in (8, 4096, 6):  # 6: not whole words, the padded path
            q = torch.randint(-128, 128, (9, cols), generator=g, dtype=torch.int8)
            with reusing_read_buffers(1 << 20) if reuse else contextlib.nullcontext():
                words = pack_ct(q, 8)
                assert torch.equal(words, pack_words(q.to(torch.int64) + 128, 8))
                got = unpack_ct(words, 8, cols)
                assert got.dtype == torch.int8 and torch.equal(got, q)
