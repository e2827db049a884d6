"""A Monte Carlo ESTIMATE of the privacy of balls-in-bins batches (not a proven bound).

Balls-in-bins (``tf_dp.data.balls_in_bins_batches``): every epoch assigns each record to one of
``T`` steps uniformly at random. Chua et al. 2025 ("Balls-and-Bins Sampling for DP-SGD") show that
one epoch of ``T`` Gaussian steps (noise multiplier ``z``, sensitivity ``C``) is dominated by the
pair ``P = (1/T) sum_j N(e_j, z^2 I_T)`` (with the record, in a uniformly random step ``j``) and
``Q = N(0, z^2 I_T)`` (without it), and estimate its hockey-stick divergence by Monte Carlo; the
epochs compose (independent assignments). The privacy loss of a point ``x`` is
``L(x) = log((1/T) sum_j exp((x_j - 1/2) / z^2))``, and
``delta(eps) = E_P[(1 - e^(eps - L))_+]`` (removal) or ``E_Q[(1 - e^(eps + L))_+]`` (addition).

:func:`balls_in_bins_estimate` estimates both with importance sampling (the record's own step
shifted for the removal side, every coordinate shifted down for the addition side, each shift
chosen from ``eps``; common random numbers across ``eps``), and reports the smallest ``eps`` whose
one-sided upper confidence limit on ``delta(eps)`` (normal approximation of the weighted mean, at
``confidence``) is at most the target ``delta``. It is an **estimate**: the confidence statement is
about the Monte Carlo draw and rests on a normal approximation; nothing here is certified. The
certified figure for the same run is the no-amplification bound that ``compute_epsilon`` gives for
``balls_in_bins`` ledgers (``certified_epsilon`` in the result).

Example::

    from tf_dp.accounting import balls_in_bins_estimate
    est = balls_in_bins_estimate(noise_multiplier=1.0, steps_per_epoch=100, epochs=5,
                                 delta=1e-5, seed=0)
    print(est)   # "ESTIMATE (Monte Carlo, not a proven bound): epsilon ~ ..."
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Optional

import numpy as np
from scipy import special, stats

__all__ = ["BallsInBinsEstimate", "balls_in_bins_estimate", "balls_in_bins_ledger_estimate"]

_CHUNK_VALUES = 4_000_000  # normals drawn per chunk (memory bound: 32 MB of float64)


@dataclasses.dataclass(frozen=True)
class BallsInBinsEstimate:
    """A Monte Carlo estimate of balls-in-bins privacy (labelled as such wherever printed).

    Attributes:
      epsilon: the estimated epsilon at ``delta``: the smallest epsilon (to 1e-3 relative) whose
        upper confidence limit on the dominating pair's ``delta(epsilon)`` is <= ``delta``.
      delta: the target delta.
      delta_estimate: the Monte Carlo mean of ``delta(epsilon)`` (max of both directions).
      delta_upper: its upper confidence limit at ``confidence`` (<= ``delta``).
      confidence: the one-sided confidence level (normal approximation).
      samples: Monte Carlo samples per direction.
      noise_multiplier, steps_per_epoch, epochs: the mechanism estimated.
      certified_epsilon: the proven bound for the same run (no amplification: ``epochs``
        Gaussian mechanisms with noise multiplier ``z``).
    """

    epsilon: float
    delta: float
    delta_estimate: float
    delta_upper: float
    confidence: float
    samples: int
    noise_multiplier: float
    steps_per_epoch: int
    epochs: int
    certified_epsilon: float
    certified: bool = False  # never: an estimate

    def __str__(self) -> str:
        return (
            f"ESTIMATE (Monte Carlo, not a proven bound): epsilon ~ {self.epsilon:.4g} at delta "
            f"= {self.delta:.3g} for balls-in-bins batches (T = {self.steps_per_epoch} steps per "
            f"epoch, {self.epochs} epoch(s), noise multiplier {self.noise_multiplier:g}); with "
            f"{self.confidence:.0%} confidence over the {self.samples} Monte Carlo samples per "
            f"direction (normal approximation), the dominating pair's delta at this epsilon is "
            f"<= {self.delta_upper:.3g} (mean {self.delta_estimate:.3g}). Certified bound for the "
            f"same run (no amplification assumed): epsilon = {self.certified_epsilon:.4g}."
        )


def _check(noise_multiplier, steps_per_epoch, epochs, delta, samples, confidence):
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and noise_multiplier > 0):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    for name, v in (("steps_per_epoch", steps_per_epoch), ("epochs", epochs),
                    ("samples", samples)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    if not (isinstance(confidence, (int, float)) and 0.5 <= confidence < 1.0):
        raise ValueError(f"confidence must be in [0.5, 1), got {confidence!r}")


def _draw(rng: np.random.Generator, samples: int, epochs: int, t: int, z: float):
    """Per (sample, epoch): ``g1`` (the record's step's standard normal), ``a`` = logsumexp over
    the other ``T - 1`` steps of ``(z g_j - 1/2) / z^2`` (``-inf`` for ``T = 1``), ``s`` = the sum
    of those ``g_j``. Drawn in chunks (bounded memory)."""
    g1 = np.empty((samples, epochs))
    a = np.empty((samples, epochs))
    s = np.empty((samples, epochs))
    rows = max(1, _CHUNK_VALUES // max(1, epochs * t))
    for start in range(0, samples, rows):
        stop = min(samples, start + rows)
        g = rng.standard_normal((stop - start, epochs, t))
        g1[start:stop] = g[..., 0]
        rest = g[..., 1:]
        if t > 1:
            a[start:stop] = special.logsumexp((z * rest - 0.5) / (z * z), axis=-1)
        else:
            a[start:stop] = -np.inf
        s[start:stop] = rest.sum(axis=-1)
    return g1, a, s


def _delta_stats(eps: float, g1, a, s, t: int, z: float, epochs: int):
    """(mean, standard error) of the importance-sampled ``delta(eps)`` in each direction."""
    z2 = z * z
    log_t = math.log(t)
    out = []
    # Removal: x_1 = theta + z g1 (the record's step, shifted), others z g_j; weight
    # N(1, z^2) / N(theta, z^2) at x_1.
    theta = max(1.0, 0.5 + z2 * math.log(t * math.expm1(eps / epochs) + 1.0))
    x1 = theta + z * g1
    loss = (np.logaddexp((x1 - 0.5) / z2, a) - log_t).sum(axis=1)
    log_w = (((x1 - theta) ** 2 - (x1 - 1.0) ** 2) / (2.0 * z2)).sum(axis=1)
    out.append(_weighted(log_w, eps - loss))
    # Addition: every coordinate shifted down by tau: x = -tau + z g; weight
    # exp((-T tau^2 + 2 tau z S) / (2 z^2)), S the sum of the g_j; L = -tau / z^2 + lse - log T.
    tau = eps * z2 / epochs
    lse = np.logaddexp((z * g1 - 0.5) / z2, a)
    loss = (-tau / z2 + lse - log_t).sum(axis=1)
    total = (g1 + s).sum(axis=1)
    log_w = (-t * epochs * tau * tau + 2.0 * tau * z * total) / (2.0 * z2)
    out.append(_weighted(log_w, eps + loss))
    return out


def _weighted(log_w: np.ndarray, exponent: np.ndarray):
    """Mean and standard error of ``w (1 - e^exponent)_+``."""
    with np.errstate(over="ignore", under="ignore"):
        y = np.exp(log_w) * np.where(exponent < 0, -np.expm1(np.minimum(exponent, 0.0)), 0.0)
    n = y.size
    return float(y.mean()), float(y.std(ddof=1) / math.sqrt(n)) if n > 1 else math.inf


def balls_in_bins_estimate(
    noise_multiplier: float,
    steps_per_epoch: int,
    epochs: int,
    delta: float,
    *,
    samples: int = 200_000,
    confidence: float = 0.95,
    seed: Optional[int] = None,
) -> BallsInBinsEstimate:
    """Monte Carlo ESTIMATE of epsilon for ``epochs`` epochs of balls-in-bins batches.

    Args:
      noise_multiplier: ``z``, the effective noise multiplier of every step (noise / sensitivity).
      steps_per_epoch: ``T``, the batches of one epoch (``round(1 / q)`` in the ledger).
      epochs: the epochs (independent assignments) composed.
      delta: the target delta in (0, 1).
      samples: Monte Carlo samples per direction (each draws ``epochs * T`` normals).
      confidence: one-sided level of the upper confidence limit on delta, in [0.5, 1).
      seed: fixes the Monte Carlo draw (default: OS entropy).

    Returns:
      A :class:`BallsInBinsEstimate` (``certified`` is False; ``certified_epsilon`` is the proven
      no-amplification figure).

    Example: ``balls_in_bins_estimate(1.0, 100, 5, 1e-5, seed=0).epsilon``.
    """
    from tf_dp.accounting import pld as _pld

    _check(noise_multiplier, steps_per_epoch, epochs, delta, samples, confidence)
    z, t, e = float(noise_multiplier), int(steps_per_epoch), int(epochs)
    key = int.from_bytes(os.urandom(8), "little") if seed is None else int(seed)
    rng = np.random.Generator(np.random.Philox(key))
    g1, a, s = _draw(rng, int(samples), e, t, z)
    zq = float(stats.norm.ppf(confidence))
    certified = _pld.pld_epsilon([(_pld.SubsampledGaussian(1.0, z), e)], delta)

    def upper(eps):
        parts = _delta_stats(eps, g1, a, s, t, z, e)
        return max(m + zq * se for m, se in parts), max(m for m, _ in parts)

    lo, hi = 0.0, max(certified, 1e-3)
    while upper(hi)[0] > delta and hi < 1e3:  # the estimate may sit above the proven bound
        hi *= 2.0
    if upper(lo)[0] <= delta:
        hi = lo
    while hi - lo > 1e-3 * max(hi, 1e-3):
        mid = 0.5 * (lo + hi)
        if upper(mid)[0] <= delta:
            hi = mid
        else:
            lo = mid
    up, mean = upper(hi)
    return BallsInBinsEstimate(
        epsilon=hi, delta=float(delta), delta_estimate=mean, delta_upper=up,
        confidence=float(confidence), samples=int(samples), noise_multiplier=z,
        steps_per_epoch=t, epochs=e, certified_epsilon=float(certified),
    )


def balls_in_bins_ledger_estimate(ledger, delta: float, **kwargs) -> BallsInBinsEstimate:
    """:func:`balls_in_bins_estimate` for a ledger whose steps are all ``balls_in_bins`` with one
    ``T`` and one effective noise multiplier (epochs counted per pass, as the certified
    accountant counts them); anything else is refused with a ValueError.

    Example: ``balls_in_bins_ledger_estimate("run.ledger.json", 1e-5, seed=0)``.
    """
    from tf_dp.accounting.ledger_analysis import shuffle_epoch_runs
    from tf_dp.ledger.ledger_file import as_runs

    runs = as_runs(ledger)
    other = {e.sampling.policy for e, _ in runs} - {"balls_in_bins"}
    if other or not runs:
        raise ValueError(
            "balls_in_bins_ledger_estimate needs a ledger of balls_in_bins steps only, got "
            f"policies {sorted(other) or 'none'}"
        )
    epochs = shuffle_epoch_runs(runs, "balls_in_bins")
    kinds = {(round(1.0 / e.sampling.selection_probability), e.effective_noise_multiplier())
             for e, _ in epochs}
    if len(kinds) != 1 or any(e.jl_projections is not None for e, _ in epochs):
        raise ValueError(
            "balls_in_bins_ledger_estimate supports one steps_per_epoch and one effective noise "
            f"multiplier (exact clipping) per ledger, got {sorted(kinds)}"
        )
    (t, z), = kinds
    if not (z > 0 and math.isfinite(z)):
        raise ValueError(f"the ledger's effective noise multiplier must be finite and > 0, got {z}")
    return balls_in_bins_estimate(z, int(t), sum(c for _, c in epochs), delta, **kwargs)
