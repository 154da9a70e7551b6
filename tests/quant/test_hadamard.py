"""Hadamard matrices and the rotations built from them (qtk.quant.hadamard): orthogonal for every order the supported
families' widths need, applied by factors (never one dense 14336² matrix), reproducible from the recorded seed."""

from __future__ import annotations

import pytest
import torch

from qtk.quant import hadamard
from qtk.quant.hadamard import Rotation, construction, hadamard_matrix, largest_block

# head_dim 64/128, SmolLM2-135M's hidden 576 and intermediate 1536, Llama's 2048/4096 and Llama-3-8B's 14336
WIDTHS = (64, 128, 576, 1536, 2048, 4096, 14336)


def assert_orthogonal(r: Rotation, rows: int = 4, seed: int = 0) -> None:
    """x R keeps every norm and x R Rᵀ = x (R is n x n, so RᵀR = I follows); on random rows, float64."""
    x = torch.randn(rows, r.size, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    y = r.apply(x)
    assert torch.allclose(y.norm(dim=1), x.norm(dim=1), rtol=1e-12, atol=0)
    assert torch.allclose(r.apply(y, transpose=True), x, rtol=0, atol=1e-12)
    assert torch.allclose(y @ y.T, x @ x.T, rtol=0, atol=1e-9 * r.size)  # every inner product, not only norms


@pytest.mark.parametrize("n", [2, 4, 12, 20, 28, 36, 44, 60, 64, 96, 128, 144, 576])
def test_hadamard_matrices_have_orthogonal_rows(n):
    h = hadamard_matrix(n).to(torch.int64)
    assert set(h.unique().tolist()) == {-1, 1}
    assert torch.equal(h @ h.T, n * torch.eye(n, dtype=torch.int64)), construction(n)


@pytest.mark.parametrize("n", WIDTHS)
def test_every_width_is_one_full_hadamard_applied_by_factors(n, monkeypatch):
    r = Rotation(n, seed=5)
    assert r.full, f"{n}: only blocks of {r.block}"
    factors = hadamard._factors(construction(n))
    assert max(f.shape[0] for f in factors) <= hadamard.MAX_DENSE_FACTOR  # 14336 = 28 ⊗ 512: no 14336² matrix
    assert_orthogonal(r)
    if n <= 2048:  # the dense R, built column by column through apply, is H/√n with the signs
        m = r.matrix()
        assert torch.allclose(m @ m.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
        assert torch.allclose(m.abs(), torch.full_like(m, n ** -0.5))


def test_the_constructions_the_widths_take():
    assert hadamard.describe(construction(576)) == "Paley II(17) ⊗ Sylvester(16)"
    assert hadamard.describe(construction(1536)) == "Paley I(11) ⊗ Sylvester(128)"
    assert hadamard.describe(construction(14336)) == "Paley I(27) ⊗ Sylvester(512)"  # GF(27): a prime power


def test_orders_no_construction_reaches_fall_back_to_orthogonal_blocks():
    assert construction(92) is None and largest_block(92) == 4
    r = Rotation(184)  # 8 x 23: blocks of Sylvester(8); still orthogonal
    assert not r.full and r.block == 8
    assert_orthogonal(r)
    assert Rotation(7).block == 1  # odd: the identity blocks (nothing to rotate with)
    with pytest.raises(ValueError):
        Rotation(64, block=12)


def test_random_signs_are_reproducible_from_the_recorded_seed():
    a, b = Rotation(576, seed=1234), Rotation.from_json(Rotation(576, seed=1234).to_json())
    x = torch.randn(3, 576, dtype=torch.float64)
    assert torch.equal(a.apply(x), b.apply(x))
    other = Rotation(576, seed=1235).apply(x)
    assert not torch.allclose(other, a.apply(x))  # another seed, another rotation
    assert not torch.allclose(Rotation(576).apply(x), a.apply(x))  # no seed: plain H/√n
    assert "seed 1234" in a.describe()


def test_the_orthogonality_check_fails_for_a_matrix_that_is_not(monkeypatch):
    """The check above is not vacuous: a Sylvester matrix with one entry flipped is no longer orthogonal."""
    good = hadamard._sylvester(64)

    def broken(n):
        h = good.clone()
        h[3, 5] = -h[3, 5]
        return h

    monkeypatch.setattr(hadamard, "_sylvester", broken)
    with pytest.raises(AssertionError):
        assert_orthogonal(Rotation(64))
    h = hadamard_matrix(64).to(torch.int64)
    assert not torch.equal(h @ h.T, 64 * torch.eye(64, dtype=torch.int64))
