"""One-run auditing (Steinke, Nasr & Jagielski 2023, "Privacy auditing with one (1) training run").

``m`` canaries are each included in the training data independently with probability 1/2. After
one training run the auditor scores every canary, guesses "in" for the ``k_plus`` highest scores
and "out" for the ``k_minus`` lowest, and abstains on the rest: ``r = k_plus + k_minus`` guesses, of
which ``v`` are correct. If training is ``eps``-DP with respect to each canary, the number of
correct guesses is stochastically dominated by ``Binomial(r, e^eps / (1 + e^eps))`` (the paper's
Theorem for pure DP); with ``(eps, delta)``-DP the tail gains a term proportional to ``m * delta``
(the paper's approximate-DP theorem)::

    P[W >= v] <= P[B >= v] + 2 m delta * max_{1 <= i <= v} P[v - i <= B < v] / i,
    B ~ Binomial(r, e^eps / (1 + e^eps))

The audit's lower bound at confidence ``1 - beta`` is the largest ``eps`` for which the right-hand
side is below ``beta``: any smaller ``eps`` would make what was observed less likely than ``beta``.
The bound is about the training as a whole and holds whatever the dependence between canaries
(they share one model), which is the point of the method.

Choosing ``k_plus`` and ``k_minus`` after seeing the scores is corrected by a union bound: the
bound is the largest over a fixed list of guess counts, each tested at level ``beta / K``.

Example::

    import numpy as np
    from tf_dp.auditing import one_run
    rng = np.random.default_rng(0)
    included = rng.random(1000) < 0.5
    scores = rng.normal(4.0 * included, 1.0)
    print(one_run.epsilon_lower_bound(scores, included, delta=1e-5))
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np
from scipy import special, stats

from tf_dp.auditing import _checks
from tf_dp.auditing._checks import percent as _percent

__all__ = ["OneRunBound", "p_value", "epsilon_from_guesses", "epsilon_lower_bound"]

_EPS_MAX = 60.0  # beyond this e^eps / (1 + e^eps) is 1 in double precision


def p_value(num_canaries: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on ``P[>= correct right guesses out of guesses]`` under ``(eps, delta)``-DP.

    The right-hand side of the paper's approximate-DP theorem (module docstring), capped at 1.

    Example::

        p_value(1000, 100, 90, epsilon=1.0, delta=1e-5)   # small: 90/100 is unlikely at eps=1
    """
    m, r, v = int(num_canaries), int(guesses), int(correct)
    if not 0 <= v <= r <= m:
        raise ValueError(f"need 0 <= correct <= guesses <= num_canaries, got {v}, {r}, {m}")
    if not (epsilon >= 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be a finite number >= 0, got {epsilon!r}")
    delta = _checks.probability("delta", delta, allow_zero=True)
    p = special.expit(epsilon)
    tail = stats.binom.sf(v - 1, r, p)  # P[B >= v]
    if delta == 0.0 or v == 0:
        return float(min(tail, 1.0))
    # P[v - i <= B < v] = cdf(v - 1) - cdf(v - i - 1) for i = 1..v
    i = np.arange(1, v + 1)
    window = stats.binom.cdf(v - 1, r, p) - stats.binom.cdf(v - i - 1, r, p)
    return float(min(tail + 2.0 * m * delta * np.max(window / i), 1.0))


def epsilon_from_guesses(
    num_canaries: int, guesses: int, correct: int, delta: float, beta: float
) -> float:
    """Largest ``eps`` with ``p_value(eps) < beta`` (0 when even ``eps = 0`` is not rejected).

    Example::

        epsilon_from_guesses(1000, 100, 100, delta=0.0, beta=0.05)  # = logit(0.05 ** (1 / 100))
    """
    beta = _checks.probability("beta", beta)
    if p_value(num_canaries, guesses, correct, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, _EPS_MAX
    if p_value(num_canaries, guesses, correct, hi, delta) < beta:
        return hi
    for _ in range(60):  # p_value grows with eps: bisection keeps p(lo) < beta <= p(hi)
        mid = 0.5 * (lo + hi)
        if p_value(num_canaries, guesses, correct, mid, delta) < beta:
            lo = mid
        else:
            hi = mid
    return lo


@dataclasses.dataclass(frozen=True)
class OneRunBound:
    """A one-run epsilon lower bound (Steinke, Nasr & Jagielski 2023).

    Attributes:
      epsilon: the lower bound.
      delta: the delta at which it holds.
      confidence: ``1 - beta``.
      num_canaries: ``m``.
      guesses, correct: ``r`` and ``v`` at the chosen guess counts.
      k_plus, k_minus: the guess counts ("in" for the top ``k_plus`` scores, "out" for the bottom
        ``k_minus``).
      candidates: how many ``(k_plus, k_minus)`` pairs were tried (the union bound's ``K``).
    """

    epsilon: float
    delta: float
    confidence: float
    num_canaries: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    candidates: int

    def __str__(self) -> str:
        return (f"one-run (Steinke, Nasr & Jagielski 2023): epsilon >= {self.epsilon:.3f} at "
                f"delta = {self.delta:.3g}, {_percent(self.confidence)} confidence "
                f"({self.num_canaries} canaries; {self.correct} of {self.guesses} guesses right "
                f"with k+ = {self.k_plus}, k- = {self.k_minus}; best of {self.candidates} guess "
                "counts)")


def default_guess_counts(num_canaries: int) -> list[int]:
    """Guess counts ``k`` tried by default (``k_plus = k_minus = k``): 1, 2, 5, 10, 20, 50, ...

    Up to ``num_canaries // 2``, which is included (every canary guessed); the list depends on
    ``m`` alone, so a union bound over it is valid.
    """
    ks, base = [], 1
    while base <= num_canaries // 2:
        ks += [k for k in (base, 2 * base, 5 * base) if k <= num_canaries // 2]
        base *= 10
    return sorted(set(ks) | {max(num_canaries // 2, 1)})


def epsilon_lower_bound(
    scores: Any,
    included: Any,
    delta: float,
    confidence: float = 0.95,
    *,
    guess_counts: Optional[Sequence[Any]] = None,
) -> OneRunBound:
    """One-run epsilon lower bound from every canary's score and inclusion.

    Args:
      scores: one score per canary (larger: more likely trained on), all from the same run (or
        from several runs, each canary in one of them).
      included: whether each canary was included (drawn independently with probability 1/2).
      delta: delta of the ``(eps, delta)`` statement, in [0, 1).
      confidence: ``1 - beta``, in (0, 1).
      guess_counts: the guess counts to try, fixed before looking at the scores: integers ``k``
        (``k_plus = k_minus = k``) or pairs ``(k_plus, k_minus)``; default
        :func:`default_guess_counts`. Each is tested at level ``beta / K``.

    Returns:
      A :class:`OneRunBound` with the largest bound over the guess counts.

    Example::

        bound = epsilon_lower_bound(scores, included, delta=1e-5, confidence=0.95)
        print(bound)
    """
    s, b = _checks.scores_and_labels(scores, included)
    delta = _checks.probability("delta", delta, allow_zero=True)
    confidence = _checks.probability("confidence", confidence)
    m = s.size
    pairs = []
    for k in (default_guess_counts(m) if guess_counts is None else guess_counts):
        kp, km = (k, k) if np.isscalar(k) else k
        if int(kp) != kp or int(km) != km or kp < 0 or km < 0 or kp + km == 0 or kp + km > m:
            raise ValueError(
                f"guess_counts: each entry must be k or (k_plus, k_minus), non-negative integers "
                f"with 0 < k_plus + k_minus <= {m} (the number of canaries), got {k!r}"
            )
        pairs.append((int(kp), int(km)))
    beta = (1.0 - confidence) / len(pairs)
    order = np.argsort(s, kind="stable")
    best = None
    for kp, km in pairs:
        guessed_in = order[m - kp:] if kp else order[:0]
        guessed_out = order[:km]
        correct = int(b[guessed_in].sum() + (~b[guessed_out]).sum())
        eps = epsilon_from_guesses(m, kp + km, correct, delta, beta)
        if best is None or eps > best.epsilon:
            best = OneRunBound(eps, delta, confidence, m, kp + km, correct, kp, km, len(pairs))
    return best
