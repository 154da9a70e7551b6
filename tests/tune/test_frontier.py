"""The precision-assignment frontier against brute force: exact, and within its stated bound when bucketed."""

from __future__ import annotations

import itertools
import random

import pytest

from qtk.tune.frontier import Option, frontier


def _random_groups(rng: random.Random, n_groups: int, n_opts: int) -> list[list[Option]]:
    groups = []
    for _ in range(n_groups):
        opts = []
        for _ in range(n_opts):  # fewer bytes usually means more damage, but not always (real estimates are noisy)
            b = rng.randrange(1, 50) * 1000 + rng.randrange(1000)
            opts.append(Option(b, rng.random() * 1e4 / b + rng.random() * 0.3))
        groups.append(opts)
    return groups


def _brute(groups):
    return [(sum(g[k].bytes for g, k in zip(groups, ch)), sum(g[k].damage for g, k in zip(groups, ch)), ch)
            for ch in itertools.product(*[range(len(g)) for g in groups])]


@pytest.mark.parametrize("seed", range(12))
def test_exact_frontier_equals_brute_force(seed):
    rng = random.Random(seed)
    groups = _random_groups(rng, rng.randint(1, 6), rng.randint(1, 4))
    all_points = _brute(groups)
    f = frontier(groups)
    # every budget: the frontier's answer is the brute-force optimum
    budgets = sorted({b for b, _, _ in all_points}) + [0, 10**9]
    for B in budgets:
        fit = [d for b, d, _ in all_points if b <= B]
        p = f.best_within(B)
        if not fit:
            assert p is None
            continue
        assert p.bytes <= B and p.damage == pytest.approx(min(fit), rel=1e-12, abs=1e-12)
        # the stored choice reproduces the totals
        assert p.bytes == sum(g[k].bytes for g, k in zip(groups, p.choice))
        assert p.damage == pytest.approx(sum(g[k].damage for g, k in zip(groups, p.choice)), rel=1e-12)
    # points are exactly the Pareto set (no dominated point, none missing)
    pareto = {(b, round(d, 9)) for b, d, _ in all_points
              if not any(b2 <= b and d2 <= d and (b2, d2) != (b, d) for b2, d2, _ in all_points)}
    got = {(p.bytes, round(p.damage, 9)) for p in f.points}
    assert got == pareto


@pytest.mark.parametrize("seed", range(8))
def test_bucketed_frontier_within_stated_bound(seed):
    rng = random.Random(100 + seed)
    groups = _random_groups(rng, 6, 3)
    all_points = _brute(groups)
    r = 3000
    f = frontier(groups, resolution=r)
    exact = frontier(groups)
    assert len(f) <= len(exact)
    for B in sorted({b for b, _, _ in all_points})[::7]:
        p = f.best_within(B)
        loose = [d for b, d, _ in all_points if b <= B - len(groups) * r]
        if loose:  # as good as the exact optimum of the budget shrunk by groups * resolution
            assert p is not None and p.damage <= min(loose) + 1e-12
        if p is not None:
            assert p.bytes <= B


def test_queries_and_errors():
    groups = [[Option(10, 1.0), Option(20, 0.1)], [Option(5, 2.0), Option(8, 0.5)]]
    f = frontier(groups)
    assert f.min_bytes == 15
    assert f.best_within(14) is None
    assert f.best_within(28).choice == (1, 1)
    assert f.smallest_under(1.0).choice == (1, 1)  # (20, 0.1) + (8, 0.5)
    assert f.smallest_under(1.5).bytes == 18  # (10, 8): damage 1.5
    assert f.smallest_under(0.01) is None
    with pytest.raises(ValueError, match="group 1 has no option"):
        frontier([[Option(1, 0.0)], []])
    assert frontier([]).points[0].choice == ()


def test_large_instance_stays_small_with_resolution():
    rng = random.Random(7)
    groups = _random_groups(rng, 120, 3)  # a 30-layer model: 4 groups per layer, 3 schemes each
    f = frontier(groups, resolution=20000)
    total = sum(max(o.bytes for o in g) for g in groups)
    assert len(f) <= total // 20000 + 1
    assert all(a.bytes < b.bytes and a.damage > b.damage for a, b in zip(f.points, f.points[1:]))


def test_buckets_are_resolution_wide():
    r = 1000
    f = frontier([[Option(0, 1.0), Option(r, 0.0)]], resolution=r)  # different buckets: both kept
    assert [p.bytes for p in f.points] == [0, r]
    g = frontier([[Option(0, 1.0), Option(r - 1, 0.0)]], resolution=r)  # one bucket: the lower damage stands for both
    assert [(p.bytes, p.damage) for p in g.points] == [(r - 1, 0.0)]
