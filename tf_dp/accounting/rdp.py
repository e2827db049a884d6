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

Example:

>>> from tf_dp.accounting import rdp
>>> orders = rdp.DEFAULT_ORDERS
>>> curve = rdp.rdp_poisson_gaussian(q=0.01, noise_multiplier=4.0, orders=orders) * 10000
>>> eps, order = rdp.epsilon_from_rdp(orders, curve, delta=1e-5)
>>> round(eps, 4), order
(1.0355, 17.0)
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
from scipy import special

__all__ = [
    "DEFAULT_ORDERS",
    "MOMENTS_ORDERS",
    "rdp_poisson_gaussian",
    "rdp_gaussian",
    "rdp_curve",
    "rdp_epsilon",
    "rdp_delta",
    "epsilon_from_rdp",
    "delta_from_rdp",
    "ComposedRdp",
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


def _log_abs_binom(a, k: np.ndarray) -> np.ndarray:
    """log |C(a, k)| for real a (a scalar, or a column of orders) and integer k >= 0 (gammaln
    gives log|Gamma|)."""
    return special.gammaln(a + 1.0) - special.gammaln(k + 1.0) - special.gammaln(a - k + 1.0)


def _logsumexp_rows(x: np.ndarray) -> np.ndarray:
    """``log(sum(exp(x), axis=1))`` of a 2-d array, stable (rows of ``-inf`` give ``-inf``);
    :func:`scipy.special.logsumexp` without its per-call overhead (it runs once per block of
    series terms)."""
    m = np.max(x, axis=1)
    m = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):
        return np.log(np.sum(np.exp(x - m[:, None]), axis=1)) + m


def _log_ndtr_upper(x: np.ndarray) -> np.ndarray:
    """Cheap upper bound on ``log Phi(x)``: ``0``, and for ``x < -1`` the Mills-ratio bound
    ``Phi(x) <= phi(x) / |x|``."""
    with np.errstate(divide="ignore", invalid="ignore"):
        mills = -0.5 * x * x - 0.5 * math.log(2.0 * math.pi) - np.log(-x)
    return np.where(x < -1.0, np.minimum(mills, 0.0), 0.0)


#: A term of a log-moment series below this (log scale) is negligible: ``A_a >= 1`` (Renyi
#: divergences are >= 0), so it is below 1e-19 of the sum. Such terms keep their cheap upper bound
#: instead of the exact Gaussian tail, so the series stays an upper bound.
_NEGLIGIBLE = -45.0


def _log_a_integer(log_q: np.ndarray, log_1mq: np.ndarray, inv2s2: np.ndarray, a: np.ndarray
                   ) -> np.ndarray:
    """``log A_a`` of the finite binomial sum, one evaluation for many (unit, integer order)
    pairs: ``a[i]`` is the order of pair ``i`` (the other arrays its unit's values); terms
    ``k > a[i]`` are left out. Pairs are taken by increasing order in blocks of ~4e6 terms."""
    a = np.asarray(a, dtype=np.float64)
    out = np.empty(a.size)
    by_order = np.argsort(a, kind="stable")
    i = 0
    while i < a.size:
        rest = by_order[i:]
        fits = (np.arange(1, rest.size + 1) * (a[rest] + 1.0)) <= 4_000_000
        sl = rest[:max(1, int(np.count_nonzero(fits)))]
        aa = a[sl, None]
        k = np.arange(int(a[sl].max()) + 1, dtype=np.float64)
        with np.errstate(invalid="ignore"):
            terms = (_log_abs_binom(aa, k) + k * log_q[sl, None] + (aa - k) * log_1mq[sl, None]
                     + (k * k - k) * inv2s2[sl, None])
        out[sl] = _logsumexp_rows(np.where(k <= aa, terms, -np.inf))
        i += sl.size
    return out


