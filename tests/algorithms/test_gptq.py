"""GPTQ kernel: beats RTN on correlated inputs, reduces to RTN without error propagation, act-order
with g_idx dequantizes to exactly what the algorithm chose, and damping retries are loud."""

import logging

import pytest
import torch

from qtk.algorithms.gptq import CholeskyFailed, gptq_quantize, hessian_from_sum, hessian_sum_
from qtk.recipe.params import GPTQParams
from qtk.quant.qtensor import QTensor
from qtk.errors import UsageError
from qtk.recipe import QuantScheme

OUT, IN, TOKENS = 24, 256, 512

SCHEMES = {
    "int4-g32-sym": QuantScheme(4, strategy="group", group_size=32),
    "int4-g32-asym": QuantScheme(4, strategy="group", group_size=32, symmetric=False),
    "int4-g128-sym": QuantScheme(4, strategy="group", group_size=128),
    "int4-g128-asym": QuantScheme(4, strategy="group", group_size=128, symmetric=False),
    "int8-channel-sym": QuantScheme(8, strategy="channel"),
    "int8-channel-asym": QuantScheme(8, strategy="channel", symmetric=False),
}
MORE_SCHEMES = {
    **SCHEMES,
    "int4-tensor-sym": QuantScheme(4, strategy="tensor"),
    "int4-channel-mse": QuantScheme(4, strategy="channel", observer="mse"),
    "int4-g32-asym-mse": QuantScheme(4, strategy="group", group_size=32, symmetric=False, observer="mse"),
    "fp8-channel": QuantScheme(8, type="float", strategy="channel"),
    "fp8-tensor": QuantScheme(8, type="float", strategy="tensor"),
}


