"""Strong (advanced) composition baseline (Dwork, Rothblum & Vadhan 2010).

``k`` adaptive ``(eps0, delta0)``-DP mechanisms compose to ``(eps, k*delta0 + delta')``-DP with
``eps = sqrt(2 k log(1/delta')) eps0 + k eps0 (e^eps0 - 1)``.

For DP-SGD, Abadi et al. 2016 (Sec. 3.1) use it as the baseline: each step is the Gaussian mechanism
with ``sigma = sqrt(2 log(1.25/delta0)) / eps0`` (valid for ``eps0 < 1``), which the lot sampling
turns into ``(q eps0, q delta0)`` per step; they report eps ~= 9.34 for q=0.01, sigma=4, T=10000,
delta=1e-5.  :func:`dp_sgd_strong_composition_epsilon` reproduces this by optimising the split of
the total delta between ``T * q * delta0`` and ``delta'`` (it gives 9.35).  It is here for
comparison only and is **not** reported as a guarantee: at the optimum ``eps0 ~= 1.46``, outside
the range ``eps0 < 1`` where the classical Gaussian calibration is proven, and the ``(q eps, q
delta)`` amplification is the paper's simplification.

Example::

    from tf_dp.accounting.strong_composition import dp_sgd_strong_composition_epsilon
    dp_sgd_strong_composition_epsilon(q=0.01, noise_multiplier=4.0, steps=10000, delta=1e-5)
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["strong_composition", "dp_sgd_strong_composition_epsilon"]


def strong_composition(eps0: float, delta0: float, k: int, delta_prime: float) -> tuple[float, float]:
    """``(eps, delta)`` of ``k``-fold adaptive composition of ``(eps0, delta0)``-DP mechanisms."""
    if not (eps0 >= 0 and math.isfinite(eps0)):
        raise ValueError(f"eps0 must be a finite number >= 0, got {eps0!r}")
    if not (0 <= delta0 <= 1):
        raise ValueError(f"delta0 must be in [0, 1], got {delta0!r}")
    if not (isinstance(k, (int, np.integer)) and k >= 1):
        raise ValueError(f"k must be an integer >= 1, got {k!r}")
    if not (0 < delta_prime < 1):
        raise ValueError(f"delta_prime must be in (0, 1), got {delta_prime!r}")
    eps = math.sqrt(2.0 * k * math.log(1.0 / delta_prime)) * eps0 + k * eps0 * math.expm1(eps0)
    return eps, k * delta0 + delta_prime


def dp_sgd_strong_composition_epsilon(
    q: float, noise_multiplier: float, steps: int, delta: float, grid: int = 199
) -> float:
    """Abadi et al.'s strong-composition baseline for DP-SGD (see module docstring).

    Splits ``delta`` as ``steps * q * delta0 + delta'`` (fraction searched on a grid) and returns the
    smallest resulting epsilon (a comparison baseline, not a certified bound).
    """
    if not (0 < q <= 1):
        raise ValueError(f"q must be in (0, 1], got {q!r}")
    if not (noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier!r}")
    if not (isinstance(steps, (int, np.integer)) and steps >= 1):
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    best = math.inf
    for frac in np.linspace(0.0, 1.0, grid + 2)[1:-1]:
        delta0 = frac * delta / (steps * q)
        if delta0 >= 1:
            continue
        eps0 = math.sqrt(2.0 * math.log(1.25 / delta0)) / noise_multiplier
        eps, _ = strong_composition(q * eps0, q * delta0, int(steps), (1.0 - frac) * delta)
        best = min(best, eps)
    return best
