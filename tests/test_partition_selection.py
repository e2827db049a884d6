"""DP-AdaFEST / DP-FEST mechanism (tf_dp.dp_query.partition_selection) and its accounting
(tf_dp.accounting.partition_selection), checked against numpy loops, closed forms and
dp_accounting (test-only oracle)."""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

from tf_dp.accounting import compute_epsilon
from tf_dp.accounting import partition_selection as acc
from tf_dp.dp_query import partition_selection as ps
from tf_dp.ledger import PrivacyLedger

EPS32 = float(np.finfo(np.float32).eps)


def _ids(seed, batch=16, length=9, vocab=40):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=(batch, length))
    ids[rng.random(ids.shape) < 0.2] = -1  # padding
    ids[3] = -1  # an example touching nothing
    return ids


def _reference_map(ids, vocab, c1):
    """Slow reference: per example, the set of its rows, weight min(1, c1/sqrt(|set|))."""
    out = np.zeros(vocab)
    per_example = []
    for row in ids:
        s = {int(r) for r in row if r >= 0}
        m = np.zeros(vocab)
        if s:
            m[list(s)] = min(1.0, c1 / math.sqrt(len(s)))
        per_example.append(m)
        out += m
    return out, per_example


@pytest.mark.parametrize("c1", [0.5, 1.0, 100.0])
def test_contribution_map_matches_set_loop_and_is_bounded(c1):
    ids, vocab = _ids(0), 40
    got = ps.contribution_map(tf.constant(ids), vocab, c1).numpy()
    want, per = _reference_map(ids, vocab, c1)
    # float32 sum of <= 16 terms each <= 1: rounding <= 16 * eps * max count
    np.testing.assert_allclose(got, want, rtol=0, atol=16 * EPS32 * max(1.0, want.max()))
    for m in per:  # each example's clipped map has L2 norm <= c1 (the query's sensitivity)
        assert np.linalg.norm(m) <= c1 * (1 + 4 * EPS32)
    w = ps.contribution_weights(tf.constant(ids), c1).numpy()
    np.testing.assert_allclose(w, [m.max() for m in per], rtol=4 * EPS32)


def test_contribution_map_refuses_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        ps.contribution_map(tf.constant([[1]]), 0, 1.0)
    with pytest.raises(ValueError, match="contribution_bound"):
        ps.contribution_map(tf.constant([[1]]), 5, 0.0)
    with pytest.raises(ValueError, match="ids"):
        ps.contribution_map(tf.constant([1, 2]), 5, 1.0)
    with pytest.raises(ValueError, match="k must"):
        ps.top_rows(tf.zeros([4]), 5)


def test_select_rows_without_noise_is_the_threshold():
    counts = np.array([0.0, 0.4, 0.6, 2.0, 0.5, 3.0], np.float32)
    gen = ps.make_generator(1)
    rows = ps.select_rows(gen, counts, 0.5, 0.0).numpy()
    np.testing.assert_array_equal(rows, np.flatnonzero(counts > 0.5))


