"""GPTQ weight quantization as pure functions on tensors.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023 (arXiv:2210.17323). Columns are quantized one at a time and each
column's rounding error is spread over the columns not yet quantized through the upper Cholesky factor
of H⁻¹, H = 2/n Σ x xᵀ. The paper's names are kept: H, Hinv, W1, Q1, Err1, Losses1.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from qtk.algorithms.params import GPTQParams
from qtk.errors import QtkError, UsageError
from qtk.quant.qparams import dequantize_grouped, quantize_grouped, weight_qparams
from qtk.quant.qtensor import QTensor
from qtk.recipe import QuantScheme

log = logging.getLogger(__name__)


class CholeskyFailed(QtkError):
    """The damped Hessian stayed indefinite through every damping retry."""


def accumulate_hessian(H: torch.Tensor | None, nsamples: int, X: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Fold a batch of layer inputs X [..., in] into the running H = 2/n Σ x xᵀ (float32, n = tokens seen).

    Returns a new (H [in, in], n); the H passed in is not modified. Start with (None, 0).
    """
    X = X.reshape(-1, X.shape[-1]).float()  # X [tokens, in]
    t, in_f = X.shape
    if H is None:
        if nsamples:
            raise ValueError(f"accumulate_hessian: H is None but nsamples={nsamples}; start with (None, 0)")
        H = torch.zeros(in_f, in_f, dtype=torch.float32, device=X.device)
    if H.shape != (in_f, in_f):
        raise ValueError(f"accumulate_hessian: H is {tuple(H.shape)} but the inputs have {in_f} features")
    if t == 0:
        return H.float().clone(), nsamples
    n = nsamples + t
    # n_old/n · H_old + 2/n · XᵀX keeps H an average, so it never grows with the number of batches
    return torch.addmm(H.float(), X.t(), X, beta=nsamples / n, alpha=2.0 / n), n


def _upper_cholesky_of_inverse(H: torch.Tensor, damp: float) -> torch.Tensor | None:
    """Upper Cholesky factor of (H + damp·I)⁻¹, or None when either factorisation fails."""
    Hd = H.clone()
    Hd.diagonal().add_(damp)
    L, info = torch.linalg.cholesky_ex(Hd)
    if info.item() != 0:
        return None
    Hinv, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
    if info.item() != 0 or not torch.isfinite(Hinv).all():
        return None
    return Hinv


def _damped_hinv(H: torch.Tensor, params: GPTQParams, name: str) -> tuple[torch.Tensor, float, int]:
    """Hinv with relative damping damp_percent · mean(diag H), ×10 on each Cholesky failure."""
    mean_diag = torch.diag(H).mean().item()
    damp = params.damp_percent * mean_diag
    for retry in range(params.max_damp_retries + 1):
        Hinv = _upper_cholesky_of_inverse(H, damp)
        if Hinv is not None:
            return Hinv, damp, retry
        if retry < params.max_damp_retries:
            log.warning("GPTQ%s: Cholesky of the damped Hessian failed at damp %.3g (%.3g × mean diag H); "
                        "retrying with 10× the damping", name, damp, damp / mean_diag)
            damp *= 10
    raise CholeskyFailed(
        f"GPTQ{name}: the Hessian is not positive definite even with damping {damp:.3g} "
        f"({damp / mean_diag:.3g} × mean diag H, after {params.max_damp_retries} retries)",
        "calibrate on more or longer samples, or raise gptq.damp_percent / gptq.max_damp_retries",
    )


