"""Gaussian differential privacy (mu-GDP) via the privacy central limit theorem.

**This is an asymptotic approximation, not a certified bound.**  Bu, Dong, Long & Su 2019
("Deep learning with Gaussian differential privacy", Sec. 3) show that as the number of steps
``T -> inf`` with ``p * sqrt(T)`` held fixed, ``T`` steps of the Poisson-subsampled Gaussian
mechanism converge to ``mu``-GDP with (their Eq. (3.1))::

    mu_CLT = p * sqrt(T * (exp(1 / sigma^2) - 1))

For finite ``T`` the true curve can be worse than ``G_mu``; use the RDP or PLD accountants for a
guarantee.  For fixed-size batches drawn uniformly without replacement, Dong, Roth & Su 2019
(Corollary 5.4, cited in Bu et al. 2019, Sec. 3.1) give::

    mu = sqrt(2) * p * sqrt(T * (exp(1/sigma^2) * Phi(1.5/sigma) + 3 Phi(-0.5/sigma) - 2))

A ``mu``-GDP mechanism is ``(eps, delta(eps; mu))``-DP for every ``eps >= 0`` with (Eq. (3.2))::

    delta(eps; mu) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2)

(for ``mu = 1/sigma`` and one step this is exactly the Gaussian mechanism's curve, Balle & Wang
2018).  ``epsilon_from_mu`` inverts it by root finding.  ``reduced_noise`` implements the noise
reduction of Eqs. (3.3)-(3.4): the smaller ``sigma~`` whose CLT guarantee equals the moments
accountant's guarantee at the original ``sigma``.

Example (an approximation, not a certified bound):

>>> from tf_dp.accounting import gdp
>>> mu = gdp.mu_poisson(q=256 / 60000, noise_multiplier=1.1, steps=60 * 60000 // 256)
>>> eps = gdp.epsilon_from_mu(1e-5, mu)
>>> round(mu, 3), round(eps, 3)
(0.574, 2.324)
"""

from __future__ import annotations

import math
from typing import Sequence

from scipy import optimize, special

__all__ = ["mu_poisson", "mu_uniform", "mu_squared", "delta_from_mu", "epsilon_from_mu",
           "reduced_noise"]


def _check(q, noise_multiplier, steps):
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"q (sampling probability) must be in [0, 1], got {q!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
    if not (isinstance(steps, (int, float)) and steps >= 0):
        raise ValueError(f"steps must be >= 0, got {steps!r}")


def mu_poisson(q: float, noise_multiplier: float, steps: float) -> float:
    """CLT ``mu`` for ``steps`` Poisson-subsampled Gaussian steps (Bu et al. 2019, Eq. (3.1))."""
    _check(q, noise_multiplier, steps)
    return q * math.sqrt(steps * math.expm1(noise_multiplier**-2))


def mu_squared(q: Sequence[float], noise_multipliers: Sequence[float],
               counts: Sequence[float]) -> float:
    """``mu^2`` of a composition of Poisson-subsampled Gaussian steps: ``counts[i]`` steps of
    rate ``q[i]`` and noise ``noise_multipliers[i]`` add ``counts[i] q[i]^2 (e^(1/sigma^2) - 1)``
    each (Eq. (3.1) squared; ``mu`` adds in squares under composition), and steps with
    ``q = 1`` add ``counts[i] / sigma^2`` (Gaussians compose exactly); a step with noise 0 makes
    it infinite. ``sqrt`` of it is the ``mu`` that the ``gdp`` accountant reports for a ledger,
    and a sum of such values is the ``mu^2`` of the steps together.

    Example::

        mu_squared([0.01, 0.01], [1.0, 1.2], [500, 500]) ** 0.5   # mu of the 1000 steps
    """
    total = 0.0
    for rate, z, count in zip(q, noise_multipliers, counts):
        if not z > 0:
            return math.inf
        if rate >= 1.0:
            total += count / (z * z)
        else:
            total += count * rate * rate * math.expm1(min(z**-2, 700.0))
    return total


def mu_uniform(q: float, noise_multiplier: float, steps: float) -> float:
    """CLT ``mu`` for fixed-size batches sampled uniformly (Dong, Roth & Su 2019, Cor. 5.4)."""
    _check(q, noise_multiplier, steps)
    s = noise_multiplier
    inner = math.exp(s**-2) * special.ndtr(1.5 / s) + 3.0 * special.ndtr(-0.5 / s) - 2.0
    return math.sqrt(2.0) * q * math.sqrt(steps * max(inner, 0.0))


def delta_from_mu(epsilon: float, mu: float) -> float:
    """``delta(eps; mu)`` of ``mu``-GDP (Bu et al. 2019, Eq. (3.2))."""
    if not (isinstance(mu, (int, float)) and mu >= 0):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    if mu == 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = -epsilon / mu + mu / 2.0
    b = -epsilon / mu - mu / 2.0
    # Phi(a) - e^eps Phi(b), evaluated in log space for large eps.
    la, lb = special.log_ndtr(a), epsilon + special.log_ndtr(b)
    if lb >= la:
        return 0.0
    return float(math.exp(la) * -math.expm1(lb - la))


def epsilon_from_mu(delta: float, mu: float) -> float:
    """Smallest ``eps >= 0`` with ``delta(eps; mu) <= delta``, by bracketing and root finding."""
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(mu, (int, float)) and mu >= 0):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    if math.isinf(mu):
        return math.inf
    if delta_from_mu(0.0, mu) <= delta:
        return 0.0
    hi = max(1.0, mu * mu)
    while delta_from_mu(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e12:
            return math.inf
    return float(optimize.brentq(lambda e: delta_from_mu(e, mu) - delta, 0.0, hi, xtol=1e-12,
                                 rtol=1e-12))


def mu_from_epsilon(epsilon: float, delta: float) -> float:
    """The ``mu`` for which ``delta(epsilon; mu) = delta`` (``delta`` increases with ``mu``)."""
    lo, hi = 0.0, 1.0
    while delta_from_mu(epsilon, hi) < delta:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(optimize.brentq(lambda m: delta_from_mu(epsilon, m) - delta, lo, hi, xtol=1e-14))


def reduced_noise(q: float, noise_multiplier: float, steps: int, delta: float) -> float:
    """Bu et al. 2019, Eqs. (3.3)-(3.4): the noise ``sigma~ < sigma`` whose CLT guarantee matches
    the moments accountant's guarantee for ``sigma``.

    Finds ``eps_MA`` (moments accountant at ``delta``), then ``mu~`` with
    ``delta(eps_MA; mu~) = delta``, then solves ``mu~ = q sqrt(T (exp(1/sigma~^2) - 1))``.
    The result relies on the CLT approximation (not certified).
    """
    from tf_dp.accounting import rdp as _rdp  # local import keeps gdp standalone

    _check(q, noise_multiplier, steps)
    if q == 0 or steps == 0:
        raise ValueError("q and steps must be positive for the noise reduction")
    orders = _rdp.DEFAULT_ORDERS
    curve = _rdp.rdp_poisson_gaussian(q, noise_multiplier, orders) * steps
    eps_ma, _ = _rdp.epsilon_from_rdp(orders, curve, delta, conversion="moments")
    mu_t = mu_from_epsilon(eps_ma, delta)
    return float(1.0 / math.sqrt(math.log1p(mu_t**2 / (q * q * steps))))


