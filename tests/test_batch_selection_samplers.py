"""Truncated Poisson and balls-in-bins samplers: inclusion statistics against theory (fixed
seeds; tolerances from the binomial laws, Bonferroni-corrected, rejection level 1e-4), the
sampling claim each hands to ``fit``, the public denominator, and a Keras fit on each."""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
from scipy import optimize, stats

import tf_dp
from tf_dp.accounting import compute_epsilon
from tf_dp.data import balls_in_bins_batches, truncated_poisson_batches

LEVEL = 1e-4  # rejection level of every statistical check in this file


def _indexed(n):
    return np.arange(n, dtype=np.float32)[:, None], np.zeros(n, np.int32)


def _real_rows(batch):
    xb, _, w = batch
    return xb.numpy()[w.numpy() > 0, 0].astype(int)


def _chisquare_ok(observed, expected):
    """Chi-square goodness of fit, cells with expected count < 5 merged into their neighbour."""
    obs, exp = [], []
    o_acc = e_acc = 0.0
    for o, e in zip(observed, expected):
        o_acc, e_acc = o_acc + o, e_acc + e
        if e_acc >= 5:
            obs.append(o_acc)
            exp.append(e_acc)
            o_acc = e_acc = 0.0
    if e_acc > 0:
        obs[-1] += o_acc
        exp[-1] += e_acc
    exp = np.asarray(exp) * (sum(obs) / sum(exp))
    return stats.chisquare(obs, exp).pvalue > LEVEL


def test_truncated_poisson_batch_sizes_and_inclusion_follow_the_truncated_binomial():
    n, q, b, steps = 40, 0.25, 8, 3000  # mean sample 10 > B = 8: heavy truncation
    x, y = _indexed(n)
    batches = truncated_poisson_batches(x, y, sampling_probability=q, max_batch_size=b,
                                        steps_per_epoch=steps, seed=11)
    sizes = np.zeros(b + 1)
    counts = np.zeros(n)
    for batch in batches.dataset:
        assert batch[0].shape[0] == batch[2].shape[0] == b  # one fixed shape
        rows = _real_rows(batch)
        assert len(np.unique(rows)) == len(rows)  # no record twice in a batch
        sizes[len(rows)] += 1
        counts[rows] += 1
    # kept size = min(Binomial(n, q), B)
    expected = stats.binom.pmf(np.arange(b + 1), n, q)
    expected[b] = stats.binom.sf(b - 1, n, q)
    assert _chisquare_ok(sizes, expected * steps)
    # a record is kept with probability q E[min(1, B / (K + 1))], K ~ Binomial(n - 1, q)
    k = np.arange(n)
    p = q * np.sum(stats.binom.pmf(k, n - 1, q) * np.minimum(1.0, b / (k + 1)))
    z = stats.norm.isf(LEVEL / (2 * n))  # Bonferroni over the n records
    sd = math.sqrt(steps * p * (1 - p))
    assert np.all(np.abs(counts - steps * p) <= z * sd)
    assert p < q  # truncation lowered the rate, as it must


def test_truncated_poisson_claim_and_argument_errors():
    x, y = _indexed(100)
    batches = truncated_poisson_batches(x, y, sampling_probability=0.1, max_batch_size=15)
    s = batches.sampling
    assert (s.policy, s.max_batch_size, s.origin, s.population_size) == (
        "truncated_poisson", 15, "sampled", 100)
    assert "truncated at 15" in s.describe()
    with pytest.raises(ValueError, match=r"max_batch_size must be in \[1, n=100\]"):
        truncated_poisson_batches(x, y, sampling_probability=0.1, max_batch_size=101)
    with pytest.raises(ValueError, match="sampling_probability must be in"):
        truncated_poisson_batches(x, y, sampling_probability=1.5)
    with pytest.raises(ValueError, match="truncation_probability must be in"):
        truncated_poisson_batches(x, y, sampling_probability=0.1, truncation_probability=0)


def test_default_truncation_size_is_the_smallest_b_with_the_stated_tail():
    from tf_dp.data import default_truncation_size

    for n, q, p in [(60000, 256 / 60000, 1e-6), (1000, 0.05, 1e-3), (50, 0.5, 1e-2)]:
        b = default_truncation_size(n, q, p)
        assert stats.binom.sf(b, n, q) <= p < stats.binom.sf(b - 1, n, q)


