"""The format registry: one spec per number format, looked up by `format_for(scheme)`.

A spec is the one place that knows a format's arithmetic: the quantization parameters of a weight (`qparams`),
its stored values (`quantize`, `storage_dtype`), how they decode (`dequantize`), GPTQ's column by column
quantization (`column_quantizer`), and how the engines quantize activations at run time (`fake_quant_activation`,
`static_scale`). QTensor, the solvers and the simulator ask the spec of a scheme instead of branching on its type.
How a format is packed on disk is the writers' business (the export codecs), keyed by the same scheme.

A format whose quantization needs more than a scale and a zero point (NVFP4's per-tensor global scale, block
scales) returns them in `QParams.extra`; QTensor carries them in its `extra` mapping, under the spec's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping

import torch

from qtk.quant.scheme import QuantScheme


@dataclass(frozen=True)
class QParams:
    """What a format computes from a weight before rounding it: scale, zero point (asymmetric int) and the tensors a
    format needs beyond them (`extra`, e.g. a global scale), which QTensor carries under the same names."""

    scale: torch.Tensor
    zero_point: torch.Tensor | None = None
    extra: Mapping[str, torch.Tensor] = field(default_factory=dict)


# GPTQ's quantizer of one column w [out] with that column's scale s and zero point z -> (q, dequantized q)
ColumnQuantizer = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor]"]


class Format:
    """A number format. Subclasses implement every method; the spec is stateless (everything comes from the scheme)."""

    name: str = ""

    def accepts(self, scheme: QuantScheme) -> bool:
        """Whether this spec quantizes `scheme` (type, bits, strategy)."""
        raise NotImplementedError

    def storage_dtype(self, scheme: QuantScheme) -> torch.dtype:
        """The dtype of QTensor.values: unpacked codes [out, in]."""
        raise NotImplementedError

    def has_zero_point(self, scheme: QuantScheme) -> bool:
        """Whether qparams carry a zero point (asymmetric int)."""
        raise NotImplementedError

    def scale_dtype(self, scheme: QuantScheme, model_dtype: torch.dtype) -> torch.dtype | None:
        """The dtype scales are stored (and rounded to before use) in; None: float32."""
        raise NotImplementedError

    def decodes_in_model_dtype(self, scheme: QuantScheme) -> bool:
        """Whether the engines (and compressed-tensors' decompressors) form the dequantized weight in the model dtype
        (True: int scales in the model dtype; NVFP4, MX, FP8 blocks decompressed to it) rather than in float32."""
        return True

    def qparams(self, w: torch.Tensor, scheme: QuantScheme, model_dtype: torch.dtype) -> QParams:
        """Quantization parameters of weight w [out, in] (model_dtype: the dtype the model stores, for scales)."""
        raise NotImplementedError

    def quantize(self, w: torch.Tensor, qp: QParams, scheme: QuantScheme,
                 model_dtype: torch.dtype | None = None) -> torch.Tensor:
        """Stored values of w [out, in] under qp, in storage_dtype; model_dtype: the dtype the model stores w in,
        for formats whose reference quantizer rounds its arithmetic to it (None: float32 arithmetic)."""
        raise NotImplementedError

    def dequantize(self, values: torch.Tensor, qp: QParams, scheme: QuantScheme,
                   g_idx: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [out, in] from stored values; g_idx [in] maps each input column to its group (act-order)."""
        raise NotImplementedError

    def quantize_decoded(self, w: torch.Tensor, qp: QParams, scheme: QuantScheme,
                         model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(quantize(w.float(), qp, scheme, model_dtype), the engine's float32 decode of those values, i.e.
        qtk.model.simulate.engine_weight) from w [rows, in] given in the model dtype, computed in that dtype where
        that gives the same bits with fewer passes (the data-free stream's fast path); None where it does not."""
        return None

    def tensor_wide(self, scheme: QuantScheme) -> bool:
        """Whether qparams hold a tensor-wide part beyond the per-group scales (NVFP4's global scale), which GPTQ fixes
        before its column loop and fusion groups share."""
        return False

    def group_qparams(self, cols: torch.Tensor, scheme: QuantScheme, model_dtype: torch.dtype,
                      qp: QParams | None = None) -> QParams:
        """For GPTQ: the scale (and zero point) [out, 1] of one group of columns cols [out, group], taken when the
        group starts; qp holds the tensor-wide extras fixed up front (tensor_wide)."""
        from dataclasses import replace

        return self.qparams(cols, replace(scheme, strategy="channel", group_size=None), model_dtype)

    def shared_extra(self, weights: list[torch.Tensor], scheme: QuantScheme,
                     model_dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
        """The tensor-wide part of qparams (tensor_wide: NVFP4's global scale) that `weights` share: one weight's, or
        the members' of a fusion group the engines run as one GEMM (q/k/v, gate/up). Taken from min/max passes over
        the weights as given (model-dtype tensors need no float32 copy); None for a format without one."""
        return None

    def row_qparams(self, w: torch.Tensor, scheme: QuantScheme, model_dtype: torch.dtype,
                    extra: dict[str, torch.Tensor] | None = None) -> QParams:
        """QParams of w [rows, in], some rows of a weight whose tensor-wide part is `extra` (shared_extra of the whole
        weight or its fusion group), for a format whose other qparams are per row; qparams(w) when extra is None."""
        return self.qparams(w, scheme, model_dtype)

    def column_quantizer(self, scheme: QuantScheme, qp: QParams | None = None,
                         model_dtype: torch.dtype | None = None) -> ColumnQuantizer:
        """For GPTQ: quantize one column with its scale (and zero point); qp holds tensor-wide extras if any;
        model_dtype as in quantize, so a column is rounded as quantize rounds the same values."""
        raise NotImplementedError

    def dequantize_columns(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None,
                           qp: QParams | None = None) -> torch.Tensor:
        """For GPTQ: float32 values of a block of quantized columns q [count, out] with per-column scale / zero
        [count | 1, out] (qp: as given to column_quantizer), elementwise as column_quantizer dequantizes each."""
        raise NotImplementedError

    def fake_quant_activation(self, x: torch.Tensor, scheme: QuantScheme, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Quantize-dequantize activations as the engine does at run time (dynamic, or static with `scale`)."""
        raise NotImplementedError

    def static_scale(self, amax: float | torch.Tensor, scheme: QuantScheme) -> torch.Tensor:
        """Static per-tensor activation scale [1] from a calibrated absolute maximum."""
        raise NotImplementedError


FORMATS: list[Format] = []
_by_scheme: dict[QuantScheme, Format] = {}


def register_format(cls: type[Format]) -> type[Format]:
    """Class decorator: add a spec to the registry (schemes are matched against specs in registration order)."""
    if any(f.name == cls.name for f in FORMATS):
        raise ValueError(f"a number format named {cls.name!r} is already registered")
    FORMATS.append(cls())
    _by_scheme.clear()
    return cls


def unregister_format(name: str) -> None:
    """Remove a spec (for tests that register a format of their own)."""
    FORMATS[:] = [f for f in FORMATS if f.name != name]
    _by_scheme.clear()


def format_for(scheme: QuantScheme) -> Format:
    """The spec that quantizes `scheme`; a scheme no spec accepts is an internal error (recipes are validated first)."""
    f = _by_scheme.get(scheme)
    if f is None:
        f = next((f for f in FORMATS if f.accepts(scheme)), None)
        if f is None:
            raise ValueError(f"no number format quantizes {scheme.describe()} "
                             f"(registered: {', '.join(f.name for f in FORMATS) or 'none'})")
        _by_scheme[scheme] = f
    return f
