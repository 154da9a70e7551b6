"""SmoothQuant scales: migrate activation outliers into the weights before W8A8 quantization.

Xiao, Lin, Seznec, Wu, Demouth, Han, "SmoothQuant: Accurate and Efficient Post-Training Quantization
for Large Language Models", ICML 2023 (arXiv:2211.10438), eq. 4: s_j = max|X_j|^α / max|W_j|^(1−α).
Search only; qtk.algorithms.smooth folds the scales in.
"""

from __future__ import annotations

import torch

S_MIN, S_MAX = 1e-5, 1e5  # keeps every scale finite and invertible


def smoothquant_scales(act_amax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """Per input channel scales s [in] for the Linears in `weights` (each [out_i, in]) sharing one input.

    act_amax [in]: calibrated max|x_j| per input channel. The weight range is taken over all the Linears
    together (q/k/v or gate/up), because one s divides their shared input.
    """
    if not weights:
        raise ValueError("smoothquant_scales: no weights given")
    in_f = act_amax.shape[-1]
    for W in weights:
        if W.shape[1] != in_f:
            raise ValueError(f"smoothquant_scales: a weight has {W.shape[1]} input features, act_amax has {in_f}")
    w_amax = torch.cat([W.float().abs() for W in weights], dim=0).amax(dim=0)  # [in]
    a = act_amax.float().to(w_amax.device).clamp(min=S_MIN)
    w = w_amax.clamp(min=S_MIN)
    s = a.pow(alpha) / w.pow(1 - alpha)
    s = torch.where(torch.isfinite(s), s, torch.ones_like(s))
    return s.clamp(S_MIN, S_MAX)