def test_select_rows_noise_rate_matches_gaussian_tail():
    """Rows of count c are selected with probability 1 - Phi((tau - c) / sigma)."""
    v, sigma, tau = 200_000, 2.0, 3.0
    counts = np.zeros(v, np.float32)
    counts[: v // 2] = 4.0
    rows = ps.select_rows(ps.make_generator(7), counts, tau, sigma).numpy()
    for lo, hi, c in ((0, v // 2, 4.0), (v // 2, v, 0.0)):
        n = hi - lo
        p = stats.norm.sf((tau - c) / sigma)
        k = np.count_nonzero((rows >= lo) & (rows < hi))
        assert abs(k - n * p) <= 5 * math.sqrt(n * p * (1 - p)), (c, k, n * p)


def test_sparse_noised_sum_without_noise_is_the_restricted_sum():
    rng = np.random.default_rng(3)
    v, d, m = 30, 4, 50
    row_ids = rng.integers(0, v, m)
    vals = rng.normal(size=(m, d)).astype(np.float32)
    rows = np.array([0, 2, 5, 7, 11, 29], np.int64)  # some touched, some not
    out = ps.sparse_noised_sum(ps.make_generator(0), rows, row_ids, vals, 0.0, [v, d])
    assert isinstance(out, tf.IndexedSlices)
    dense = np.zeros((v, d))
    np.add.at(dense, row_ids, vals.astype(np.float64))
    np.testing.assert_array_equal(out.indices.numpy(), rows)
    # float32 sums of at most m terms of size |vals|
    np.testing.assert_allclose(out.values.numpy(), dense[rows], rtol=0,
                               atol=m * EPS32 * np.abs(vals).max())
    empty = ps.sparse_noised_sum(ps.make_generator(0), np.zeros([0], np.int64), row_ids, vals, 1.0,
                                 [v, d])
    assert empty.values.shape == (0, d)


def test_sparse_noised_sum_noise_only_on_selected_rows():
    v, d, sigma = 100_000, 8, 1.5
    rows = np.arange(0, v, 10, dtype=np.int64)  # 10_000 selected, nothing touched
    out = ps.sparse_noised_sum(ps.make_generator(5), rows, np.array([1]), np.ones([1, d], np.float32),
                               sigma, [v, d])
    x = out.values.numpy().astype(np.float64)
    n = x.size
    assert x.shape == (rows.size, d)  # row 1 (not selected) dropped; no other rows carry noise
    # sample variance of n N(0, sigma^2) draws: relative sd sqrt(2/n); 5 sd
    assert abs(x.var() / sigma**2 - 1) <= 5 * math.sqrt(2 / n)
    assert abs(x.mean()) <= 5 * sigma / math.sqrt(n)


def test_top_rows_matches_argsort():
    f = np.random.default_rng(2).permutation(50).astype(np.float32)
    np.testing.assert_array_equal(ps.top_rows(f, 7).numpy(), np.sort(np.argsort(-f)[:7]))


def test_selection_works_in_tf_function():
    ids = _ids(1)
    f = tf.function(lambda x: ps.select_rows(ps_gen, ps.contribution_map(x, 40, 1.0), 0.5, 0.0))
    ps_gen = ps.make_generator(0)
    want, _ = _reference_map(ids, 40, 1.0)
    np.testing.assert_array_equal(f(tf.constant(ids)).numpy(), np.flatnonzero(want > 0.5))


# -- accounting -----------------------------------------------------------------------------------


def _ledger(q, steps, z_grad, z_sel, c2=1.0, c1=2.0, n=10_000):
    ledger = PrivacyLedger()
    for _ in range(steps):
        ledger.record_sampling(n, q, "poisson")
        ledger.record_sum_query(c2, z_grad * c2)
        acc.record_selection(ledger, c1, z_sel)
    return ledger


def test_ledger_records_the_selection_query():
    ledger = _ledger(0.01, 2, 1.1, 3.0)
    entry = ledger.samples()[0]
    assert [(e.l2_sensitivity, e.noise_stddev) for e in entry.queries] == [(1.0, 1.1), (2.0, 6.0)]


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_unsampled_composition_matches_dp_accounting(accountant):
    """q = 1: the two Gaussians of each step composed by dp_accounting itself."""
    steps, z_grad, z_sel, delta = 5, 1.2, 2.5, 1e-5
    ours = compute_epsilon(_ledger(1.0, steps, z_grad, z_sel), delta, accountant).epsilon
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.ComposedDpEvent(
            [dp_accounting.GaussianDpEvent(z_grad), dp_accounting.GaussianDpEvent(z_sel)]), steps)
    if accountant == "rdp":
        oracle = dp_accounting.rdp.RdpAccountant()
    else:
        oracle = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    want = oracle.compose(event).get_epsilon(delta)
    assert ours == pytest.approx(want, rel=2e-2 if accountant == "pld" else 1e-6)


def test_one_step_matches_gaussian_closed_form():
    """q = 1, one step: exact delta of the Gaussian mechanism with mu = sqrt(z1^-2 + z2^-2)
    (Balle and Wang 2018): the PLD epsilon is an upper bound within its discretisation."""
    z_grad, z_sel, delta = 0.9, 1.7, 1e-5
    mu = math.sqrt(z_grad**-2 + z_sel**-2)

    def exact_delta(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)

    from scipy.optimize import brentq
    eps_exact = brentq(lambda e: exact_delta(e) - delta, 1e-6, 100, xtol=1e-13)
    ours = compute_epsilon(_ledger(1.0, 1, z_grad, z_sel), delta, "pld").epsilon
    # lower slack: the accountant's own root search stops within ~1e-9 of the exact root
    assert eps_exact - 1e-8 <= ours <= eps_exact * 1.02 + 1e-3


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_sampled_steps_match_dp_accounting(accountant):
    """Poisson-sampled: dp_accounting's subsampled Gaussian at the combined multiplier."""
    q, steps, z_grad, z_sel, delta = 0.01, 300, 1.0, 2.0, 1e-5
    ours = acc.adafest_epsilon(10_000, q, steps, z_grad, z_sel, delta, accountant,
                               contribution_bound=3.0).epsilon
    z = (z_grad**-2 + z_sel**-2) ** -0.5
    assert acc.combined_noise_multiplier(z_grad, z_sel) == pytest.approx(z, rel=1e-15)
    event = dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    if accountant == "rdp":
        oracle = dp_accounting.rdp.RdpAccountant()
    else:
        oracle = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    want = oracle.compose(event).get_epsilon(delta)
    assert ours == pytest.approx(want, rel=2e-2 if accountant == "pld" else 1e-6)
    # the selection costs privacy: more than the gradient query alone
    alone = acc.adafest_epsilon(10_000, q, steps, z_grad, 1e6, delta, accountant).epsilon
    assert ours > alone


def test_accounting_refuses_bad_arguments():
    with pytest.raises(ValueError, match="noise_multiplier"):
        acc.selection_event(1.0, 0.0)
    with pytest.raises(ValueError, match="contribution_bound"):
        acc.selection_event(-1.0, 1.0)
    with pytest.raises(ValueError, match="steps"):
        acc.adafest_epsilon(100, 0.1, 0, 1.0, 1.0, 1e-5)
