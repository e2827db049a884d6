"""Correlated-noise strategies and their accounting, against independent computations: dense
matrices (C C = A for the full square root, C C^{-1} = I, the recurrences against
np.linalg.solve), a brute-force enumeration of participation patterns for the sensitivity, the
Gaussian closed form and dp_accounting's PLD for the epsilons."""

from __future__ import annotations

import itertools
import math

import dp_accounting
import numpy as np
import pytest

from tf_dp.accounting.matrix_factorization import (
    amplified_bandmf_epsilon,
    calibrate_mf_noise,
    mf_epsilon,
    mf_sensitivity,
)
from tf_dp.correlated.strategies import BandedStrategy, BLTStrategy, from_config

#: float64 products of n x n matrices with entries <= 1: n roundings of relative 2^-52
F64 = 2.0**-52
#: tf_dp's and dp_accounting's PLDs are pessimistic and within 0.5% of the exact epsilon here
PLD_REL = 5e-3


def test_full_square_root_squares_to_the_prefix_sum_matrix():
    n = 50
    c = BandedStrategy.square_root(n, n).matrix()
    assert np.abs(c @ c - np.tril(np.ones((n, n)))).max() <= 4 * n * n * F64


@pytest.mark.parametrize("strategy", [
    BandedStrategy.square_root(40, 5),
    BandedStrategy([1.0, -0.3, 0.2], 40),
    BLTStrategy([0.4, -0.1], [0.9, 0.3], 40),
])
def test_inverse_and_noise_recurrence_match_dense_algebra(strategy):
    n = strategy.num_steps
    c, c_inv = strategy.matrix(), strategy.inverse_matrix()
    assert np.abs(c @ c_inv - np.eye(n)).max() <= 1e3 * n * F64
    z = np.random.default_rng(0).normal(size=(n, 3))
    want = np.linalg.solve(c, z)  # the noise rows the recurrence must release
    rec = strategy.noise_recurrence()
    w = np.zeros_like(z)
    if hasattr(rec, "coef"):
        for t in range(n):
            past = sum(rec.coef[t, j] * w[t - j] for j in range(1, rec.coef.shape[1]) if t >= j)
            w[t] = (z[t] - past) / rec.coef[t, 0]
    else:
        s = np.zeros((len(rec.omega), 3))
        for t in range(n):
            w[t] = z[t] + rec.omega @ s
            s = rec.theta[:, None] * s + z[t]
    assert np.abs(w - want).max() <= 1e3 * n * F64 * np.abs(want).max()
    again = from_config(strategy.to_config())
    assert np.array_equal(again.matrix(), c)


def _brute_sensitivity(c, period):
    """max ||C u|| over every offset and every non-empty subset of its steps."""
    n, best = c.shape[0], 0.0
    for j in range(min(period, n)):
        steps = list(range(j, n, period))
        for k in range(1, len(steps) + 1):
            for sub in itertools.combinations(steps, k):
                best = max(best, float(np.linalg.norm(c[:, list(sub)].sum(axis=1))))
    return best


@pytest.mark.parametrize("period", [None, 1, 2, 3, 5])
def test_sensitivity_is_the_largest_over_every_participation_pattern(period):
    n = 10
    c = BandedStrategy.square_root(n, 4).matrix()  # C >= 0: exact
    sens, exact = mf_sensitivity(c, period)
    want = (_brute_sensitivity(c, 1 if period is None else period) if period else
            float(np.linalg.norm(c, axis=0).max()))
    assert exact and sens == pytest.approx(want, rel=1e-12)
    assert BandedStrategy.square_root(n, 4).sensitivity(period) == pytest.approx(sens, rel=1e-12)


def test_sensitivity_with_negative_gram_entries_is_a_bound_above_every_pattern():
    c = BandedStrategy([1.0, -0.9, 0.5], 9).matrix()
    sens, exact = mf_sensitivity(c, 1)  # adjacent columns: (C^T C)_{t,t+1} = -0.9 - 0.45 < 0
    assert not exact
    assert sens >= _brute_sensitivity(c, 1)


@pytest.mark.parametrize("z,period", [(3.0, 10), (1.5, None), (6.0, 4)])
def test_mf_epsilon_is_the_gaussian_mechanisms_and_dp_accountings(z, period):
    s = BandedStrategy.square_root(60, 6)
    res = mf_epsilon(s, z, 1e-5, period)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(z / res.sensitivity))
    ref = acc.get_epsilon(1e-5)
    assert res.epsilon <= ref * (1 + 1e-6) and res.epsilon >= ref * (1 - PLD_REL)


def test_dp_sgd_as_a_strategy_is_the_composition_of_its_steps():
    """C = I with every step (period 1): n Gaussians of noise z compose to one of sqrt(n) / z."""
    n, z = 25, 5.0
    res = mf_epsilon(BandedStrategy([1.0], n), z, 1e-5, period=1)
    assert res.sensitivity == pytest.approx(math.sqrt(n), rel=1e-12)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(z), n)
    assert res.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=PLD_REL)