def test_balls_in_bins_uses_every_example_once_per_pass_with_uniform_bins():
    n, t, passes = 60, 10, 300
    x, y = _indexed(n)
    batches = balls_in_bins_batches(x, y, num_batches=t, seed=5)
    assert batches.steps_per_epoch == t and batches.sampling.selection_probability == 1 / t
    first_sizes = np.zeros(n + 1)
    bins_of = np.zeros((passes, n), int)
    for p in range(passes):
        seen = []
        for j, batch in enumerate(batches.dataset):  # one iteration = one pass
            rows = _real_rows(batch)
            bins_of[p, rows] = j
            seen.append(rows)
            if j == 0:
                first_sizes[len(rows)] += 1
        assert len(seen) == t
        assert sorted(np.concatenate(seen).tolist()) == list(range(n))  # each exactly once
    assert len({tuple(r) for r in bins_of}) == passes  # a fresh assignment every pass
    # a batch holds Binomial(n, 1/T) examples (first batch of each pass: independent passes)
    assert _chisquare_ok(first_sizes, stats.binom.pmf(np.arange(n + 1), n, 1 / t) * passes)
    # each example's batch is uniform over the T batches (n * passes independent throws)
    assert _chisquare_ok(np.bincount(bins_of.ravel(), minlength=t), np.full(t, n * passes / t))


def test_balls_in_bins_argument_errors():
    x, y = _indexed(20)
    with pytest.raises(ValueError, match="exactly one of batch_size"):
        balls_in_bins_batches(x, y)
    with pytest.raises(ValueError, match=r"num_batches must be in \[1, n=20\]"):
        balls_in_bins_batches(x, y, num_batches=21)
    with pytest.raises(ValueError, match=r"batch_size must be in \[1, n=20\]"):
        balls_in_bins_batches(x, y, batch_size=21)
    with pytest.raises(ValueError, match="batch_size must be None or an integer >= 1"):
        balls_in_bins_batches(x, y, batch_size=0)


def _model(noise, lr=0.1, clip=1.0):
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((1,)), keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=noise, learning_rate=lr, noise_seed=0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _gaussian_epsilon(mu, delta):
    def f(eps):
        return (stats.norm.cdf(mu / 2 - eps / mu)
                - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu) - delta)
    return optimize.brentq(f, 0.0, 100.0, xtol=1e-12)