def correlated_layer(seed: int = 0, out: int = OUT, inp: int = IN, tokens: int = TOKENS):
    """W [out, in] and inputs X [tokens, in] with correlated features and a few large channels, like LLM activations."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.eye(inp) + 2 * torch.randn(inp, inp, generator=g) / inp**0.5
    X = torch.randn(tokens, inp, generator=g) @ mix
    X[:, :4] *= 6
    W = 0.05 * torch.randn(out, inp, generator=g)
    return W, X


def output_err(W, Wq, X) -> float:
    return ((W - Wq) @ X.t()).norm().item()


def hessian(X):
    X = X.reshape(-1, X.shape[-1])
    return hessian_from_sum(hessian_sum_(torch.zeros(X.shape[1], X.shape[1], dtype=torch.float64), X), X.shape[0])


# ---- Hessian accumulation ----

def test_hessian_sum_takes_any_leading_dims_as_tokens_in_place():
    _, X = correlated_layer(inp=16, tokens=100)
    S = torch.zeros(16, 16, dtype=torch.float64)
    for chunk in (X[:10], X[10:55].reshape(5, 9, 16), X[55:]):  # any leading dims count as tokens
        assert hessian_sum_(S, chunk) is S  # the sum is updated in place
    H = hessian_from_sum(S, 100)
    assert H.dtype == torch.float32 and torch.equal(H, H.t())
    torch.testing.assert_close(H, 2 / 100 * X.t() @ X, rtol=1e-5, atol=1e-5)


def test_hessian_sum_rejects_mismatched_inputs():
    with pytest.raises(ValueError, match="features"):
        hessian_sum_(torch.zeros(8, 8, dtype=torch.float64), torch.randn(4, 9))
    with pytest.raises(ValueError, match="float32"):  # the sum must be float64
        hessian_sum_(torch.zeros(8, 8), torch.randn(4, 8))


# ---- GPTQ beats RTN ----

@pytest.mark.parametrize("actorder", [False, "static", "group"])
@pytest.mark.parametrize("name", list(SCHEMES))
def test_gptq_reconstruction_error_below_rtn(name, actorder):
    scheme = SCHEMES[name]
    W, X = correlated_layer()
    qt, info = gptq_quantize(W, hessian(X), scheme, GPTQParams(block_size=64, actorder=actorder), torch.bfloat16)
    rtn = QTensor.quantize(W, scheme, torch.bfloat16)
    e_gptq, e_rtn = output_err(W, qt.dequantize(), X), output_err(W, rtn.dequantize(), X)
    # measured ratios on this layer are 0.50–0.55; RTN-level error would be 1.0
    assert e_gptq < 0.65 * e_rtn, f"{name}: GPTQ/RTN = {e_gptq / e_rtn:.3f}"
    # info["loss"] is the mean squared output error per token, from H alone
    assert info["loss"] == pytest.approx(e_gptq**2 / TOKENS, rel=1e-3)
    # the summed per-column losses are exactly the damped quadratic error: the error propagation is exact OBS
    dW = W - info["dequantized"]
    H_damped = hessian(X) + info["damp"] * torch.eye(IN)
    assert info["loss_estimate"] == pytest.approx(((dW @ H_damped) * dW).sum().item() / 2, rel=1e-3)
    assert info["retries"] == 0 and info["damp"] == pytest.approx(0.01 * torch.diag(hessian(X)).mean().item(), rel=1e-5)
    v = qt.values
    assert v.dtype == torch.int8 and int(v.min()) >= scheme.qmin and int(v.max()) <= scheme.qmax
    assert qt.scale.shape == rtn.scale.shape and qt.dtype == torch.bfloat16
    # int scales are rounded to the model dtype, as RTN's are
    assert torch.equal(qt.scale, qt.scale.to(torch.bfloat16).float())


def test_gptq_fp8_below_rtn():
    scheme = MORE_SCHEMES["fp8-channel"]
    W, X = correlated_layer()
    qt, info = gptq_quantize(W, hessian(X), scheme, GPTQParams(), torch.bfloat16)
    assert qt.values.dtype == torch.float8_e4m3fn and qt.zero_point is None
    e_gptq = output_err(W, qt.dequantize(), X)
    e_rtn = output_err(W, QTensor.quantize(W, scheme, torch.bfloat16).dequantize(), X)
    assert e_gptq < 0.65 * e_rtn
    assert torch.equal(qt.dequantize(), info["dequantized"])


# ---- reduction to RTN ----

@pytest.mark.parametrize("name", list(MORE_SCHEMES))
def test_gptq_with_diagonal_hessian_is_rtn(name):
    """A diagonal H has a diagonal Hinv (and Cholesky factor): no error reaches any other column,
    whatever the damping, so every column is rounded as RTN rounds it with the same qparams: for the model dtype below
    8 bits, with float32 quotients for 8-bit grids (qtk/algorithms/gptq.py says why)."""
    from qtk.quant.formats import format_for
    scheme = MORE_SCHEMES[name]
    W, _ = correlated_layer(seed=1)
    fmt = format_for(scheme)
    qp = fmt.qparams(W, scheme, torch.bfloat16)
    quotients = torch.bfloat16 if scheme.num_bits < 8 else None
    rtn = QTensor.of(fmt.quantize(W, qp, scheme, model_dtype=quotients), qp, scheme, torch.bfloat16)
    assert torch.equal(rtn.scale, QTensor.quantize(W, scheme, torch.bfloat16).scale)
    g = torch.Generator().manual_seed(2)
    for H in (torch.eye(IN), torch.diag(torch.rand(IN, generator=g) + 0.1)):
        qt, info = gptq_quantize(W, H, scheme, GPTQParams(block_size=48), torch.bfloat16)
        assert torch.equal(qt.values.float(), rtn.values.float())
        assert torch.equal(qt.scale, rtn.scale)
        assert (qt.zero_point is None) == (rtn.zero_point is None)
        if rtn.zero_point is not None:
            assert torch.equal(qt.zero_point, rtn.zero_point)
        assert qt.g_idx is None
        assert torch.equal(info["dequantized"], rtn.dequantize())


@pytest.mark.parametrize("name", ["int4-g32-sym", "int4-g128-sym", "int8-channel-sym"])
@pytest.mark.parametrize("actorder", ["static", None, "group"])
def test_full_range_gptq_with_diagonal_hessian_is_full_range_rtn(name, actorder):
    """full_range: each group's (channel's) scale is amax / -qmin in the model dtype, signed so its larger-magnitude
    weight is the most negative code, whether the scales are fixed up front (actorder static) or taken as each group
    starts (actorder off, group); with a diagonal H, GPTQ rounds every weight to nearest on that grid."""
    from qtk.quant.formats import format_for
    scheme = SCHEMES[name]
    W, _ = correlated_layer(seed=1)
    fmt = format_for(scheme)
    g = scheme.group_size if scheme.strategy == "group" else IN
    wg = W.reshape(OUT, -1, g)
    amax, big = wg.abs().amax(-1), wg.gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    want = (-amax / -scheme.qmin * big.sign()).to(torch.bfloat16).float()  # negative where the larger extreme is > 0
    # (act-order "group" forms its groups in the visiting order: H = I keeps that order the columns' own)
    H = torch.eye(IN) if actorder == "group" else torch.diag(torch.rand(IN, generator=torch.Generator().manual_seed(2)) + 0.1)
    qt, info = gptq_quantize(W, H, scheme, GPTQParams(block_size=48, actorder=actorder, full_range=True), torch.bfloat16)
    assert torch.equal(qt.scale, want) and bool((qt.scale < 0).any()) and bool((qt.scale > 0).any())
    quotients = torch.bfloat16 if scheme.num_bits < 8 else None
    rtn = fmt.quantize(W, type(fmt.qparams(W, scheme, torch.bfloat16))(want, None, {}), scheme, model_dtype=quotients)
    assert torch.equal(qt.values.float(), rtn.float())
    # the larger-magnitude weight of every group sits on qmin, the grid's one code without a mirror
    at_big = qt.values.float().reshape(OUT, -1, g).gather(-1, wg.abs().argmax(-1, keepdim=True)).squeeze(-1)
    assert bool((at_big == scheme.qmin).all())
    assert torch.equal(info["dequantized"], qt.dequantize())


def test_full_range_gptq_beats_the_half_step_grid_on_correlated_inputs():
    """On the correlated layer the full-range int4 grid's output error is below compressed-tensors' amax / 7.5
    grid's (both GPTQ): a finer step and no extreme half a step off the grid."""
    scheme = SCHEMES["int4-g32-sym"]
    W, X = correlated_layer()
    H = hessian(X)
    errs = [output_err(W, gptq_quantize(W, H, scheme, GPTQParams(full_range=f), torch.bfloat16)[0].dequantize(), X)
            for f in (False, True)]
    assert errs[1] < 0.95 * errs[0], errs


