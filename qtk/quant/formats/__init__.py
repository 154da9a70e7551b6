"""Number formats, one object each (base.py: `Format`, the registry, `format_for(scheme)`): int-N (integer.py) and
fp8 e4m3 per tensor / channel (fp8.py), sharing the tensor/channel/group machinery of grouped.py; NVFP4 (nvfp4.py),
MXFP4/MXFP8 (mx.py) and FP8 in 2-D blocks with per-token-group FP8 activations (fp8_block.py). Each module holds
its format whole: the recipe's refusals, the arithmetic, its compressed-tensors tensors, the planner's byte count,
the native kernel's plan and the checks of a written checkpoint. Importing them imports no torch."""

from qtk.quant.formats.base import (FORMATS, Format, QParams, Stored, format_claiming, format_for, register_format,
                                    unregister_format)
from qtk.quant.formats import integer  # noqa: F401,I001 (registers int-N first)
from qtk.quant.formats import fp8  # noqa: F401 (registers fp8 e4m3)
from qtk.quant.formats import nvfp4, mx, fp8_block  # noqa: F401,I001 (register NVFP4, MX, FP8 block)


def fake_quant_activation(x, scheme, scale=None):
    """Quantize-dequantize activations x with `scheme` as the engine does (the scheme's format decides how)."""
    return format_for(scheme).fake_quant_activation(x, scheme, scale)


def static_scale(amax, scheme):
    """Static per-tensor activation scale [1] from a calibrated absolute maximum."""
    return format_for(scheme).static_scale(amax, scheme)


__all__ = ["FORMATS", "Format", "QParams", "Stored", "format_claiming", "format_for", "register_format",
           "unregister_format", "fake_quant_activation", "static_scale"]