def test_fit_on_truncated_poisson_records_policy_and_b():
    x, y = _indexed(120)
    x, y = x / 120.0, (np.arange(120) % 3).astype(np.int32)
    batches = truncated_poisson_batches(x, y, sampling_probability=0.1, seed=3)
    model = _model(noise=1.0)
    model.fit(batches, epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 2 * batches.steps_per_epoch
    for e in entries:
        s = e.sampling
        assert (s.policy, s.max_batch_size, s.origin) == (
            "truncated_poisson", batches.max_batch_size, "sampled")
        assert (s.population_size, s.selection_probability) == (120, 0.1)
    result = compute_epsilon(model.optimizer.ledger, 1e-5, "pld")
    assert "truncated Poisson" in result.assumptions


def test_truncated_batches_divide_by_the_public_expected_size():
    """q = 1 and B = 4 of n = 10: every batch holds exactly 4 real rows. The update must divide
    the clipped sum by q n = 10 (public), not by the 4 rows (a private count)."""
    n, b = 10, 4
    x = np.ones((n, 1), np.float32)
    y = np.zeros(n, np.int32)
    batches = truncated_poisson_batches(x, y, sampling_probability=1.0, max_batch_size=b,
                                        steps_per_epoch=1, seed=0)
    model = _model(noise=0.0, lr=1.0, clip=1e6)  # no clipping, no noise
    before = [w.copy() for w in model.get_weights()]
    with_grad = keras.Sequential([keras.Input((1,)), keras.layers.Dense(3)])
    with_grad.set_weights(before)
    import tensorflow as tf

    with tf.GradientTape() as tape:  # the per-example gradient (all examples are identical)
        logits = with_grad(x[:1])
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(y[:1], logits)
    grads = tape.gradient(loss, with_grad.trainable_variables)
    model.fit(batches, epochs=1, verbose=0)
    for w0, w1, g in zip(before, model.get_weights(), grads):
        # float32 step of a few terms: relative error ~1e-6
        np.testing.assert_allclose(w0 - w1, g.numpy() * b / n, rtol=1e-5, atol=1e-7)


def test_fit_on_balls_in_bins_counts_one_gaussian_per_epoch():
    n, t, z = 60, 6, 2.0
    x, y = _indexed(n)
    x, y = x / n, (np.arange(n) % 3).astype(np.int32)
    batches = balls_in_bins_batches(x, y, num_batches=t, seed=4)
    model = _model(noise=z)
    model.fit(batches, epochs=3, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 3 * t
    assert [e.sampling.pass_start for e in entries] == ([True] + [False] * (t - 1)) * 3
    assert {e.sampling.policy for e in entries} == {"balls_in_bins"}
    result = compute_epsilon(model.optimizer.ledger, 1e-5, "pld")
    exact = _gaussian_epsilon(math.sqrt(3) / z, 1e-5)  # 3 epochs, sensitivity C each
    assert exact <= result.epsilon <= exact * 1.005
    with pytest.raises(ValueError, match=r"steps_per_epoch must be None or 6"):
        model.fit(batches, epochs=1, steps_per_epoch=4, verbose=0)


def test_every_selection_returns_sampled_batches_with_one_interface():
    x = np.arange(200, dtype=np.float32).reshape(100, 2)
    y = np.zeros(100, np.int32)
    made = {
        "poisson": tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=1),
        "truncated_poisson": truncated_poisson_batches(x, y, sampling_probability=0.1, seed=1),
        "balls_in_bins": balls_in_bins_batches(x, y, batch_size=10, seed=1),
    }
    for policy, b in made.items():
        assert isinstance(b, tf_dp.data.SampledBatches)
        assert b.sampling.policy == policy and b.sampling.origin == "sampled"
        assert (b.population_size, b.sampling_probability) == b.tf_dp_sampling
        assert b.population_size == 100
        assert b.expected_batch_size == pytest.approx(10.0)
        assert len(b) == b.steps_per_epoch == 10


@pytest.mark.parametrize("kind", ["truncated_poisson", "balls_in_bins"])
def test_privacy_budget_stops_before_the_step_that_would_exceed(kind):
    """PrivacyBudget on the fixed-shape selections: the run stops at the last step whose epsilon
    is within the target (truncated Poisson: any step; balls-in-bins: an epoch boundary, since the
    first step of an epoch costs the epoch's whole Gaussian), found here step by step from
    hyperparameter runs of the same selection."""
    n, z, delta = 120, 2.0, 1e-5
    x, y = _indexed(n)
    x, y = x / n, (np.arange(n) % 3).astype(np.int32)
    if kind == "truncated_poisson":
        batches = truncated_poisson_batches(x, y, sampling_probability=0.1, seed=3)
        extra = {"max_batch_size": batches.max_batch_size}
    else:
        batches = balls_in_bins_batches(x, y, batch_size=12, seed=3)
        extra = {}
    t = batches.steps_per_epoch

    def eps(steps):  # the ledger of `steps` steps of this selection, from its hyperparameters
        entry, _ = tf_dp.accounting.dp_sgd_run(n, 12, z, steps=1, sampling=kind, **extra)
        return compute_epsilon([(entry, steps)], delta, "rdp").epsilon

    if kind == "balls_in_bins":  # a step opening epoch e is charged as the whole epoch
        charged = [eps(math.ceil(k / t) * t) for k in range(1, 6 * t + 1)]
    else:
        charged = [eps(k) for k in range(1, 6 * t + 1)]
    stop = 3 * t - 1 if kind == "truncated_poisson" else 3 * t  # within the third epoch / at its end
    target = 0.5 * (charged[stop - 1] + charged[stop])
    expected = max(k for k in range(1, len(charged) + 1) if charged[k - 1] <= target)
    budget = tf_dp.keras.PrivacyBudget(target_epsilon=target, delta=delta, verbose=False)
    model = _model(noise=z)
    model.fit(batches, epochs=6, verbose=0, callbacks=[budget])
    assert budget.stopped
    assert model.optimizer.ledger.num_samples == expected == stop
    spent = compute_epsilon(model.optimizer.ledger, delta, "rdp").epsilon
    assert spent <= target
