"""Tradeoff functions (f-DP): a privacy guarantee as the errors of an optimal attacker.

An attacker who sees a mechanism's output tests "record out" against "record in".  At type I
error ``alpha`` no test has a type II error below ``f(alpha)``, the *tradeoff function* (Dong, Roth
& Su 2019; Bu, Dong, Long & Su 2019, "Deep learning with Gaussian differential privacy").

* :func:`gaussian_tradeoff`: ``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``, the curve of
  ``mu``-GDP, e.g. the privacy-CLT approximation ``mu = p sqrt(T (e^(1/sigma^2) - 1))`` of DP-SGD
  (:func:`tf_dp.accounting.gdp.mu_poisson`).  An approximation when it comes from the CLT.
* :func:`tradeoff_from_epsilon_delta`: the curve implied by ``(eps_i, delta_i)``-DP for every ``i``
  (the upper envelope of the lines ``1 - delta - e^eps alpha`` and ``e^-eps (1 - delta - alpha)``,
  Bu et al. 2019 Eq. (2.1)); a single pair gives the two-segment curve of one ``(eps, delta)``.
* :func:`pld_tradeoff`: the certified curve of a composition of mechanisms: both directions
  (add / remove one record) are composed with the PLD accountant (pessimistic discretisation, so
  its ``delta(eps)`` are upper bounds), ``delta(eps)`` is read at every grid point of the composed
  distributions and turned into a curve by :func:`tradeoff_from_epsilon_delta`.  Every point of
  it is a proven lower bound on any attacker's type II error.

Example::

    import numpy as np
    from tf_dp.accounting import SubsampledGaussian, gdp, tradeoff
    alpha = np.linspace(0, 1, 501)
    q, sigma, steps = 256 / 60000, 1.1, 14063
    certified = tradeoff.pld_tradeoff([(SubsampledGaussian(q, sigma), steps)], alpha)
    clt = tradeoff.gaussian_tradeoff(alpha, gdp.mu_poisson(q, sigma, steps))
    optimistic = clt > certified + 1e-9   # where the CLT claims more privacy than is proven
"""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import numpy as np
from scipy import special

from tf_dp.accounting import pld as _pld

__all__ = [
    "gaussian_tradeoff",
    "tradeoff_from_epsilon_delta",
    "pld_delta_curve",
    "pld_tradeoff",
    "min_total_error",
]


def _alpha(alpha) -> np.ndarray:
    a = np.asarray(alpha, dtype=np.float64)
    if np.any(~np.isfinite(a)) or np.any(a < 0) or np.any(a > 1):
        raise ValueError("alpha (type I errors) must lie in [0, 1]")
    return a


def gaussian_tradeoff(alpha, mu: float) -> np.ndarray:
    """``G_mu(alpha) = Phi(Phi^-1(1 - alpha) - mu)``: the tradeoff function of ``mu``-GDP."""
    if not (isinstance(mu, (int, float)) and mu >= 0 and not math.isnan(mu)):
        raise ValueError(f"mu must be >= 0, got {mu!r}")
    a = _alpha(alpha)
    if math.isinf(mu):
        return np.zeros_like(a)
    return special.ndtr(special.ndtri(1.0 - a) - mu)


def tradeoff_from_epsilon_delta(alpha, epsilons: Sequence[float], deltas: Sequence[float]
                                ) -> np.ndarray:
    """Lower bound on the type II error implied by ``(eps_i, delta_i)``-DP for every ``i``.

    ``f(alpha) = max_i max(0, 1 - delta_i - e^eps_i alpha, e^-eps_i (1 - delta_i - alpha))``.
    """
    a = _alpha(alpha)
    e = np.asarray(epsilons, dtype=np.float64).ravel()
    d = np.asarray(deltas, dtype=np.float64).ravel()
    if e.shape != d.shape or e.size == 0:
        raise ValueError("epsilons and deltas must be non-empty and of equal length")
    if np.any(e < 0) or np.any(np.isnan(e)) or np.any(d < 0) or np.any(d > 1):
        raise ValueError("epsilons must be >= 0 and deltas in [0, 1]")
    keep = np.isfinite(e) & (d < 1)
    e, d = e[keep], d[keep]
    out = np.zeros_like(a)
    for start in range(0, e.size, 512):  # bounded memory: 512 lines at a time
        ee, dd = e[start:start + 512, None], d[start:start + 512, None]
        with np.errstate(over="ignore"):
            lines = np.maximum(1.0 - dd - np.exp(ee) * a, np.exp(-ee) * (1.0 - dd - a))
        out = np.maximum(out, lines.max(axis=0))
    return np.clip(out, 0.0, 1.0)


