"""Correlated noise in TensorFlow (tf_dp.correlated.noise_tf): the released noise is C^{-1} Z.

Every check compares with numpy's ``np.linalg.solve(C, Z)`` for the same draws ``Z`` (fed to the
recurrences, or re-drawn from a generator of the same seed), never with the query's own output.
Tolerances: the recurrences are forward substitution, backward stable (Higham, *Accuracy and
Stability*, Thm 8.5): the computed ``w`` solves ``(C + dC) w = z`` with ``|dC| <= k u |C|`` for
``k`` terms per row, hence ``|w - w_exact| <= k eps (|C^{-1}| |C| |w|)`` entrywise (first order),
with ``eps`` of the dtype the recurrence runs in.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import eps
from tf_dp.correlated.noise_tf import (
    CorrelatedNoiseSumQuery,
    banded_noise_step,
    blt_noise_step,
)
from tf_dp.dp_query.noise import gaussian_noise, make_generator


@dataclasses.dataclass(frozen=True)
class Banded:  # the shape of strategies.BandedRecurrence
    coef: np.ndarray


@dataclasses.dataclass(frozen=True)
class BLT:  # the shape of strategies.BLTRecurrence
    omega: np.ndarray
    theta: np.ndarray


def banded_matrix(n: int, b: int, seed: int = 0) -> np.ndarray:
    """A lower-triangular banded C (b bands) with a dominant diagonal."""
    rng = np.random.default_rng(seed)
    c = np.zeros((n, n))
    for t in range(n):
        for j in range(b):
            if t - j >= 0:
                c[t, t - j] = rng.uniform(1.0, 2.0) if j == 0 else rng.uniform(-0.4, 0.4)
    return c


def coef_of(c: np.ndarray, b: int) -> np.ndarray:
    n = c.shape[0]
    return np.array([[c[t, t - j] if t - j >= 0 else 0.0 for j in range(b)] for t in range(n)])


def blt_inverse(omega, theta, n: int) -> np.ndarray:
    """C^{-1} of a BLT, built from its definition: Toeplitz, first column 1 then
    sum_i omega_i theta_i^(k-1) at lag k (a direct sum, not the recurrence)."""
    col = [1.0] + [float(np.sum(omega * theta ** (k - 1))) for k in range(1, n)]
    return np.array([[col[t - s] if t >= s else 0.0 for s in range(n)] for t in range(n)])


def solve_tolerance(c: np.ndarray, w: np.ndarray, dtype, terms: int) -> np.ndarray:
    """Forward error bound of forward substitution (module docstring), entrywise [n, d]."""
    return terms * eps(dtype) * (np.abs(np.linalg.inv(c)) @ np.abs(c) @ np.abs(w)) + (
        eps(dtype) * np.abs(w)
    )


BLT_PARAMS = BLT(np.array([-0.3, -0.15, 0.05]), np.array([0.9, 0.5, 0.2]))


@pytest.mark.parametrize("b", [1, 2, 4])
def test_banded_recurrence_is_the_solve_of_c(b):
    n, d = 16, 7
    c = banded_matrix(n, b, seed=b)
    z = np.random.default_rng(1).normal(size=(n, d))
    buf, got = tf.zeros([b - 1, d], tf.float64), []
    for t in range(n):
        w, buf = banded_noise_step(tf.constant(coef_of(c, b)[t]), buf, tf.constant(z[t]))
        got.append(w.numpy())
    assert buf.shape == (b - 1, d)  # fixed-shape state (variables hold it between steps)
    want = np.linalg.solve(c, z)
    assert np.all(np.abs(np.array(got) - want) <= solve_tolerance(c, want, "float64", b + 1))
    if b == 1:  # DP-SGD: w = z / c_tt
        np.testing.assert_array_equal(np.array(got), z / np.diag(c)[:, None])


def test_blt_recurrence_is_the_toeplitz_inverse():
    n, d = 20, 5
    c_inv = blt_inverse(BLT_PARAMS.omega, BLT_PARAMS.theta, n)
    z = np.random.default_rng(2).normal(size=(n, d))
    buf, got = tf.zeros([3, d], tf.float64), []
    for t in range(n):
        w, buf = blt_noise_step(BLT_PARAMS.omega, BLT_PARAMS.theta, buf, tf.constant(z[t]))
        got.append(w.numpy())
    want = c_inv @ z
    # a sum of t terms per row of C^{-1} z, plus the buffers' geometric sums (t products each)
    tol = 2 * n * eps("float64") * (np.abs(c_inv) @ np.abs(z))
    assert np.all(np.abs(np.array(got) - want) <= tol)


def _query_noise(query, specs, steps, compile_mode):
    """The noise the query releases over ``steps`` steps of zero records (compiled as asked)."""
    gs = query.initial_global_state()
    held = tf.nest.map_structure(lambda t: tf.Variable(t) if isinstance(t, tf.Tensor) else t, gs)

    def step():
        state = [tf.zeros(s.shape, s.dtype) for s in specs]
        out, new = query.get_noised_result(state, held)
        for old, value in zip(tf.nest.flatten(held), tf.nest.flatten(new)):
            if isinstance(old, tf.Variable):
                old.assign(value)
        return out

    if compile_mode == "eager":
        run = step
    else:
        run = tf.function(step, jit_compile=compile_mode == "xla")
    return [[t.numpy() for t in run()] for _ in range(steps)], held


def _draws(seed, specs, steps):
    """The z's a query seeded with ``seed`` draws: per step, per leaf, from one generator."""
    gen = make_generator(seed)
    return [
        [
            tf.reshape(gaussian_noise(gen, s.shape.num_elements(), s.dtype, 1.0), s.shape).numpy()
            for s in specs
        ]
        for _ in range(steps)
    ]


