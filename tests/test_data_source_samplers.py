"""Truncated Poisson and balls-in-bins batches read from random-access sources (memmap, HDF5,
TFRecord, ArrayRecord): the selections' distributions against their theory (fixed seeds,
chi-square tests at p > 1e-4: a seed either passes or fails, always the same), the records read
against an independent read, and the claim a private model's ledger records."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

import tf_dp
from tf_dp.data import ArraySource, balls_in_bins_sample, truncated_poisson_sample
from tests.test_data_sources import KINDS, _model, _records, _source

#: A chi-square p-value below this fails (fixed seeds: deterministic, never flaky).
P_MIN = 1e-4


def _chi2_p(observed, expected):
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    keep = expected >= 5  # pool the thin tail so the chi-square approximation holds
    obs = np.append(observed[keep], observed[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("kind", KINDS)
def test_truncated_poisson_reads_the_sampled_records_in_batches_of_b(kind, tmp_path):
    n, q, b = 40, 0.3, 10
    source = _source(kind, tmp_path, n)
    batches = truncated_poisson_sample(source, q, steps_per_epoch=20, max_batch_size=b, seed=3)
    assert batches.sampling.policy == "truncated_poisson" and batches.sampling.max_batch_size == b
    x_all, _ = _records(n)
    for bx, by, bw in batches.dataset.as_numpy_iterator():
        assert bx.shape[0] == by.shape[0] == bw.shape[0] == b  # one shape for every step
        real = bw > 0
        assert len(set(by[real])) == real.sum()  # distinct records
        np.testing.assert_array_equal(bx[real], x_all[by[real]])  # what an independent read gives
        assert np.all(bx[~real] == 0)


def test_truncated_poisson_sizes_and_inclusion_follow_the_truncated_binomial():
    n, q, b, steps = 50, 0.3, 12, 3000
    x, y = _records(n)
    batches = truncated_poisson_sample(ArraySource(x, y), q, steps_per_epoch=steps,
                                       max_batch_size=b, seed=7)
    sizes, counts = [], np.zeros(n)
    for _, by, bw in batches.dataset.as_numpy_iterator():
        sizes.append(int((bw > 0).sum()))
        counts[by[bw > 0]] += 1
    # P[size = k] = Binomial(n, q) pmf for k < B, and P[K >= B] at B (the cut)
    expected = stats.binom.pmf(np.arange(b + 1), n, q)
    expected[b] = stats.binom.sf(b - 1, n, q)
    assert _chi2_p(np.bincount(sizes, minlength=b + 1), expected * steps) > P_MIN
    # every record equally likely (the cut keeps a uniform B)
    assert _chi2_p(counts, np.full(n, counts.sum() / n)) > P_MIN


@pytest.mark.parametrize("kind", KINDS)
def test_balls_in_bins_reads_every_record_once_per_pass(kind, tmp_path):
    n, batch = 30, 7
    source = _source(kind, tmp_path, n)
    batches = balls_in_bins_sample(source, batch_size=batch, seed=5)
    t = math.ceil(n / batch)
    assert batches.steps_per_epoch == t and batches.sampling.policy == "balls_in_bins"
    assert batches.sampling_probability == 1 / t
    x_all, _ = _records(n)
    passes = []
    for _ in range(2):  # every iteration of the dataset is a fresh pass
        seen = []
        for bx, by, bw in batches.dataset.as_numpy_iterator():
            real = bw > 0
            np.testing.assert_array_equal(bx[real], x_all[by[real]])
            seen.append(sorted(by[real].tolist()))
        assert sorted(i for s in seen for i in s) == list(range(n))
        passes.append(seen)
    assert passes[0] != passes[1]


def test_balls_in_bins_assignment_is_uniform_and_independent():
    n, t, passes = 60, 6, 150
    x, y = _records(n)
    batches = balls_in_bins_sample(ArraySource(x, y), num_batches=t, seed=11)
    where = np.zeros((n, t))  # how often record i was in batch j
    sizes = []
    for _ in range(passes):
        for j, (_, by, bw) in enumerate(batches.dataset.as_numpy_iterator()):
            where[by[bw > 0], j] += 1
            sizes.append(int((bw > 0).sum()))
    assert np.all(where.sum(axis=1) == passes)
    assert _chi2_p(where.ravel(), np.full(n * t, passes / t)) > P_MIN
    # batch sizes: Binomial(n, 1 / T)
    expected = stats.binom.pmf(np.arange(n + 1), n, 1 / t) * len(sizes)
    assert _chi2_p(np.bincount(sizes, minlength=n + 1), expected) > P_MIN


def test_fit_records_the_selection_and_its_epsilon(tmp_path):
    n, q, b = 60, 0.2, 16
    source = _source("tfrecord", tmp_path, n)

    class Scaled:  # the records' x scaled down, y in 3 classes, for a small classifier
        def __len__(self):
            return len(source)

        def read(self, idx):
            bx, by = source.read(idx)
            return bx / n, by % 3

    model = _model()
    model.fit(truncated_poisson_sample(Scaled(), q, max_batch_size=b, seed=1), epochs=2,
              verbose=0)
    steps = 2 * round(1 / q)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == steps
    assert {(e.sampling.policy, e.sampling.max_batch_size, e.sampling.origin)
            for e in entries} == {("truncated_poisson", b, "sampled")}
    got = tf_dp.accounting.compute_epsilon(model.optimizer.ledger, 1e-5, "rdp").epsilon
    ref = tf_dp.accounting.dp_sgd_epsilon(n, round(q * n), 1.0, 1e-5, steps=steps,
                                          sampling="truncated_poisson", max_batch_size=b)
    assert got == pytest.approx(ref.epsilon, rel=1e-9)

    model = _model()
    model.fit(balls_in_bins_sample(Scaled(), batch_size=20, seed=1), epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 2 * 3
    assert {(e.sampling.policy, e.sampling.selection_probability) for e in entries} == {
        ("balls_in_bins", 1 / 3)}
    got = tf_dp.accounting.compute_epsilon(model.optimizer.ledger, 1e-5, "pld").epsilon
    ref = tf_dp.accounting.dp_sgd_epsilon(n, 20, 1.0, 1e-5, epochs=2, sampling="balls_in_bins",
                                          accountant="pld")
    assert got == pytest.approx(ref.epsilon, rel=1e-9)


def test_arguments_are_checked_by_name():
    x, y = _records(10)
    source = ArraySource(x, y)
    with pytest.raises(TypeError, match="random-access source"):
        truncated_poisson_sample(x, 0.1)
    with pytest.raises(ValueError, match=r"max_batch_size must be in \[1, n=10\]"):
        truncated_poisson_sample(source, 0.1, max_batch_size=11)
    with pytest.raises(ValueError, match="sampling_probability"):
        truncated_poisson_sample(source, 1.5)
    with pytest.raises(ValueError, match="give exactly one of batch_size"):
        balls_in_bins_sample(source, batch_size=2, num_batches=5)
    with pytest.raises(ValueError, match=r"num_batches must be in \[1, n=10\]"):
        balls_in_bins_sample(source, num_batches=11)
    with pytest.raises(TypeError, match="seed must be None or an integer"):
        balls_in_bins_sample(source, batch_size=2, seed="s")
