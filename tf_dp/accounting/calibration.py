"""Noise calibration: the smallest noise multiplier that meets a target ``(epsilon, delta)``.

Epsilon decreases as the noise multiplier grows, so the calibration brackets the answer (doubling
and halving from 1) and bisects until the bracket is within ``rtol``.  The returned value is the
upper end of the final bracket, so the guarantee at that noise is never above the target (for the
certified accountants).  ``gdp`` calibrates against the CLT approximation (not certified).

Example:

>>> from tf_dp.accounting import calibrate_noise_multiplier
>>> sigma = calibrate_noise_multiplier(3.0, 1e-5, n=60000, batch_size=256, epochs=60)
>>> round(sigma, 3)
1.014
"""

from __future__ import annotations

import math
from typing import Optional

from scipy import optimize

from tf_dp._progress import working
from tf_dp.accounting.ledger_analysis import ACCOUNTANTS, dp_sgd_epsilon

__all__ = ["calibrate_noise_multiplier", "MAX_NOISE_MULTIPLIER"]

#: Largest noise multiplier tried before declaring a target unreachable.
MAX_NOISE_MULTIPLIER = 1000.0


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    n: int,
    batch_size: int,
    *,
    epochs: Optional[float] = None,
    steps: Optional[int] = None,
    accountant: str = "rdp",
    sampling: str = "poisson",
    microbatch_size: Optional[int] = None,
    jl_projections: Optional[int] = None,
    rtol: float = 1e-3,
    max_batch_size: Optional[int] = None,
) -> float:
    """Smallest noise multiplier (within ``rtol``) whose epsilon at ``delta`` is <= the target.

    The run is described as for :func:`tf_dp.accounting.dp_sgd_epsilon`: ``sampling`` is
    ``poisson``, ``shuffle``, ``truncated_poisson`` (give ``max_batch_size``, the ``B`` of
    :func:`tf_dp.data.truncated_poisson_batches`) or ``balls_in_bins`` (certified: one Gaussian
    per epoch, no amplification).

    Raises:
      ValueError: bad arguments, or the target is unreachable (even ``MAX_NOISE_MULTIPLIER`` gives
        a larger epsilon).
    """
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if not (0 < rtol < 1):
        raise ValueError(f"rtol must be in (0, 1), got {rtol!r}")

    # a pld calibration can take minutes: progress lines past 5 s (tf_dp.set_progress)
    with working(f"calibrating the noise multiplier for epsilon <= {target_epsilon:g} "
                 f"({accountant} accountant)"):
        def eps(sigma: float) -> float:
            return dp_sgd_epsilon(n, batch_size, sigma, delta, steps=steps, epochs=epochs,
                                  accountant=accountant, sampling=sampling,
                                  microbatch_size=microbatch_size,
                                  jl_projections=jl_projections,
                                  max_batch_size=max_batch_size).epsilon

        def log_gap(sigma: float) -> float:
            e = eps(sigma)
            return math.log(e / target_epsilon) if 0 < e < math.inf else (50.0 if e else -50.0)

        # Bracket: start from the fast RDP answer for slow accountants (pld is tighter, so its
        # multiplier is at most RDP's; the brackets are verified anyway).
        hi = 1.0
        if accountant == "pld" and jl_projections is None:
            try:
                hi = calibrate_noise_multiplier(
                    target_epsilon, delta, n, batch_size, epochs=epochs, steps=steps,
                    accountant="rdp", sampling=sampling, microbatch_size=microbatch_size, rtol=rtol,
                    max_batch_size=max_batch_size)
            except ValueError:
                # RDP cannot reach the target; pld may (it is tighter). Bracket from the top, so a
                # target out of reach is reported by the pld check below, under its own name.
                hi = MAX_NOISE_MULTIPLIER
        while eps(hi) > target_epsilon:
            if hi >= MAX_NOISE_MULTIPLIER:
                raise ValueError(
                    f"target epsilon {target_epsilon} at delta {delta} is unreachable with the "
                    f"{accountant!r} accountant: even noise_multiplier={MAX_NOISE_MULTIPLIER:g} gives "
                    f"epsilon={eps(hi):.4g}"
                )
            hi = min(hi * 2.0, MAX_NOISE_MULTIPLIER)
        lo = hi / (1.5 if accountant == "pld" else 2.0)
        while eps(lo) <= target_epsilon:
            hi = lo
            lo /= 2.0
            if lo < 1e-3:
                return hi
        root = optimize.brentq(log_gap, lo, hi, xtol=rtol * lo / 4.0)
        # Return a value on the safe side of the root, checked.
        candidate = min(hi, root * (1.0 + rtol / 2.0))
        return candidate if eps(candidate) <= target_epsilon else hi
