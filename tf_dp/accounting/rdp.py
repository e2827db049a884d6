"""Renyi DP (RDP) and the moments accountant for the Poisson-subsampled Gaussian mechanism.

The *moments accountant* of Abadi et al. 2016 (Sec. 3.2, Theorem 2) tracks the log moment
``alpha(lambda) = log E[exp(lambda * c)]`` of the privacy loss ``c``; it composes additively and
converts to ``(eps, delta)`` with the tail bound ``delta = min_lambda exp(alpha(lambda) - lambda*eps)``.
In Renyi-DP language (Mironov 2017) the log moment at ``lambda`` is ``lambda`` times the Renyi
divergence of order ``a = lambda + 1``: ``alpha(lambda) = (a - 1) * R(a)``, so the tail bound reads
``eps = min_a R(a) + log(1/delta) / (a - 1)``.  This module computes ``R(a)`` for the
Poisson-subsampled Gaussian (Eq. (3)-(4) of Abadi et al.: ``mu = (1-q) N(0, s^2) + q N(1, s^2)``
against ``N(0, s^2)``) for integer and fractional orders, in log space:

* integer ``a``: the binomial expansion of ``E_{mu0}[(mu/mu0)^a]`` is a finite sum
  (``sum_k C(a,k) (1-q)^(a-k) q^k exp((k^2-k) / (2 s^2))``);
* fractional ``a``: the integral is split where the two mixture components have equal density and
  each half is expanded in a convergent binomial series whose terms are Gaussian tail integrals
  (Mironov, Talwar & Zhang 2019, "Renyi DP of the sampled Gaussian mechanism", Sec. 3.3).  Terms
  are summed in absolute value, so the result is an upper bound on ``A_a`` (equal to it up to the
  alternating remainder, which is far below double precision in the regimes of interest).

Two conversions to ``(eps, delta)`` are offered:

* ``moments``: the tail bound of Abadi et al. Theorem 2 (equivalently Mironov 2017 Prop. 3).
* ``rdp`` (default): the tighter conversion of Canonne, Kamath & Steinke 2020 (Prop. 12) /
  Asoodeh et al. 2020: ``eps = R(a) + log((a-1)/a) - (log(delta) + log(a)) / (a - 1)``, together with
  the KL bound ``delta >= sqrt(1 - exp(-R))`` for orders near 1.

Both are certified upper bounds given the RDP curve.

Example::

    from tf_dp.accounting import rdp
    orders = rdp.DEFAULT_ORDERS
    curve = rdp.rdp_poisson_gaussian(q=0.01, noise_multiplier=4.0, orders=orders) * 10000
    eps, order = rdp.epsilon_from_rdp(orders, curve, delta=1e-5)
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

import numpy as np
from scipy import special

__all__ = [
    "DEFAULT_ORDERS",
    "MOMENTS_ORDERS",
    "rdp_poisson_gaussian",
    "rdp_gaussian",
    "epsilon_from_rdp",
    "delta_from_rdp",
]

#: A rich default set of RDP orders: dense fractional orders near 1 (large noise / small eps),
#: every integer up to 64, then a geometric tail for small noise.
DEFAULT_ORDERS: tuple[float, ...] = tuple(
    [1.0 + x / 20.0 for x in range(1, 20)]
    + [2.0 + x / 10.0 for x in range(0, 90)]
    + [float(a) for a in range(11, 65)]
    + [80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 768.0, 1024.0, 2048.0, 4096.0]
)

#: Orders of the original moments accountant implementation: ``lambda = 1, ..., 32`` (Abadi et al.
#: 2016 report moments up to 32), i.e. RDP orders ``a = lambda + 1 = 2, ..., 33``.  With these
#: orders and the tail bound the accountant gives eps ~= 1.26 for q=0.01, sigma=4, T=10000,
#: delta=1e-5 (the paper's figure).
MOMENTS_ORDERS: tuple[float, ...] = tuple(float(l + 1) for l in range(1, 33))


def _check_q_sigma(q: float, noise_multiplier: float) -> None:
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"q (sampling probability) must be in [0, 1], got {q!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier!r}")


def _check_orders(orders: Sequence[float]) -> np.ndarray:
    arr = np.asarray(orders, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 1.0):
        raise ValueError("orders must be a non-empty sequence of finite numbers > 1")
    return arr


def _log_abs_binom(a: float, k: np.ndarray) -> np.ndarray:
    """log |C(a, k)| for real a and integer k >= 0 (gammaln gives log|Gamma|)."""
    return special.gammaln(a + 1.0) - special.gammaln(k + 1.0) - special.gammaln(a - k + 1.0)


def _log_a_integer(q: float, s: float, a: int) -> float:
    k = np.arange(a + 1, dtype=np.float64)
    terms = (
        _log_abs_binom(float(a), k)
        + k * math.log(q)
        + (a - k) * math.log1p(-q)
        + (k * k - k) / (2.0 * s * s)
    )
    return float(special.logsumexp(terms))


def _log_a_fractional(q: float, s: float, a: float) -> float:
    # Split point where q*N(1,s^2) and (1-q)*N(0,s^2) have equal density.
    z0 = s * s * math.log(1.0 / q - 1.0) + 0.5
    log_q, log_1mq = math.log(q), math.log1p(-q)
    total = -np.inf
    chunk = 64
    start = 0
    while start < 100000:
        k = np.arange(start, start + chunk, dtype=np.float64)
        lb = _log_abs_binom(a, k)
        j = a - k
        # Left half (x <= z0): expand in powers of the (smaller) q-component.
        left = (
            lb + k * log_q + j * log_1mq + (k * k - k) / (2 * s * s)
            + special.log_ndtr((z0 - k) / s)
        )
        # Right half (x > z0): expand in powers of the (smaller) (1-q)-component.
        right = (
            lb + j * log_q + k * log_1mq + (j * j - j) / (2 * s * s)
            + special.log_ndtr((j - z0) / s)
        )
        block = special.logsumexp(np.concatenate([left, right]))
        new_total = np.logaddexp(total, block)
        tail_small = max(left[-1], right[-1]) < new_total - 40
        decreasing = left[-1] < left[-2] and right[-1] < right[-2]
        total = new_total
        if start > a and tail_small and decreasing:
            return float(total)
        start += chunk
    return math.inf  # did not converge: drop this order (inf is always a valid bound)


def _rdp_one(q: float, s: float, a: float) -> float:
    if q == 0:
        return 0.0
    if s == 0:
        return math.inf
    if q == 1.0:
        return a / (2.0 * s * s)
    if float(a).is_integer():
        log_a = _log_a_integer(q, s, int(a))
    else:
        log_a = _log_a_fractional(q, s, a)
    return max(log_a / (a - 1.0), 0.0)


def rdp_poisson_gaussian(
    q: float, noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS
) -> np.ndarray:
    """RDP ``R(a)`` of one step of the Poisson-subsampled Gaussian mechanism.

    Args:
      q: sampling probability in [0, 1] (q = 1: the plain Gaussian mechanism).
      noise_multiplier: noise stddev divided by the L2 sensitivity (>= 0; 0 gives inf).
      orders: RDP orders, each > 1.

    Returns:
      array of ``R(a)`` per order (multiply by the number of steps to compose).
    """
    _check_q_sigma(q, noise_multiplier)
    arr = _check_orders(orders)
    return _rdp_cached(float(q), float(noise_multiplier), tuple(float(a) for a in arr)).copy()


@functools.lru_cache(maxsize=4096)
def _rdp_cached(q: float, s: float, orders: tuple[float, ...]) -> np.ndarray:
    return np.array([_rdp_one(q, s, a) for a in orders])


def rdp_gaussian(noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the (unsampled) Gaussian mechanism: ``a / (2 sigma^2)`` (Mironov 2017, Prop. 7)."""
    return rdp_poisson_gaussian(1.0, noise_multiplier, orders)


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def epsilon_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], delta: float, conversion: str = "rdp"
) -> tuple[float, float]:
    """Smallest ``eps`` over the orders such that the RDP curve implies ``(eps, delta)``-DP.

    Args:
      orders, rdp: the composed RDP curve.
      delta: target delta in (0, 1).
      conversion: ``"rdp"`` (Canonne-Kamath-Steinke 2020 Prop. 12, tighter) or ``"moments"``
        (Abadi et al. 2016 Theorem 2 tail bound).

    Returns:
      ``(epsilon, optimal_order)``; epsilon is ``inf`` when no order gives a finite bound.
    """
    _check_delta(delta)
    a = _check_orders(orders)
    r = np.asarray(rdp, dtype=np.float64)
    if r.shape != a.shape:
        raise ValueError("orders and rdp must have the same length")
    with np.errstate(invalid="ignore", over="ignore"):
        if conversion == "moments":
            eps = r + math.log(1.0 / delta) / (a - 1.0)
        elif conversion == "rdp":
            eps = r + np.log1p(-1.0 / a) - (math.log(delta) + np.log(a)) / (a - 1.0)
            # KL route: delta >= sqrt(1 - exp(-R)) already gives eps = 0.
            eps = np.where(delta**2 + np.expm1(-r) > 0, 0.0, eps)
        else:
            raise ValueError(f"conversion must be 'rdp' or 'moments', got {conversion!r}")
    eps = np.where(np.isnan(eps), np.inf, eps)
    i = int(np.argmin(eps))
    return max(0.0, float(eps[i])), float(a[i])


