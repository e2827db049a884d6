"""Testing a whole certified privacy profile, and the power of that test (numpy/scipy only).

An accountant certifies more than one ``(eps, delta)`` pair: it certifies ``eps(delta)`` for every
``delta`` (the privacy profile). Every pair bounds every membership test (Kairouz, Oh &
Viswanath 2015): an attack with rates ``(TPR, FPR)`` satisfies ``TPR <= e^eps(delta) FPR +
delta`` and ``1 - FPR <= e^eps(delta) (1 - TPR) + delta`` for *each* certified pair. So an attack
whose Clopper-Pearson rates break any one pair shows the certificate false, and checking more
pairs costs no confidence (the certificate is a fixed set of numbers; only the rates are random).
This is the test that has power: a broken DP-SGD (no noise, a larger clip than recorded, ...) is
often far from its certificate at moderate rates (``FPR`` around 0.05-0.5, where a few thousand
trials measure rates to a percent), while proving a large ``eps`` at ``delta = 1e-5`` needs
false-positive rates around ``e^-eps``, hence tens of thousands of trials (Nasr et al. 2023,
"Tight auditing of differentially private machine learning", audit the whole tradeoff curve of
the Gaussian mechanism for the same reason).

* :func:`profile_test`: ``K`` score thresholds fixed before the scores are seen (e.g. quantiles of
  scores simulated from the configured mechanism, :func:`design_thresholds`), Clopper-Pearson
  bounds on the rates at each (union bound over the ``2K`` intervals), compared with every
  certified ``(eps(delta_i), delta_i)``. Trials must be independent.
* :func:`detection_probability_bound`: from the rates a hypothetical mechanism would give at those
  thresholds, counts that it reaches with probability ``>= p`` (exact binomial quantiles), and
  whether the test flags them: then that mechanism is flagged with probability ``>= p``. Used by
  :func:`tf_dp.auditing.audit_dp_sgd` to report the smallest violation its budget detects.

Example::

    import numpy as np
    from tf_dp.auditing import profile
    rng = np.random.default_rng(0)
    included = rng.random(4000) < 0.5
    scores = rng.normal(3.0 * included, 1.0)       # a Gaussian mechanism with mu = 3
    deltas = np.array([1e-5, 1e-2, 0.1, 0.3])
    certified = np.array([4.4, 2.3, 1.3, 0.5])     # a profile mu = 3 breaks
    test = profile.profile_test(scores, included, deltas, certified, 0.95, thresholds=[1.5])
    print(test.violated, test)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import numpy as np
from scipy import stats

from tf_dp.auditing import _checks
from tf_dp.auditing._checks import percent as _percent
from tf_dp.auditing.many_run import _counts, clopper_pearson, epsilon_from_rates

__all__ = [
    "DEFAULT_FPR_LEVELS", "profile_deltas", "ProfileTest", "design_thresholds",
    "detection_probability_bound", "profile_test",
]

#: False-positive rates of the configured mechanism at which :func:`design_thresholds` puts the
#: thresholds: moderate rates (where a few thousand trials measure rates well) and small ones.
DEFAULT_FPR_LEVELS = (0.5, 0.2, 0.05, 0.01, 0.001)


def profile_deltas(delta: float) -> np.ndarray:
    """The deltas at which the certificate is compared: ``delta`` itself and 23 values from
    ``1e-12`` to ``0.5`` (log-spaced)."""
    return np.unique(np.concatenate([[float(delta)], np.geomspace(1e-12, 0.5, 23)]))


@dataclasses.dataclass(frozen=True)
class ProfileTest:
    """Did an attack break any certified ``(eps(delta), delta)`` pair?

    Attributes:
      violated: True when, at some threshold and some certified pair, the Clopper-Pearson rates
        are impossible under the certificate (false with probability ``>= confidence`` when the
        certificate is right).
      confidence: the level of the test (its false-alarm probability is ``1 - confidence``).
      delta: the pair the attack came closest to breaking (or broke by the most).
      certified_epsilon: the certificate's ``eps`` at ``delta``.
      epsilon: the attack's ``eps`` lower bound at ``delta`` (``> certified_epsilon`` iff
        violated there).
      threshold, tpr_low, fpr_high: the threshold and its Clopper-Pearson rates.
      trials_in, trials_out: canaries in / out.
      num_thresholds: ``K``, the thresholds fixed in advance (each interval at level
        ``(1 - confidence) / (2K)``).
      num_deltas: certified pairs compared.
    """

    violated: bool
    confidence: float
    delta: float
    certified_epsilon: float
    epsilon: float
    threshold: float
    tpr_low: float
    fpr_high: float
    trials_in: int
    trials_out: int
    num_thresholds: int
    num_deltas: int

    def __str__(self) -> str:
        verdict = "BREAKS" if self.violated else "within"
        return (f"certified-profile test ({self.num_thresholds} thresholds fixed in advance, "
                f"{self.num_deltas} certified (eps, delta) pairs, {_percent(self.confidence)} "
                f"confidence): TPR >= {self.tpr_low:.4f}, FPR <= {self.fpr_high:.3g} "
                f"({self.trials_in} in / {self.trials_out} out trials) -> epsilon >= "
                f"{self.epsilon:.3f} at delta = {self.delta:.3g}, {verdict} the certified "
                f"{self.certified_epsilon:.3f} there")


def _check_profile(deltas: Any, certified: Any) -> tuple[np.ndarray, np.ndarray]:
    d = np.asarray(deltas, dtype=np.float64).reshape(-1)
    e = np.asarray(certified, dtype=np.float64).reshape(-1)
    if d.size == 0 or d.shape != e.shape:
        raise ValueError(
            f"deltas and certified_epsilons must be non-empty 1-D arrays of the same length, got "
            f"{d.shape} and {e.shape}")
    if not np.all((d > 0) & (d < 1)):
        raise ValueError("deltas must lie in (0, 1)")
    if np.any(np.isnan(e)) or np.any(e < 0):
        raise ValueError("certified_epsilons must be numbers >= 0 (inf allowed)")
    return d, e


def _thresholds(thresholds: Any) -> np.ndarray:
    t = np.unique(np.asarray(thresholds, dtype=np.float64).reshape(-1))
    if t.size == 0 or not np.all(np.isfinite(t)):
        raise ValueError("thresholds must be a non-empty list of finite numbers")
    return t


def _margins(tp, fp, n_in, n_out, deltas, certified, alpha_each):
    """[K, D] margins in rate units (> 0: the pair is broken), the attack's eps, the rates.

    The margin is the larger of ``TPR_low - (e^eps FPR_high + delta)`` and ``(1 - FPR_high) -
    (e^eps (1 - TPR_low) + delta)``: positive exactly when the attack's eps lower bound at that
    delta exceeds the certified eps.
    """
    tpr_low, _ = clopper_pearson(tp, n_in, alpha_each)
    _, fpr_high = clopper_pearson(fp, n_out, alpha_each)
    t, f = tpr_low[:, None], fpr_high[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
        growth = np.exp(certified)[None, :]
        margin = np.maximum(t - (growth * f + deltas[None, :]),
                            (1.0 - f) - (growth * (1.0 - t) + deltas[None, :]))
    margin = np.nan_to_num(margin, nan=-np.inf)
    measured = epsilon_from_rates(t, f, deltas[None, :])
    return margin, measured, tpr_low, fpr_high


def profile_test(
    scores: Any,
    included: Any,
    deltas: Any,
    certified_epsilons: Any,
    confidence: float = 0.95,
    *,
    thresholds: Sequence[float],
) -> ProfileTest:
    """Tests the certified privacy profile ``{(certified_epsilons[i], deltas[i])}``.

    Args:
      scores, included: one score and one inclusion flag per independent trial (larger score:
        "in").
      deltas, certified_epsilons: the certified pairs (``inf``: that pair certifies nothing).
      confidence: in (0, 1): a right certificate is flagged with probability at most
        ``1 - confidence``.
      thresholds: the attack's thresholds (``score >= t`` means "in"), fixed before looking at
        ``scores``; each Clopper-Pearson interval is at ``(1 - confidence) / (2K)``.

    Returns:
      A :class:`ProfileTest`.

    Example::

        test = profile_test(scores, included, [1e-5, 0.1], [4.4, 1.3], thresholds=[1.5])
        test.violated
    """
    s, b = _checks.scores_and_labels(scores, included)
    confidence = _checks.probability("confidence", confidence)
    d, e = _check_profile(deltas, certified_epsilons)
    t = _thresholds(thresholds)
    tp, fp = _counts(s[b], s[~b], t)
    n_in, n_out = int(b.sum()), int((~b).sum())
    margin, measured, tpr_low, fpr_high = _margins(tp, fp, n_in, n_out, d, e,
                                                   (1.0 - confidence) / (2 * t.size))
    i, j = np.unravel_index(int(np.argmax(margin)), margin.shape)
    return ProfileTest(bool(np.max(margin) > 0), confidence, float(d[j]), float(e[j]),
                       float(measured[i, j]), float(t[i]), float(tpr_low[i]), float(fpr_high[i]),
                       n_in, n_out, int(t.size), int(d.size))


def design_thresholds(reference_out: Any, levels: Sequence[float] = DEFAULT_FPR_LEVELS
                      ) -> np.ndarray:
    """Thresholds at the given false-positive rates of reference out-scores (scores simulated from
    the configured mechanism, never the audited ones).

    Example::

        t = design_thresholds(simulated_out_scores)     # FPR 0.5, 0.2, 0.05, 0.01, 0.001
    """
    ro = np.asarray(reference_out, dtype=np.float64).reshape(-1)
    if ro.size < 2 or not np.all(np.isfinite(ro)):
        raise ValueError("reference_out must hold at least two finite scores")
    lv = np.asarray(levels, dtype=np.float64)
    if lv.size == 0 or not np.all((lv > 0) & (lv < 1)):
        raise ValueError(f"levels must be false-positive rates in (0, 1), got {levels!r}")
    return np.unique(np.quantile(ro, 1.0 - lv))


def detection_probability_bound(
    tpr: Any, fpr: Any, trials_in: int, trials_out: int, deltas: Any, certified_epsilons: Any,
    confidence: float, probability: float = 0.9,
) -> bool:
    """Whether a mechanism with these true rates at the test's thresholds is flagged by
    :func:`profile_test` with probability ``>= probability``.

    At each threshold, ``tp`` is at least its ``(1 - probability) / 2`` binomial quantile and
    ``fp`` at most its ``(1 + probability) / 2`` quantile, together with probability ``>=
    probability``; if those counts break the certificate at some threshold, so does every
    outcome at least as extreme (the Clopper-Pearson bounds are monotone in the counts).

    Example::

        detection_probability_bound([0.99], [0.01], 1000, 1000, [1e-5], [2.0], 0.95)   # True
    """
    tpr = np.clip(np.asarray(tpr, dtype=np.float64).reshape(-1), 0.0, 1.0)
    fpr = np.clip(np.asarray(fpr, dtype=np.float64).reshape(-1), 0.0, 1.0)
    d, e = _check_profile(deltas, certified_epsilons)
    tail = (1.0 - _checks.probability("probability", probability)) / 2
    tp = stats.binom.ppf(tail, trials_in, tpr)
    fp = stats.binom.ppf(1.0 - tail, trials_out, fpr)
    tp = np.where(tpr >= 1.0, trials_in, np.nan_to_num(tp))
    fp = np.where(fpr <= 0.0, 0, np.nan_to_num(fp, nan=trials_out))
    margin, _, _, _ = _margins(tp, fp, trials_in, trials_out, d, e,
                               (1.0 - confidence) / (2 * tpr.size))
    return bool(np.max(margin) > 0)
