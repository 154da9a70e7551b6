"""Folding per-channel smoothing scales s into a block's weights, shared by AWQ and SmoothQuant.

A Linear's input x is replaced by x/s and its weight columns by W·s, so its float output is unchanged;
x/s is produced by dividing whatever made x: a norm's weight, or the output rows of a preceding Linear.
Xiao et al., "SmoothQuant", ICML 2023 (arXiv:2211.10438); Lin et al., "AWQ", MLSys 2024 (arXiv:2306.00978).
All functions compute in float32, return new tensors in the input's dtype, and never modify inputs.
"""

from __future__ import annotations

import torch


def _check(s: torch.Tensor, n: int, what: str) -> torch.Tensor:
    if s.shape != (n,):
        raise ValueError(f"{what}: scales have shape {tuple(s.shape)}, expected ({n},)")
    return s.float()


def fold_into_norm(norm_weight: torch.Tensor, s: torch.Tensor, one_plus: bool = False) -> torch.Tensor:
    """New norm weight [in] whose output is the old output / s.

    one_plus: the norm scales by (1 + w) (Gemma RMSNorm); then 1 + w' = (1 + w) / s.
    """
    s = _check(s, norm_weight.shape[0], "fold_into_norm")
    w = norm_weight.float()
    new = (1.0 + w) / s - 1.0 if one_plus else w / s
    return new.to(norm_weight.dtype)


def fold_into_linear_rows(prev_W: torch.Tensor, prev_bias: torch.Tensor | None,
                          s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Divide the output rows of the preceding Linear (v_proj before o_proj, up_proj before down_proj).

    prev_W [out, in], prev_bias [out] | None, s [out] -> (W' [out, in], b' [out] | None).
    """
    s = _check(s, prev_W.shape[0], "fold_into_linear_rows")
    W = (prev_W.float() / s.unsqueeze(1)).to(prev_W.dtype)
    b = None if prev_bias is None else (prev_bias.float() / s).to(prev_bias.dtype)
    return W, b


def scale_linear_columns(W: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """W [out, in] · s [in] column-wise: the Linear that now receives x / s."""
    s = _check(s, W.shape[1], "scale_linear_columns")
    return (W.float() * s.unsqueeze(0)).to(W.dtype)
