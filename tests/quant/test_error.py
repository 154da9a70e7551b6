"""The relative weight error summed in row blocks (qtk/quant/error.py)."""

import pytest
import torch

import qtk.quant.error as error
from qtk.quant.error import ErrorSum, block_rows, relative_error


def _pair(rows, cols, seed=0):
    g = torch.Generator().manual_seed(seed)
    ref = torch.randn(rows, cols, generator=g)
    return ref + 0.03 * torch.randn(rows, cols, generator=g), ref


def test_blocked_error_is_the_float64_figure():
    """The blocked float32 norms added in float64 give the exact (float64) relative error to ~1e-7 on a weight
    of Llama-3-8B's MLP shape, where one float32 norm of the whole difference drifts by more."""
    w_hat, ref = _pair(14336, 4096)
    exact = float((w_hat.double() - ref.double()).norm() / ref.double().norm())
    assert relative_error(w_hat, ref) == pytest.approx(exact, rel=1e-6)
    whole32 = float((w_hat - ref).norm() / ref.norm())  # the figure before: one float32 norm, 2.4e-4 off here
    assert abs(whole32 / exact - 1) > 1e-4
    assert block_rows((14336, 4096)) == 128 and block_rows((4096,)) == 1


def test_rows_given_block_by_block_or_whole_give_the_same_bits(monkeypatch):
    monkeypatch.setattr(error, "ERROR_BLOCK_BYTES", 4 * 64 * 6)  # 6 rows' bytes of 64 columns: blocks of 4 (a power of two)
    assert block_rows((23, 64)) == 4
    w_hat, ref = _pair(23, 64, seed=1)
    whole = relative_error(w_hat, ref)
    for step in (4, 8, 12):  # any cut at block boundaries (the last block short)
        s = ErrorSum()
        for r in range(0, 23, step):
            s.add(w_hat[r:r + step], ref[r:r + step])
        assert s.value() == whole
    odd = ErrorSum()
    for r in range(0, 23, 3):  # cuts off the block boundaries sum other partial norms: equal only to rounding
        odd.add(w_hat[r:r + 3], ref[r:r + 3])
    assert odd.value() == pytest.approx(whole, rel=1e-6)


def test_nan_and_degenerate_inputs():
    w_hat, ref = _pair(8, 16)
    w_hat[3, 4] = float("nan")
    assert relative_error(w_hat, ref) != relative_error(w_hat, ref)  # NaN is reported, not hidden
    assert relative_error(torch.zeros(4, 4), torch.zeros(4, 4)) == 0.0
    assert ErrorSum().value() == 0.0
    w = torch.randn(3, 5, 7)  # leading dims are rows (stacked experts)
    assert relative_error(w * 1.01, w) == pytest.approx(0.01, rel=1e-5)
    assert relative_error(torch.tensor([1.0, 2.0]).bfloat16(), torch.tensor([1.0, 1.0])) == pytest.approx(0.5 ** 0.5)