def _grid_deltas(d: "_pld.DiscretePLD", epsilons: np.ndarray) -> np.ndarray:
    """``delta(eps)`` of a discrete PLD at sorted ``epsilons >= 0``, in one pass (suffix sums)."""
    L, p = d.losses, d.pmf
    # Suffix sums over L > eps of p and of p e^(eps - L); e^(-L) only for L > eps >= 0 (no overflow).
    order = np.searchsorted(L, epsilons, side="right")  # first index with L > eps
    pos = L > 0
    w = np.where(pos, p * np.exp(-np.where(pos, L, 0.0)), 0.0)
    suffix_p = np.concatenate([np.cumsum(p[::-1])[::-1], [0.0]])
    suffix_w = np.concatenate([np.cumsum(w[::-1])[::-1], [0.0]])
    vals = d.inf_mass + suffix_p[order] - np.exp(epsilons) * suffix_w[order]
    return np.clip(vals, 0.0, 1.0)


def pld_delta_curve(
    mechanisms: Iterable[tuple[object, int]],
    epsilons: Optional[Sequence[float]] = None,
    h: Optional[float] = None,
    max_points: int = 4000,
) -> tuple[np.ndarray, np.ndarray]:
    """Certified ``delta(eps)`` of a composition (max over add/remove), at many ``eps`` at once.

    Args:
      mechanisms: ``[(mechanism, count), ...]`` as for :func:`tf_dp.accounting.pld_epsilon`.
      epsilons: where to evaluate (``>= 0``); default: up to ``max_points`` grid points of the
        composed distributions, from 0 to where ``delta`` falls below ``1e-12``.
      h: PLD grid spacing (default: the accountant's).

    Returns:
      ``(epsilons, deltas)`` as arrays.
    """
    mechanisms = list(mechanisms)
    h = _pld._auto_h(mechanisms) if h is None else h
    composed = [_pld.compose_mechanisms(mechanisms, direction, h) for direction in _pld.DIRECTIONS]
    if epsilons is None:
        top = max(float(c.losses[-1]) if c.pmf.size else 0.0 for c in composed)
        top = max(top, h)
        eps = np.linspace(0.0, top, int(max_points))
    else:
        eps = np.sort(np.asarray(epsilons, dtype=np.float64).ravel())
        if np.any(eps < 0) or not np.all(np.isfinite(eps)):
            raise ValueError("epsilons must be finite and >= 0")
    deltas = np.max([_grid_deltas(c, eps) for c in composed], axis=0)
    return eps, deltas


def pld_tradeoff(
    mechanisms: Iterable[tuple[object, int]],
    alpha,
    h: Optional[float] = None,
    max_points: int = 4000,
) -> np.ndarray:
    """Certified tradeoff curve of a composition of mechanisms (see the module docstring).

    Any finite set of ``eps`` gives a valid lower bound; ``max_points`` grid points make it tight
    to the discretisation (the curve is the envelope of their lines).
    """
    a = _alpha(alpha)
    eps, deltas = pld_delta_curve(mechanisms, h=h, max_points=max_points)
    return tradeoff_from_epsilon_delta(a, eps, deltas)


def min_total_error(alpha, beta) -> float:
    """``min(alpha + f(alpha))`` over the grid: the smallest total error of any attacker
    (1 = guessing; Bu et al. 2019 quote it for Table 1)."""
    a, b = _alpha(alpha), np.asarray(beta, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError("alpha and beta must have the same shape")
    return float(np.min(a + b))
