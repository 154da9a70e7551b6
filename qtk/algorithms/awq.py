"""AWQ search: per input channel scales and per group clip ranges, as pure functions on tensors.

Lin, Tang, Tang, Yang, Chen, Wang, Xiao, Dang, Gan, Han, "AWQ: Activation-aware Weight Quantization
for LLM Compression and Acceleration", MLSys 2024 (arXiv:2306.00978). Search only: the results are
small records; qtk.algorithms.smooth folds the scales in and apply_clip applies the clip values.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch

from qtk.recipe.params import AWQParams
from qtk.algorithms.smooth import scale_linear_columns
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy

CLIP_BATCH_ELEMENTS = 1 << 24  # bounds the [rows, tokens, n_groups] partial outputs of the clip search

# combine(losses, tokens): mean losses measured on this process's `tokens` tokens -> the mean losses over the tokens
# of every process that searches together (one process: the losses as they are)
Combine = Callable[[torch.Tensor, int], torch.Tensor]


def _fake_quant(W: torch.Tensor, scheme: QuantScheme, dtype: torch.dtype) -> torch.Tensor:
    """RTN quantize-dequantize with qtk's conventions, float32 [out, in]."""
    return QTensor.quantize(W, scheme, dtype).dequantize()


def _tokens(x: torch.Tensor, n: int) -> torch.Tensor:
    """At most n evenly spaced tokens of x [tokens, in] (deterministic, so a search can be repeated)."""
    t = x.shape[0]
    if t <= n:
        return x
    return x[torch.linspace(0, t - 1, n, device=x.device).round().long()]


def _group_size(scheme: QuantScheme, in_f: int) -> int:
    g = scheme.column_group or in_f  # int / MX groups, NVFP4's groups of 16; per row for tensor and channel scales
    if in_f % g:
        raise ValueError(f"AWQ: group_size {g} does not divide in_features {in_f}")
    return g