def _series_side(lb, k, p_log, c_log, quad, tail_arg):
    """Terms ``lb + k p_log + (a-k) c_log + quad + log Phi(tail_arg)``, with the exact Gaussian
    tail only where the term could matter (elsewhere its upper bound)."""
    terms = lb + p_log + c_log + quad
    ub = terms + _log_ndtr_upper(tail_arg)
    need = ub > _NEGLIGIBLE
    if np.any(need):
        ub[need] = terms[need] + special.log_ndtr(tail_arg[need])
    return ub


def _log_a_fractional(log_q: np.ndarray, log_1mq: np.ndarray, s: np.ndarray, a,
                      max_terms: int = 100_000) -> np.ndarray:
    """``log A_a`` for fractional orders, one evaluation for many (unit, order) pairs: ``a`` is
    the order of each pair (or one order for all), the other arrays its unit's values (Mironov,
    Talwar & Zhang 2019, Sec. 3.3): both halves of the integral, split at ``z0``, expanded in
    binomial series whose terms are summed in absolute value (an upper bound). The pairs share
    the blocks of terms ``k``; each stops on its own test below, so its value does not depend on
    the other pairs.

    A unit stops at ``K`` terms once the certified bound on the rest of both series
    (:func:`_log_tail_bound`) is below ``1e-7`` of ``log A_a``, and the bound is added; or (where
    that bound does not apply yet, ``K`` below the split point) once its last terms are
    decreasing and below ``1e-17`` of its sum. A unit still running after ``max_terms`` terms
    gets ``inf`` unless the tail bound applies."""
    n = log_q.size
    a = np.broadcast_to(np.asarray(a, dtype=np.float64), (n,))
    # |C(a, k)| depends on the order only: evaluated once per distinct order and block
    orders, which = np.unique(a, return_inverse=True)
    which = which.ravel()
    total = np.full(n, -np.inf)
    active = np.arange(n)
    # Split point where q N(1, s^2) and (1-q) N(0, s^2) have equal density.
    z0 = s * s * (log_1mq - log_q) + 0.5
    inv2s2 = 0.5 / (s * s)
    chunk = 16
    start = 0
    while active.size:
        k = np.arange(start, start + chunk, dtype=np.float64)
        aa = a[active, None]
        lb = _log_abs_binom(orders[:, None], k)[which[active]]
        j = aa - k
        lq, l1 = log_q[active, None], log_1mq[active, None]
        ss, zz, w = s[active, None], z0[active, None], inv2s2[active, None]
        # Left half (x <= z0): powers of the smaller q-component; right half: of the other.
        left = _series_side(lb, k, k * lq, j * l1, (k * k - k) * w, (zz - k) / ss)
        right = _series_side(lb, k, j * lq, k * l1, (j * j - j) * w, (j - zz) / ss)
        block = _logsumexp_rows(np.concatenate([left, right], axis=1))
        new_total = np.logaddexp(total[active], block)
        start += chunk
        tail = _log_tail_bound(a[active], start, log_1mq[active], s[active], z0[active])
        last = np.maximum(left[:, -1], right[:, -1])
        small = ((start - 1 > a[active] + 1) & (last < new_total - 40)
                 & (left[:, -1] < left[:, -2]) & (right[:, -1] < right[:, -2]))
        # The rest is below 1e-7 of log A_a (~ A_a - 1, small for small divergences).
        with np.errstate(divide="ignore", invalid="ignore"):
            certified = tail < np.log(np.expm1(np.minimum(new_total, 700.0))) - 16.0
        final = start >= max_terms
        done = certified | small | final
        with_tail = done & np.isfinite(tail)
        new_total[with_tail] = np.logaddexp(new_total[with_tail], tail[with_tail])
        new_total[final & ~certified & ~small & ~np.isfinite(tail)] = np.inf
        total[active] = new_total
        active = active[~done]
        chunk = min(2 * chunk, 8192)  # slowly converging units: fewer, larger blocks
    return total


