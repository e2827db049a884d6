"""Gaussian-DP (mu) from canary scores: a lower bound and an estimate.

A ``mu``-GDP mechanism (Dong, Roth & Su 2019, "Gaussian differential privacy"; Bu, Dong, Long &
Su 2019 for DP-SGD) lets no test beat the Gaussian tradeoff curve: an attack with rates
``(TPR, FPR)`` satisfies ``TPR <= Phi(Phi^-1(FPR) + mu)``, so::

    mu >= Phi^-1(TPR) - Phi^-1(FPR)

* :func:`mu_lower_bound` puts Clopper-Pearson bounds into that inequality (threshold chosen on one
  random half of the trials, bound computed on the other, as in
  :func:`tf_dp.auditing.many_run.epsilon_lower_bound`): a lower bound on ``mu`` at the stated
  confidence, valid for independent trials.
* :func:`mu_estimate` assumes the scores *are* Gaussian with a common variance (white-box
  canaries read through Gaussian noise, e.g. full-batch DP-SGD: score ``~ N(mu, 1)`` in, ``N(0, 1)``
  out after scaling): ``mu`` is the standardised mean difference, with a normal-approximation
  confidence interval. **It is an estimate, not a bound**: it is only as good as the Gaussian
  assumption, and is labelled as such wherever it is shown.

Either ``mu`` converts to an ``(eps, delta)`` figure with
:func:`tf_dp.accounting.gdp.epsilon_from_mu`.

Example::

    import numpy as np
    from tf_dp.auditing import gaussian
    rng = np.random.default_rng(0)
    included = rng.random(4000) < 0.5
    scores = rng.normal(1.5 * included, 1.0)
    print(gaussian.mu_estimate(scores, included))     # about 1.5
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
from scipy import special

from tf_dp.accounting.gdp import epsilon_from_mu
from tf_dp.auditing import _checks
from tf_dp.auditing._checks import percent as _percent
from tf_dp.auditing.many_run import _counts, clopper_pearson

__all__ = ["GaussianEstimate", "mu_estimate", "mu_lower_bound"]


@dataclasses.dataclass(frozen=True)
class GaussianEstimate:
    """A ``mu`` figure from canary scores.

    Attributes:
      mu: the lower bound (``kind == "lower bound"``) or point estimate (``"estimate"``).
      low, high: confidence interval of the estimate (for a lower bound: ``low == mu``,
        ``high == inf``).
      confidence: its confidence level.
      kind: ``"lower bound"`` or ``"estimate"``.
      delta: the delta used for ``epsilon``.
      epsilon: ``epsilon_from_mu(delta, mu)``.
    """

    mu: float
    low: float
    high: float
    confidence: float
    kind: str
    delta: float
    epsilon: float

    def __str__(self) -> str:
        if self.kind == "lower bound":
            return (f"GDP lower bound: mu >= {self.mu:.3f} ({_percent(self.confidence)} "
                    f"confidence), i.e. epsilon >= {self.epsilon:.3f} at delta = "
                    f"{self.delta:.3g} if the mechanism is GDP")
        return (f"GDP ESTIMATE (assumes Gaussian scores; not a bound): mu ~ {self.mu:.3f} "
                f"[{self.low:.3f}, {self.high:.3f}] ({_percent(self.confidence)} interval), i.e. "
                f"epsilon ~ {self.epsilon:.3f} at delta = {self.delta:.3g}")


def _eps(mu: float, delta: float) -> float:
    return float(epsilon_from_mu(delta, float(mu))) if mu > 0 else 0.0


def mu_estimate(
    scores: Any, included: Any, confidence: float = 0.95, delta: float = 1e-5
) -> GaussianEstimate:
    """``mu`` as the standardised mean difference of in and out scores (an estimate).

    ``mu_hat = (mean_in - mean_out) / s_pooled``, with the large-sample standard error
    ``sqrt(1/n_in + 1/n_out + mu_hat^2 / (2 (n_in + n_out)))`` for the interval.

    Example::

        est = mu_estimate(scores, included)
        est.mu, (est.low, est.high)
    """
    s, b = _checks.scores_and_labels(scores, included)
    confidence = _checks.probability("confidence", confidence)
    delta = _checks.probability("delta", delta)
    si, so = s[b], s[~b]
    if si.size < 2 or so.size < 2:
        raise ValueError("mu_estimate needs at least two canaries in and two out")
    pooled = math.sqrt(((si.size - 1) * si.var(ddof=1) + (so.size - 1) * so.var(ddof=1))
                       / (si.size + so.size - 2))
    if pooled == 0.0:
        mu = math.inf if si.mean() > so.mean() else 0.0
        return GaussianEstimate(mu, mu, mu, confidence, "estimate", delta,
                                math.inf if math.isinf(mu) else 0.0)
    mu = (si.mean() - so.mean()) / pooled
    se = math.sqrt(1 / si.size + 1 / so.size + mu * mu / (2 * (si.size + so.size)))
    z = float(special.ndtri(0.5 + confidence / 2))
    return GaussianEstimate(float(mu), float(mu - z * se), float(mu + z * se), confidence,
                            "estimate", delta, _eps(max(mu, 0.0), delta))


def mu_lower_bound(
    scores: Any, included: Any, confidence: float = 0.95, delta: float = 1e-5, *, seed: int = 0
) -> GaussianEstimate:
    """``mu >= Phi^-1(TPR_low) - Phi^-1(FPR_high)`` at ``confidence``, threshold on a split.

    Valid for independent trials of a mechanism that is ``mu``-GDP for some ``mu``; the returned
    ``mu`` is then at most the true one with probability ``>= confidence``.

    Example::

        lb = mu_lower_bound(scores, included, confidence=0.95)
    """
    s, b = _checks.scores_and_labels(scores, included)
    confidence = _checks.probability("confidence", confidence)
    delta = _checks.probability("delta", delta)
    alpha = (1.0 - confidence) / 2
    order = np.random.default_rng(seed).permutation(s.size)
    halves = [order[: s.size // 2], order[s.size // 2:]]
    parts = [(s[h][b[h]], s[h][~b[h]]) for h in halves]
    if any(p.size == 0 for part in parts for p in part):
        raise ValueError("too few trials to split: each half needs canaries in and out")

    def mus(si, so, thresholds):
        tp, fp = _counts(si, so, thresholds)
        tpr, _ = clopper_pearson(tp, si.size, alpha)
        _, fpr = clopper_pearson(fp, so.size, alpha)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.nan_to_num(special.ndtri(tpr) - special.ndtri(fpr), nan=0.0, neginf=0.0)

    candidates = np.unique(np.concatenate(parts[0]))
    threshold = candidates[int(np.argmax(mus(*parts[0], candidates)))]
    mu = max(float(mus(*parts[1], np.array([threshold]))[0]), 0.0)
    return GaussianEstimate(mu, mu, math.inf, confidence, "lower bound", delta, _eps(mu, delta))
