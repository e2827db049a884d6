"""Correlated-noise strategies: the matrix ``C`` of DP matrix factorization, in numpy.

DP-MF releases ``C x + z`` for the stream of clipped sums ``x`` (one row per step), which an
optimizer turns into ``x + C^{-1} z``: step ``t`` adds row ``t`` of ``C^{-1} Z``. Two families,
both lower-triangular Toeplitz (the same coefficients down every diagonal):

* :class:`BandedStrategy` (BandMF; Choquette-Choo et al. 2023, "(Amplified) Banded Matrix
  Factorization", Sec. 3-4): ``C`` has ``b`` non-zero diagonals ``c_0 .. c_{b-1}``. Its noise
  needs the ``b - 1`` previous noise rows (``w_t = (z_t - sum_j c_j w_{t-j}) / c_0``), and a
  ``b``-banded ``C`` with participations ``b`` steps apart admits amplification by cyclic Poisson
  sampling (:func:`tf_dp.accounting.matrix_factorization.amplified_bandmf_epsilon`). ``b = 1`` is
  DP-SGD.
* :class:`BLTStrategy` (buffered linear Toeplitz; Dvijotham, McMahan, Pillutla, Steinke, Thakurta
  2024, Sec. 3): ``C^{-1}`` has first column ``1, sum_i omega_i theta_i^(k-1)`` (``k >= 1``), so
  its noise needs ``d`` model-sized buffers ``s_i`` (``w_t = z_t + sum_i omega_i s_i``,
  ``s_i <- theta_i s_i + z_t``), whatever the run's length.

As power series, ``C(x) = c_0 + c_1 x + ...``; a banded ``C`` is a polynomial and a BLT's
``C^{-1}(x) = 1 + sum_i omega_i x / (1 - theta_i x)`` a rational function ``P(x) / Q(x)`` with
``Q(x) = prod_i (1 - theta_i x)``, so every product with ``C`` or ``C^{-1}`` is a linear filter
(``scipy.signal.lfilter``): ``O(n * bands)`` or ``O(n * buffers)``, never an ``n x n`` matrix
(``matrix()`` builds one for checks and small runs).

Optimisation (``optimize``) chooses the coefficients for a workload ``A`` (prefix sums: SGD's
parameters; or momentum's weighted sums), minimising ``sens(C) * ||A C^{-1}||_F`` (the noise in
the workload at unit privacy: the loss is invariant to scaling ``C``), where ``sens`` is the
sensitivity under the run's participation (one participation, or every ``period``-th step).

Example:

>>> from tf_dp.correlated.strategies import BandedStrategy, BLTStrategy
>>> s = BandedStrategy.square_root(num_steps=100, bands=4)
>>> s.bands, s.noise_recurrence().coef.shape
(4, (100, 4))
>>> b = BLTStrategy.optimize(num_steps=100, buffers=2)
>>> b.noise_recurrence().omega.shape
(2,)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
from scipy import optimize as _opt
from scipy import signal, special

__all__ = [
    "BLTRecurrence",
    "BLTStrategy",
    "BandedRecurrence",
    "BandedStrategy",
    "TreeStrategy",
    "workload_column",
]

#: Longest run the optimisers handle (their cost is linear in it; the float64 filters stay exact).
MAX_STEPS = 100_000


@dataclasses.dataclass(frozen=True)
class BandedRecurrence:
    """``coef[t, j] = C[t, t - j]`` (``[n, b]``, zero where ``t - j < 0``); noise step ``t`` is
    ``w_t = (z_t - sum_{j >= 1} coef[t, j] w_{t-j}) / coef[t, 0]``."""

    coef: np.ndarray


@dataclasses.dataclass(frozen=True)
class BLTRecurrence:
    """``C^{-1}`` as a buffered linear Toeplitz: ``w_t = z_t + sum_i omega_i s_{i,t}``,
    ``s_{i,t+1} = theta_i s_{i,t} + z_t``, ``s_{i,0} = 0``."""

    omega: np.ndarray
    theta: np.ndarray


def _check_steps(num_steps: Any) -> int:
    if isinstance(num_steps, bool) or not isinstance(num_steps, (int, np.integer)) or not (
        1 <= num_steps <= MAX_STEPS
    ):
        raise ValueError(f"num_steps must be an integer in [1, {MAX_STEPS}], got {num_steps!r}")
    return int(num_steps)


def _impulse(n: int) -> np.ndarray:
    e = np.zeros(n)
    e[0] = 1.0
    return e


def workload_column(num_steps: int, workload: str = "prefix", momentum: float = 0.9) -> np.ndarray:
    """First column of the lower-triangular Toeplitz workload ``A``: ``prefix`` (all ones: the
    running sum, SGD's parameters) or ``momentum`` (``(1 - beta^(k+1)) / (1 - beta)``: SGD with
    heavy-ball momentum ``beta``)."""
    n = _check_steps(num_steps)
    if workload == "prefix":
        return np.ones(n)
    if workload == "momentum":
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum!r}")
        return (1.0 - momentum ** (np.arange(n) + 1.0)) / (1.0 - momentum)
    raise ValueError(f"workload must be 'prefix' or 'momentum', got {workload!r}")


def _toeplitz(column: np.ndarray) -> np.ndarray:
    n = len(column)
    idx = np.arange(n)[:, None] - np.arange(n)[None, :]
    return np.where(idx >= 0, column[np.clip(idx, 0, n - 1)], 0.0)


class _ToeplitzStrategy:
    """``C`` and ``C^{-1}`` as the filters ``num / den`` and ``den / num``."""

    num_steps: int

    def _filters(self) -> tuple[np.ndarray, np.ndarray]:  # C(x) = num(x) / den(x)
        raise NotImplementedError

    def toeplitz_filters(self) -> tuple[np.ndarray, np.ndarray, int]:
        """``(num, den, num_steps)``: ``C(x) = num(x) / den(x)`` (what the accountants of
        :mod:`tf_dp.accounting.matrix_factorization` use instead of a dense ``C``)."""
        num, den = self._filters()
        return num, den, self.num_steps

    def c_column(self, n: Optional[int] = None) -> np.ndarray:
        """First column of ``C`` (``n`` entries, default ``num_steps``)."""
        num, den = self._filters()
        return signal.lfilter(num, den, _impulse(n or self.num_steps))

    def c_inverse_column(self, n: Optional[int] = None) -> np.ndarray:
        """First column of ``C^{-1}``."""
        num, den = self._filters()
        return signal.lfilter(den, num, _impulse(n or self.num_steps))

    def matrix(self) -> np.ndarray:
        """``C``, dense ``[n, n]`` (for checks and the accountants on small runs)."""
        return _toeplitz(self.c_column())

    def inverse_matrix(self) -> np.ndarray:
        """``C^{-1}``, dense ``[n, n]``."""
        return _toeplitz(self.c_inverse_column())

    def sensitivity(self, period: Optional[int] = None) -> float:
        """``max ||C u||`` over the participations ``u`` of one record: one step (``period``
        None), or every ``period``-th step from any offset (see
        :func:`tf_dp.accounting.matrix_factorization.mf_sensitivity`, which this equals)."""
        return _filter_sensitivity(*self._filters(), self.num_steps, period)

    def workload_error(self, workload: str = "prefix", momentum: float = 0.9) -> float:
        """``||A C^{-1}||_F`` (at unit noise): the total noise the workload sees."""
        s = np.convolve(workload_column(self.num_steps, workload, momentum),
                        self.c_inverse_column())[: self.num_steps]
        return float(math.sqrt(np.sum((self.num_steps - np.arange(self.num_steps)) * s * s)))


def _filter_sensitivity(num, den, n: int, period: Optional[int]) -> float:
    if period is None:  # one participation: the largest column norm is the first column's
        return float(np.linalg.norm(signal.lfilter(num, den, _impulse(n))))
    if isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1:
        raise ValueError(f"period must be None or an integer >= 1, got {period!r}")
    # C is Toeplitz: C u_j (ones at j, j + p, ...) is C u_0 shifted down by j and truncated, so
    # offset 0 has the largest norm (O(n * bands))
    u = np.zeros(n)
    u[::int(period)] = 1.0
    return float(np.linalg.norm(signal.lfilter(num, den, u)))


def _sqrt_coefficients(n: int) -> np.ndarray:
    """``binom(2k, k) / 4^k``: the Toeplitz square root of the prefix-sum matrix."""
    k = np.arange(n)
    return np.exp(special.gammaln(2 * k + 1) - 2 * special.gammaln(k + 1) - k * math.log(4))


class BandedStrategy(_ToeplitzStrategy):
    """A ``b``-banded lower-triangular Toeplitz ``C`` (diagonals ``c_0 .. c_{b-1}``, ``c_0 > 0``).

    Args:
      coefficients: ``c_0 .. c_{b-1}`` (``b >= 1``, finite, ``c_0 > 0``).
      num_steps: ``n``, the run's steps (``b <= n``).

    Example: ``BandedStrategy.optimize(num_steps=1000, bands=8)``.
    """

    def __init__(self, coefficients: Any, num_steps: int):
        c = np.asarray(coefficients, np.float64).reshape(-1)
        self.num_steps = _check_steps(num_steps)
        if not (1 <= len(c) <= self.num_steps) or not np.all(np.isfinite(c)) or c[0] <= 0:
            raise ValueError(
                f"coefficients must be 1 to num_steps={self.num_steps} finite numbers with "
                f"c_0 > 0, got {c.tolist()[:8]}"
            )
        self.coefficients = c

    @property
    def bands(self) -> int:
        return len(self.coefficients)

    def _filters(self):
        return self.coefficients, np.ones(1)

    @classmethod
    def square_root(cls, num_steps: int, bands: int) -> BandedStrategy:
        """The prefix-sum matrix's Toeplitz square root cut to ``bands`` diagonals (the banded
        square root of Choquette-Choo et al. 2023; ``bands = num_steps``: ``C C = A``)."""
        n = _check_steps(num_steps)
        b = _check_bands(bands, n)
        return cls(_sqrt_coefficients(b), n)

    @classmethod
    def optimize(cls, num_steps: int, bands: int, workload: str = "prefix",
                 momentum: float = 0.9, period: Optional[int] = None,
                 max_iterations: int = 200) -> BandedStrategy:
        """The ``bands``-banded Toeplitz ``C`` minimising ``sens(C, period) * ||A C^{-1}||_F``
        for the workload (``prefix`` or ``momentum``), from the banded square root (L-BFGS over
        ``c_1 .. c_{b-1}``, ``c_0 = 1``); never worse than that start."""
        start = cls.square_root(num_steps, bands)
        if start.bands == 1:
            return start
        n = start.num_steps

        def loss(v):
            s = cls(np.r_[1.0, v], n)
            return s.sensitivity(period) * s.workload_error(workload, momentum)

        v0 = start.coefficients[1:]
        res = _opt.minimize(loss, v0, method="L-BFGS-B", options={"maxiter": max_iterations})
        best = res.x if np.isfinite(res.fun) and res.fun < loss(v0) else v0
        return cls(np.r_[1.0, best], n)

    def noise_recurrence(self) -> BandedRecurrence:
        n, b = self.num_steps, self.bands
        coef = np.tile(self.coefficients, (n, 1))
        coef[np.arange(n)[:, None] < np.arange(b)[None, :]] = 0.0
        return BandedRecurrence(coef=coef)

    def to_config(self) -> dict:
        return {"kind": "banded", "coefficients": self.coefficients.tolist(),
                "num_steps": self.num_steps}

    @classmethod
    def from_config(cls, config: dict) -> BandedStrategy:
        return cls(config["coefficients"], config["num_steps"])


def _check_bands(bands: Any, n: int) -> int:
    if isinstance(bands, bool) or not isinstance(bands, (int, np.integer)) or not 1 <= bands <= n:
        raise ValueError(f"bands must be an integer in [1, num_steps={n}], got {bands!r}")
    return int(bands)


class BLTStrategy(_ToeplitzStrategy):
    """``C^{-1}`` a buffered linear Toeplitz: first column ``1, sum_i omega_i theta_i^(k-1)``.

    Args:
      omega, theta: ``d`` output weights and decay rates (``|theta_i| < 1``).
      num_steps: ``n``, the run's steps.

    Example: ``BLTStrategy.optimize(num_steps=2000, buffers=4)``.
    """

    def __init__(self, omega: Any, theta: Any, num_steps: int):
        self.omega = np.asarray(omega, np.float64).reshape(-1)
        self.theta = np.asarray(theta, np.float64).reshape(-1)
        self.num_steps = _check_steps(num_steps)
        if len(self.omega) != len(self.theta) or not len(self.omega):
            raise ValueError("omega and theta must have the same number (>= 1) of buffers")
        if not (np.all(np.isfinite(self.omega)) and np.all(np.abs(self.theta) < 1.0)):
            raise ValueError("omega must be finite and every |theta_i| < 1")

    @property
    def buffers(self) -> int:
        return len(self.omega)

    def _filters(self):
        # C^{-1}(x) = P(x) / Q(x): Q = prod (1 - theta_i x), P = Q + sum_i omega_i x prod_{j != i}
        q = np.ones(1)
        for t in self.theta:
            q = np.convolve(q, [1.0, -t])
        p = q.copy()
        for i, w in enumerate(self.omega):
            rest = np.ones(1)
            for j, t in enumerate(self.theta):
                if j != i:
                    rest = np.convolve(rest, [1.0, -t])
            p[1:] += w * rest  # x * prod_{j != i} (1 - theta_j x): degrees 1 .. d
        return q, p  # C = Q / P

    @classmethod
    def optimize(cls, num_steps: int, buffers: int, workload: str = "prefix",
                 momentum: float = 0.9, period: Optional[int] = None,
                 max_iterations: int = 200) -> BLTStrategy:
        """A ``buffers``-buffer BLT minimising ``sens(C, period) * ||A C^{-1}||_F``: a
        least-squares fit of ``C^{-1}``'s column to the inverse square root's (decay rates spread
        on a log scale), then L-BFGS over ``omega`` and ``theta``."""
        n = _check_steps(num_steps)
        if isinstance(buffers, bool) or not isinstance(buffers, (int, np.integer)) or not (
            1 <= buffers <= 32
        ):
            raise ValueError(f"buffers must be an integer in [1, 32], got {buffers!r}")
        d = int(buffers)
        lag = np.arange(1, max(n, 2))
        target = np.cumprod((lag - 1.5) / lag)  # (1 - x)^(1/2): the inverse square root's lags
        theta0 = np.minimum(1.0 - np.geomspace(0.5, 2.0 / max(n, 4), d), 0.999)
        basis = theta0[None, :] ** (lag - 1)[:, None]
        omega0 = np.linalg.lstsq(basis, target, rcond=None)[0]

        def unpack(v):
            return v[:d], 0.9999 / (1.0 + np.exp(-v[d:]))

        def loss(v):
            omega, theta = unpack(v)
            s = cls(omega, theta, n)
            with np.errstate(over="ignore", invalid="ignore"):  # an unstable C: rejected
                value = s.sensitivity(period) * s.workload_error(workload, momentum)
            return value if np.isfinite(value) else 1e300

        v0 = np.r_[omega0, np.log(theta0 / (0.9999 - theta0))]
        res = _opt.minimize(loss, v0, method="L-BFGS-B", options={"maxiter": max_iterations})
        v = res.x if res.fun < loss(v0) else v0
        return cls(*unpack(v), n)

    def noise_recurrence(self) -> BLTRecurrence:
        return BLTRecurrence(omega=self.omega.copy(), theta=self.theta.copy())

    def to_config(self) -> dict:
        return {"kind": "blt", "omega": self.omega.tolist(), "theta": self.theta.tolist(),
                "num_steps": self.num_steps}

    @classmethod
    def from_config(cls, config: dict) -> BLTStrategy:
        return cls(config["omega"], config["theta"], config["num_steps"])


class TreeStrategy:
    """The binary tree of DP-FTRL (tf_dp's tree aggregation, Kairouz et al. 2021) as a
    factorization ``A = B C`` of the prefix sums: ``C`` has one row per released node (the
    dyadic intervals ``[i 2^l, (i + 1) 2^l)`` that end by step ``num_steps``, at the levels ``l``
    with ``2^l <= num_steps``: what tree aggregation noises) and one column per step; ``B``
    (:meth:`decoder`) adds the nodes of each prefix's dyadic decomposition. ``C`` is not square,
    so it has no Toeplitz filter; :func:`tf_dp.accounting.matrix_factorization.mf_sensitivity`
    and ``mf_epsilon`` read it dense (a leaf lies in ``floor(log2 n) + 1`` nodes: one
    participation has sensitivity ``sqrt(floor(log2 n) + 1)``, the tree accountant's).

    Example:

    >>> from tf_dp.correlated.strategies import TreeStrategy
    >>> TreeStrategy(6).matrix().shape  # 6 leaves, 3 pairs, 1 node of 4
    (10, 6)
    """

    def __init__(self, num_steps: int):
        self.num_steps = _check_steps(num_steps)

    def nodes(self) -> list[tuple[int, int]]:
        """``(level, index)`` of each released node, level by level."""
        n = self.num_steps
        return [(lvl, i) for lvl in range(n.bit_length()) for i in range(n >> lvl)]

    def matrix(self) -> np.ndarray:
        """``C``: ``[nodes, num_steps]``, 1 where the node's interval holds the step."""
        nodes = self.nodes()
        c = np.zeros((len(nodes), self.num_steps))
        for row, (lvl, i) in enumerate(nodes):
            c[row, i << lvl:(i + 1) << lvl] = 1.0
        return c

    def decoder(self) -> np.ndarray:
        """``B``: ``[num_steps, nodes]``, row ``t`` sums the nodes of the dyadic decomposition of
        ``[0, t]`` (what tree aggregation releases as the prefix sum), so ``B C = A``."""
        index = {node: row for row, node in enumerate(self.nodes())}
        b = np.zeros((self.num_steps, len(index)))
        for t in range(self.num_steps):
            start, count = 0, t + 1
            for lvl in reversed(range(count.bit_length())):
                if count >> lvl & 1:
                    b[t, index[(lvl, start >> lvl)]] = 1.0
                    start += 1 << lvl
        return b


def from_config(config: dict) -> Any:
    """The strategy a ``to_config()`` dict describes."""
    kinds = {"banded": BandedStrategy, "blt": BLTStrategy}
    if not isinstance(config, dict) or config.get("kind") not in kinds:
        raise ValueError(f"config must be a strategy's to_config() dict, got {config!r}")
    return kinds[config["kind"]].from_config(config)
