"""Statistics and verdicts: paired bootstrap intervals, the two gate modes, limits, agreement limits."""

import numpy as np
import pytest

from qtk.eval.gate import agreement, judge_task, metric_difference, paired_bootstrap, statistic
from qtk.eval.tasks import Agreement, Limit, TaskSpec


def test_bootstrap_interval_covers_a_known_difference_about_95_percent_of_the_time():
    """Synthetic paired data whose true accuracy difference is known: the candidate flips 10% of the baseline's
    correct answers to wrong and 4% of its wrong answers to right, so the expected difference is
    0.04 * 0.3 - 0.10 * 0.7 = -5.8 points."""
    true_diff = 100 * (0.04 * 0.3 - 0.10 * 0.7)
    rng = np.random.default_rng(0)
    covered, widths, trials = 0, [], 200
    for t in range(trials):
        base = (rng.random(400) < 0.7).astype(float)
        u = rng.random(400)
        cand = np.where(base == 1, u >= 0.10, u < 0.04).astype(float)
        d, lo, hi = metric_difference("acc", {"acc": base}, {"acc": cand}, n_boot=400, seed=t)
        covered += lo <= true_diff <= hi
        widths.append(hi - lo)
    assert 0.90 <= covered / trials <= 0.99, covered / trials
    assert 2.0 < np.mean(widths) < 8.0  # paired: far narrower than two independent 400-sample intervals (~12 points)


def test_a_constant_shift_has_a_degenerate_interval_and_perplexity_uses_token_weighted_nll():
    base = {"nll": [2.0, 4.0, 6.0], "tokens": [1, 2, 3]}
    cand = {"nll": [2.0 + np.log(2) * 1, 4.0 + np.log(2) * 2, 6.0 + np.log(2) * 3], "tokens": [1, 2, 3]}
    assert statistic("perplexity", base) == pytest.approx(np.exp(12 / 6))
    # every token's NLL rises by log 2: perplexity doubles in every resample
    b, c = np.array([[2.0, 1], [4.0, 2], [6.0, 3]]), np.array([[x[0] + np.log(2) * x[1], x[1]] for x in [[2.0, 1], [4.0, 2], [6.0, 3]]])
    r = paired_bootstrap(b, c, lambda bs, cs, n: np.exp(cs[..., 0] / cs[..., 1]) / np.exp(bs[..., 0] / bs[..., 1]), n_boot=300)
    assert r == pytest.approx((2.0, 2.0, 2.0))
    d, lo, hi = metric_difference("perplexity", base, cand, n_boot=300)
    assert d == pytest.approx(np.exp(2) * 2 - np.exp(2)) and lo <= d <= hi


def _spec(limit, typ="multiple_choice", metric="acc"):
    return TaskSpec(name="t", type=typ, data="x.jsonl", metric=metric, gate=limit)


def test_significant_mode_forgives_noise_strict_mode_does_not():
    base = {"acc": [1.0] * 10 + [0.0] * 10, "acc_norm": [0.0] * 20}
    noisy = {"acc": [1.0] * 9 + [0.0] * 10 + [1.0], "acc_norm": [0.0] * 20}  # one answer lost, another gained: no drop
    one_down = {"acc": [1.0] * 9 + [0.0] * 11, "acc_norm": [0.0] * 20}  # -5 points, from a single example
    lim = Limit(max_drop=2.0)
    v = judge_task(_spec(lim), base, one_down, strict=False, n_boot=500, seed=0)
    assert v.drop == pytest.approx(5.0) and not v.significant and v.status == "pass" and "not significant" in v.reason
    assert judge_task(_spec(lim), base, one_down, strict=True, n_boot=500, seed=0).status == "fail"
    assert judge_task(_spec(lim), base, noisy, strict=True, n_boot=500, seed=0).status == "pass"
    many_down = {"acc": [1.0] * 2 + [0.0] * 18, "acc_norm": [0.0] * 20}  # -40 points, 8 examples lost, none gained
    v = judge_task(_spec(lim), base, many_down, strict=False, n_boot=500, seed=0)
    assert v.significant and v.status == "fail" and v.drop_ci[0] > 0
    assert [o.metric for o in v.other] == ["acc_norm"]
    assert judge_task(_spec(Limit()), base, many_down, strict=True, n_boot=100, seed=0).status == "report"


def test_min_recovery_for_perplexity_is_baseline_over_candidate():
    base = {"nll": [10.0] * 30, "tokens": [10] * 30}
    worse = {"nll": [10.5] * 30, "tokens": [10] * 30}  # ppl e^1 -> e^1.05: recovery e^-0.05 = 0.951
    spec = _spec(Limit(min_recovery=0.96), "perplexity", "perplexity")
    v = judge_task(spec, base, worse, strict=False, n_boot=200, seed=0)
    assert not v.higher_is_better and v.recovery == pytest.approx(np.exp(-0.05))
    assert v.drop > 0 and v.status == "fail"
    assert judge_task(_spec(Limit(min_recovery=0.95), "perplexity", "perplexity"), base, worse, strict=True, n_boot=200, seed=0).status == "pass"


def test_agreement_limits():
    base = [{"nll": 20.0, "tokens": 10}, {"nll": 10.0, "tokens": 5}]
    cand = [{"nll": 21.0, "tokens": 10, "kl": 0.5, "top1": 9}, {"nll": 10.5, "tokens": 5, "kl": 0.25, "top1": 4}]
    a = agreement(base, cand, Agreement(max_kl=0.04, min_top1=80, max_ppl_ratio=1.2), n_boot=100, seed=0)
    assert a.kl == pytest.approx(0.75 / 15) and a.top1 == pytest.approx(100 * 13 / 15)
    assert a.ppl_ratio == pytest.approx(np.exp(1.5 / 15))
    assert a.status == "fail" and "KL" in a.reason and "top-1" not in a.reason
    assert agreement(base, cand, Agreement(), n_boot=10, seed=0).status == "report"