def gptq_quantize(W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, params: GPTQParams,
                  dtype: torch.dtype | None = None, name: str = "", loss: bool = True) -> tuple[QTensor, dict]:
    """Quantize W [out, in] against the Hessian H [in, in] of its inputs (see accumulate_hessian).

    dtype: the model dtype (int scales are rounded to it; default W's). name: for log and error messages.
    Group qparams are taken when a group starts, from its current (already error-compensated) columns,
    or up front from the original columns with params.static_groups. With params.actorder the columns
    are visited by descending diag H; with dynamic groups the groups then follow that order and the
    QTensor carries g_idx [in] (compressed-tensors actorder "group"); with static groups g_idx stays
    None (column // group_size, actorder "weight").

    info: damp (absolute, added to diag H), damp_percent (relative, after retries), retries,
    dead_columns, loss (1/n Σ‖(W − Q)x‖² = tr(ΔW H ΔWᵀ)/2, the layer's mean output error),
    loss_estimate (the paper's Σ (w − q)²/[Hinv]²_jj / 2, which equals tr(ΔW (H + damp·I) ΔWᵀ)/2), actorder (None | "group" | "weight"),
    dequantized (float32 [out, in], the exact matrix the algorithm chose; equals qt.dequantize()).
    """
    dtype = dtype or W.dtype
    label = f" ({name})" if name else ""
    out_f, in_f = W.shape
    if H.shape != (in_f, in_f):
        raise ValueError(f"gptq_quantize{label}: H is {tuple(H.shape)} but W has {in_f} input features")
    g = scheme.group_size if scheme.strategy == "group" else None
    if g is not None and in_f % g:
        raise UsageError(f"GPTQ{label}: group_size {g} does not divide in_features {in_f}",
                         "pick a group_size that divides every quantized layer's input size, or ignore this layer")
    if not torch.isfinite(H).all():
        raise UsageError(f"GPTQ{label}: the Hessian has inf/nan entries",
                         "calibration activations overflowed; check the calibration data or run in float32/bfloat16")
    W0, H0 = W, H
    W = W.float().clone()  # W [out, in], updated in place as errors are compensated
    H = H.to(W.device, torch.float32).clone()  # H [in, in]

    dead = torch.diag(H) == 0  # inputs that were always zero: their weights do not matter
    H[dead, dead] = 1
    W[:, dead] = 0

    scale_dtype = None if scheme.is_fp8 else dtype
    dynamic_groups = g is not None and not params.static_groups
    if not dynamic_groups:
        # scale, zero [1] | [out, 1] | [out, n_groups] (groups over the original column order)
        scale, zero = weight_qparams(W, scheme, scale_dtype)
    col_scheme = replace(scheme, strategy="channel", group_size=None)
    gscales: list[torch.Tensor] = []
    gzeros: list[torch.Tensor | None] = []

    perm = None
    if params.actorder:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)  # perm [in]
        W = W[:, perm]
        H = H[perm][:, perm]

    Hinv, damp, retries = _damped_hinv(H, params, label)  # Hinv [in, in], upper triangular

    # per-column scale / zero of a block, [out|1, count]: filled up front for fixed qparams, at each group
    # start for dynamic groups (a group may start in an earlier block: its qparams carry over)
    def fixed_block_qparams(i1: int, i2: int):
        if g is None:
            return scale.reshape(-1, 1), None if zero is None else zero.reshape(-1, 1)
        cols = torch.arange(i1, i2, device=W.device) if perm is None else perm[i1:i2]
        grp = cols // g  # [count], the original group of each visited column
        return scale[:, grp], None if zero is None else zero[:, grp]

    Qv = torch.zeros_like(W)  # quantized values (ints, or fp8 values) as float32 [out, in]
    Qd = torch.zeros_like(W)  # dequantized [out, in]
    loss_estimate = 0.0
    bs = params.block_size
    for i1 in range(0, in_f, bs):
        i2 = min(i1 + bs, in_f)
        count = i2 - i1
        W1 = W[:, i1:i2].clone()  # W1 [out, count]
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        d1 = Hinv1.diagonal().tolist()
        if dynamic_groups:
            S1 = torch.empty_like(W1)  # [out, count]
            Z1 = None if scheme.symmetric or scheme.is_fp8 else torch.empty_like(W1)
            if i1 % g:  # the group that started in an earlier block goes on here
                S1[:] = gscales[-1]
                if Z1 is not None:
                    Z1[:] = gzeros[-1]
        else:
            S1, Z1 = fixed_block_qparams(i1, i2)  # [out|1, count] (or [out|1, 1] per channel/tensor)
        per_col = S1.shape[1] > 1

        for i in range(count):
            j = i1 + i
            if dynamic_groups and j % g == 0:
                cols = W1[:, i:i + g]
                if j + g > i2:
                    # the group runs past this block: bring its later columns up to date with the
                    # updates still pending from this block (Err1 is zero beyond column i)
                    rest = W[:, i2:j + g] - Err1 @ Hinv[i1:i2, i2:j + g]
                    cols = torch.cat([cols, rest], dim=1)
                s, z = weight_qparams(cols, col_scheme, scale_dtype)  # [out, 1]
                gscales.append(s)
                gzeros.append(z)
                S1[:, i:i + g] = s
                if Z1 is not None:
                    Z1[:, i:i + g] = z
            s = S1[:, i:i + 1] if per_col else S1
            z = None if Z1 is None else (Z1[:, i:i + 1] if per_col else Z1)
            w = W1[:, i:i + 1]  # w [out, 1]
            q = quantize_grouped(w, s, z, scheme)  # [out, 1]
            err1 = (w - dequantize_grouped(q, s, z)).div_(d1[i])  # [out, 1]
            Q1[:, i:i + 1] = q
            Err1[:, i:i + 1] = err1
            if i + 1 < count:  # column i itself is done: only later columns need the update
                W1[:, i + 1:].addmm_(err1, Hinv1[i:i + 1, i + 1:], alpha=-1)

        Qv[:, i1:i2] = Q1
        Qd[:, i1:i2] = dequantize_grouped(Q1, S1, Z1)  # elementwise, as each column's dq above
        loss_estimate += Err1.square().sum().item() / 2  # Σ (w − q)²/[Hinv]²_jj / 2
        W[:, i2:].addmm_(Err1, Hinv[i1:i2, i2:], alpha=-1)  # lazy batch update of the remaining columns

    g_idx = None
    if dynamic_groups:
        scale = torch.cat(gscales, dim=1)  # [out, n_groups], groups in visiting order
        zero = None if gzeros[0] is None else torch.cat(gzeros, dim=1)
    if perm is not None:
        invperm = torch.argsort(perm)
        Qv = Qv[:, invperm]
        Qd = Qd[:, invperm]
        if dynamic_groups:
            # original column c was visited at position invperm[c], inside group invperm[c] // g
            g_idx = (torch.arange(in_f, device=W.device) // g)[invperm].to(torch.int32)

    values = Qv.to(torch.float8_e4m3fn) if scheme.is_fp8 else Qv.to(torch.int8)
    qt = QTensor(values, scale.float(), scheme, None if zero is None else zero.float(), g_idx, dtype)

    def layer_loss() -> float:
        dW = W0.float() - Qd  # dW [out, in]
        return ((dW @ H0.to(W.device, torch.float32)) * dW).sum().item() / 2

    info = {
        "damp": damp,
        "damp_percent": damp / torch.diag(H).mean().item(),
        "retries": retries,
        "dead_columns": int(dead.sum()),
        "loss": layer_loss() if loss else None,  # loss=False: the caller splits it
        "loss_estimate": loss_estimate,
        "actorder": None if not params.actorder else ("group" if dynamic_groups else "weight"),
        "dequantized": Qd,
    }
    return qt, info


def gptq_quantize_shared(Ws: list[torch.Tensor], H: torch.Tensor, scheme: QuantScheme, params: GPTQParams,
                         dtype: torch.dtype | None = None, names: list[str] | None = None) -> list[tuple[QTensor, dict]]:
    """GPTQ for Linears that share one input, hence one H (q/k/v; gate/up): one solve on the row-concatenated W.

    Rows of W never interact in GPTQ (each row's error is spread over its own later columns through the same
    Hinv), and the act-order permutation, dead columns and damping depend on H alone, so this equals one
    gptq_quantize per weight, with the column loop and the Cholesky factorisations run once instead of len(Ws)
    times. One difference, on purpose: a per-tensor scale is taken over the whole group, as engines fusing the
    group need one scale (DESIGN.md §4). Returns (QTensor, info) per weight, info as gptq_quantize's, with loss
    and dequantized per weight.
    """
    if len(Ws) == 1:
        return [gptq_quantize(Ws[0], H, scheme, params, dtype, name=(names or [""])[0])]
    name = ", ".join(names) if names else ""
    W = torch.cat([w.float() for w in Ws], dim=0)  # W [sum out, in]
    qt, info = gptq_quantize(W, H, scheme, params, dtype or Ws[0].dtype, name=name, loss=False)
    H0 = H.to(W.device, torch.float32)
    out, r0 = [], 0
    for w in Ws:
        r1 = r0 + w.shape[0]
        rows = slice(r0, r1)
        per_row = qt.scale.shape[0] > 1  # [out, *] scales split with the rows; a per-tensor [1] scale is shared
        part = QTensor(qt.values[rows], qt.scale[rows] if per_row else qt.scale, scheme,
                       None if qt.zero_point is None else (qt.zero_point[rows] if per_row else qt.zero_point),
                       qt.g_idx, qt.dtype)
        Qd = info["dequantized"][rows]
        dW = w.float() - Qd  # dW [out_i, in]
        out.append((part, {**info, "loss": ((dW @ H0) * dW).sum().item() / 2, "dequantized": Qd,
                           "loss_estimate": None}))  # the paper's estimate is only tracked for the whole group
        r0 = r1
    return out