def _log_tail_bound(a: np.ndarray, K: int, log_1mq: np.ndarray, s: np.ndarray, z0: np.ndarray
                    ) -> np.ndarray:
    """log of an upper bound on the sum of the absolute terms ``k >= K`` of both series of
    :func:`_log_a_fractional` (``inf`` where it does not apply: ``K <= a + 1`` or ``K`` not past
    the split point).

    With the Mills-ratio bound ``Phi(-x) <= phi(x) / x``, each term ``k`` of the left series is at
    most ``|C(a, k)| (1-q)^a exp(-z0^2 / 2s^2) / (sqrt(2 pi) (k - z0) / s)`` (the powers of
    ``q``, ``1-q`` and the Gaussian exponents cancel exactly, by the choice of ``z0``), and of
    the right series the same with ``k - a + z0`` in place of ``k - z0``. For ``k >= K > a + 1``,
    ``|C(a, k)| <= |C(a, K)| ((K+1) / (k+1))^(a+1)`` (each ratio is ``1 - (a+1)/(i+1) <=
    exp(-(a+1)/(i+1))``), and ``sum_{k >= K} ((K+1)/(k+1))^(a+1) <= 1 + (K+1)/a``."""
    d_left, d_right = K - z0, K - a + z0
    ok = (K > a + 1) & (d_left > 0) & (d_right > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_c = (a * log_1mq - z0 * z0 / (2.0 * s * s) - 0.5 * math.log(2.0 * math.pi)
                 + np.log(s))
        val = (_log_abs_binom(a, float(K)) + np.log1p((K + 1.0) / a)
               + log_c + np.log(1.0 / d_left + 1.0 / d_right))
    return np.where(ok, val, np.inf)


def _prepare_units(q, s):
    q = np.asarray(q, dtype=np.float64).ravel()
    s = np.asarray(s, dtype=np.float64).ravel()
    if q.shape != s.shape:
        raise ValueError("q and noise_multiplier must have the same length")
    if q.size and not (np.all((q >= 0) & (q <= 1)) and np.all(s >= 0)):
        raise ValueError("q must be in [0, 1] and noise_multipliers >= 0")
    return q, s


def _rdp_matrix(q: np.ndarray, s: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """``R(a)`` for every unit (rows) and order (columns), vectorised over the units."""
    out = np.zeros((q.size, orders.size))
    gauss = (q == 1.0) & (s > 0)
    inf = (q > 0) & (s == 0)
    sub = (q > 0) & (q < 1) & (s > 0) & np.isfinite(s)
    with np.errstate(divide="ignore"):
        out[gauss] = orders[None, :] / (2.0 * s[gauss, None] ** 2)
    out[inf] = np.inf
    if np.any(sub):
        qs, ss = q[sub], s[sub]
        log_q, log_1mq = np.log(qs), np.log1p(-qs)
        inv2s2 = 0.5 / (ss * ss)
        frac = np.array([not float(a).is_integer() for a in orders], dtype=bool)
        # log A_a at every integer order needed (the integer orders, and the neighbours of the
        # fractional ones for their chord below), all in one evaluation; log A_1 = 0.
        ints = np.unique(np.concatenate([orders[~frac], np.floor(orders[frac]),
                                         np.ceil(orders[frac])]))
        ints = ints[ints > 1]
        n = qs.size
        unit = np.tile(np.arange(n), ints.size)
        vals = _log_a_integer(log_q[unit], log_1mq[unit], inv2s2[unit], np.repeat(ints, n))
        integer = {1: np.zeros(n)}
        integer.update({int(a): vals[j * n:(j + 1) * n] for j, a in enumerate(ints)})
        log_a = np.empty((n, orders.size))
        for i in np.nonzero(~frac)[0]:
            log_a[:, i] = integer[int(orders[i])]
        fo = orders[frac]
        if fo.size:
            # log A_a is convex in a (a log moment generating function), so it lies below its
            # chord between the neighbouring integer orders: a valid upper bound, used where it is
            # below the series (which is slow and loose for q near 1, a near 1).
            lo, hi = np.floor(fo), np.ceil(fo)
            chord = np.stack([(h - a) * integer[int(l)] + (a - l) * integer[int(h)]
                              for a, l, h in zip(fo, lo, hi)], axis=1)
            # The series for all (unit, order) pairs at once, in groups of at most
            # max(units, 2048) pairs (bounding the memory of slowly converging pairs).
            series = np.empty((n, fo.size))
            per = max(1, 2048 // n)
            for g in range(0, fo.size, per):
                go = fo[g:g + per]
                unit = np.tile(np.arange(n), go.size)
                v = _log_a_fractional(log_q[unit], log_1mq[unit], ss[unit], np.repeat(go, n))
                series[:, g:g + go.size] = v.reshape(go.size, n).T
            log_a[:, frac] = np.minimum(series, chord)
        cols = np.maximum(log_a / (orders[None, :] - 1.0), 0.0)
        out[sub] = cols
    return out


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

    Example: ``rdp_poisson_gaussian(0.01, 1.1) * 1000`` is the curve of 1000 steps.
    """
    _check_q_sigma(q, noise_multiplier)
    arr = _check_orders(orders)
    return _rdp_matrix(np.array([float(q)]), np.array([float(noise_multiplier)]), arr)[0]


def _unique_units(q, s, counts):
    q, s = _prepare_units(q, s)
    c = np.asarray(counts, dtype=np.float64).ravel()
    if c.shape != q.shape or np.any(c < 0):
        raise ValueError("counts must be >= 0, one per unit")
    keep = (c > 0) & (q > 0) & ~np.isinf(s)  # these spend nothing
    q, s, c = q[keep], s[keep], c[keep]
    if q.size == 0:
        return q, s, c
    pairs, inverse = np.unique(np.stack([q, s], axis=1), axis=0, return_inverse=True)
    return pairs[:, 0], pairs[:, 1], np.bincount(inverse.ravel(), weights=c)


def rdp_curve(
    q: Sequence[float], noise_multipliers: Sequence[float], counts: Sequence[float],
    orders: Sequence[float] = DEFAULT_ORDERS,
) -> np.ndarray:
    """Composed RDP curve of ``counts[i]`` steps with rate ``q[i]`` and noise ``noise_multipliers[i]``.

    Identical ``(q, noise)`` pairs are merged and every order is computed for all distinct pairs
    at once (numpy arrays over the pairs).

    Example: ``rdp_curve([0.01, 0.02], [1.0, 2.0], [500, 300])``.
    """
    arr = _check_orders(orders)
    q, s, c = _unique_units(q, noise_multipliers, counts)
    if q.size == 0:
        return np.zeros(arr.size)
    with np.errstate(invalid="ignore"):
        return np.nan_to_num(c @ _rdp_matrix(q, s, arr), nan=np.inf)


def _conversion_values(a: np.ndarray, r: np.ndarray, target: float, what: str, conversion: str
                       ) -> np.ndarray:
    """Per order: the epsilon (``what="epsilon"``, ``target`` = delta) or the log delta
    (``what="delta"``, ``target`` = epsilon) the curve value ``r`` implies; each is
    non-decreasing in ``r``."""
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        if what == "epsilon":
            if conversion == "moments":
                v = r + math.log(1.0 / target) / (a - 1.0)
            elif conversion == "rdp":
                v = r + np.log1p(-1.0 / a) - (math.log(target) + np.log(a)) / (a - 1.0)
                # KL route: delta >= sqrt(1 - exp(-R)) already gives eps = 0.
                v = np.where(target**2 + np.expm1(-r) > 0, 0.0, v)
            else:
                raise ValueError(f"conversion must be 'rdp' or 'moments', got {conversion!r}")
        else:
            if conversion == "moments":
                v = (a - 1.0) * (r - target)
            elif conversion == "rdp":
                v = (a - 1.0) * (r - target + np.log1p(-1.0 / a)) - np.log(a)
                kl = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf)
                v = np.minimum(v, kl)
            else:
                raise ValueError(f"conversion must be 'rdp' or 'moments', got {conversion!r}")
    return np.where(np.isnan(v), np.inf, v)


def _log_moment_lower_bounds(orders: np.ndarray, known: dict) -> np.ndarray:
    """Lower bounds on ``f(a) = (a - 1) R(a)`` (the log moment ``log A_a`` of the composition)
    at ``orders`` from its values at the ``known`` orders, by convexity: ``f`` is a log moment
    generating function of the privacy loss, hence convex in ``a``, and ``f(1) = 0``; so beyond
    two known points ``f`` lies above the line through them. Also ``f >= 0``."""
    pts = sorted([(1.0, 0.0)] + [(a, v) for a, v in known.items()])
    xs = np.array([p[0] for p in pts])
    fs = np.array([p[1] for p in pts])
    lb = np.zeros(orders.size)
    pos = np.searchsorted(xs, orders)  # xs[pos - 1] < a < xs[pos]
    last = xs.size - 1
    with np.errstate(invalid="ignore", over="ignore"):
        for i0 in (pos - 2, pos):  # the two known points left of a, the two right of a
            ok = (i0 >= 0) & (i0 + 1 <= last)
            j0, j1 = np.clip(i0, 0, last), np.clip(i0 + 1, 0, last)
            f0, f1 = fs[j0], fs[j1]
            ok &= np.isfinite(f0) & np.isfinite(f1) & (xs[j1] > xs[j0])
            line = f0 + (f1 - f0) / np.where(ok, xs[j1] - xs[j0], 1.0) * (orders - xs[j0])
            lb = np.where(ok & np.isfinite(line), np.maximum(lb, line), lb)
    return lb


def _kl_lower_bound(q: np.ndarray, s: np.ndarray) -> np.ndarray:
    """A lower bound on ``KL(mu || mu0)`` per unit (the Renyi divergence at order 1, below every
    order's): by data processing, the binary KL of the event ``{x > t}`` (best of a few
    thresholds ``t``), minus a round-off allowance."""
    out = np.zeros(q.size)
    for t in (0.5, 1.0, 2.0):
        with np.errstate(divide="ignore", invalid="ignore"):
            r = special.ndtr(-t / s)
            p = (1.0 - q) * r + q * special.ndtr((1.0 - t) / s)
            kl = special.rel_entr(p, r) + special.rel_entr(1.0 - p, 1.0 - r)
        out = np.maximum(out, np.nan_to_num(kl - 1e-15, nan=0.0, posinf=0.0))
    return np.maximum(out, 0.0)


def _optimise_orders(q, s, counts, orders, target, what, conversion):
    """Best order for the composed curve, evaluating only the orders that can be best.

    A few orders (geometrically spaced, the cheapest) are evaluated first; convexity of the log
    moment (:func:`_log_moment_lower_bounds`) then gives a lower bound on the value at every other
    order, and only the orders whose bound beats the best value so far are evaluated (a few at a
    time, best bound first), until none is left. The result is the optimum over all of
    ``orders`` as the full evaluation would find it, and a valid bound in any case (every order
    gives one)."""
    arr = _check_orders(orders)
    q, s, c = _unique_units(q, s, counts)
    if q.size == 0:
        v = _conversion_values(arr, np.zeros(arr.size), target, what, conversion)
        i = int(np.argmin(v))
        return float(v[i]), float(arr[i])
    known: dict = {}

    def evaluate(sub):
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(c @ _rdp_matrix(q, s, sub), nan=np.inf)

    return _search_orders(np.unique(arr), known, float(c @ _kl_lower_bound(q, s)), evaluate,
                          target, what, conversion)


def _seed_orders(uniq: np.ndarray) -> np.ndarray:
    """Orders spaced by a factor >= 1.5 up to 64 (integers preferred: finite sums)."""
    seed, last = [], 0.0
    for i, a in enumerate(uniq):
        if a <= 64 and (not seed or a >= 1.5 * last) and a.is_integer():
            seed.append(i)
            last = a
    if len(seed) < 2:
        seed = list(range(min(2, uniq.size)))
    return uniq[np.array(seed)]


def _search_orders(uniq, known, kl_lb, evaluate, target, what, conversion, stop_at=None):
    """The order search of :func:`_optimise_orders` on a composed curve known at the orders of
    ``known`` (order -> value, updated in place); ``evaluate(orders)`` gives the curve at more
    orders and ``kl_lb`` is a lower bound on the curve at every order. With ``stop_at``, the
    search stops once an order gives a value ``<= stop_at`` (the optimum is then below it
    too) and returns that value."""

    def add(sub):
        for a, r in zip(sub, evaluate(sub)):
            known[float(a)] = r

    if not known:
        add(_seed_orders(uniq))
    while True:
        ks = np.array(sorted(known))
        vals = _conversion_values(ks, np.array([known[a] for a in ks]), target, what, conversion)
        best = float(np.min(vals))
        if stop_at is not None and best <= stop_at:
            break
        rest = np.array([i for i, a in enumerate(uniq) if float(a) not in known], dtype=int)
        if rest.size == 0:
            break
        a_rest = uniq[rest]
        f_lb = _log_moment_lower_bounds(a_rest, {a: known[a] * (a - 1.0) for a in known})
        r_lb = np.maximum(f_lb / (a_rest - 1.0), kl_lb)
        lb = _conversion_values(a_rest, r_lb, target, what, conversion)
        cand = np.nonzero(lb < best - 1e-12 * abs(best))[0]
        if cand.size == 0:
            break
        add(uniq[rest[cand[np.argsort(lb[cand])[:8]]]])
    ks = np.array(sorted(known))
    vals = _conversion_values(ks, np.array([known[a] for a in ks]), target, what, conversion)
    i = int(np.argmin(vals))
    return float(vals[i]), float(ks[i])


class ComposedRdp:
    """A composition of Poisson-subsampled Gaussian steps that grows: :meth:`add` steps, ask
    :meth:`epsilon` (optionally with further steps), at a cost proportional to the steps added
    and the orders looked at, not to all the steps so far.

    The composed curve is kept at the orders evaluated so far; the order search is that of
    :func:`rdp_epsilon` (the same epsilon, up to round-off): an order not kept yet is evaluated
    over every unit only when its convexity bound says it may be the best.

    Example::

        acc = ComposedRdp(delta=1e-5)
        acc.add([0.01], [1.1], [1000])
        acc.epsilon([0.01], [1.2], [1])   # epsilon after one more step with noise 1.2
    """

    def __init__(self, delta: float, orders: Sequence[float] = DEFAULT_ORDERS,
                 conversion: str = "rdp"):
        _check_delta(delta)
        self.delta = float(delta)
        self.conversion = conversion
        self._uniq = np.unique(_check_orders(orders))
        self._q = np.zeros(0)
        self._s = np.zeros(0)
        self._c = np.zeros(0)
        self._known: dict = {}  # order -> composed R(a) of the added units
        self._kl = 0.0
        # (q, s) -> {order: R(a)} of the units asked about or announced (:meth:`prefetch`) since
        # the last announcement: a step asked about before it runs is added without evaluating
        # it again
        self._pending: dict = {}

    def _unit_curves(self, q, s, orders) -> np.ndarray:
        """``R(a)`` of each unit (rows) at ``orders``, from the pending units' values. Orders a
        pending unit lacks are evaluated for every pending unit lacking them, in one call."""
        keys = list(zip(q.tolist(), s.tolist()))
        if len(self._pending) > 4096:
            self._pending.clear()
        for k in keys:
            self._pending.setdefault(k, {})
        if any(a not in self._pending[k] for k in keys for a in orders):
            self._evaluate_pending(orders)
        return (np.array([[self._pending[k][a] for a in orders] for k in keys])
                if orders else np.zeros((q.size, 0)))

    def _evaluate_pending(self, orders) -> None:
        rows = [k for k, known in self._pending.items() if any(a not in known for a in orders)]
        if not rows:
            return
        missing = sorted({a for k in rows for a in orders if a not in self._pending[k]})
        pq, ps = (np.array(v, dtype=np.float64) for v in zip(*rows))
        with np.errstate(invalid="ignore"):
            m = np.nan_to_num(_rdp_matrix(pq, ps, np.asarray(missing, float)), nan=np.inf)
        for i, k in enumerate(rows):
            self._pending[k].update(zip(missing, m[i].tolist()))

    def prefetch(self, q: Sequence[float], noise_multipliers: Sequence[float]) -> None:
        """Announces the steps that will be asked about or added next (e.g. the next steps of a
        clip schedule): their ``R(a)`` at the orders kept so far is evaluated now, for all of
        them in one call, and looked up (by value) when they are. The values kept are those of
        the steps last announced (older ones are dropped).

        Example::

            acc.prefetch([0.01] * 64, noise_of_the_next_64_steps)
            acc.epsilon([0.01], noise_of_the_next_64_steps[:1], [1])  # no new RDP evaluation
        """
        uq, us, _ = _unique_units(q, noise_multipliers, np.ones(len(q)))
        old = self._pending
        self._pending = {k: old.get(k, {}) for k in zip(uq.tolist(), us.tolist())}
        self._evaluate_pending(sorted(self._known))

    def _curve(self, q, s, c, orders) -> np.ndarray:
        if q.size == 0:
            return np.zeros(len(orders))
        with np.errstate(invalid="ignore"):
            return np.nan_to_num(c @ _rdp_matrix(q, s, np.asarray(orders, float)), nan=np.inf)

    def add(self, q: Sequence[float], noise_multipliers: Sequence[float],
            counts: Sequence[float]) -> None:
        """Composes ``counts[i]`` steps of rate ``q[i]`` and noise ``noise_multipliers[i]``."""
        q, s, c = _unique_units(q, noise_multipliers, counts)
        if q.size == 0:
            return
        ks = sorted(self._known)
        for a, r in zip(ks, c @ self._unit_curves(q, s, ks)):
            self._known[a] += r
        self._kl += float(c @ _kl_lower_bound(q, s))
        self._q = np.concatenate([self._q, q])
        self._s = np.concatenate([self._s, s])
        self._c = np.concatenate([self._c, c])

    def epsilon(self, q: Sequence[float] = (), noise_multipliers: Sequence[float] = (),
                counts: Sequence[float] = (), at_most: Optional[float] = None) -> float:
        """Epsilon at ``delta`` of the added steps followed by the given ones (not added).

        With ``at_most``, the order search stops at the first order whose epsilon is
        ``<= at_most``, and returns that epsilon (an upper bound, ``<= at_most``, on the
        optimum); above ``at_most`` the result is the optimum. A budget check
        (``epsilon(..., at_most=target) <= target``) is decided with the same answer as with
        the optimum, looking at fewer orders while the budget is far.

        Example::

            acc.epsilon([0.01], [1.2], [1], at_most=3.0) <= 3.0   # one more step fits in 3.0
        """
        uq, us, uc = _unique_units(q, noise_multipliers, counts)
        if self._q.size == 0 and uq.size == 0:
            return 0.0
        ks = sorted(self._known)
        extra = dict(zip(ks, uc @ self._unit_curves(uq, us, ks))) if uq.size else {}
        total = {a: self._known[a] + extra.get(a, 0.0) for a in ks}

        def evaluate(sub):
            mine = self._curve(self._q, self._s, self._c, sub)
            for a, r in zip(sub, mine):  # kept for later calls
                self._known[float(a)] = r
            if not uq.size:
                return mine
            return mine + uc @ self._unit_curves(uq, us, [float(a) for a in sub])

        kl = self._kl + (float(uc @ _kl_lower_bound(uq, us)) if uq.size else 0.0)
        eps, _ = _search_orders(self._uniq, total, kl, evaluate, self.delta, "epsilon",
                                self.conversion, stop_at=at_most)
        return max(0.0, eps)


def rdp_epsilon(
    q: Sequence[float], noise_multipliers: Sequence[float], counts: Sequence[float],
    delta: float, orders: Sequence[float] = DEFAULT_ORDERS, conversion: str = "rdp",
) -> tuple[float, float]:
    """``(epsilon, optimal_order)`` of the composition of ``counts[i]`` Poisson-subsampled
    Gaussian steps ``(q[i], noise_multipliers[i])``, at ``delta``.

    Equal to ``epsilon_from_rdp(orders, rdp_curve(...), delta, conversion)``, but only the orders
    that can be optimal are computed (see :func:`_optimise_orders`), all distinct steps at once.

    Example: ``rdp_epsilon([0.01] * 3, [1.0, 1.1, 1.2], [100, 100, 100], 1e-5)``.
    """
    _check_delta(delta)
    eps, order = _optimise_orders(q, noise_multipliers, counts, orders, delta, "epsilon",
                                  conversion)
    return max(0.0, eps), order


def rdp_delta(
    q: Sequence[float], noise_multipliers: Sequence[float], counts: Sequence[float],
    epsilon: float, orders: Sequence[float] = DEFAULT_ORDERS, conversion: str = "rdp",
) -> tuple[float, float]:
    """``(delta, optimal_order)`` at ``epsilon`` for the same composition as :func:`rdp_epsilon`.

    Example: ``rdp_delta([0.01], [1.1], [1000], 2.0)``.
    """
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    logd, order = _optimise_orders(q, noise_multipliers, counts, orders, float(epsilon), "delta",
                                   conversion)
    return float(min(1.0, math.exp(min(logd, 0.0)))), order


def rdp_gaussian(noise_multiplier: float, orders: Sequence[float] = DEFAULT_ORDERS) -> np.ndarray:
    """RDP of the (unsampled) Gaussian mechanism: ``a / (2 sigma^2)`` (Mironov 2017, Prop. 7)."""
    return rdp_poisson_gaussian(1.0, noise_multiplier, orders)


def _check_rdp(r: np.ndarray, a: np.ndarray) -> None:
    """An RDP curve holds Renyi divergences: numbers >= 0 (``+inf`` allowed), one per order."""
    if r.shape != a.shape:
        raise ValueError("orders and rdp must have the same length")
    bad = np.isnan(r) | (r < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"rdp must hold Renyi divergences, numbers >= 0 (+inf allowed), one per order; got "
            f"{float(r[i])!r} at order {a[i]:g}"
        )


def _check_delta(delta: float) -> None:
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")


def _rdp_values(rdp: Any) -> np.ndarray:
    """``rdp`` as float64, refusing text and booleans (numpy would read ``'1'`` as 1.0)."""
    raw = np.asarray(rdp)
    if raw.dtype.kind in "USb":
        raise TypeError(f"rdp must hold numbers (Renyi divergences), got {raw.dtype} values")
    return np.asarray(raw, dtype=np.float64)


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
    r = _rdp_values(rdp)
    _check_rdp(r, a)
    eps = _conversion_values(a, r, delta, "epsilon", conversion)
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
    r = _rdp_values(rdp)
    _check_rdp(r, a)
    logd = _conversion_values(a, r, epsilon, "delta", conversion)
    i = int(np.argmin(logd))
    return float(min(1.0, math.exp(min(logd[i], 0.0)))), float(a[i])
