"""The NaN/Inf scan every float tensor qtk reads passes (each source tensor as it is read, each dense tensor the
self-check reads back): a tensor, or a StoredTensor scanned chunk by chunk from its file."""

from __future__ import annotations

import torch

from qtk.io.safetensors import StoredTensor
from qtk.quant.native import scan


def all_finite(t) -> bool:
    """Whether a tensor, or a StoredTensor scanned chunk by chunk from its file, holds no NaN/Inf. The native scan
    tests the exponent bits in one pass at memory speed (qtk.quant.native.scan); without it, a sum is non-finite
    whenever one is present and the exact scan (a bool copy) runs only then, so an embedding needs no float32 or
    bool copy of its size."""
    chunks = t.chunks() if isinstance(t, StoredTensor) else (t,)
    for c in chunks:
        got = scan.all_finite(c)
        if got is None:
            got = bool(torch.isfinite(c.sum())) or bool(torch.isfinite(c).all())
        if not got:
            return False
    return True