@pytest.mark.parametrize("weights", ["{num_bits: 4, type: int, symmetric: false, strategy: group, group_size: 32}",
                                     "{num_bits: 8, type: float, strategy: channel}",
                                     "{num_bits: 4, type: int, strategy: tensor}"])
def test_full_range_gptq_refuses_weights_it_has_no_grid_for(weights):
    import yaml

    from qtk.recipe import parse_recipe

    doc = f"name: x\nweights: {weights}\nalgorithm: [{{gptq: {{full_range: true}}}}]\n"
    with pytest.raises(UsageError, match="gptq full_range is a grid of symmetric int weights"):
        parse_recipe(yaml.safe_load(doc), doc, "x")


@pytest.mark.parametrize("actorder", ["group", "static"])
def test_gptq_actorder_identity_hessian_is_rtn(actorder):
    """With H = I every diag entry ties, the stable act-order is the identity, so groups are RTN's."""
    scheme = SCHEMES["int4-g32-asym"]
    W, _ = correlated_layer(seed=3)
    qt, _ = gptq_quantize(W, torch.eye(IN), scheme, GPTQParams(actorder=actorder))
    rtn = QTensor.quantize(W, scheme)
    assert torch.equal(qt.values, rtn.values) and torch.equal(qt.scale, rtn.scale)
    assert torch.equal(qt.dequantize(), rtn.dequantize())


def test_gptq_dead_columns_are_zeroed():
    W, X = correlated_layer(seed=4)
    X[:, [5, 100]] = 0  # inputs that never fire
    qt, info = gptq_quantize(W, hessian(X), SCHEMES["int4-g32-asym"], GPTQParams(actorder="group"))
    assert info["dead_columns"] == 2
    deq = qt.dequantize()
    assert torch.equal(deq[:, [5, 100]], torch.zeros(OUT, 2))
    assert output_err(W, deq, X) < 0.65 * output_err(W, QTensor.quantize(W, SCHEMES["int4-g32-asym"]).dequantize(), X)


