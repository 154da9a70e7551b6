"""Smoothing folds leave a block's float output unchanged; SmoothQuant scales balance the ranges."""

import pytest
import torch

from qtk.algorithms.smooth import fold_into_linear_rows, fold_into_norm, scale_linear_columns
from qtk.algorithms.smoothquant import smoothquant_scales

G = torch.Generator().manual_seed(0)
HIDDEN, TOKENS = 48, 64


def rms_norm(h, w, one_plus=False, eps=1e-6):
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1 + w) if one_plus else y * w


def hidden_with_outliers():
    h = torch.randn(TOKENS, HIDDEN, generator=G)
    h[:, [3, 17]] *= 30  # activation outlier channels, as in the SmoothQuant paper
    return h


@pytest.mark.parametrize("alpha", [0.5, 0.85])
@pytest.mark.parametrize("one_plus", [False, True], ids=["rmsnorm", "gemma-1+w"])
def test_norm_fold_keeps_norm_to_linears_output(one_plus, alpha):
    h = hidden_with_outliers()
    norm_w = 0.5 + torch.rand(HIDDEN, generator=G)
    if one_plus:
        norm_w = norm_w - 1  # Gemma stores w with an effective weight 1 + w
    Ws = [torch.randn(n, HIDDEN, generator=G) * 0.05 for n in (32, 16, 16)]  # q, k, v
    x = rms_norm(h, norm_w, one_plus)
    s = smoothquant_scales(x.abs().amax(0), Ws, alpha)
    assert s.shape == (HIDDEN,) and (s - 1).abs().max() > 0.5, "the test needs scales far from 1"

    new_norm = fold_into_norm(norm_w, s, one_plus=one_plus)
    x_s = rms_norm(h, new_norm, one_plus)
    torch.testing.assert_close(x_s, x / s, rtol=1e-5, atol=1e-5)
    for W in Ws:
        torch.testing.assert_close(x_s @ scale_linear_columns(W, s).t(), x @ W.t(), rtol=1e-4, atol=1e-4)
    # the smoothed activations have their outlier channels tamed
    assert x_s.abs().amax(0).max() / x_s.abs().amax(0).median() < 0.5 * x.abs().amax(0).max() / x.abs().amax(0).median()


def test_linear_row_fold_keeps_v_to_o_output():
    x = torch.randn(TOKENS, HIDDEN, generator=G)
    Wv, bv = torch.randn(24, HIDDEN, generator=G), torch.randn(24, generator=G)
    Wo = torch.randn(HIDDEN, 24, generator=G)
    s = torch.rand(24, generator=G) * 4 + 0.1
    Wv2, bv2 = fold_into_linear_rows(Wv, bv, s)
    ref = (x @ Wv.t() + bv) @ Wo.t()
    torch.testing.assert_close((x @ Wv2.t() + bv2) @ scale_linear_columns(Wo, s).t(), ref, rtol=1e-4, atol=1e-4)
    W_nb, b_nb = fold_into_linear_rows(Wv, None, s)
    assert b_nb is None and torch.equal(W_nb, Wv2)


def test_linear_row_fold_keeps_up_to_down_output():
    """up_proj's rows can take s because SwiGLU multiplies act(gate) by up elementwise."""
    x = torch.randn(TOKENS, HIDDEN, generator=G)
    Wg, Wu, Wd = torch.randn(40, HIDDEN, generator=G), torch.randn(40, HIDDEN, generator=G), torch.randn(HIDDEN, 40, generator=G)
    s = torch.rand(40, generator=G) * 4 + 0.1

    def mlp(Wg, Wu, Wd):
        return (torch.nn.functional.silu(x @ Wg.t()) * (x @ Wu.t())) @ Wd.t()

    Wu2, _ = fold_into_linear_rows(Wu, None, s)
    torch.testing.assert_close(mlp(Wg, Wu2, scale_linear_columns(Wd, s)), mlp(Wg, Wu, Wd), rtol=1e-4, atol=1e-4)


def test_folds_return_new_tensors_in_the_input_dtype():
    w = torch.rand(8, dtype=torch.bfloat16)
    W = torch.rand(4, 8, dtype=torch.bfloat16)
    b = torch.rand(4, dtype=torch.bfloat16)
    s8, s4 = torch.full((8,), 2.0), torch.full((4,), 2.0)
    w0, W0, b0 = w.clone(), W.clone(), b.clone()
    outs = [fold_into_norm(w, s8), fold_into_norm(w, s8, one_plus=True), scale_linear_columns(W, s8), *fold_into_linear_rows(W, b, s4)]
    assert all(o.dtype == torch.bfloat16 for o in outs)
    assert torch.equal(w, w0) and torch.equal(W, W0) and torch.equal(b, b0)
    assert torch.equal(outs[0], w / 2) and torch.equal(outs[2], W * 2) and torch.equal(outs[3], W / 2)
    torch.testing.assert_close(outs[1].float(), ((1 + w.float()) / 2 - 1), rtol=0, atol=4e-3)
    with pytest.raises(ValueError, match="expected"):
        scale_linear_columns(W, s4)


def test_smoothquant_scales_known_values_and_balance():
    act = torch.tensor([4.0, 1.0, 9.0])
    W1 = torch.tensor([[1.0, -4.0, 0.5]])
    W2 = torch.tensor([[0.5, 2.0, -1.0]])  # channel 2's weight max comes from the second Linear
    s = smoothquant_scales(act, [W1, W2], alpha=0.5)
    torch.testing.assert_close(s, torch.tensor([2.0, 0.5, 3.0]))
    # alpha = 0.5 equalises the two ranges: max|X_j| / s_j == max|W_j| · s_j
    torch.testing.assert_close(act / s, torch.tensor([1.0, 4.0, 1.0]) * s)
    torch.testing.assert_close(smoothquant_scales(act, [W1, W2], alpha=1.0), act)
    torch.testing.assert_close(smoothquant_scales(act, [W1, W2], alpha=0.0), 1 / torch.tensor([1.0, 4.0, 1.0]))


def test_smoothquant_scales_stay_finite_for_dead_channels():
    act = torch.tensor([0.0, 2.0, 1e30])
    W = torch.tensor([[1.0, 0.0, 1.0]])
    s = smoothquant_scales(act, [W], alpha=0.5)
    assert torch.isfinite(s).all() and (s > 0).all() and s.max() <= 1e5 and s.min() >= 1e-5
    with pytest.raises(ValueError, match="input features"):
        smoothquant_scales(act, [torch.ones(2, 4)], 0.5)
