"""GPTQ weight quantization as pure functions on tensors.

Frantar, Ashkboos, Hoefler, Alistarh, "GPTQ: Accurate Post-Training Quantization for Generative
Pre-trained Transformers", ICLR 2023 (arXiv:2210.17323). Columns are quantized one at a time and each
column's rounding error is spread over the columns not yet quantized through the upper Cholesky factor
of H⁻¹, H = 2/n Σ x xᵀ. The paper's names are kept: H, Hinv, W1, Q1, Err1, Losses1.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, replace

import torch

from qtk.recipe.params import GPTQParams
from qtk.errors import QtkError, UsageError
from qtk.quant.formats import QParams, format_for
from qtk.quant.qtensor import QTensor
from qtk.quant.scheme import QuantScheme, Strategy

log = logging.getLogger(__name__)

SUB_BLOCK = 16  # columns per inner lazy-update block (see gptq_quantize)
HESSIAN_CHUNK = 1024  # tokens of a non-float32 batch converted to float32 at a time in hessian_sum_


class CholeskyFailed(QtkError):
    """The damped Hessian stayed indefinite through every damping retry."""


@contextlib.contextmanager
def _bf16_products(on: bool):
    """fp32 matmuls through oneDNN's bf16 kernels (bf16 products, fp32 accumulation and output). Exact for inputs
    that are bf16 values, for which it gives fp32 GEMM accuracy at about twice the speed on CPUs with bf16 units."""
    mm = getattr(torch.backends.mkldnn, "matmul", None)
    if not on or mm is None or not torch.backends.mkldnn.is_available() or not torch.cpu._is_avx512_bf16_supported():
        yield
        return
    old = mm.fp32_precision
    mm.fp32_precision = "bf16"
    try:
        yield
    finally:
        mm.fp32_precision = old


HESSIAN_ROWS = 1024  # rows of the float32 block product hessian_sum_ adds to the float64 sum at a time


def hessian_sum_(S: torch.Tensor, X: torch.Tensor) -> torch.Tensor:
    """S += XᵀX in place for a batch of layer inputs X [..., in]: S is a float64 [in, in] sum of which the upper
    triangle (and each diagonal block whole) is kept; hessian_from_sum reads H from it. Each product is computed in
    float32 (bf16 inputs through oneDNN's bf16 kernels with fp32 accumulation: exact products, twice as fast), a block
    of HESSIAN_ROWS rows at a time, and added in float64. The float64 sum is why: float32 H read from it is the same
    whichever way the batches were split over processes and summed (reassociating float64 additions moves the sum far
    below float32's last bit), so a torch.distributed run solves with the very Hessian of one process, and writes the
    same codes."""
    exact_bf16 = X.dtype == torch.bfloat16 and X.device.type == "cpu"
    X = X.reshape(-1, X.shape[-1])
    in_f = X.shape[1]
    if S.shape != (in_f, in_f) or S.dtype != torch.float64:
        raise ValueError(f"hessian_sum_: S is {S.dtype} {tuple(S.shape)}, the inputs have {in_f} features")
    with _bf16_products(exact_bf16):
        for c in (X.split(HESSIAN_CHUNK) if X.dtype != torch.float32 else (X,)):
            c = c.float()
            for r0 in range(0, in_f, HESSIAN_ROWS):
                r1 = min(r0 + HESSIAN_ROWS, in_f)
                S[r0:r1, r0:].add_(c[:, r0:r1].t() @ c[:, r0:])
    return S


def hessian_from_sum(S: torch.Tensor, n: int) -> torch.Tensor:
    """H = 2/n · S as float32 [in, in] from hessian_sum_'s float64 sum over n tokens, exactly symmetric (the upper
    triangle mirrored); zeros when n is 0."""
    in_f = S.shape[0]
    H = torch.empty(in_f, in_f, dtype=torch.float32, device=S.device)
    alpha = 2.0 / n if n else 0.0
    for r0 in range(0, in_f, HESSIAN_ROWS):
        r1 = min(r0 + HESSIAN_ROWS, in_f)
        H[r0:r1, r0:] = S[r0:r1, r0:] * alpha  # rounded to float32 once
        d = H[r0:r1, r0:r1]
        d.copy_(d.triu() + d.triu(1).t())
        H[r1:, r0:r1] = H[r0:r1, r1:].t()
    return H


def _inverse_lower(L: torch.Tensor, base: int = 256) -> torch.Tensor:
    """L⁻¹ for lower-triangular L [n, n], by halves: [[A, 0], [B, C]]⁻¹ = [[A⁻¹, 0], [−C⁻¹ B A⁻¹, C⁻¹]]. Unlike a
    triangular solve against I it skips the known zeros: about n³/3 flops, in GEMMs."""
    n = L.shape[0]
    if n <= base:
        return torch.linalg.solve_triangular(L, torch.eye(n, dtype=L.dtype, device=L.device), upper=False)
    k = n // 2
    out = torch.zeros_like(L)
    Ai = _inverse_lower(L[:k, :k], base)
    Ci = _inverse_lower(L[k:, k:], base)
    out[:k, :k] = Ai
    out[k:, k:] = Ci
    out[k:, :k] = -(Ci @ L[k:, :k]) @ Ai
    return out


def _damped_hinv(make_h, diag: torch.Tensor, params: GPTQParams, name: str) -> tuple[torch.Tensor, float, int, float]:
    """Upper Cholesky factor U of (H + damp·I)⁻¹ with relative damping damp_percent · mean(diag H), ×10 on each
    failed factorisation. diag: diag H [in]. make_h() returns a private fp32 copy of J H J (rows and columns in
    reverse order), damped in place and freed as soon as its Cholesky factor exists: with the caller's H, at most
    three [in, in] matrices are alive at once (each over 100 MB for a wide down_proj). Returns (U, damp,
    retries, mean diag H).

    With J H J = L Lᵀ, H = (J L J)(J L J)ᵀ where J L J is upper triangular, so (H + damp·I)⁻¹ = Uᵀ U with
    U = (J L J)⁻¹ = J L⁻¹ J: one Cholesky and one triangular inverse (2n³/3 flops) instead of Cholesky, inverse
    and a second Cholesky (4n³/3)."""
    mean_diag = diag.mean().item()
    damp = params.damp_percent * mean_diag
    for retry in range(params.max_damp_retries + 1):
        H = make_h()  # J H J
        H.diagonal().copy_(diag.flip(0)).add_(damp)
        L, info = torch.linalg.cholesky_ex(H)
        del H
        if info.item() == 0:
            Li = _inverse_lower(L)
            del L
            Hinv = Li.flip(0, 1)  # J L⁻¹ J, upper triangular
            del Li
            if torch.isfinite(Hinv).all():
                return Hinv, damp, retry, mean_diag
            del Hinv
        else:
            del L
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
                  dtype: torch.dtype | None = None, name: str = "", loss: bool = True,
                  dequantized: bool = True) -> tuple[QTensor, dict]:
    """Quantize W [out, in] against the Hessian H [in, in] of its inputs (H = 2/n Σ x xᵀ: hessian_sum_, hessian_from_sum).

    dtype: the model dtype (int scales are rounded to it; default W's). name: for log and error messages.
    Group qparams are taken when a group starts, from its current (already error-compensated) columns,
    or up front from the original columns (params.actorder "static", or params.static_groups). With
    params.actorder the columns are visited by descending diag H; with actorder "group" the groups then
    follow that order and the QTensor carries g_idx [in]; with "static" g_idx stays None
    (column // group_size; compressed-tensors actorder "weight").

    The steps: _check (what GPTQ cannot solve), _setup (dead columns, the visiting order, qparams fixed up front,
    the upper Cholesky factor of the damped H⁻¹: the inputs of the paper's Algorithm 1), _column_loop (Algorithm 1),
    then the QTensor in the original column order and the losses.

    info: damp (absolute, added to diag H), damp_percent (relative, after retries), retries,
    dead_columns, loss (1/n Σ‖(W − Q)x‖² = tr(ΔW H ΔWᵀ)/2, the layer's mean output error),
    loss_estimate (the paper's Σ (w − q)²/[Hinv]²_jj / 2, which equals tr(ΔW (H + damp·I) ΔWᵀ)/2), actorder (None | "group" | "weight"),
    dequantized (float32 [out, in], the exact matrix the algorithm chose; equals qt.dequantize(); None with
    dequantized=False, which saves one float32 copy of W while the loop runs).
    """
    dtype = dtype or W.dtype
    label = f" ({name})" if name else ""
    _check(W, H, scheme, label)
    st = _setup(W, H, scheme, params, dtype, label)
    solved = _column_loop(st, dequantized)
    qt, Qd = _qtensor(st, solved)

    def layer_loss() -> float:
        dW = W.float() - (qt.dequantize() if Qd is None else Qd)  # dW [out, in]
        return ((dW @ H.to(dW.device, torch.float32)) * dW).sum().item() / 2

    info = {
        "damp": st.damp,
        "damp_percent": st.damp / st.mean_diag,
        "retries": st.retries,
        "dead_columns": int(st.dead.sum()),
        "loss": layer_loss() if loss else None,  # loss=False: the caller splits it
        "loss_estimate": float(solved.row_loss.sum()),
        "loss_estimate_rows": solved.row_loss,  # [out] float64, the estimate per row of W
        "actorder": None if not params.reorders else ("group" if qt.g_idx is not None else "weight"),
        "dequantized": Qd,
    }
    return qt, info


def _check(W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, label: str) -> None:
    """Refuse what GPTQ cannot solve: a Hessian of another width or not finite, groups that do not divide W's
    columns, FP8 blocks (a 2-D scale: round-to-nearest solves them)."""
    in_f = W.shape[1]
    if H.shape != (in_f, in_f):
        raise ValueError(f"gptq_quantize{label}: H is {tuple(H.shape)} but W has {in_f} input features")
    g = scheme.column_group  # columns sharing a scale (groups; NVFP4's and MX's groups of 16 / 32)
    if scheme.strategy == Strategy.BLOCK:
        raise UsageError(f"GPTQ{label}: FP8 block weights ({scheme.describe()}) are solved by round-to-nearest",
                         "use algorithm: [rtn] with FP8 block weights")
    if g is not None and in_f % g:
        raise UsageError(f"GPTQ{label}: group_size {g} does not divide in_features {in_f}",
                         "pick a group_size that divides every quantized layer's input size, or ignore this layer")
    if not torch.isfinite(H).all():
        raise UsageError(f"GPTQ{label}: the Hessian has inf/nan entries",
                         "calibration activations overflowed; check the calibration data or run in float32/bfloat16")


def scale_scheme(scheme: QuantScheme, params: GPTQParams) -> QuantScheme:
    """The scheme GPTQ takes its scales with: full_range puts them on the full-range grid (observer full_range)."""
    return replace(scheme, observer="full_range") if params.full_range else scheme


@dataclass
class _Setup:
    """What the column loop starts from: the format and its quantizer, the columns sharing a scale (g) and whether
    their qparams are taken as each group starts (dynamic_groups) or were fixed up front (qp), the visiting order
    (perm, None: in order), the inputs that were always zero (dead), Hinv (the upper Cholesky factor of
    (H + damp·I)⁻¹ in visiting order: the paper's H⁻¹ ← Cholesky(H⁻¹)ᵀ) with its damping, and Wt (Wᵀ [in, out] in
    visiting order, dead columns zeroed; the loop runs on it, so a column of W is one contiguous row)."""

    fmt: object
    scheme: QuantScheme
    params: GPTQParams
    dtype: torch.dtype
    g: int | None
    dynamic_groups: bool
    qp: QParams | None
    perm: torch.Tensor | None
    dead: torch.Tensor
    Hinv: torch.Tensor
    damp: float
    retries: int
    mean_diag: float
    Wt: torch.Tensor
    quantize_column: object = None

    def fixed_qparams(self, i1: int, i2: int):
        """scale, zero of the visited columns i1..i2 from qp, as [count, out] (groups) or [1, out] (channel / tensor)."""
        scale, zero = self.qp.scale, self.qp.zero_point
        if self.g is None:
            return scale.reshape(1, -1), None if zero is None else zero.reshape(1, -1)
        cols = torch.arange(i1, i2, device=self.Wt.device) if self.perm is None else self.perm[i1:i2]
        grp = cols // self.g  # [count], the original group of each visited column
        return scale[:, grp].t().contiguous(), None if zero is None else zero[:, grp].t().contiguous()


def _setup(W: torch.Tensor, H: torch.Tensor, scheme: QuantScheme, params: GPTQParams, dtype: torch.dtype,
           label: str) -> _Setup:
    """Dead columns (H_jj := 1, W[:, j] := 0), the qparams fixed up front, the visiting order, the damped H⁻¹'s
    upper Cholesky factor (_damped_hinv) and Wᵀ in visiting order."""
    in_f = W.shape[1]
    diag = torch.diag(H).to(W.device, torch.float32)  # [in]
    dead = diag == 0  # inputs that were always zero: their weights do not matter (H_jj := 1, W[:, j] := 0)
    any_dead = bool(dead.any())
    g = scheme.column_group
    fmt = format_for(scheme)  # the number format decides qparams, rounding and storage; the loop is the same for all
    dynamic_groups = g is not None and not params.static_groups and params.actorder != "static"
    qp = None  # the whole weight's qparams, when fixed up front (with any extras of its format)
    if not dynamic_groups:
        # scale, zero [1] | [out, 1] | [out, n_groups] (groups over the original column order)
        Wq = W.float()
        if any_dead:
            Wq = Wq.clone()
            Wq[:, dead] = 0
        qp = fmt.qparams(Wq, scale_scheme(scheme, params), dtype)
        del Wq
    elif fmt.tensor_wide(scheme):  # the tensor-wide part (NVFP4's global scale) is fixed before the groups are
        qp = fmt.qparams(W.float(), scheme, dtype)

    perm = None
    if params.reorders:
        perm = torch.argsort(torch.where(dead, 1.0, diag), descending=True, stable=True)  # perm [in]
    dead_v = dead if perm is None else dead[perm]  # dead, in visiting order
    rev = (perm if perm is not None else torch.arange(in_f, device=W.device)).flip(0)  # visiting order, reversed

    def make_h():  # private fp32 J H J [in, in] (H in visiting order, reversed: see _damped_hinv), dead H_jj = 1
        Hp = H.to(W.device, torch.float32)[rev[:, None], rev]
        if any_dead:
            Hp.diagonal()[dead_v.flip(0)] = 1
        return Hp

    diag_v = torch.where(dead, 1.0, diag) if perm is None else torch.where(dead, 1.0, diag)[perm]
    Hinv, damp, retries, mean_diag = _damped_hinv(make_h, diag_v, params, label)  # Hinv [in, in], upper triangular

    Wt = torch.empty(in_f, W.shape[0], dtype=torch.float32, device=W.device)  # Wt [in, out], in visiting order,
    Wt.copy_(W.t() if perm is None else W.t()[perm])                          # updated in place as errors are compensated
    if any_dead:
        Wt[dead_v] = 0
    # (w [out], s, z) -> (q, dequantized q). Below 8 bits each column is rounded as RTN rounds it for the model dtype
    # (the quotient w / s in bf16 for a bf16 model, compressed-tensors' arithmetic), so GPTQ with a diagonal Hessian
    # is RTN, which also measured a lower perplexity on the real model (docs/real-model.md) than float32 quotients.
    # 8-bit grids keep float32 quotients, as llm-compressor's GPTQ computes them: bf16 resolves only 0.5 for
    # |q| >= 64, so nearly every int8 column would land on a rounding tie whose outcome flips with the Hessian's
    # summation order (processes would disagree on many int8 codes).
    quantize_column = fmt.column_quantizer(scheme, qp, model_dtype=dtype if scheme.num_bits < 8 else None)
    return _Setup(fmt, scheme, params, dtype, g, dynamic_groups, qp, perm, dead, Hinv, damp, retries, mean_diag, Wt,
                  quantize_column)


@dataclass
class _Solved:
    """What the column loop chose, in visiting order: the codes Qt [in, out], their decode Qdt (None when not kept),
    the paper's loss per row of W, and the qparams of each group as it started (dynamic groups)."""

    Qt: torch.Tensor
    Qdt: torch.Tensor | None
    row_loss: torch.Tensor
    gscales: list[torch.Tensor]
    gzeros: list[torch.Tensor | None]


def _column_loop(st: _Setup, dequantized: bool) -> _Solved:
    """Algorithm 1 of the paper on Wᵀ, block by block (B = params.block_size columns):

        for i = 0, B, 2B, ...:
            for j = i .. i+B-1:                                        _quantize_block
                Q[:, j] = quant(W[:, j])
                E[:, j-i] = (W[:, j] - Q[:, j]) / [H⁻¹]_jj
                W[:, j:i+B] -= E[:, j-i] · H⁻¹[j, j:i+B]
            W[:, i+B:] -= E · H⁻¹[i:i+B, i+B:]                        (the lazy batch update)

    Inside a block the update of the block's later columns is itself lazy: rank-1 within a sub-block of a few
    columns, a GEMM onto the rest of the block once per sub-block. Same arithmetic, fewer bytes moved."""
    in_f, out_f = st.Wt.shape
    solved = _Solved(torch.empty(in_f, out_f, dtype=st.fmt.storage_dtype(st.scheme), device=st.Wt.device),
                     torch.empty_like(st.Wt) if dequantized else None,
                     torch.zeros(out_f, dtype=torch.float64, device=st.Wt.device), [], [])
    bs = st.params.block_size
    for i1 in range(0, in_f, bs):
        i2 = min(i1 + bs, in_f)
        Err1, S1, Z1 = _quantize_block(st, solved, i1, i2)
        if solved.Qdt is not None:
            solved.Qdt[i1:i2] = st.fmt.dequantize_columns(solved.Qt[i1:i2], S1, Z1, st.qp)  # as each column's dq
        solved.row_loss += Err1.square().sum(0, dtype=torch.float64) / 2
        if i2 < in_f:
            st.Wt[i2:].addmm_(st.Hinv[i1:i2, i2:].t(), Err1, alpha=-1)  # lazy batch update of the remaining columns
    st.Wt = None  # every column is final: freed before the QTensor is assembled
    return solved


def _quantize_block(st: _Setup, solved: _Solved, i1: int, i2: int):
    """Columns i1..i2 (visiting order) of one block, each quantized with its group's qparams (taken as the group
    starts, or fixed up front) and its error spread over the block's later columns. Returns the block's errors Err1
    [count, out] (the paper's E), and its scales and zero points per column ([count | 1, out])."""
    Wt, Hinv, g = st.Wt, st.Hinv, st.g
    count = i2 - i1
    sub = math.gcd(SUB_BLOCK, st.params.block_size, g if st.dynamic_groups else SUB_BLOCK)  # group starts open one
    W1 = Wt[i1:i2]  # W1 [count, out], a view: these rows are final once this block is done
    Q1 = solved.Qt[i1:i2]
    Err1 = torch.zeros_like(W1)  # rows not reached yet stay zero (read by a group that runs past the block)
    Hinv1 = Hinv[i1:i2, i1:i2]
    d1 = Hinv1.diagonal().tolist()
    if st.dynamic_groups:
        S1 = torch.empty_like(W1)  # [count, out]
        Z1 = torch.empty_like(W1) if st.fmt.has_zero_point(st.scheme) else None
        if i1 % g:  # the group that started in an earlier block goes on here
            S1[:] = solved.gscales[-1].reshape(1, -1)
            if Z1 is not None:
                Z1[:] = solved.gzeros[-1].reshape(1, -1)
    else:
        S1, Z1 = st.fixed_qparams(i1, i2)
    per_col = S1.shape[0] > 1

    for j1 in range(0, count, sub):
        j2 = min(j1 + sub, count)
        for i in range(j1, j2):
            j = i1 + i
            if st.dynamic_groups and j % g == 0:  # i == j1: every earlier column's update has been applied
                _start_group(st, solved, W1, Err1, S1, Z1, i, i1, i2)
            s = S1[i] if per_col else S1[0]  # [out] (or [1] per tensor)
            z = None if Z1 is None else (Z1[i] if per_col else Z1[0])
            w = W1[i]  # w [out]
            err1 = Err1[i]
            q, dq = st.quantize_column(w, s, z)  # Q[:, j] = quant(W[:, j])
            torch.sub(w, dq, out=err1).div_(d1[i])  # E[:, j-i] = (W[:, j] - Q[:, j]) / [H⁻¹]_jj   [out]
            Q1[i] = q
            if i + 1 < j2:  # W[:, j:i+B] -= E[:, j-i] · H⁻¹[j, j:i+B], within the sub-block (column i is done)
                W1[i + 1:j2].addr_(Hinv1[i, i + 1:j2], err1, alpha=-1)
        if j2 < count:  # ... and onto the rest of the block once per sub-block
            W1[j2:].addmm_(Hinv1[j1:j2, j2:].t(), Err1[j1:j2], alpha=-1)
    return Err1, S1, Z1


def _start_group(st: _Setup, solved: _Solved, W1, Err1, S1, Z1, i: int, i1: int, i2: int) -> None:
    """The qparams of the group starting at visited column i1 + i, from its columns as they are now (already
    error-compensated), into S1 / Z1 for the group's columns in this block."""
    g = st.g
    j = i1 + i
    cols = W1[i:i + g]  # [<= g, out]
    if j + g > i2:
        # the group runs past this block: bring its later columns up to date with the
        # updates still pending from this block (Err1 is zero from row i on)
        rest = st.Wt[i2:j + g] - st.Hinv[i1:i2, i2:j + g].t() @ Err1
        cols = torch.cat([cols, rest], dim=0)
    gq = st.fmt.group_qparams(cols.t(), scale_scheme(st.scheme, st.params), st.dtype, st.qp)  # [out, 1]
    sc, zc = gq.scale, gq.zero_point
    solved.gscales.append(sc)
    solved.gzeros.append(zc)
    S1[i:i + g] = sc.reshape(1, -1)
    if Z1 is not None:
        Z1[i:i + g] = zc.reshape(1, -1)


def _qtensor(st: _Setup, solved: _Solved) -> tuple[QTensor, torch.Tensor | None]:
    """The QTensor (and the decode the loop computed, [out, in] float32) in the original column order: the visiting
    order undone, a g_idx when the groups followed it."""
    in_f = solved.Qt.shape[0]
    Qv, Qd = solved.Qt.t(), None if solved.Qdt is None else solved.Qdt.t()  # [out, in]
    if st.dynamic_groups:
        scale = torch.cat(solved.gscales, dim=1)  # [out, n_groups], groups in visiting order
        zero = None if solved.gzeros[0] is None else torch.cat(solved.gzeros, dim=1)
    else:
        scale, zero = st.qp.scale, st.qp.zero_point
    g_idx = None
    if st.perm is not None:
        invperm = torch.argsort(st.perm)
        Qv = Qv[:, invperm]
        Qd = None if Qd is None else Qd[:, invperm]
        if st.dynamic_groups:
            # original column c was visited at position invperm[c], inside group invperm[c] // g
            g_idx = (torch.arange(in_f, device=Qv.device) // st.g)[invperm].to(torch.int32)
    Qv, Qd = Qv.contiguous(), None if Qd is None else Qd.contiguous()
    extra = {} if st.qp is None else st.qp.extra
    qt = QTensor.of(Qv, QParams(scale.float(), None if zero is None else zero.float(), extra), st.scheme, st.dtype, g_idx)
    return qt, Qd


def gptq_quantize_shared(Ws: list[torch.Tensor], H: torch.Tensor, scheme: QuantScheme, params: GPTQParams,
                         dtype: torch.dtype | None = None, names: list[str] | None = None) -> list[tuple[QTensor, dict]]:
    """GPTQ for Linears that share one input, hence one H (q/k/v; gate/up): one solve on the row-concatenated W.

    Rows of W never interact in GPTQ (each row's error is spread over its own later columns through the same
    Hinv), and the act-order permutation, dead columns and damping depend on H alone, so this equals one
    gptq_quantize per weight, with the column loop and the Cholesky factorisations run once instead of len(Ws)
    times. One difference, on purpose: a per-tensor scale is taken over the whole group, as engines fusing the
    group need one scale (docs/architecture.md). Returns (QTensor, info) per weight, info as gptq_quantize's, with loss
    and dequantized per weight.
    """
    name = ", ".join(names) if names else ""
    W = Ws[0].float() if len(Ws) == 1 else torch.cat([w.float() for w in Ws], dim=0)  # W [sum out, in]
    qt, info = gptq_quantize(W, H, scheme, params, dtype or Ws[0].dtype, name=name, loss=False, dequantized=False)
    del W
    dead = torch.diag(H) == 0
    out, r0 = [], 0
    for w in Ws:
        r1 = r0 + w.shape[0]
        rows = slice(r0, r1)
        per_row = qt.scale.shape[0] > 1  # [out, *] scales split with the rows; a per-tensor [1] scale is shared
        part = QTensor(qt.values[rows], qt.scale[rows] if per_row else qt.scale, scheme,
                       None if qt.zero_point is None else (qt.zero_point[rows] if per_row else qt.zero_point),
                       qt.g_idx, qt.dtype, qt.extra)
        Qd = part.dequantize()  # what the algorithm chose for these rows (gptq_quantize: equals its "dequantized")
        dW = w.float() - Qd  # dW [out_i, in]
        dW[:, dead] = 0  # inputs that were always zero add nothing to the output error
        # 1/n Σ‖ΔW x‖² = tr(ΔW H ΔWᵀ)/2 from the paper's per-column terms (which sum to tr(ΔW (H + damp·I) ΔWᵀ)/2),
        # without the [out, in] x [in, in] product
        loss = float(info["loss_estimate_rows"][rows].sum()) - info["damp"] * float(dW.square().sum()) / 2
        out.append((part, {**info, "loss": loss, "dequantized": Qd, "loss_estimate": None, "loss_estimate_rows": None}))
        r0 = r1
    return out
