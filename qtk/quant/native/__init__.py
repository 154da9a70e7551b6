"""qtk's native CPU kernels (kernels.c): compiled with the machine's C compiler on first use into a per-user cache,
loaded with ctypes (a call releases the GIL, so the stream's reading and writing threads run beside it), and
checked against the torch path before they are trusted: the scans here (scan.self_test), the rounding by the number
formats whose arithmetic it must equal (qtk.quant.formats.kernel). Where there is no compiler, the build fails, a
check disagrees, or QTK_NATIVE=0 is set, every caller uses the torch path, which gives the same codes and scales
(its error figure sums float32 norms: it agrees to float32 rounding), several times slower: a warning says so, once.
Only CPU tensors take this path. The first use on a machine compiles (a few seconds); later processes load the
cached library.

Environment: QTK_NATIVE=0 turns the kernels off; CC picks the compiler (default cc); QTK_CACHE_DIR (default
$XDG_CACHE_HOME/qtk or ~/.cache/qtk) holds the built library, keyed by the source, the compiler, the flags and the
CPU's feature flags (the build targets this CPU: -march=native)."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("kernels.c")
# -ffp-contract=off: no fused multiply-add (it rounds once where the torch path rounds twice); no -ffast-math
FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
         "-pthread"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # on an AVX-512 CPU, 16-float vectors where GCC would pick 8 (its default): the rounding loops run faster
    # (benchmarks/results); a no-op below AVX-512
    FLAGS.insert(2, "-mprefer-vector-width=512")


class RTNArgs(ctypes.Structure):
    """kernels.c's qtk_rtn_args, field for field."""

    _fields_ = [("w", ctypes.c_void_p), ("rows", ctypes.c_int64), ("cols", ctypes.c_int64), ("group", ctypes.c_int64),
                ("group_rows", ctypes.c_int64), ("in_dtype", ctypes.c_int32), ("half", ctypes.c_int32),
                ("kind", ctypes.c_int32), ("want_error", ctypes.c_int32), ("divisor", ctypes.c_float),
                ("qmin", ctypes.c_float), ("qmax", ctypes.c_float), ("zero_scale", ctypes.c_float),
                ("global_scale", ctypes.c_float), ("values", ctypes.c_void_p), ("scale", ctypes.c_void_p),
                ("row_e", ctypes.c_void_p), ("row_w", ctypes.c_void_p), ("hi", ctypes.c_void_p),
                ("bad", ctypes.c_void_p)]


def cache_dir() -> Path:
    env = os.environ.get("QTK_CACHE_DIR")
    if env:
        return Path(env) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "qtk" / "native"


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler_version(cc: str) -> str:
    return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=True).stdout


def _build(cc: str) -> Path:
    src = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, _compiler_version(cc).encode(), " ".join(FLAGS).encode(),
                                     platform.machine().encode(), _cpu_flags().encode()])).hexdigest()[:20]
    d = cache_dir()
    so = d / f"kernels-{key}.so"
    if so.exists():
        return so
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kernels-", suffix=".so", dir=d)
    os.close(fd)
    try:
        subprocess.run([cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120, check=True)
        os.replace(tmp, so)  # atomic: processes building at once (torchrun ranks) each rename a complete file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return so


def _load(so: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(so))
    lib.qtk_rtn.argtypes = [ctypes.POINTER(RTNArgs), ctypes.c_int]
    lib.qtk_rtn.restype = ctypes.c_int
    lib.qtk_sq_rows.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                ctypes.c_void_p, ctypes.c_int]
    lib.qtk_sq_rows.restype = ctypes.c_int
    lib.qtk_block_sums.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.qtk_block_sums.restype = None
    lib.qtk_unpack_nibbles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_int]
    lib.qtk_unpack_nibbles.restype = ctypes.c_int
    lib.qtk_pack_nibbles.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                                     ctypes.c_int, ctypes.c_int]
    lib.qtk_pack_nibbles.restype = ctypes.c_int
    lib.qtk_crc32c.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint32]
    lib.qtk_crc32c.restype = ctypes.c_uint32
    lib.qtk_all_finite.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_int]
    lib.qtk_all_finite.restype = ctypes.c_int
    lib.qtk_lut8_f32.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int]
    lib.qtk_lut8_f32.restype = ctypes.c_int
    lib.qtk_count_not_pow2.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    lib.qtk_count_not_pow2.restype = ctypes.c_int64
    return lib


_loading = False  # library() is building or self-testing the kernels


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (the torch path) when they are turned off, cannot be built, or disagree with
    torch on the self-test (scan.self_test; the rounding is checked by qtk.quant.formats.kernel before its first use).
    Inside that self-test it is None: the torch reference the kernels are compared with must not reach them (nor
    build them again, a call at a time). Called once per process (cached): the warning that they are off, once."""
    global _loading
    if _loading or os.environ.get("QTK_NATIVE", "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    _loading = True
    try:
        lib = _checked_library()
    finally:
        _loading = False
    library.cache_clear()  # a call from inside the self-test cached None
    return lib


# what running without the kernels costs, in the one warning that says they are off
SLOWER = ("weights round, pack and are checked in torch, several times slower (a C compiler, or CC=, turns them on; "
          "QTK_NATIVE=0 silences this)")


def _checked_library() -> ctypes.CDLL | None:
    cc = os.environ.get("CC") or "cc"
    if shutil.which(cc) is None:
        log.warning("native kernels off: no C compiler (%s) on PATH; %s", cc, SLOWER)
        return None
    try:
        lib = _load(_build(cc))
    except (OSError, subprocess.SubprocessError, ValueError, AttributeError) as e:  # AttributeError: a symbol missing
        detail = getattr(e, "stderr", "") or e
        log.warning("native kernels off: building %s failed (%s); %s", SOURCE.name, str(detail).strip()[:300], SLOWER)
        return None
    from qtk.quant.native import scan

    try:
        problem = scan.self_test(lib)
    except Exception as e:  # noqa: BLE001 (any failure of the check means: do not trust the kernels)
        problem = repr(e)
    if problem:
        log.warning("native kernels off: they disagree with torch (%s); %s", problem, SLOWER)
        return None
    return lib


def thread_count(threads: int | None = None) -> int:
    """The threads a kernel call splits its rows over: `threads`, default torch's intra-op count, 1..64 (the
    kernels keep per-thread results in arrays of 64)."""
    return max(1, min(threads or torch.get_num_threads(), 64))