@pytest.mark.parametrize("compile_mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_query_releases_c_inverse_z_for_its_own_draws(kind, compile_mode):
    """Zero records: the released sums over n steps are sigma * C^{-1} Z, Z re-drawn from a
    generator of the same seed (two variables of different shapes: one Z column each entry)."""
    n, b, sigma, seed = 10, 3, 1.7, 7
    specs = [tf.TensorSpec([2, 3], tf.float32), tf.TensorSpec([4], tf.float32)]
    if kind == "banded":
        c = banded_matrix(n, b)
        recurrence = Banded(coef_of(c, b))
        terms = b + 1
    else:
        c = np.linalg.inv(blt_inverse(BLT_PARAMS.omega, BLT_PARAMS.theta, n))
        recurrence = BLT_PARAMS
        terms = 2 * n
    query = CorrelatedNoiseSumQuery(1.0, sigma, recurrence, record_specs=specs, seed=seed)
    got, held = _query_noise(query, specs, n, compile_mode)
    draws = _draws(seed, specs, n)
    for leaf in range(len(specs)):
        z = np.stack([np.reshape(draws[t][leaf], -1) for t in range(n)]).astype(np.float64)
        w = np.stack([np.reshape(got[t][leaf], -1) for t in range(n)]).astype(np.float64)
        want = sigma * np.linalg.solve(c, z)
        # float32 recurrence, plus the draw's scaling by sigma and the final cast (2 roundings);
        # under XLA the Box-Muller transform rounds differently (tests/test_noise.py: a few ulps)
        tol = solve_tolerance(c, want, "float32", terms + 2 + (8 if compile_mode == "xla" else 0))
        assert np.all(np.abs(w - want) <= tol), np.max(np.abs(w - want) - tol)
    assert int(held.step.numpy()) == n


def test_banded_steps_past_the_strategy_reuse_its_last_row():
    n, b = 4, 2
    c = banded_matrix(n, b)
    specs = [tf.TensorSpec([3], tf.float64)]
    query = CorrelatedNoiseSumQuery(1.0, 1.0, Banded(coef_of(c, b)), record_specs=specs, seed=3)
    got, _ = _query_noise(query, specs, n + 3, "graph")
    # the Toeplitz continuation: C extended with rows that repeat the last row's band
    big = np.zeros((n + 3, n + 3))
    big[:n, :n] = c
    for t in range(n, n + 3):
        big[t, t], big[t, t - 1] = c[n - 1, n - 1], c[n - 1, n - 2]
    z = np.stack([draw[0] for draw in _draws(3, specs, n + 3)])
    want = np.linalg.solve(big, z)
    w = np.stack([g[0] for g in got])
    assert np.all(np.abs(w - want) <= solve_tolerance(big, want, "float64", b + 2))


@pytest.mark.parametrize(
    "recurrence, match",
    [
        (Banded(np.array([[0.0, 0.0]])), r"coef\[t, 0\] > 0"),
        (Banded(np.ones(3)), r"shape \(num_steps, bands\)"),
        (BLT(np.array([0.1]), np.array([1.0])), r"\|theta_i\| < 1"),
        (BLT(np.array([0.1, 0.2]), np.array([0.5])), "same length"),
        (object(), "noise_recurrence"),
    ],
)
def test_bad_recurrences_name_the_field_and_range(recurrence, match):
    with pytest.raises((ValueError, TypeError), match=match):
        CorrelatedNoiseSumQuery(1.0, 1.0, recurrence)


@pytest.mark.parametrize("kind", ["banded", "blt"])
def test_the_strategies_noise_is_their_c_inverse_z(kind):
    """tf_dp.correlated.strategies' optimised strategies through the query: C^{-1} Z with C the
    strategy's own dense matrix (strategy.matrix())."""
    from tf_dp.correlated.strategies import BandedStrategy, BLTStrategy

    n = 12
    if kind == "banded":
        strategy, terms = BandedStrategy.optimize(n, bands=3), 3 + 2
    else:
        strategy, terms = BLTStrategy.optimize(n, buffers=2), 2 * n + 2
    specs = [tf.TensorSpec([5], tf.float64)]
    query = CorrelatedNoiseSumQuery(1.0, 1.0, strategy, record_specs=specs, seed=9)
    got, _ = _query_noise(query, specs, n, "graph")
    c = strategy.matrix()
    z = np.stack([draw[0] for draw in _draws(9, specs, n)])
    want = np.linalg.solve(c, z)
    w = np.stack([g[0] for g in got])
    assert np.all(np.abs(w - want) <= solve_tolerance(c, want, "float64", terms))
