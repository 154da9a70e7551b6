"""Number formats as registered specs (base.py): `format_for(scheme)` gives the spec that computes a scheme's
qparams, quantizes, dequantizes and fake-quantizes activations. Built in: int-N (integer.py) and fp8 e4m3 (fp8.py),
sharing the tensor/channel/group machinery of grouped.py; NVFP4 (nvfp4.py), MXFP4/MXFP8 (mx.py) and FP8 in 2-D
blocks with per-token-group FP8 activations (fp8_block.py)."""

from qtk.quant.formats.base import FORMATS, Format, QParams, format_for, register_format, unregister_format
from qtk.quant.formats import integer  # noqa: F401,I001 (registers int-N first)
from qtk.quant.formats import fp8  # noqa: F401 (registers fp8 e4m3)
from qtk.quant.formats import nvfp4, mx, fp8_block  # noqa: F401,I001 (register NVFP4, MX, FP8 block)


def fake_quant_activation(x, scheme, scale=None):
    """Quantize-dequantize activations x with `scheme` as the engine does (the scheme's format decides how)."""
    return format_for(scheme).fake_quant_activation(x, scheme, scale)


def static_scale(amax, scheme):
    """Static per-tensor activation scale [1] from a calibrated absolute maximum."""
    return format_for(scheme).static_scale(amax, scheme)


__all__ = ["FORMATS", "Format", "QParams", "format_for", "register_format", "unregister_format",
           "fake_quant_activation", "static_scale"]