# ---- act-order, static groups, blocks ----

@pytest.mark.parametrize("actorder", ["group", "dynamic", "static", "weight"])
@pytest.mark.parametrize("name", ["int4-g32-sym", "int4-g32-asym", "int4-g128-asym", "int4-g32-asym-mse"])
def test_gptq_actorder_g_idx_dequantizes_to_algorithm_output(name, actorder):
    """llm-compressor's spellings: group = dynamic (g_idx), static = weight (no g_idx)."""
    scheme = MORE_SCHEMES[name]
    gs = scheme.group_size
    W, X = correlated_layer(seed=5)
    H = hessian(X)
    # block 48 is not a multiple of 32 or 128: groups straddle block boundaries
    qt, info = gptq_quantize(W, H, scheme, GPTQParams(block_size=48, actorder=actorder))
    assert torch.equal(qt.dequantize(), info["dequantized"])
    assert qt.scale.shape == (OUT, IN // gs)
    perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    if actorder in ("static", "weight"):
        # groups over the original columns: g_idx would be column // group_size
        assert qt.g_idx is None and info["actorder"] == "weight"
    else:
        assert info["actorder"] == "group"
        assert qt.g_idx.dtype == torch.int32 and qt.g_idx.shape == (IN,)
        # the j-th visited column belongs to group j // group_size; every group has group_size columns
        assert torch.equal(qt.g_idx[perm].long(), torch.arange(IN) // gs)
        assert torch.equal(torch.bincount(qt.g_idx.long()), torch.full((IN // gs,), gs))
        assert not torch.equal(qt.g_idx.long(), torch.arange(IN) // gs), "X has outlier channels 0-3: order must change"
    rtn = QTensor.quantize(W, scheme, W.dtype)
    assert output_err(W, qt.dequantize(), X) < 0.65 * output_err(W, rtn.dequantize(), X)


def test_gptq_static_groups_use_original_weights():
    """Static groups take their qparams from the original W, before any error compensation."""
    scheme = SCHEMES["int4-g32-asym"]
    W, X = correlated_layer(seed=6)
    qt, _ = gptq_quantize(W, hessian(X), scheme, GPTQParams(actorder="static"), torch.bfloat16)
    rtn = QTensor.quantize(W, scheme, torch.bfloat16)
    assert torch.equal(qt.scale, rtn.scale) and torch.equal(qt.zero_point, rtn.zero_point)
    assert not torch.equal(qt.values, rtn.values)


@pytest.mark.parametrize("name", ["int4-g32-asym", "int4-g128-sym", "int8-channel-sym"])
def test_gptq_block_size_does_not_change_the_result(name):
    """Lazy block updates are an exact rewrite of the column-by-column algorithm (up to float rounding).
    With groups straddling blocks this also checks that a group's qparams see every pending update."""
    scheme = SCHEMES[name]
    W, X = correlated_layer(seed=7)
    H = hessian(X)
    ref, ref_info = gptq_quantize(W, H, scheme, GPTQParams(block_size=IN))
    for bs in (1, 48, 100):
        qt, info = gptq_quantize(W, H, scheme, GPTQParams(block_size=bs))
        same = (qt.values == ref.values).float().mean().item()
        assert same > 0.995, f"block_size {bs}: only {same:.4f} of values agree"
        torch.testing.assert_close(qt.scale, ref.scale, rtol=1e-2, atol=0)
        assert info["loss"] == pytest.approx(ref_info["loss"], rel=1e-2)


def test_gptq_does_not_modify_inputs():
    W, X = correlated_layer(seed=8)
    H = hessian(X)
    W0, H0 = W.clone(), H.clone()
    X[:, 7] = 0
    gptq_quantize(W, H, SCHEMES["int4-g32-asym"], GPTQParams(actorder="group"))
    assert torch.equal(W, W0) and torch.equal(H, H0)


# ---- damping ----

def indefinite_hessian(n: int = 32, neg: float = -0.5):
    """H with one eigenvalue `neg` and the rest 1: mean diag ≈ 1, so relative damps 0.01 and 0.1 fail, 1.0 works."""
    Qm, _ = torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(0)))
    eig = torch.ones(n)
    eig[0] = neg
    return (Qm * eig) @ Qm.t()


def test_gptq_retries_with_more_damping_and_says_so(caplog):
    H = indefinite_hessian()
    W = torch.randn(8, 32, generator=torch.Generator().manual_seed(1))
    with caplog.at_level(logging.WARNING, logger="qtk.algorithms.gptq"):
        qt, info = gptq_quantize(W, H, QuantScheme(8), GPTQParams(damp_percent=0.01), name="layers.0.mlp.up_proj")
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2 and info["retries"] == 2
    assert all("layers.0.mlp.up_proj" in r.getMessage() and "10×" in r.getMessage() for r in warnings)
    mean_diag = torch.diag(H).mean().item()
    assert info["damp"] == pytest.approx(mean_diag, rel=1e-4)  # 0.01 · 10 · 10 · mean
    assert info["damp_percent"] == pytest.approx(1.0, rel=1e-4)
    assert torch.isfinite(qt.dequantize()).all()


def test_gptq_raises_when_damping_retries_run_out(caplog):
    H = indefinite_hessian()
    W = torch.randn(8, 32)
    with caplog.at_level(logging.WARNING, logger="qtk.algorithms.gptq"):
        with pytest.raises(CholeskyFailed, match="not positive definite") as e:
            gptq_quantize(W, H, QuantScheme(8), GPTQParams(max_damp_retries=1))
    assert len(caplog.records) == 1
    assert "damp_percent" in str(e.value)  # says how to fix it


def test_gptq_rank_deficient_hessian_needs_no_retry(caplog):
    """Fewer tokens than features leaves H singular; the 1% damping alone makes it positive definite."""
    W, X = correlated_layer(seed=9, tokens=20)
    with caplog.at_level(logging.WARNING, logger="qtk.algorithms.gptq"):
        qt, info = gptq_quantize(W, hessian(X), SCHEMES["int4-g32-sym"], GPTQParams())
    assert info["retries"] == 0 and not caplog.records
    assert output_err(W, qt.dequantize(), X) < output_err(W, QTensor.quantize(W, SCHEMES["int4-g32-sym"]).dequantize(), X)


def test_gptq_user_errors():
    W = torch.randn(4, 48)
    with pytest.raises(UsageError, match="does not divide"):
        gptq_quantize(W, torch.eye(48), QuantScheme(4, strategy="group", group_size=32), GPTQParams())
    H = torch.eye(48)
    H[3, 3] = float("nan")
    with pytest.raises(UsageError, match="inf/nan"):
        gptq_quantize(W, H, QuantScheme(8), GPTQParams())
    with pytest.raises(ValueError, match="input features"):
        gptq_quantize(W, torch.eye(47), QuantScheme(8), GPTQParams())


# ---- one solve for Linears sharing an input ----

@pytest.mark.parametrize("actorder,static_groups", [(False, False), (False, True), ("group", False), ("static", False)],
                         ids=["ordered", "ordered-static", "group", "static"])
@pytest.mark.parametrize("name", list(MORE_SCHEMES))
def test_shared_input_solve_equals_separate_solves(name, actorder, static_groups):
    """q/k/v (or gate/up) solved as one row-concatenated W give what three separate solves give: GPTQ rows are
    independent given H, and act-order depends on diag H only. Per-tensor scales are the exception: shared."""
    from qtk.algorithms.gptq import gptq_quantize_shared

    scheme = MORE_SCHEMES[name]
    params = GPTQParams(block_size=64, actorder=actorder, static_groups=static_groups)
    W, X = correlated_layer(seed=3, out=40)
    Ws = [W[:24], W[24:32], W[32:]]  # unequal row counts, like q/k/v with GQA
    H = hessian(X)
    joint = gptq_quantize_shared(Ws, H, scheme, params, torch.bfloat16, names=["q", "k", "v"])
    for w, (qt, info) in zip(Ws, joint):
        ref, ref_info = gptq_quantize(w, H, scheme, params, torch.bfloat16)
        if scheme.strategy == "tensor":  # one scale for the group, so only the shapes and the loss's meaning carry over
            assert qt.scale.numel() == 1 and torch.equal(qt.scale, joint[0][0].scale)
            dW = w - qt.dequantize()
            assert info["loss"] == pytest.approx(((dW @ H) * dW).sum().item() / 2, rel=1e-4)
            continue
        # the same rows, the same column order and the same per-row updates: bit for bit the same
        assert torch.equal(qt.values, ref.values)
        assert torch.equal(qt.scale, ref.scale)
        if ref.zero_point is not None:
            assert torch.equal(qt.zero_point, ref.zero_point)
        assert (qt.g_idx is None) == (ref.g_idx is None)
        if ref.g_idx is not None:
            assert torch.equal(qt.g_idx, ref.g_idx)
        torch.testing.assert_close(qt.dequantize(), info["dequantized"], rtol=0, atol=0)
        assert info["loss"] == pytest.approx(ref_info["loss"], rel=1e-3)


def test_hessian_of_bf16_inputs_is_fp32_accurate():
    """bf16 inputs take the bf16-kernel path (fp32 accumulation): H matches a float64 reference to fp32 accuracy."""
    _, X = correlated_layer(inp=384, tokens=3000)
    Xb = X.bfloat16()
    S = torch.zeros(384, 384, dtype=torch.float64)
    hessian_sum_(S, Xb[:2600])  # more tokens than one float32 chunk (HESSIAN_CHUNK)
    hessian_sum_(S, Xb[2600:])
    H = hessian_from_sum(S, 3000)
    ref = 2 / 3000 * Xb.double().t() @ Xb.double()
    assert H.dtype == torch.float32
    assert ((H.double() - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert torch.backends.mkldnn.matmul.fp32_precision != "bf16"  # the global setting is restored


def test_hessian_sum_in_row_blocks_is_2_over_n_xtx_and_independent_of_the_batch_split():
    """hessian_sum_ adds float32 row-block products into a float64 sum (several blocks: in > HESSIAN_ROWS, bf16 and
    float32 inputs); hessian_from_sum is 2/n XᵀX, exactly symmetric, and the same bits whichever process summed
    which batches (the property torch.distributed runs rely on: each process sees whole batches)."""
    from qtk.algorithms.gptq import HESSIAN_ROWS

    g = torch.Generator().manual_seed(0)
    in_f = 2 * HESSIAN_ROWS + 100
    X = (torch.randn(96, in_f, generator=g) * torch.linspace(0.1, 3, in_f)).to(torch.bfloat16)
    ref = (2 / X.shape[0]) * X.double().t() @ X.double()
    whole = hessian_from_sum(hessian_sum_(torch.zeros(in_f, in_f, dtype=torch.float64), X), X.shape[0])
    torch.testing.assert_close(whole, ref.float(), rtol=1e-5, atol=1e-5)
    assert torch.equal(whole, whole.t())
    batches = [p.float() if i % 3 else p for i, p in enumerate(X.split(16))]  # batches of 16 tokens, mixed dtypes
    one = torch.zeros(in_f, in_f, dtype=torch.float64)
    for p in batches:
        hessian_sum_(one, p)
    a, b = torch.zeros(in_f, in_f, dtype=torch.float64), torch.zeros(in_f, in_f, dtype=torch.float64)
    for i, p in enumerate(reversed(batches)):  # the same batches in another order, alternately to two "processes"
        hessian_sum_(a if i % 2 else b, p)
    assert torch.equal(hessian_from_sum(a.add_(b), X.shape[0]), hessian_from_sum(one, X.shape[0]))
    torch.testing.assert_close(hessian_from_sum(one, X.shape[0]), whole, rtol=1e-5, atol=1e-5)
    assert torch.equal(hessian_from_sum(torch.zeros(4, 4, dtype=torch.float64), 0), torch.zeros(4, 4))
