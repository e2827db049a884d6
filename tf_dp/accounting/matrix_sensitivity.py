"""Sensitivity of a DP matrix-factorization strategy ``C`` and the ledger's correlated-noise
steps as composable Gaussian mechanisms (what ``tf_dp.accounting.compute_epsilon`` composes).

The public names are re-exported by :mod:`tf_dp.accounting.matrix_factorization`, whose docstring
describes the analysis; this module holds the part the ledger analysis imports (it imports
nothing of the accountants, so ``ledger_analysis`` can use it without an import circle).

Example:

>>> from tf_dp.accounting.matrix_sensitivity import ToeplitzC, mf_sensitivity
>>> c = ToeplitzC.from_config({"kind": "banded", "coefficients": [1.0, 0.5], "num_steps": 4})
>>> sens, exact = mf_sensitivity(c, period=2)  # ||C (1, 0, 1, 0)|| = ||(1, .5, 1, .5)||
>>> round(sens, 6), exact
(1.581139, True)
"""

from __future__ import annotations

import json
import math
from typing import Any, Optional

import numpy as np
from scipy import signal

__all__ = ["ToeplitzC", "ledger_mf_units", "mf_sensitivity"]


def _matrix(strategy: Any) -> np.ndarray:
    c = strategy.matrix() if hasattr(strategy, "matrix") else np.asarray(strategy, np.float64)
    c = np.asarray(c, np.float64)
    if c.ndim != 2 or c.shape[0] < c.shape[1] or not c.shape[1]:
        raise ValueError(f"strategy must be a matrix C with at least as many rows as columns "
                         f"(or have matrix()), got {c.shape}")
    if not np.all(np.isfinite(c)):
        raise ValueError("strategy's matrix C must be finite")
    return c


class ToeplitzC:
    """A lower-triangular Toeplitz ``C`` of ``num_steps`` steps as the filter ``num(x) / den(x)``
    (its first column is the filter's impulse response): what the accountants need of a banded or
    BLT strategy in ``O(num_steps * bands)`` time and memory, never an ``n x n`` matrix.

    Example: ``ToeplitzC.from_config({"kind": "banded", "coefficients": [1, .5], "num_steps": 3},
    num_steps=100_000).column_norm()``.
    """

    def __init__(self, num: Any, den: Any, num_steps: int):
        self.num = np.asarray(num, np.float64).reshape(-1)
        self.den = np.asarray(den, np.float64).reshape(-1)
        if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or (
                num_steps < 1):
            raise ValueError(f"num_steps must be an integer >= 1, got {num_steps!r}")
        if not len(self.num) or not len(self.den) or self.den[0] == 0:
            raise ValueError("num and den must be non-empty with den[0] != 0")
        self.num_steps = int(num_steps)

    @classmethod
    def from_config(cls, config: dict, num_steps: Optional[int] = None) -> ToeplitzC:
        """From a strategy's ``to_config()`` dict (as
        :class:`~tf_dp.ledger.events.MatrixFactorizationEvent` records it), for ``num_steps``
        steps (default the config's; past it the Toeplitz continues, as the runtime noise does)."""
        from tf_dp.ledger.events import MatrixFactorizationEvent

        MatrixFactorizationEvent(config, 1.0, 1.0)  # validates the config
        n = config["num_steps"] if num_steps is None else num_steps
        if config["kind"] == "banded":
            return cls(config["coefficients"][:n], [1.0], n)
        # C^{-1}(x) = P(x) / Q(x): Q = prod_i (1 - theta_i x), P = Q + sum_i omega_i x
        # prod_{j != i} (1 - theta_j x); so C = Q / P
        q = np.ones(1)
        for t in config["theta"]:
            q = np.convolve(q, [1.0, -float(t)])
        p = q.copy()
        for i, w in enumerate(config["omega"]):
            rest = np.ones(1)
            for j, t in enumerate(config["theta"]):
                if j != i:
                    rest = np.convolve(rest, [1.0, -float(t)])
            p[1:] += float(w) * rest
        return cls(q, p, n)

    def toeplitz_filters(self) -> tuple[np.ndarray, np.ndarray, int]:
        return self.num, self.den, self.num_steps

    def column(self) -> np.ndarray:
        """The first column of ``C`` (the largest column: the others are its truncations)."""
        return _filter_column(self.num, self.den, self.num_steps)

    def matrix(self) -> np.ndarray:
        """``C``, dense (for checks)."""
        col, n = self.column(), self.num_steps
        lag = np.arange(n)[:, None] - np.arange(n)[None, :]
        return np.where(lag >= 0, col[np.clip(lag, 0, n - 1)], 0.0)


