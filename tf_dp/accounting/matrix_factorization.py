"""Privacy of DP matrix factorization (correlated noise): sensitivity, epsilon, calibration.

A run of ``n`` steps with strategy ``C`` releases ``C X + Z`` (``X``: the clipped sums, one row
per step; ``Z``: i.i.d. ``N(0, (z C_clip)^2)`` entries): one Gaussian mechanism whose sensitivity
is the largest ``||C u||`` over the participation vectors ``u`` of one record (``u_t = 1`` at the
steps where it can be in the batch), in units of the clip norm (Choquette-Choo et al. 2023,
"Multi-Epoch Matrix Factorization Mechanisms", and "(Amplified) Banded Matrix Factorization",
Sec. 2). Here a record's participations follow a period ``p``: a fixed-order cyclic schedule
(``p`` batches per epoch, the record in the same batch of every epoch) or cyclic Poisson sampling
over ``p`` parts (without amplification, each step of the record's part may include it). Its
participation vectors are ``u_j = 1`` at steps ``j, j + p, ...`` and their sub-vectors (a Poisson
sample may skip some): :func:`mf_sensitivity` takes the largest ``||C u_j||`` when ``C^T C`` is
non-negative on those steps (then a sub-vector never has a larger norm: exact), and otherwise the
bound ``sqrt(sum |C^T C|)`` over them (an upper bound, said in the result).

* :func:`mf_epsilon`: that Gaussian mechanism's exact epsilon (Balle & Wang 2018, Thm. 8).
* :func:`amplified_bandmf_epsilon`: a ``b``-banded ``C`` with cyclic Poisson sampling over ``b``
  parts (rate ``q`` within the part): a record's possible participations are ``b`` steps apart,
  so they touch disjoint blocks of rows of ``C`` and the run is ``ceil(n / b)`` independent
  Poisson-subsampled Gaussian mechanisms, each of sensitivity the largest column norm of ``C``
  (Choquette-Choo et al. 2023, Thm. 4); composed by tf_dp's accountants (``pld`` or ``rdp``).
  ``b = 1`` is DP-SGD's accounting, number for number.
* :func:`calibrate_mf_noise`: the noise multiplier for a target epsilon, for either.
* :func:`mf_epsilon_from_ledger`: epsilon recomputed from a saved ledger file whose metadata holds
  a :class:`~tf_dp.ledger.events.MatrixFactorizationEvent` (``C`` rebuilt from the strategy's
  config for the number of steps the ledger records).

Example:

>>> from tf_dp.correlated.strategies import BandedStrategy
>>> from tf_dp.accounting.matrix_factorization import mf_epsilon, calibrate_mf_noise
>>> c = BandedStrategy.square_root(num_steps=100, bands=10)
>>> round(mf_epsilon(c, noise_multiplier=4.0, delta=1e-5, period=10).epsilon, 3)
4.674
>>> z = calibrate_mf_noise(c, 3.0, 1e-5, period=10)
>>> mf_epsilon(c, z, 1e-5, period=10).epsilon <= 3.0
True
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
from scipy import optimize, stats

from tf_dp.accounting.matrix_sensitivity import (  # noqa: F401 -- re-exported
    ToeplitzC,
    _filter_column,
    _filters_of,
    _matrix,
    ledger_mf_units,
    mf_sensitivity,
)

__all__ = [
    "MFPrivacy",
    "ToeplitzC",
    "amplified_bandmf_epsilon",
    "calibrate_mf_noise",
    "ledger_mf_units",
    "mf_epsilon",
    "mf_epsilon_from_ledger",
    "mf_matrix_from_config",
    "mf_sensitivity",
]


@dataclasses.dataclass(frozen=True)
class MFPrivacy:
    """The guarantee of a matrix-factorization run.

    Attributes:
      epsilon, delta: the guarantee (``epsilon`` certified for the ideal real-valued mechanism).
      sensitivity: the sensitivity used, in units of the clip norm.
      exact_sensitivity: False when ``sensitivity`` is the ``|C^T C|`` upper bound.
      assumptions: what the figure assumes, in words.
    """

    epsilon: float
    delta: float
    sensitivity: float
    exact_sensitivity: bool
    assumptions: str


def _gaussian_delta(eps: float, mu: float) -> float:
    return float(stats.norm.cdf(-eps / mu + mu / 2)
                 - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def _gaussian_epsilon(mu: float, delta: float) -> float:
    if mu == 0 or _gaussian_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while _gaussian_delta(hi, mu) > delta:
        hi *= 2.0
    return float(optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, hi, xtol=1e-12))


def _check_noise(noise_multiplier: Any) -> float:
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and noise_multiplier >= 0):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    return float(noise_multiplier)


def _check_delta(delta: Any) -> float:
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    return float(delta)


def mf_epsilon(strategy: Any, noise_multiplier: float, delta: float,
               period: Optional[int] = None) -> MFPrivacy:
    """Epsilon of a matrix-factorization run without amplification: the Gaussian mechanism of
    sensitivity :func:`mf_sensitivity` and noise ``noise_multiplier`` (both in clip-norm units).

    Example: ``mf_epsilon(BandedStrategy.optimize(1000, 8), 2.0, 1e-5, period=100)``.
    """
    z, delta = _check_noise(noise_multiplier), _check_delta(delta)
    sens, exact = mf_sensitivity(strategy, period)
    eps = math.inf if z == 0 else _gaussian_epsilon(sens / z, delta)
    where = ("one participation" if period is None else
             f"participations every {period} steps (a fixed cyclic order, or cyclic Poisson over "
             f"{period} parts without amplification)")
    return MFPrivacy(
        eps, delta, sens, exact,
        f"add/remove-one adjacency; one Gaussian mechanism C X + Z over the run, {where}; "
        f"sensitivity max ||C u|| = {sens:.6g} x the clip norm"
        + ("" if exact else " (upper bound: C^T C has negative entries)")
        + "; exact Gaussian epsilon (Balle & Wang 2018)")


def _banded_width(c: np.ndarray) -> int:
    n = c.shape[0]
    rows, cols = np.nonzero(np.abs(c) > 0)
    if np.any(cols > rows):
        raise ValueError("strategy's matrix C must be lower triangular")
    return int((rows - cols).max()) + 1 if len(rows) else 1 if n else 0


def amplified_bandmf_epsilon(strategy: Any, noise_multiplier: float, delta: float,
                             sampling_probability: float, bands: Optional[int] = None,
                             accountant: str = "pld") -> MFPrivacy:
    """Epsilon of a ``b``-banded ``C`` under cyclic Poisson sampling over ``b`` parts (rate ``q``
    within a record's part), with amplification: ``ceil(n / b)`` Poisson-subsampled Gaussian
    mechanisms of sensitivity ``max_t ||C[:, t]||`` composed by ``accountant`` (``pld`` or
    ``rdp``).

    Args:
      strategy: a lower-triangular ``C`` with at most ``bands`` non-zero diagonals (default: its
        own band count), or a strategy with ``matrix()``.
      noise_multiplier: ``z`` (the entries of ``Z`` have stddev ``z`` times the clip norm).
      sampling_probability: ``q`` in (0, 1], a record's inclusion probability at each step of
        its part.
    """
    from tf_dp.accounting.ledger_analysis import ACCOUNTANTS, _epsilon_of_runs
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    z, delta = _check_noise(noise_multiplier), _check_delta(delta)
    if not (isinstance(sampling_probability, (int, float)) and 0 < sampling_probability <= 1):
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability!r}")
    if accountant not in ("pld", "rdp") or accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be 'pld' or 'rdp', got {accountant!r}")
    filters = _filters_of(strategy)
    if filters is not None:  # Toeplitz: the first column is the largest; O(n * bands)
        column = _filter_column(*filters)
        n, nonzero = filters[2], np.flatnonzero(column)
        width = int(nonzero[-1]) + 1 if len(nonzero) else 1
        col = float(np.linalg.norm(column))
    else:
        c = _matrix(strategy)
        if c.shape[0] != c.shape[1]:
            raise ValueError(f"amplified BandMF needs a square banded C, got shape {c.shape}")
        n = c.shape[0]
        width = _banded_width(c)
        col = float(np.sqrt((c * c).sum(axis=0)).max())
    b = width if bands is None else bands
    if isinstance(b, bool) or not isinstance(b, (int, np.integer)) or not width <= b <= n:
        raise ValueError(f"bands must be an integer in [{width} (C's band), {n}], got {bands!r}")
    k = math.ceil(n / int(b))
    if z == 0:
        return MFPrivacy(math.inf, delta, col, True, "no noise")
    entry = SampleEntry(SamplingEvent(max(1, int(b)), float(sampling_probability), "poisson"),
                        (SumQueryEvent(col, z),))
    eps = _epsilon_of_runs([(entry, k)], k, delta, accountant).epsilon
    return MFPrivacy(
        float(eps), delta, col, True,
        f"add/remove-one adjacency; {int(b)}-banded C with cyclic Poisson sampling over {int(b)} "
        f"parts at rate q = {sampling_probability:g}: {k} Poisson-subsampled Gaussian mechanisms "
        f"of sensitivity max column norm {col:.6g} x the clip norm (Choquette-Choo et al. 2023, "
        f"amplified BandMF), composed by the {accountant} accountant")


def calibrate_mf_noise(strategy: Any, target_epsilon: float, delta: float,
                       period: Optional[int] = None, sampling_probability: Optional[float] = None,
                       bands: Optional[int] = None, accountant: str = "pld",
                       rtol: float = 1e-3) -> float:
    """The smallest noise multiplier (within ``rtol``, on the safe side) whose epsilon is at most
    ``target_epsilon``: without amplification (``period``, :func:`mf_epsilon`: exact, from the
    Gaussian mechanism's ``mu``), or amplified (``sampling_probability`` given:
    :func:`amplified_bandmf_epsilon`).

    Example: ``calibrate_mf_noise(BandedStrategy.optimize(1000, 8), 3.0, 1e-5, period=100)``.
    """
    if not (isinstance(target_epsilon, (int, float)) and 0 < target_epsilon < math.inf):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    delta = _check_delta(delta)
    if not 0 < rtol < 1:
        raise ValueError(f"rtol must be in (0, 1), got {rtol!r}")
    if sampling_probability is None:
        sens, _ = mf_sensitivity(strategy, period)
        mu = optimize.brentq(lambda m: _gaussian_delta(target_epsilon, m) - delta, 1e-6, 1e3,
                             xtol=1e-12)
        z = sens / mu * (1 + 1e-9)
        while mf_epsilon(strategy, z, delta, period).epsilon > target_epsilon:
            z *= 1 + 1e-9
        return z

    def eps(z):
        return amplified_bandmf_epsilon(strategy, z, delta, sampling_probability, bands,
                                        accountant).epsilon

    hi = 1.0
    while eps(hi) > target_epsilon:
        hi *= 2.0
        if hi > 1e4:
            raise ValueError(f"target_epsilon {target_epsilon} is out of reach (noise > 1e4)")
    lo = hi / 2.0
    while eps(lo) <= target_epsilon and lo > 1e-3:
        hi, lo = lo, lo / 2.0
    while hi - lo > rtol * lo:
        mid = 0.5 * (lo + hi)
        if eps(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    return hi


def mf_matrix_from_config(config: dict, num_steps: Optional[int] = None) -> np.ndarray:
    """``C`` (dense, ``[num_steps, num_steps]``, default the config's ``num_steps``) from a
    strategy's ``to_config()`` dict, in numpy: ``banded``, the lower-triangular Toeplitz of the
    coefficients; ``blt``, the inverse of the Toeplitz ``C^{-1}`` with first column ``1, sum_i
    omega_i theta_i^(k-1)`` (lag ``k >= 1``). Past the config's ``num_steps`` both continue as
    Toeplitz (what the runtime noise does).

    Example: ``mf_matrix_from_config({"kind": "banded", "coefficients": [1, .5], "num_steps": 3})``.
    """
    from tf_dp.ledger.events import MatrixFactorizationEvent

    MatrixFactorizationEvent(config, 1.0, 1.0)  # validates the config
    n = config["num_steps"] if num_steps is None else num_steps
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
        raise ValueError(f"num_steps must be an integer >= 0, got {num_steps!r}")
    n = int(n)
    lag = np.arange(n)[:, None] - np.arange(n)[None, :]
    if config["kind"] == "banded":
        col = np.zeros(n)
        coef = np.asarray(config["coefficients"], np.float64)[:n]
        col[: len(coef)] = coef
        return np.where(lag >= 0, col[np.clip(lag, 0, max(n - 1, 0))], 0.0)
    omega = np.asarray(config["omega"], np.float64)
    theta = np.asarray(config["theta"], np.float64)
    k = np.arange(1, n)
    inv_col = np.r_[1.0, (omega[None, :] * theta[None, :] ** (k - 1)[:, None]).sum(axis=1)][:n]
    inv = np.where(lag >= 0, inv_col[np.clip(lag, 0, max(n - 1, 0))], 0.0)
    return np.linalg.solve(inv, np.eye(n)) if n else inv


def mf_epsilon_from_ledger(path: Any, delta: float, accountant: str = "pld") -> MFPrivacy:
    """Recomputes a matrix-factorization run's epsilon from its saved ledger file.

    The file's metadata holds the run's :class:`~tf_dp.ledger.events.MatrixFactorizationEvent`
    under :data:`~tf_dp.ledger.events.MF_METADATA_KEY` (covered by the file's checksum); the
    ledger's steps give ``n``, the number of releases, and ``C`` is rebuilt for ``n`` steps
    (:class:`ToeplitzC`: the strategy's filter, ``O(n * bands)``, no ``n x n`` matrix).
    ``cyclic_poisson`` with a ``C`` of at most ``period`` bands:
    :func:`amplified_bandmf_epsilon` (``accountant``); otherwise, and for ``single`` / ``periodic``
    participation: :func:`mf_epsilon` (no amplification). Refuses (ValueError) a file without the
    event, a cyclic Poisson claim the ledger's sampling events contradict, or a step whose recorded
    sensitivity exceeds the event's clip norm.

    Example::

        ledger.save("run.ledger.json", metadata={MF_METADATA_KEY: event.to_dict()})
        mf_epsilon_from_ledger("run.ledger.json", delta=1e-5).epsilon
    """
    import json
    import os

    from tf_dp.ledger.events import MF_METADATA_KEY, MatrixFactorizationEvent
    from tf_dp.ledger.ledger_file import read_ledger_runs

    delta = _check_delta(delta)
    runs = read_ledger_runs(path)  # validates the file and its checksum (metadata included)
    with open(os.fspath(path), encoding="utf-8") as f:
        meta = json.load(f).get("metadata") or {}
    if MF_METADATA_KEY not in meta:
        raise ValueError(f"ledger file {os.fspath(path)!r} has no matrix-factorization event "
                         f"(metadata key {MF_METADATA_KEY!r}); save it with "
                         f"metadata={{{MF_METADATA_KEY!r}: event.to_dict()}}")
    event = MatrixFactorizationEvent.from_dict(meta[MF_METADATA_KEY])
    n = sum(count for _, count in runs)
    clip = float(event.l2_norm_clip)
    declared_order = _check_participation(event, runs, sum(count for _, count in runs))
    for entry, _ in runs:
        smp = entry.sampling
        if event.participation == "cyclic_poisson" and not (
                smp.policy == "cyclic_poisson" and smp.num_parts == event.period
                and math.isclose(smp.selection_probability, event.sampling_probability,
                                 rel_tol=2.0**-23)):
            raise ValueError(
                f"the event claims cyclic Poisson sampling over {event.period} parts at rate "
                f"{event.sampling_probability}, but the ledger records a {smp.policy!r} draw "
                f"(num_parts={smp.num_parts}, q={smp.selection_probability})")
        for q in entry.queries:
            if q.l2_sensitivity > clip * (1 + 2.0**-23):
                raise ValueError(f"a step's l2_sensitivity {q.l2_sensitivity} exceeds the "
                                 f"event's l2_norm_clip {clip}")
    if n == 0:
        return MFPrivacy(0.0, delta, 0.0, True, "no steps recorded")
    c = ToeplitzC.from_config(event.strategy, n)  # O(n * bands): 1e5 steps take milliseconds
    nonzero = np.flatnonzero(c.column())
    z = float(event.noise_multiplier)
    if event.participation == "cyclic_poisson" and nonzero[-1] + 1 <= min(event.period, n):
        return amplified_bandmf_epsilon(c, z, delta, float(event.sampling_probability),
                                        bands=min(event.period, n), accountant=accountant)
    period = None if event.participation == "single" else min(event.period, n)
    result = mf_epsilon(c, z, delta, period)
    if declared_order:
        result = dataclasses.replace(result, assumptions=result.assumptions + (
            "; the ledger records shuffled fixed-size batches: that every epoch visits the "
            "batches in the same order (each record every period steps) is the user's claim, "
            "not checked by tf_dp"))
    return result


def _check_participation(event: Any, runs: Any, n: int) -> bool:
    """Refuses a ``single`` / ``periodic`` claim the ledger's sampling contradicts; True when the
    claim rests on the user's word that shuffled batches kept one order (``periodic`` over
    ``shuffle`` draws with the epoch's length as period)."""
    from tf_dp.accounting.ledger_analysis import shuffle_steps_per_epoch

    if event.participation == "cyclic_poisson":
        return False
    period = 1 if event.participation == "periodic" and event.period == 1 else None
    declared = False
    for entry, _ in runs:
        smp = entry.sampling
        claim = (f"the event claims {event.participation!r} participation"
                 + (f" (period {event.period})" if event.participation == "periodic" else ""))
        if smp.policy == "cyclic_poisson":
            ok = (n <= smp.num_parts if event.participation == "single"
                  else smp.num_parts % event.period == 0)
            why = (f"a record of a cyclic Poisson part can take part every {smp.num_parts} steps "
                   f"(a periodic claim needs a period dividing {smp.num_parts}; single needs at "
                   f"most {smp.num_parts} steps)")
        elif smp.policy == "shuffle":
            per_epoch = shuffle_steps_per_epoch(smp.population_size, smp.selection_probability)
            ok = (n <= per_epoch if event.participation == "single"
                  else period == 1 or event.period == per_epoch)
            declared = declared or (event.participation == "periodic" and period is None)
            why = (f"shuffled batches visit each record once per epoch of {per_epoch} steps (a "
                   f"periodic claim needs period {per_epoch}, the epoch, or 1; single needs at "
                   f"most {per_epoch} steps)")
        else:
            ok = period == 1 or (event.participation == "single" and n <= 1)
            why = (f"the ledger records {smp.policy!r} draws, in which a record can take part in "
                   "any step: only participation 'periodic' with period 1 (or "
                   "'cyclic_poisson' batches) describes them")
        if not ok:
            raise ValueError(f"{claim}, which the ledger contradicts: {why}")
    return declared
