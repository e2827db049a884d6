"""Privacy accounting for DP-SGD with JL norm estimates (Bu et al. 2020, DP-SGD-JL).

With ``r`` Johnson-Lindenstrauss projections the clip weight of an example comes from a *noisy*
norm estimate, so its contribution to the sum can exceed the clip ``C``.  Lemma 4.3 of Bu et al.
2020 shows that one step (before subsampling) is ``f``-DP with::

    f = T(Z_r, N(Z_r / sigma, 1)  ||  Z_r, N(0, 1)),    Z_r = sqrt(r / chi2_r)

i.e. the pair of output distributions reveals a random, *public* scale ``Z_r`` and, given
``Z_r = z``, is the Gaussian mechanism with shift ``z / sigma`` (noise multiplier ``sigma / z``).
Its hockey-stick curve is therefore the ``Z_r``-average of Gaussian curves (their Lemma 4.1 /
proof of Lemma 4.2).  Theorem 4.1: with Poisson subsampling at rate ``p`` the run is
``min{f_p^(T), (f_p^(T))^-1}**``-DP, ``f_p = p f + (1-p) Id``, which this module evaluates with the
PLD accountant (:mod:`tf_dp.accounting.pld`) through its mixture hook, both directions, max taken.
Proposition B.5: ``chi^2(f) = inf``, so the privacy CLT does **not** apply; no GDP number is given.

**Discretising ``Z_r`` pessimistically.**  By Lemma 4.2 a larger ``z`` is less private, so the
support of ``Z_r`` is cut into bins and each bin is represented by its *upper* edge (noise
multiplier ``sigma / z_upper``) with the bin's exact probability; the last bin ``[z_max, inf)`` is
represented by noise multiplier 0 (the released sum is exact): its whole probability is kept, as
an infinite privacy loss when the example is sampled.  The tail of ``Z_r`` is heavy
(``P(Z_r > z) ~ z^-r``), so for small ``r`` that mass can dominate delta; it is never dropped.
For ``r = 1`` in typical settings the honest epsilon at ``delta = 1e-5`` is therefore very large or
``inf`` at the accountant's loss cap: the heavy tail of the norm estimate, not the accountant, is
the reason.

Example::

    from tf_dp.accounting import jl_epsilon
    eps = jl_epsilon(q=256/60000, noise_multiplier=1.3, steps=1170, delta=1e-5, jl_projections=16)
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
from scipy import special

from tf_dp.accounting import pld as _pld

__all__ = ["jl_mechanism", "jl_epsilon", "jl_delta", "JL_LOSS_CAP"]

#: Losses above this are counted as infinite in JL accounting (pessimistic; keeps grids small).
JL_LOSS_CAP = 100.0


def _check(q, noise_multiplier, r, num_bins):
    if not (isinstance(q, (int, float)) and 0.0 <= q <= 1.0):
        raise ValueError(f"q (sampling probability) must be in [0, 1], got {q!r}")
    if not (isinstance(noise_multiplier, (int, float)) and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
    if not (isinstance(r, (int, np.integer)) and r >= 1):
        raise ValueError(f"jl_projections must be an integer >= 1, got {r!r}")
    if not (isinstance(num_bins, int) and num_bins >= 8):
        raise ValueError(f"num_bins must be an integer >= 8, got {num_bins!r}")


def _z_cdf(z: np.ndarray, r: int) -> np.ndarray:
    """``P(Z_r <= z) = P(chi2_r >= r / z^2)``."""
    return special.chdtrc(r, r / np.square(z))


@functools.lru_cache(maxsize=256)
def jl_mechanism(
    q: float, noise_multiplier: float, jl_projections: int, num_bins: int = 400,
    loss_cap: float = JL_LOSS_CAP,
) -> _pld.Mixture:
    """The per-step JL mechanism as a PLD mixture (pessimistic discretisation of ``Z_r``).

    Bin edges: half of them at equally spaced quantiles of ``Z_r`` (where its mass is), half
    geometric from the ``1e-14`` quantile up to ``z_max``, the scale beyond which a component's
    privacy loss (shift ``z / sigma``) exceeds ``loss_cap`` with near certainty.
    """
    _check(q, noise_multiplier, jl_projections, num_bins)
    r, s = int(jl_projections), float(noise_multiplier)
    z_lo = math.sqrt(r / special.chdtri(r, 1e-14))  # chdtri: inverse survival function
    z_max = s * (math.sqrt(2.0 * loss_cap) + 12.0)
    z_med = math.sqrt(r / special.chdtri(r, 0.5))
    if z_max <= z_lo:
        z_max = 2.0 * z_lo
    probs = np.linspace(0.0, 1.0, num_bins // 4 + 2)[1:-1]
    quant = np.sqrt(r / special.chdtri(r, probs))  # Z quantiles at levels probs
    geo = np.geomspace(z_lo, z_max, num_bins - num_bins // 4)
    edges = np.unique(np.concatenate([[z_lo, z_med, z_max], quant, geo]))
    edges = edges[(edges >= z_lo) & (edges <= z_max)]
    cdf = _z_cdf(edges, r)
    weights = [float(cdf[0])]  # [0, z_lo] -> represented by z_lo
    comps = [_pld.SubsampledGaussian(float(q), s / float(edges[0]))]
    for k in range(1, edges.size):
        w = float(cdf[k] - cdf[k - 1])
        if w > 0:
            weights.append(w)
            comps.append(_pld.SubsampledGaussian(float(q), s / float(edges[k])))
    tail = float(special.chdtr(r, r / edges[-1] ** 2))  # P(Z > z_max)
    weights.append(tail)
    comps.append(_pld.SubsampledGaussian(float(q), 0.0))  # exact release: infinite loss if sampled
    w = np.asarray(weights)
    w = w / w.sum()  # removes ~1e-16 rounding; each weight is an exact bin probability
    return _pld.Mixture(tuple(comps), tuple(float(x) for x in w))


def _default_h(steps: int) -> float:
    return 2e-3 if steps > 100 else 1e-3


def jl_epsilon(
    q: float,
    noise_multiplier: float,
    steps: int,
    delta: float,
    jl_projections: int,
    num_bins: int = 400,
    h: Optional[float] = None,
) -> float:
    """Certified epsilon of ``steps`` Poisson-subsampled DP-SGD-JL steps (Bu et al. 2020, Thm 4.1).

    ``inf`` when the mass of privacy loss beyond the loss cap (the heavy tail of the norm
    estimate) already exceeds ``delta``.
    """
    if not (isinstance(steps, (int, np.integer)) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    mech = jl_mechanism(float(q), float(noise_multiplier), int(jl_projections), num_bins)
    h = _default_h(steps) if h is None else h
    return _pld.pld_epsilon([(mech, int(steps))], delta, h=h, loss_cap=JL_LOSS_CAP)


def jl_delta(
    q: float,
    noise_multiplier: float,
    steps: int,
    epsilon: float,
    jl_projections: int,
    num_bins: int = 400,
    h: Optional[float] = None,
) -> float:
    """Certified delta at ``epsilon`` for DP-SGD-JL (see :func:`jl_epsilon`)."""
    if not (isinstance(steps, (int, np.integer)) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    mech = jl_mechanism(float(q), float(noise_multiplier), int(jl_projections), num_bins)
    h = _default_h(steps) if h is None else h
    return _pld.pld_delta([(mech, int(steps))], epsilon, h=h, loss_cap=JL_LOSS_CAP)
