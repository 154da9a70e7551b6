"""The bytes-vs-damage frontier of a per-group precision assignment (a multiple-choice knapsack), exactly.

Each group (a fusion group of Linears: q/k/v, o, gate/up, down) takes exactly one option (a scheme), which costs
`bytes` and does `damage` (an additive estimate of the harm to the model's output). The frontier holds every
assignment that no other beats on both totals: for any byte budget the cheapest-damage assignment is on it, and
for any damage limit the smallest one.

It is built group by group: the frontier of the first k groups, combined with every option of group k+1, then
pruned of dominated points (dynamic programming over Pareto sets; exact). The number of points is bounded by the
number of distinct byte totals; `resolution` > 0 keeps one point per bucket of `resolution` bytes (the least
damage in it), so at most (total range / resolution) points survive each group. A kept point then stands for a
dropped one with no more damage and fewer than `resolution` more bytes, once per group, so the answer for a budget B
is at least as good as the exact optimum for budget B - groups * resolution: a stated bound, used only when a model
has so many groups that the exact set grows too large.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Option:
    bytes: int
    damage: float


@dataclass(frozen=True)
class Point:
    """One assignment on the frontier: total bytes, total damage, and the option index chosen for each group."""

    bytes: int
    damage: float
    choice: tuple[int, ...]


class Frontier:
    """Pareto-optimal assignments sorted by bytes (ascending); damage then strictly decreases."""

    def __init__(self, points: list[Point]):
        self.points = points

    def __len__(self) -> int:
        return len(self.points)

    def best_within(self, max_bytes: int) -> Point | None:
        """The least-damage assignment that fits in max_bytes (None: nothing fits)."""
        i = bisect.bisect_right([p.bytes for p in self.points], max_bytes) - 1
        return self.points[i] if i >= 0 else None

    def smallest_under(self, max_damage: float) -> Point | None:
        """The smallest assignment whose damage is at most max_damage (None: none is that good)."""
        return next((p for p in self.points if p.damage <= max_damage), None)

    @property
    def min_bytes(self) -> int:
        return self.points[0].bytes


def _prune(cands: list[tuple[int, float, int, int]], resolution: int) -> list[tuple[int, float, int, int]]:
    """Keep the non-dominated (bytes, damage, parent, option) candidates, sorted by bytes; with resolution > 0, first
    only the least-damage candidate of each bucket of `resolution` bytes (floor(bytes / resolution))."""
    if resolution:
        best: dict[int, tuple[int, float, int, int]] = {}
        for c in cands:
            key = c[0] // resolution
            if key not in best or (c[1], c[0]) < (best[key][1], best[key][0]):
                best[key] = c
        cands = list(best.values())
    cands.sort(key=lambda c: (c[0], c[1]))
    out: list[tuple[int, float, int, int]] = []
    for c in cands:
        if not out or c[1] < out[-1][1]:  # otherwise a kept point costs no more and damages no less
            out.append(c)
    return out


def frontier(groups: Sequence[Sequence[Option]], resolution: int = 0) -> Frontier:
    """The exact Pareto frontier of choosing one option per group (see the module docstring for `resolution`)."""
    if not groups:
        return Frontier([Point(0, 0.0, ())])
    for g, opts in enumerate(groups):
        if not opts:
            raise ValueError(f"group {g} has no option")
    # stages[k] holds the kept points after group k as (bytes, damage, index of the parent point in stage k-1, option)
    stages: list[list[tuple[int, float, int, int]]] = []
    prev = [(0, 0.0, -1, -1)]
    for opts in groups:
        cands = [(b + o.bytes, d + o.damage, i, k) for i, (b, d, _, _) in enumerate(prev) for k, o in enumerate(opts)]
        prev = _prune(cands, resolution)
        stages.append(prev)
    points = []
    for b, d, parent, k in stages[-1]:
        choice = [k]
        for stage in range(len(stages) - 2, -1, -1):
            _, _, grand, k2 = stages[stage][parent]
            choice.append(k2)
            parent = grand
        points.append(Point(b, d, tuple(reversed(choice))))
    return Frontier(points)
