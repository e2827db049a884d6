"""Many-run auditing: an epsilon lower bound from the true/false positive rates of an attack.

A mechanism that is ``(eps, delta)``-DP bounds every membership test: an attack that says "in"
when a canary's score is at least ``t`` has true positive rate ``TPR`` and false positive rate
``FPR`` with ``TPR <= e^eps FPR + delta`` and ``1 - FPR <= e^eps (1 - TPR) + delta`` (the
hypothesis-testing view of DP; Kairouz, Oh & Viswanath 2015, and its use for auditing DP-SGD in
Jagielski, Ullman & Oprea 2020, "Auditing differentially private machine learning: how private is
private SGD?", and Nasr et al. 2021, "Adversary instantiation: lower bounds for differentially
private machine learning"). Replacing the rates by Clopper-Pearson bounds (Clopper & Pearson
1934: exact binomial intervals) gives, at the stated confidence::

    eps >= max( log((TPR_low - delta) / FPR_high), log((1 - FPR_high - delta) / (1 - TPR_low)) )

Each trial (a canary's score with its inclusion) must be independent of the others: one canary per
training run, or several canaries whose scores do not interact (white-box Dirac canaries on
disjoint coordinates under Poisson sampling, see :mod:`tf_dp.auditing.canaries`).

Choosing the threshold after looking at the scores would overstate the bound, so the choice is
corrected in one of two ways (both documented on :func:`epsilon_lower_bound`):

* ``thresholds=None`` (default): the trials are split at random into two halves; the threshold
  that gives the largest bound on the first half is used on the second half only;
* ``thresholds=[...]`` fixed before seeing the scores: the bound is the largest over them, with a
  union (Bonferroni) bound over the ``2K`` Clopper-Pearson intervals. :func:`design_threshold`
  picks one from scores *simulated* from the mechanism the certificate describes (independent of
  the audited scores), so that every trial counts towards the bound.

Example::

    import numpy as np
    from tf_dp.auditing import many_run
    rng = np.random.default_rng(0)
    included = rng.random(20000) < 0.5
    scores = rng.normal(2.0 * included, 1.0)          # a Gaussian mechanism, mu = 2
    bound = many_run.epsilon_lower_bound(scores, included, delta=1e-5, confidence=0.95)
    print(bound)                                      # eps >= ... at 95% confidence
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
from scipy import stats

from tf_dp.auditing import _checks
from tf_dp.auditing._checks import percent as _percent

__all__ = [
    "ManyRunBound", "clopper_pearson", "design_threshold", "epsilon_from_rates",
    "epsilon_lower_bound",
]


def clopper_pearson(successes: Any, trials: Any, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """One-sided Clopper-Pearson bounds on a binomial proportion, each at level ``alpha``.

    Returns ``(low, high)``: ``P[p < low] <= alpha`` and ``P[p > high] <= alpha`` over the draw of
    ``successes ~ Binomial(trials, p)``; both hold together with probability ``>= 1 - 2 alpha``.
    Works elementwise on arrays.

    Example::

        low, high = clopper_pearson(5, 100, 0.025)    # 95% two-sided interval for 5/100
    """
    alpha = _checks.probability("alpha", alpha)
    k = np.asarray(successes, dtype=np.float64)
    n = np.asarray(trials, dtype=np.float64)
    if np.any(k < 0) or np.any(k > n):
        raise ValueError("successes must lie in [0, trials]")
    with np.errstate(invalid="ignore", divide="ignore"):
        low = np.where(k > 0, stats.beta.ppf(alpha, k, n - k + 1), 0.0)
        high = np.where(k < n, stats.beta.ppf(1.0 - alpha, k + 1, n - k), 1.0)
    return np.asarray(low, dtype=np.float64), np.asarray(high, dtype=np.float64)


def epsilon_from_rates(tpr: Any, fpr: Any, delta: float) -> np.ndarray:
    """The smallest ``eps`` that an attack with these rates allows at ``delta`` (>= 0).

    ``max(log((tpr - delta) / fpr), log((1 - fpr - delta) / (1 - tpr)), 0)``, elementwise.
    """
    tpr = np.asarray(tpr, dtype=np.float64)
    fpr = np.asarray(fpr, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.log(np.maximum(tpr - delta, 0.0)) - np.log(fpr)
        b = np.log(np.maximum(1.0 - fpr - delta, 0.0)) - np.log(1.0 - tpr)
    out = np.maximum(np.nan_to_num(a, nan=0.0, neginf=0.0), np.nan_to_num(b, nan=0.0, neginf=0.0))
    return np.maximum(out, 0.0)


@dataclasses.dataclass(frozen=True)
class ManyRunBound:
    """A many-run epsilon lower bound.

    Attributes:
      epsilon: the lower bound (finite: Clopper-Pearson keeps ``FPR_high > 0`` and
        ``TPR_low < 1``).
      delta: the delta at which it holds.
      confidence: probability that the bound is valid (over the randomness of the trials).
      threshold: the attack's threshold (``score >= threshold`` means "in").
      tpr_low, fpr_high: the Clopper-Pearson bounds at that threshold.
      trials_in, trials_out: the canaries in / out that the bound was computed on.
      method: how the threshold was chosen (``"split"`` or ``"fixed thresholds (K)"``).
    """

    epsilon: float
    delta: float
    confidence: float
    threshold: float
    tpr_low: float
    fpr_high: float
    trials_in: int
    trials_out: int
    method: str

    def __str__(self) -> str:
        return (f"many-run (Clopper-Pearson, threshold by {self.method}): epsilon >= "
                f"{self.epsilon:.3f} at delta = {self.delta:.3g}, {_percent(self.confidence)} "
                f"confidence ({self.trials_in} in / {self.trials_out} out trials; TPR >= "
                f"{self.tpr_low:.4f}, FPR <= {self.fpr_high:.3g})")


def _counts(scores_in: np.ndarray, scores_out: np.ndarray, thresholds: np.ndarray):
    """Numbers of in / out scores >= each threshold."""
    si, so = np.sort(scores_in), np.sort(scores_out)
    tp = si.size - np.searchsorted(si, thresholds, side="left")
    fp = so.size - np.searchsorted(so, thresholds, side="left")
    return tp, fp


def _bounds(scores_in, scores_out, thresholds, delta, alpha_each):
    tp, fp = _counts(scores_in, scores_out, thresholds)
    tpr_low, _ = clopper_pearson(tp, scores_in.size, alpha_each)
    _, fpr_high = clopper_pearson(fp, scores_out.size, alpha_each)
    return epsilon_from_rates(tpr_low, fpr_high, delta), tpr_low, fpr_high


def epsilon_lower_bound(
    scores: Any,
    included: Any,
    delta: float,
    confidence: float = 0.95,
    *,
    thresholds: Optional[Sequence[float]] = None,
    seed: int = 0,
) -> ManyRunBound:
    """Epsilon lower bound from independent trials (canary score, was it included).

    Args:
      scores: one score per trial; larger means "more likely included".
      included: one boolean per trial: True when the canary was trained on.
      delta: the delta of the ``(eps, delta)`` statement, in [0, 1).
      confidence: in (0, 1): probability that the returned bound holds.
      thresholds: ``None`` (default) splits the trials at random into halves, picks the
        threshold with the largest bound on the first half and reports the bound on the second;
        otherwise the thresholds to try, fixed before looking at the scores, with a union bound
        over all of them (level ``(1 - confidence) / (2K)`` per Clopper-Pearson interval).
      seed: the random split (any value gives a valid bound: the split ignores the scores).

    Returns:
      A :class:`ManyRunBound`.

    Example::

        bound = epsilon_lower_bound(scores, included, delta=1e-5, confidence=0.95)
        bound.epsilon
    """
    s, b = _checks.scores_and_labels(scores, included)
    delta = _checks.probability("delta", delta, allow_zero=True)
    confidence = _checks.probability("confidence", confidence)
    alpha = 1.0 - confidence
    if thresholds is not None:
        t = np.unique(np.asarray(thresholds, dtype=np.float64).reshape(-1))
        if t.size == 0 or not np.all(np.isfinite(t)):
            raise ValueError("thresholds must be a non-empty list of finite numbers (or None)")
        eps, tpr, fpr = _bounds(s[b], s[~b], t, delta, alpha / (2 * t.size))
        i = int(np.argmax(eps))
        return ManyRunBound(float(eps[i]), delta, confidence, float(t[i]), float(tpr[i]),
                            float(fpr[i]), int(b.sum()), int((~b).sum()),
                            f"fixed thresholds ({t.size})")
    order = np.random.default_rng(seed).permutation(s.size)
    first, second = order[: s.size // 2], order[s.size // 2:]
    s1, b1, s2, b2 = s[first], b[first], s[second], b[second]
    if b1.all() or not b1.any() or b2.all() or not b2.any():
        raise ValueError(
            "too few trials to split: each half needs canaries in and out (pass more trials, or "
            "fixed thresholds)"
        )
    candidates = np.unique(s1)
    eps1, _, _ = _bounds(s1[b1], s1[~b1], candidates, delta, alpha / 2)
    threshold = float(candidates[int(np.argmax(eps1))])
    eps2, tpr, fpr = _bounds(s2[b2], s2[~b2], np.array([threshold]), delta, alpha / 2)
    return ManyRunBound(float(eps2[0]), delta, confidence, threshold, float(tpr[0]),
                        float(fpr[0]), int(b2.sum()), int((~b2).sum()), "split")


def design_threshold(
    reference_in: Any,
    reference_out: Any,
    trials_in: int,
    trials_out: int,
    delta: float,
    confidence: float = 0.95,
) -> float:
    """The threshold with the largest expected bound, from reference scores of a model mechanism.

    ``reference_in`` / ``reference_out`` are scores drawn from a *model* of the mechanism (e.g. a
    simulation of the configured DP-SGD), never the audited scores: the threshold is then fixed
    before the audit looks at its trials, and ``epsilon_lower_bound(..., thresholds=[t])`` uses all
    of them at the full confidence level. For each candidate (quantiles of ``reference_out``), the
    Clopper-Pearson bound is computed at the counts the reference rates predict for
    ``trials_in`` / ``trials_out`` trials; the best candidate is returned. A wrong model only makes
    the audit weaker, never invalid.

    Example::

        t = design_threshold(sim_in, sim_out, 2500, 2500, delta=1e-5)
        bound = epsilon_lower_bound(scores, included, 1e-5, thresholds=[t])
    """
    ri = np.sort(np.asarray(reference_in, dtype=np.float64).reshape(-1))
    ro = np.sort(np.asarray(reference_out, dtype=np.float64).reshape(-1))
    if ri.size < 2 or ro.size < 2 or not (np.all(np.isfinite(ri)) and np.all(np.isfinite(ro))):
        raise ValueError("reference_in and reference_out must hold at least two finite scores each")
    for name, n in (("trials_in", trials_in), ("trials_out", trials_out)):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {n!r}")
    delta = _checks.probability("delta", delta, allow_zero=True)
    confidence = _checks.probability("confidence", confidence)
    # candidates from FPR 1/ro.size to 1/2 (the complementary test by symmetry of the quantiles)
    levels = np.unique(np.concatenate([np.geomspace(1.0 / ro.size, 0.5, 200),
                                       1.0 - np.geomspace(1.0 / ro.size, 0.5, 200)]))
    candidates = np.unique(np.quantile(ro, 1.0 - levels))
    tp, fp = _counts(ri, ro, candidates)
    exp_tp = np.round(tp / ri.size * trials_in)
    exp_fp = np.round(fp / ro.size * trials_out)
    alpha = (1.0 - confidence) / 2
    low, _ = clopper_pearson(exp_tp, trials_in, alpha)
    _, high = clopper_pearson(exp_fp, trials_out, alpha)
    return float(candidates[int(np.argmax(epsilon_from_rates(low, high, delta)))])