def _filter_column(num, den, n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    with np.errstate(over="ignore", invalid="ignore"):
        col = signal.lfilter(num, den, e)
    if not np.all(np.isfinite(col)):
        raise ValueError("strategy's matrix C must be finite (its filter diverges)")
    return col


def _filters_of(strategy: Any):
    """``(num, den, n)`` of a Toeplitz strategy (``toeplitz_filters()``), else None."""
    get = getattr(strategy, "toeplitz_filters", None)
    return None if get is None else get()


#: Largest ``n`` for which a Toeplitz ``C`` with negative entries gets the dense ``|C^T C|``
#: bound (the tighter one); above it, the ``||(|C|) u||`` bound from the filter (O(n * bands)).
_DENSE_BOUND_STEPS = 2000


def _toeplitz_sensitivity(num, den, n: int, period: Optional[int]) -> tuple[float, bool]:
    """:func:`mf_sensitivity` of a Toeplitz ``C``: column ``t`` is the first column truncated to
    ``n - t`` entries, and ``C u_j`` (``u_j``: ones at ``j, j + p, ...``) is ``C u_0`` shifted
    down by ``j`` and truncated, so offset 0 has the largest norm. With ``C >= 0`` (so ``C^T C >=
    0``) that norm is exact; otherwise ``||(|C|) u_0||`` bounds ``sqrt(sum |C^T C|)`` over every
    offset's steps (for ``n <= 2000`` the dense bound of :func:`mf_sensitivity` is used)."""
    col = _filter_column(num, den, n)
    if period is None:
        return float(np.linalg.norm(col)), True
    if np.any(col < 0) and n <= _DENSE_BOUND_STEPS:
        return mf_sensitivity(ToeplitzC(num, den, n).matrix(), period)
    u = np.zeros(n)
    u[::period] = 1.0
    if not np.any(col < 0):  # C u_0 by the filter: O(n * bands)
        return float(np.linalg.norm(signal.lfilter(num, den, u))), True
    cu = signal.fftconvolve(np.abs(col), u)[:n]  # |C| u_0: O(n log n)
    return float(np.linalg.norm(np.maximum(cu, 0.0))), False


def _check_period(period: Any, n: int) -> Optional[int]:
    if period is None:
        return None
    if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
        raise ValueError(f"period must be None (one participation) or an integer >= 1, got "
                         f"{period!r}")
    return int(period)


def mf_sensitivity(strategy: Any, period: Optional[int] = None) -> tuple[float, bool]:
    """``(sensitivity, exact)`` of ``C`` for one record's participations, in clip-norm units.

    Args:
      strategy: ``C`` (an array with a row per release and a column per step: square for
        banded and BLT, one row per tree node for the tree), a strategy with ``matrix()``, or a
        Toeplitz strategy with ``toeplitz_filters()`` (banded, BLT, :class:`ToeplitzC`: computed
        in ``O(n * bands)`` from the filter, no ``n x n`` matrix).
      period: None: one participation (the largest column norm); ``p``: every ``p``-th step from
        any offset ``j < p`` (and any subset of those steps).

    ``exact`` is False when ``C^T C`` has negative entries on some offset's steps; the value is
    then the upper bound ``sqrt(sum_{s,t} |(C^T C)_{st}|)`` over those steps.
    """
    filters = _filters_of(strategy)
    if filters is not None:  # banded / BLT: O(n * bands), no n x n matrix
        return _toeplitz_sensitivity(*filters, _check_period(period, filters[2]))
    c = _matrix(strategy)
    n = c.shape[1]
    period = _check_period(period, n)
    if period is None:
        return float(np.sqrt((c * c).sum(axis=0)).max()), True
    best, exact = 0.0, True
    for j in range(min(period, n)):
        cols = c[:, j::period]
        gram = cols.T @ cols
        if np.all(gram >= -1e-12 * np.abs(gram).max()):
            value = float(np.sqrt(max(gram.sum(), 0.0)))
        else:
            value, exact = float(np.sqrt(np.abs(gram).sum())), False
        best = max(best, value)
    return best, exact


def _is_mf(entry: Any) -> bool:
    return any(q.mechanism == "mf" for q in entry.queries)


def ledger_mf_units(runs: Any) -> tuple[list, list[tuple[float, float, int, str]], set, bool]:
    """The ledger's correlated-noise (``mf``) steps as composable Gaussian mechanisms, what
    :func:`tf_dp.accounting.compute_epsilon` composes with the run's other steps.

    Returns ``(other_runs, mechanisms, policies, non_private)``: ``mechanisms`` are ``(q, z,
    count, policy)`` (``count`` mechanisms, each Poisson-subsampled at rate ``q`` when ``q < 1``,
    Gaussian with noise multiplier ``z``). The ``n`` mf steps are the rows of one ``C`` (the
    strategy the rows record, rebuilt for ``n`` steps as a filter, :class:`ToeplitzC`), noise
    multiplier ``z = sigma / S`` (``sigma``: the rows' smallest stddev of ``Z``, ``S``: their
    largest recorded sensitivity). The participation follows the recorded sampling:

    * every step cyclic Poisson over the same ``p`` parts at one rate ``q`` and ``C`` at most ``p``
      bands: amplified BandMF, ``ceil(n / p)`` mechanisms at rate ``q`` with sensitivity ``C``'s
      largest column norm (:func:`amplified_bandmf_epsilon`; Choquette-Choo et al. 2023, Thm. 4);
    * cyclic Poisson with a wider ``C``: one Gaussian mechanism of sensitivity
      :func:`mf_sensitivity` with ``period = p`` (no amplification);
    * Poisson-family draws and balls-in-bins (add/remove-one; a record can be in any step): one
      Gaussian mechanism with ``period = 1``;
    * shuffled batches (replace-one adjacency, a record in any step across epochs): one Gaussian
      mechanism with twice the ``period = 1`` sensitivity.

    Refuses (ValueError) mf steps of different strategies or a step that mixes an mf query with
    another noised query. A fixed-order (``periodic``) claim is the user's word, not the ledger's:
    :func:`mf_epsilon_from_ledger` reads it from a saved file's metadata.
    """
    other, mf = [], []
    for entry, count in runs:
        (mf if _is_mf(entry) else other).append((entry, count))
    if not mf:
        return list(runs), [], set(), False
    strategies, policies_seen = set(), set()
    n, sens, sigma = 0, 0.0, math.inf
    for entry, count in mf:
        noisy = [q for q in entry.queries if q.l2_sensitivity > 0 or q.mechanism == "mf"]
        if len(noisy) != 1:
            raise ValueError(
                "a ledger step holds a correlated-noise (mf) sum query together with "
                f"{len(noisy) - 1} other sum queries; no tf_dp accountant analyses that mix")
        (q,) = noisy
        strategies.add(q.mf_strategy)
        n += count
        sens, sigma = max(sens, q.l2_sensitivity), min(sigma, q.noise_stddev)
        s = entry.sampling
        policies_seen.add((s.policy, s.num_parts, s.selection_probability))
    if len(strategies) > 1:
        raise ValueError(f"the ledger's correlated-noise steps use {len(strategies)} different "
                         "strategies (C); tf_dp accounts for one matrix-factorization run per "
                         "ledger: record each run in its own ledger")
    if sens == 0:
        return other, [], set(), False
    if sigma == 0:
        return other, [], {"mf"}, True
    z = sigma / sens
    c = ToeplitzC.from_config(json.loads(strategies.pop()), n)
    kinds = {p for p, _, _ in policies_seen}
    if kinds == {"cyclic_poisson"} and len(policies_seen) == 1:
        (_, parts, rate), = policies_seen
        nonzero = np.flatnonzero(c.column())
        if int(nonzero[-1]) + 1 <= min(parts, n):  # banded within the parts: amplified
            col = float(np.linalg.norm(c.column()))
            return other, [(float(rate), z / col, math.ceil(n / min(parts, n)), "mf")], \
                {"mf", "mf_amplified"}, False
        period: Optional[int] = min(parts, n)
    else:
        period = 1
    sensitivity, _ = mf_sensitivity(c, period)
    if "shuffle" in kinds:
        return other, [(1.0, z / (2.0 * sensitivity), 1, "mf")], {"mf_replace"}, False
    return other, [(1.0, z / sensitivity, 1, "mf")], {"mf"}, False
