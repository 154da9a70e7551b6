"""compressed-tensors layouts (docs/formats.md, vllm): the writer's and the reader's one entry to them. Each number
format holds its own (qtk.quant.formats: `ct_format`, `encode`, `decode`, `check_stored`, and the planner's `stored`
list of the same tensors); this module asks the format of a module's scheme, so the vllm writer and reader name no
format.
"""

from __future__ import annotations

from typing import Mapping

from qtk.quant.formats import FORMATS, format_for
from qtk.quant.formats.base import input_scale_key  # noqa: F401 (the vllm writer's and reader's)
from qtk.quant.scheme import QuantScheme


def ct_format(scheme) -> str:
    """The compressed-tensors format of a module's ModuleScheme (weights and activations)."""
    return format_for(scheme.weights).ct_format(scheme)


def scale_dtype(fmt: str) -> str | None:
    """compressed-tensors' scale_dtype of a config group in format `fmt`, for the formats whose scales are not in the
    model dtype (written, and required by its MX compressors, which key on torch.uint8)."""
    return next((f.ct_scale_dtype for f in FORMATS if fmt in f.ct_formats and f.ct_scale_dtype), None)


def encode(qt, dtype, fmt: str) -> dict:
    """The tensors qt is written as in format `fmt`, keyed after the Linear's name."""
    return qt.format.encode(qt, dtype, fmt)


def decode(t: Mapping, scheme: QuantScheme, dtype):
    """The QTensor of one module from its stored tensors (packed or not, as found)."""
    return format_for(scheme).decode(t, scheme, dtype)
