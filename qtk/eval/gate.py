"""The gate: task scores from per-example results, paired bootstrap confidence intervals, and the verdict.

Every metric is a function of per-example additive columns (accuracy: the 0/1 column; perplexity: summed
NLL and token counts), so one vectorised paired bootstrap serves all of them: resample the examples with
replacement, the same indices for baseline and candidate, and recompute the statistic.

Verdicts. `max_drop` limits how many points the candidate may lose (percentage points for accuracies,
perplexity units for perplexity), `min_recovery` how much of the baseline it must keep (candidate/baseline,
or baseline/candidate for perplexity). In the default mode a task fails only when its point estimate breaks
a limit AND the drop is statistically significant (the whole 95% interval of the drop lies above zero), so
a noisy small task does not block a release; --strict fails on the point estimate alone.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

import numpy as np

# metric name -> (columns it needs, statistic of the column sums (…, k) and the example count, higher is better)
Stat = Callable[[np.ndarray, int], np.ndarray]


def _mean_pct(col: str):
    return ((col,), lambda s, n: 100.0 * s[..., 0] / n, True)


METRICS: dict[str, tuple[tuple[str, ...], Stat, bool]] = {
    "acc": _mean_pct("acc"),
    "acc_norm": _mean_pct("acc_norm"),
    "exact_match": _mean_pct("exact_match"),
    "perplexity": (("nll", "tokens"), lambda s, n: np.exp(s[..., 0] / np.maximum(s[..., 1], 1)), False),
}


def _columns(per_example: dict[str, list[float]], cols) -> np.ndarray:
    return np.stack([np.asarray(per_example[c], dtype=np.float64) for c in cols], axis=-1)  # [n, k]


def statistic(metric: str, per_example: dict[str, list[float]]) -> float:
    cols, f, _ = METRICS[metric]
    x = _columns(per_example, cols)
    return float(f(x.sum(0), len(x)))


def bootstrap_indices(n: int, n_boot: int, seed: int) -> np.ndarray:
    """Resampled example indices [n_boot, n], the same for every statistic of a task (paired)."""
    return np.random.default_rng(seed).integers(0, n, size=(n_boot, n))


def paired_bootstrap(base: np.ndarray, cand: np.ndarray, stat: Callable[[np.ndarray, np.ndarray, int], np.ndarray], *,
                     n_boot: int = 2000, seed: int = 0, level: float = 0.95, chunk: int = 250) -> tuple[float, float, float]:
    """Point estimate and percentile interval of stat(base_sums, cand_sums, n) over paired resamples.

    base, cand: per-example additive columns [n, k] (the same examples, in the same order)."""
    n = len(base)
    assert len(cand) == n and n > 0
    point = float(stat(base.sum(0), cand.sum(0), n))
    if n == 1 or n_boot <= 0:
        return point, point, point
    idx = bootstrap_indices(n, n_boot, seed)
    vals = []
    for s in range(0, n_boot, chunk):  # bounded memory: chunk x n x k
        i = idx[s: s + chunk]
        vals.append(stat(base[i].sum(1), cand[i].sum(1), n))
    v = np.concatenate(vals)
    v = v[np.isfinite(v)]
    a = (1 - level) / 2
    return point, float(np.quantile(v, a)), float(np.quantile(v, 1 - a))


def metric_difference(metric: str, base_ex: dict, cand_ex: dict, **kw) -> tuple[float, float, float]:
    """candidate − baseline of a metric, with its paired bootstrap interval."""
    cols, f, _ = METRICS[metric]
    return paired_bootstrap(_columns(base_ex, cols), _columns(cand_ex, cols), lambda b, c, n: f(c, n) - f(b, n), **kw)


@dataclass
class MetricResult:
    metric: str
    baseline: float
    candidate: float
    diff: float  # candidate − baseline
    ci: tuple[float, float]  # 95% interval of diff


@dataclass
class TaskVerdict:
    name: str
    type: str
    metric: str
    higher_is_better: bool
    n: int
    baseline: float
    candidate: float
    diff: float
    ci: tuple[float, float]
    drop: float  # how much worse the candidate is, in the metric's units (> 0: worse)
    drop_ci: tuple[float, float]
    recovery: float  # candidate/baseline (baseline/candidate for perplexity); 1.0 = no loss
    significant: bool  # the drop's interval lies entirely above zero
    limit: dict
    status: str  # pass | fail | report (no limit set)
    reason: str = ""
    other: list[MetricResult] = field(default_factory=list)
    extra: dict = field(default_factory=dict)  # e.g. generation agreement
    baseline_cached: bool = False

    def to_dict(self) -> dict:
        return asdict(self)


def judge_task(spec, base_ex: dict, cand_ex: dict, *, strict: bool, n_boot: int, seed: int) -> TaskVerdict:
    """Score one task for both models and apply its limit (spec: a TaskSpec)."""
    metric = spec.metric
    hib = METRICS[metric][2]
    b, c = statistic(metric, base_ex), statistic(metric, cand_ex)
    d, lo, hi = metric_difference(metric, base_ex, cand_ex, n_boot=n_boot, seed=seed)
    drop, drop_ci = (-d, (-hi, -lo)) if hib else (d, (lo, hi))
    if hib:
        recovery = c / b if b > 0 else (1.0 if c >= b else 0.0)
    else:
        recovery = b / c if c > 0 else 1.0
    significant = drop_ci[0] > 0
    lim = spec.gate
    broken = []
    if lim.max_drop is not None and drop > lim.max_drop + 1e-12:
        broken.append(f"drop {drop:.3g} > max_drop {lim.max_drop:g}")
    if lim.min_recovery is not None and recovery < lim.min_recovery - 1e-12:
        broken.append(f"recovery {recovery:.4g} < min_recovery {lim.min_recovery:g}")
    if lim.empty:
        status, reason = "report", "no limit set"
    elif not broken:
        status, reason = "pass", ""
    elif strict:
        status, reason = "fail", "; ".join(broken)
    elif significant:
        status, reason = "fail", "; ".join(broken) + f" (significant: drop 95% CI [{drop_ci[0]:.3g}, {drop_ci[1]:.3g}])"
    else:
        status, reason = "pass", "; ".join(broken) + f", but not significant (drop 95% CI [{drop_ci[0]:.3g}, {drop_ci[1]:.3g}] includes 0)"
    others = []
    for m in _other_metrics(spec.type, metric):
        ob, oc = statistic(m, base_ex), statistic(m, cand_ex)
        od, olo, ohi = metric_difference(m, base_ex, cand_ex, n_boot=n_boot, seed=seed)
        others.append(MetricResult(m, ob, oc, od, (olo, ohi)))
    return TaskVerdict(name=spec.name, type=spec.type, metric=metric, higher_is_better=hib, n=len(next(iter(base_ex.values()))),
                       baseline=b, candidate=c, diff=d, ci=(lo, hi), drop=drop, drop_ci=drop_ci, recovery=recovery,
                       significant=significant, limit={k: v for k, v in asdict(lim).items() if v is not None},
                       status=status, reason=reason, other=others)


def _other_metrics(typ: str, primary: str) -> list[str]:
    return [m for m in {"multiple_choice": ("acc", "acc_norm")}.get(typ, ()) if m != primary]


@dataclass
class AgreementResult:
    """Model-level agreement on the perplexity texts: mean token KL(baseline || candidate), top-1 agreement (%),
    perplexity ratio candidate/baseline; each with a bootstrap interval over texts, and its limit if set."""

    tokens: int
    kl: float | None
    kl_ci: tuple[float, float] | None
    top1: float
    top1_ci: tuple[float, float]
    ppl_ratio: float
    ppl_ratio_ci: tuple[float, float]
    limits: dict
    status: str  # pass | fail | report
    reason: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def agreement(base_rows: list[dict], cand_rows: list[dict], limits, *, n_boot: int, seed: int) -> AgreementResult:
    """base_rows/cand_rows: per text {nll, tokens} (candidate rows also kl, top1). limits: tasks.Agreement."""
    b = np.array([[r["nll"], r["tokens"]] for r in base_rows], dtype=np.float64)
    has_kl = all(r.get("kl") is not None for r in cand_rows)
    c = np.array([[r["nll"], r["tokens"], r["kl"] if has_kl else 0.0, r["top1"]] for r in cand_rows], dtype=np.float64)
    kw = dict(n_boot=n_boot, seed=seed)
    top1 = paired_bootstrap(b, c, lambda bs, cs, n: 100.0 * cs[..., 3] / cs[..., 1], **kw)
    ratio = paired_bootstrap(b, c, lambda bs, cs, n: np.exp(cs[..., 0] / cs[..., 1] - bs[..., 0] / bs[..., 1]), **kw)
    kl = paired_bootstrap(b, c, lambda bs, cs, n: cs[..., 2] / cs[..., 1], **kw) if has_kl else None
    broken = []
    if limits.max_kl is not None:
        if kl is None:
            broken.append("max_kl is set but this engine does not report KL")
        elif kl[0] > limits.max_kl:
            broken.append(f"KL {kl[0]:.4g} > max_kl {limits.max_kl:g}")
    if limits.min_top1 is not None and top1[0] < limits.min_top1:
        broken.append(f"top-1 agreement {top1[0]:.4g}% < min_top1 {limits.min_top1:g}%")
    if limits.max_ppl_ratio is not None and ratio[0] > limits.max_ppl_ratio:
        broken.append(f"perplexity ratio {ratio[0]:.4g} > max_ppl_ratio {limits.max_ppl_ratio:g}")
    lims = {k: getattr(limits, k) for k in ("max_kl", "min_top1", "max_ppl_ratio") if getattr(limits, k) is not None}
    status = "report" if not lims else ("fail" if broken else "pass")
    return AgreementResult(int(b[:, 1].sum()), None if kl is None else kl[0], None if kl is None else (kl[1], kl[2]),
                           top1[0], (top1[1], top1[2]), ratio[0], (ratio[1], ratio[2]), lims, status, "; ".join(broken))