def _w_mean(weights: list[torch.Tensor], schemes: Sequence[QuantScheme]) -> torch.Tensor:
    """Per input channel mean of |W| / (its group's max |W|) over all rows of all weights -> [in]."""
    rows = []
    for W, scheme in zip(weights, schemes):
        out_f, in_f = W.shape
        g = _group_size(scheme, in_f)
        wa = W.float().abs().reshape(out_f, in_f // g, g)  # [out, n_groups, group]
        rows.append((wa / (wa.amax(-1, keepdim=True) + 1e-6)).reshape(out_f, in_f))
    return torch.cat(rows, dim=0).mean(0)


def awq_search_scales(x: torch.Tensor, weights: list[torch.Tensor], scheme: QuantScheme | Sequence[QuantScheme],
                      params: AWQParams, dtype: torch.dtype | None = None,
                      combine: Combine | None = None, x_mean: torch.Tensor | None = None) -> tuple[torch.Tensor, dict]:
    """Scales s [in] for the Linears `weights` (each [out_i, in], quantized with `scheme`, or one scheme per weight)
    that share the input x [tokens, in].

    Candidates: s = 1, and for r = i/grid, i = 0..grid−1, s = x_mean^r / w_mean^(1−r) (x_mean^r without
    duo_scaling), normalised by sqrt(max s · min s). The chosen s minimises the mean squared error of
    the concatenated outputs (x/s) @ Q(W·s)ᵀ against x @ Wᵀ on up to params.n_sample_tokens evenly spaced
    tokens (x_mean uses all of them), with each W·s in its own dtype as the folded model stores it; s = 1
    is kept unless a candidate is strictly better, so the error never exceeds plain RTN's.
    dtype: the model dtype (scales rounded to it when quantizing; default the weights' dtype). combine: merges the
    candidates' losses with those other processes measured on their tokens before the choice (see Combine).
    x_mean: the per-channel mean |x| the candidates are built from (default: x's own; several processes pass the mean
    over all their tokens).

    info: ratio (chosen r, None when s = 1 won), loss, loss_identity (the error with s = 1), losses (per r).
    """
    if not weights:
        raise ValueError("awq_search_scales: no weights given")
    dtype = dtype or weights[0].dtype
    schemes = [scheme] * len(weights) if isinstance(scheme, QuantScheme) else list(scheme)
    in_f = x.shape[-1]
    for W in weights:
        if W.shape[1] != in_f:
            raise ValueError(f"awq_search_scales: a weight has {W.shape[1]} input features, x has {in_f}")
    x = x.reshape(-1, in_f).float()  # x [tokens, in]
    if x_mean is None:  # given: the mean over every process's tokens, so all processes search the same candidates
        x_mean = x.abs().mean(0)  # [in]
    w_mean = _w_mean(weights, schemes).to(x.device)  # [in]
    xs = _tokens(x, params.n_sample_tokens)  # [n, in]
    ref = xs @ torch.cat([W.float() for W in weights], dim=0).t()  # [n, sum out]

    def loss(s: torch.Tensor) -> float:
        Q = torch.cat([_fake_quant(scale_linear_columns(W, s), sc, dtype) for W, sc in zip(weights, schemes)], dim=0)
        return (((xs / s) @ Q.t()) - ref).pow(2).mean().item()

    # candidates: s = 1 first, then one per grid ratio r
    candidates: list[tuple[float | None, torch.Tensor]] = [(None, torch.ones(in_f, device=x.device))]
    for i in range(params.grid):
        r = i / params.grid
        if params.duo_scaling:
            s = (x_mean.pow(r) / (w_mean.pow(1 - r) + 1e-4)).clamp(min=1e-4)
        else:
            s = x_mean.pow(r).clamp(min=1e-4)
        candidates.append((r, s / (s.max() * s.min()).sqrt()))
    losses = [loss(s) for _, s in candidates]
    if combine is not None:
        losses = combine(torch.tensor(losses, dtype=torch.float64), xs.shape[0]).tolist()
    best = 0  # s = 1 is kept unless a candidate is strictly better
    for k in range(1, len(candidates)):
        if losses[k] < losses[best]:
            best = k
    info = {"loss_identity": losses[0], "losses": losses[1:], "ratio": candidates[best][0], "loss": losses[best]}
    return candidates[best][1], info


def awq_search_clip(x: torch.Tensor, W: torch.Tensor, scheme: QuantScheme, params: AWQParams,
                    dtype: torch.dtype | None = None, combine: Combine | None = None) -> torch.Tensor:
    """Per output row and input group, the clip value max_val [out, n_groups] for W [out, in].

    Call it on the already scaled W and the scaled input x/s [tokens, in]. For each group the range
    max|w| is shrunk by up to params.max_shrink in params.clip_grid steps, keeping the shrink that
    minimises the mean squared error of that group's share of the output (unshrunk unless strictly better).
    The quantizer in the search is min-max (the clip search is itself the range search); tensor-wise
    schemes are searched per row. channel/tensor schemes give n_groups = 1. combine: as in awq_search_scales, applied
    to each shrink step's errors [rows, n_groups].
    """
    dtype = dtype or W.dtype
    out_f, in_f = W.shape
    g = _group_size(scheme, in_f)
    n_groups = in_f // g
    search_scheme = replace(scheme, observer="minmax")
    if scheme.strategy == Strategy.TENSOR:
        search_scheme = replace(search_scheme, strategy="channel")
    xg = _tokens(x.reshape(-1, in_f).float(), params.n_sample_tokens).reshape(-1, n_groups, g)  # [n, n_groups, g]
    n_tok = xg.shape[0]
    steps = int(params.max_shrink * params.clip_grid)
    chunk = max(1, min(out_f, CLIP_BATCH_ELEMENTS // max(1, n_tok * n_groups)))  # rows per batch

    max_val = torch.empty(out_f, n_groups, device=W.device)
    for o1 in range(0, out_f, chunk):
        wg = W[o1:o1 + chunk].float().reshape(-1, n_groups, g)  # [co, n_groups, g]
        org_max = wg.abs().amax(-1)  # [co, n_groups]
        org_out = torch.einsum("tng,cng->ctn", xg, wg)  # [co, n, n_groups]
        best = org_max.clone()
        min_err = torch.full_like(org_max, float("inf"))
        for i_s in range(steps):
            mv = org_max * (1 - i_s / params.clip_grid)  # [co, n_groups]
            cur = torch.maximum(torch.minimum(wg, mv.unsqueeze(-1)), -mv.unsqueeze(-1))
            q = _fake_quant(cur.reshape(-1, in_f), search_scheme, dtype).reshape(-1, n_groups, g)
            err = (torch.einsum("tng,cng->ctn", xg, q) - org_out).pow(2).mean(dim=1)  # [co, n_groups]
            if combine is not None:
                err = combine(err, n_tok)
            better = err < min_err
            min_err = torch.where(better, err, min_err)
            best = torch.where(better, mv, best)
        max_val[o1:o1 + chunk] = best
    return max_val


def apply_clip(W: torch.Tensor, max_val: torch.Tensor) -> torch.Tensor:
    """W [out, in] clamped to [−max_val, max_val] per (row, group); max_val [out, n_groups]. New tensor."""
    out_f, in_f = W.shape
    n_groups = max_val.shape[1]
    if max_val.shape[0] != out_f or in_f % n_groups:
        raise ValueError(f"apply_clip: max_val {tuple(max_val.shape)} does not fit W {tuple(W.shape)}")
    wg = W.float().reshape(out_f, n_groups, in_f // n_groups)
    mv = max_val.float().to(W.device).unsqueeze(-1)
    return torch.maximum(torch.minimum(wg, mv), -mv).reshape(out_f, in_f).to(W.dtype)