def delta_from_rdp(
    orders: Sequence[float], rdp: Sequence[float], epsilon: float, conversion: str = "rdp"
) -> tuple[float, float]:
    """Smallest ``delta`` over the orders such that the RDP curve implies ``(epsilon, delta)``-DP.

    ``moments``: ``delta = min_a exp((a-1) (R(a) - eps))`` (Abadi et al. Theorem 2 with
    ``lambda = a - 1``).  ``rdp``: Canonne-Kamath-Steinke 2020 Prop. 12 and the KL bound.
    Returns ``(delta, optimal_order)``.
    """
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    a = _check_orders(orders)
    r = np.asarray(rdp, dtype=np.float64)
    if r.shape != a.shape:
        raise ValueError("orders and rdp must have the same length")
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if conversion == "moments":
            logd = (a - 1.0) * (r - epsilon)
        elif conversion == "rdp":
            logd = (a - 1.0) * (r - epsilon + np.log1p(-1.0 / a)) - np.log(a)
            kl = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf)
            logd = np.minimum(logd, kl)
        else:
            raise ValueError(f"conversion must be 'rdp' or 'moments', got {conversion!r}")
    logd = np.where(np.isnan(logd), np.inf, logd)
    i = int(np.argmin(logd))
    return float(min(1.0, math.exp(min(logd[i], 0.0)))), float(a[i])
