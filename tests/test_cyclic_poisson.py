"""Cyclic Poisson batches (tf_dp.data.cyclic_poisson_batches): inclusion probabilities,
b-min-separation, the claim in the ledger and its DP-SGD accounting.

Statistics use fixed seeds; tolerances come from the binomial law: a record's count over P passes
is Binomial(P, q), and with R records checked at once a deviation beyond z standard deviations,
z = sqrt(2 ln(2 R / alpha)) (Gaussian tail, Bonferroni), has probability below alpha = 1e-6.
"""

from __future__ import annotations

import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.accounting import compute_epsilon
from tf_dp.ledger import PrivacyLedger


def _passes(batches, passes):
    """[passes, b] lists of the record ids of each step (non-padding rows)."""
    out = []
    for _ in range(passes):
        out.append([xb.numpy()[w.numpy() > 0, 0].astype(int) for xb, _, w in batches.dataset])
    return out


def test_inclusion_probabilities_and_separation():
    n, b, q, passes = 120, 4, 0.3, 150
    x = np.arange(n, dtype=np.float32)[:, None]
    batches = tf_dp.data.cyclic_poisson_batches(
        x, np.zeros(n, np.int32), num_parts=b, sampling_probability=q, seed=3
    )
    sizes = np.bincount(batches.parts, minlength=b)
    assert set(sizes) <= {n // b, -(-n // b)} and sizes.sum() == n
    counts = np.zeros(n)
    last_step = np.full(n, -1)
    for p, steps in enumerate(_passes(batches, passes)):
        for t, ids in enumerate(steps):
            # step t holds records of part t only (exact), each at most once
            assert np.all(batches.parts[ids] == t) and len(set(ids)) == len(ids)
            gap = p * b + t - last_step[ids]
            # b-min-separation: consecutive participations at least b steps apart (exact)
            assert np.all((last_step[ids] < 0) | ((gap >= b) & (gap % b == 0)))
            last_step[ids] = p * b + t
            counts[ids] += 1
    z = math.sqrt(2 * math.log(2 * n / 1e-6))
    sd = math.sqrt(passes * q * (1 - q))
    assert np.all(np.abs(counts - passes * q) <= z * sd), np.max(np.abs(counts - passes * q)) / sd
    # the pooled rate: n * passes Bernoulli(q) draws
    pooled_sd = math.sqrt(q * (1 - q) / (n * passes))
    assert abs(counts.sum() / (n * passes) - q) <= 5 * pooled_sd


def test_inclusion_never_above_the_recorded_rate_at_the_float64_grid(monkeypatch):
    """A float64 uniform is a multiple of 2^-52; a rate q off that grid must take the
    floor(q 2^52) lowest values only (probability <= q, the rule of every tf_dp Poisson sampler):
    the value k0 2^-52 with k0 = floor(q 2^52) is out, k0 - 1 is in (counted by hand here)."""
    import tensorflow as tf

    n, b, q = 30, 3, 0.1  # 0.1 is not a multiple of 2^-52
    k0 = math.floor(q * 2**52)
    assert k0 * 2.0**-52 < q < (k0 + 1) * 2.0**-52
    x = np.arange(n, dtype=np.float32)[:, None]
    real = tf.random.stateless_uniform
    for k, joins in ((k0, False), (k0 - 1, True)):
        def fake(shape, seed, dtype=tf.float32, k=k, **_):
            return tf.fill(shape, tf.constant(k * 2.0**-52, tf.float64))

        monkeypatch.setattr(tf.random, "stateless_uniform", fake)
        batches = tf_dp.data.cyclic_poisson_batches(
            x, np.zeros(n, np.int32), num_parts=b, sampling_probability=q, seed=0
        )
        monkeypatch.setattr(tf.random, "stateless_uniform", real)
        (steps,) = _passes(batches, 1)
        for t, ids in enumerate(steps):
            want = np.flatnonzero(batches.parts == t) if joins else np.array([], int)
            np.testing.assert_array_equal(np.sort(ids), want)


def test_fit_records_the_claim_and_it_round_trips(tmp_path):
    n, b, batch = 64, 4, 4
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = rng.integers(0, 2, n)
    batches = tf_dp.data.cyclic_poisson_batches(x, y, num_parts=b, batch_size=batch, seed=1)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)]))
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.2)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(batches, epochs=2, verbose=0)
    entries = opt.ledger.samples()
    assert len(entries) == 2 * b
    for e in entries:
        s = e.sampling
        assert (s.population_size, s.policy, s.num_parts, s.origin) == (
            n,
            "cyclic_poisson",
            b,
            "sampled",
        )
        assert s.selection_probability == pytest.approx(batch * b / n, rel=1e-12)
    path = str(tmp_path / "ledger.json")
    opt.ledger.save(path)
    again = PrivacyLedger.load(path).samples()
    assert [e.sampling for e in again] == [e.sampling for e in entries]
    # DP-SGD accounting: Poisson sampling at rate q at every step (an upper bound), as
    # dp_accounting's RDP accountant computes it
    q, steps, delta = batch * b / n, 2 * b, 1e-5
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(1.2)), steps)
    ours = compute_epsilon(opt.ledger, delta, "rdp")
    assert ours.epsilon <= acc.get_epsilon(delta) * (1 + 1e-6)
    assert ours.epsilon >= acc.get_epsilon(delta) * 0.9  # same event: a tight, not loose, bound
    assert "cyclic Poisson" in str(ours)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 4}, "num_parts is required"),
        ({"num_parts": 0, "batch_size": 4}, "num_parts"),
        ({"num_parts": 65, "batch_size": 1}, r"num_parts must be in \[1, n=64\]"),
        ({"num_parts": 4, "batch_size": 17}, r"batch_size must be in \[1, n / num_parts"),
        ({"num_parts": 4}, "exactly one of batch_size and sampling_probability"),
    ],
)
def test_bad_arguments_name_the_argument_and_range(kwargs, match):
    x = np.zeros((64, 2), "float32")
    with pytest.raises(ValueError, match=match):
        tf_dp.data.cyclic_poisson_batches(x, np.zeros(64), **kwargs)