@pytest.mark.parametrize("bands,q", [(1, 0.05), (4, 0.2), (8, 0.5)])
def test_amplified_bandmf_is_poisson_subsampled_gaussians_per_dp_accounting(bands, q):
    n, z = 64, 1.2
    s = BandedStrategy.optimize(n, bands)
    res = amplified_bandmf_epsilon(s, z, 1e-5, q)
    col = float(np.linalg.norm(s.matrix(), axis=0).max())
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z / col))
    acc.compose(event, math.ceil(n / bands))
    assert res.epsilon == pytest.approx(acc.get_epsilon(1e-5), rel=2 * PLD_REL)
    if bands == 1:  # DP-SGD: column norm 1
        assert res.sensitivity == pytest.approx(1.0)


def test_amplification_needs_a_banded_c():
    with pytest.raises(ValueError, match="bands must be an integer"):
        amplified_bandmf_epsilon(BandedStrategy.square_root(20, 5), 1.0, 1e-5, 0.1, bands=3)
    with pytest.raises(ValueError, match="lower triangular"):
        amplified_bandmf_epsilon(np.ones((4, 4)), 1.0, 1e-5, 0.1)


@pytest.mark.parametrize("kw", [{"period": 10}, {"sampling_probability": 0.1}])
def test_calibration_meets_the_target_tightly(kw):
    s = BandedStrategy.square_root(100, 10)
    z = calibrate_mf_noise(s, 2.0, 1e-5, **kw)

    def eps(v):
        if "period" in kw:
            return mf_epsilon(s, v, 1e-5, kw["period"]).epsilon
        return amplified_bandmf_epsilon(s, v, 1e-5, kw["sampling_probability"]).epsilon

    assert eps(z) <= 2.0 < eps(z * (1 - 2e-3))


def test_optimised_strategies_beat_their_starts_and_dp_sgd():
    n, period = 200, 20
    sqrt = BandedStrategy.square_root(n, 8)
    opt = BandedStrategy.optimize(n, 8, period=period)
    blt = BLTStrategy.optimize(n, 3, period=period)
    dpsgd = BandedStrategy([1.0], n)

    def cost(s):
        return s.sensitivity(period) * s.workload_error()

    assert cost(opt) <= cost(sqrt) and cost(blt) < cost(dpsgd) and cost(opt) < cost(dpsgd)
    with pytest.raises(ValueError, match="bands must be an integer in"):
        BandedStrategy.square_root(10, 11)
    with pytest.raises(ValueError, match="every |theta_i| < 1"):
        BLTStrategy([0.1], [1.0], 10)


# -- the tree of DP-FTRL as a member of the family ------------------------------------------------


@pytest.mark.parametrize("steps", [1, 2, 3, 7, 8, 33, 100])
def test_tree_strategy_factors_prefix_sums_with_the_tree_accountants_sensitivity(steps):
    from tf_dp.correlated.strategies import TreeStrategy

    tree = TreeStrategy(steps)
    c = tree.matrix()
    # B C = A: the prefix sums, from the nodes tree aggregation releases (0/1 integers: exact)
    assert np.array_equal(tree.decoder() @ c, np.tril(np.ones((steps, steps))))
    sens, exact = mf_sensitivity(tree, None)
    # a leaf lies in one node per level l with 2^l <= T: floor(log2 T) + 1 nodes
    assert exact and sens**2 == pytest.approx(math.floor(math.log2(steps)) + 1, rel=4 * F64)


@pytest.mark.parametrize("population,batch,z", [(1000, 10, 3.0), (640, 64, 1.5)])
def test_tree_epsilon_by_mf_accounting_equals_the_tree_accountants(population, batch, z):
    """One epoch of tree aggregation over shuffled batches (replace-one: leaf sensitivity 2C),
    as the ledger records it: compute_epsilon's tree accounting (GDP: exact for one Gaussian) and
    mf_epsilon of TreeStrategy's C at noise z / 2 are the same Gaussian mechanism."""
    from tf_dp.accounting import compute_epsilon
    from tf_dp.correlated.strategies import TreeStrategy
    from tf_dp.ledger import SampleEntry, SamplingEvent, SumQueryEvent

    steps = math.ceil(population / batch)
    entries = [
        SampleEntry(SamplingEvent(population, batch / population, "shuffle", pass_start=(t == 0)),
                    (SumQueryEvent(1.0, z, "tree", tree_step=t),))
        for t in range(steps)
    ]
    tree_eps = compute_epsilon(entries, 1e-5, "gdp").epsilon
    mf = mf_epsilon(TreeStrategy(steps), z / 2.0, 1e-5)
    assert mf.epsilon == pytest.approx(tree_eps, rel=1e-8)
    # and against dp_accounting's PLD of that Gaussian (noise z / (2 sqrt(d)))
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.GaussianDpEvent(z / (2.0 * math.sqrt(steps.bit_length()))))
    ref = acc.get_epsilon(1e-5)
    assert ref * (1 - PLD_REL) <= mf.epsilon <= ref * (1 + 1e-6)
