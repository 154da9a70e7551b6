"""qtk's native rounding kernel (qtk.quant.native.rounding) for every format: the plan a format gives for a weight
(Format.native_plan), and the check of the kernel against the formats' own torch arithmetic before it rounds
anything. The kernel is built and loaded below (qtk.quant.native); the reference it must equal is here, with the
arithmetic, so the native package never reaches up into the formats."""

from __future__ import annotations

import logging
import weakref

from qtk.quant.formats.base import format_for
from qtk.quant.lazy import torch
from qtk.quant.scheme import QuantScheme

log = logging.getLogger(__name__)

_verdicts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # library -> whether its rounding is torch's
_checking = False


def trusted(lib) -> bool:
    """Whether the loaded kernels `lib` round as the torch path does (self_test, once per library). False inside that
    check, so the torch reference it runs never reaches the kernel."""
    global _checking
    if _checking:
        return False
    if lib not in _verdicts:
        _checking = True
        try:
            problem = self_test(lib)
        except Exception as e:  # noqa: BLE001 (any failure of the check means: do not trust the kernel)
            problem = repr(e)
        finally:
            _checking = False
        if problem:
            log.warning("native rounding off: the kernel disagrees with torch (%s); weights round in torch, several "
                        "times slower", problem)
        _verdicts[lib] = not problem
    return _verdicts[lib]


def native_rtn(w: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype", extra: dict | None = None,
               want_error: bool = True, threads: int | None = None, lib=None):
    """(values, scale, RowSums | None) of the torch path's QTensor for weight w [out, in] (the model dtype or float32,
    on the CPU) under `scheme` and a format's tensor-wide part `extra` (NVFP4's global scale: given, the fusion
    group's); None where the kernel does not apply (turned off or untrusted, a scheme or shape its format gives no
    plan for, the MSE observer). lib: the kernels, used as given (default: the loaded ones, once trusted)."""
    from qtk.quant.native import rounding

    if lib is None:
        lib = rounding.library()
        if lib is None or not trusted(lib):
            return None
    if scheme.observer != "minmax" or not rounding.applies(w, model_dtype):
        return None
    plan = format_for(scheme).native_plan(w, scheme, model_dtype, extra)
    if plan is None:
        return None
    return rounding.rtn(w, plan, model_dtype, want_error, threads, lib)


def reference(w: "torch.Tensor", scheme: QuantScheme, model_dtype: "torch.dtype"):
    """The torch path's QTensor (what the kernel must equal), with NVFP4's global scale from w itself."""
    from qtk.quant.qtensor import QTensor

    return QTensor.quantize(w.float(), scheme, model_dtype)


def self_test(lib) -> str | None:
    """None when the kernels give the torch path's codes and scales on a few small weights (zeros, subnormals,
    quotients across each element format's range, every kind and dtype); else what differed."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 256, generator=g) * 0.05
    w[1] = 0.0
    w[2] *= 1e-38  # subnormal scales and quotients
    w[3, :128] = torch.arange(128) / 127.0 * 448.0  # quotients across the whole fp8 range
    w[4] = torch.linspace(-3e-3, 3e-3, 256)  # fp8 subnormal codes once divided by the row's scale
    w[5] = torch.linspace(-6.5, 6.5, 256)  # every fp4 threshold
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    cases = [(QuantScheme(num_bits=8, type="float", strategy="channel"), d) for d in dtypes] + [
        (QuantScheme(num_bits=8, type="int", strategy="channel"), torch.bfloat16),
        (QuantScheme(num_bits=4, type="int", strategy="group", group_size=32), torch.float16),
        (QuantScheme(num_bits=4, type="int", strategy="group", group_size=64), torch.float32),
        (QuantScheme(num_bits=8, type="float", strategy="block", block_structure=(16, 96)), torch.bfloat16),
        (QuantScheme(num_bits=4, type="float", strategy="group", group_size=32, scale_dtype="e8m0"), torch.bfloat16),
        (QuantScheme(num_bits=4, type="float", strategy="tensor_group", group_size=16), torch.bfloat16)]
    for scheme, dtype in cases:
        x = w.to(dtype)
        ref = reference(x, scheme, dtype)
        for given in (x, x.float()):
            got = native_rtn(given, scheme, dtype, dict(ref.extra) or None, want_error=False, lib=lib)
            if got is None:
                return f"kernel refused {scheme.type}{scheme.num_bits} {scheme.strategy} {dtype}"
            values, scale, _ = got
            if not (values.dtype == ref.values.dtype and torch.equal(values.view(torch.uint8), ref.values.view(torch.uint8))
                    and torch.equal(scale, ref.scale.float().reshape(scale.shape))):
                return f"codes or scales differ for {scheme.type}{scheme.num_bits} {scheme.strategy} {dtype}"
    return None