def test_sampling_claim_needs_num_parts_exactly_with_its_policy():
    with pytest.raises(ValueError, match="num_parts must be an integer"):
        tf_dp.data.Sampling(100, 0.1, "cyclic_poisson")
    with pytest.raises(ValueError, match="num_parts must be None"):
        tf_dp.data.Sampling(100, 0.1, "poisson", num_parts=4)
    s = tf_dp.data.Sampling(100, 0.2, "cyclic_poisson", num_parts=4)
    assert s.expected_batch_size == pytest.approx(5.0)


# -- the random-access source version: only the selected records are read ------------------------


class _CountingSource(tf_dp.data.ArraySource):
    """An ArraySource that logs the indices of every read."""

    def __init__(self, *args):
        super().__init__(*args)
        self.reads = []

    def read(self, indices):
        self.reads.append(np.asarray(indices).copy())
        return super().read(indices)


def test_source_inclusion_statistics_separation_and_only_selected_reads():
    n, b, q, passes = 120, 4, 0.3, 100
    source = _CountingSource(np.arange(n, dtype=np.float32)[:, None], np.zeros(n, np.int32))
    batches = tf_dp.data.cyclic_poisson_sample(source, num_parts=b, sampling_probability=q,
                                               seed=3)
    assert batches.sampling == tf_dp.data.Sampling(n, q, "cyclic_poisson", origin="sampled",
                                                   num_parts=b)
    sizes = np.bincount(batches.parts, minlength=b)
    assert set(sizes) <= {n // b, -(-n // b)} and sizes.sum() == n
    source.reads.clear()  # the element spec's read of record 0 at construction
    counts = np.zeros(n)
    last_step = np.full(n, -1)
    for p, steps in enumerate(_passes(batches, passes)):
        for t, ids in enumerate(steps):
            assert np.all(batches.parts[ids] == t) and len(set(ids)) == len(ids)
            gap = p * b + t - last_step[ids]
            assert np.all((last_step[ids] < 0) | ((gap >= b) & (gap % b == 0)))
            last_step[ids] = p * b + t
            counts[ids] += 1
    # every read asked for exactly the records of one batch, nothing else (exact)
    read = np.concatenate(source.reads)
    assert len(read) == counts.sum() and np.array_equal(np.bincount(read, minlength=n), counts)
    z = math.sqrt(2 * math.log(2 * n / 1e-6))
    sd = math.sqrt(passes * q * (1 - q))
    assert np.all(np.abs(counts - passes * q) <= z * sd), np.max(np.abs(counts - passes * q)) / sd
    pooled_sd = math.sqrt(q * (1 - q) / (n * passes))
    assert abs(counts.sum() / (n * passes) - q) <= 5 * pooled_sd


def test_source_version_fits_and_records_its_claim():
    n, b = 64, 4
    rng = np.random.default_rng(0)
    source = tf_dp.data.ArraySource(rng.normal(size=(n, 3)).astype("float32"),
                                    rng.integers(0, 2, n).astype("int32"))
    batches = tf_dp.data.cyclic_poisson_sample(source, num_parts=b, batch_size=4, seed=1)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(batches, epochs=2, verbose=0)
    runs = opt.ledger.runs()
    assert sum(c for _, c in runs) == 2 * b
    for entry, _ in runs:
        s = entry.sampling
        assert (s.policy, s.num_parts, s.population_size, s.origin) == (
            "cyclic_poisson", b, n, "sampled")
        assert s.selection_probability == pytest.approx(4 * b / n, rel=2.0**-23)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"batch_size": 4}, "num_parts is required"),
        ({"num_parts": 65, "batch_size": 1}, r"num_parts must be in \[1, n=64\]"),
        ({"num_parts": 4, "batch_size": 17}, r"batch_size must be in \[1, n / num_parts"),
        ({"num_parts": 4, "batch_size": 2, "prefetch": 0}, "prefetch"),
    ],
)
def test_source_version_names_bad_arguments(kwargs, match):
    source = tf_dp.data.ArraySource(np.zeros((64, 2), "float32"), np.zeros(64))
    with pytest.raises(ValueError, match=match):
        tf_dp.data.cyclic_poisson_sample(source, **kwargs)
