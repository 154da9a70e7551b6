"""Round-to-nearest weight quantization: the baseline every other algorithm is measured against."""

from __future__ import annotations

import torch

from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme


def rtn_quantize(W: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype | None = None) -> QTensor:
    """Quantize W [out, in] with the scheme's observer (min-max or MSE grid); dtype = model dtype (default W's)."""
    return QTensor.quantize(W, scheme, dtype or W.dtype)
