"""tf_dp.data.shuffled_passes: sequential pipelines in full passes, recorded as shuffle batches."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tf_dp.data import poisson_batches, shuffled_passes


def _dataset(n):
    x = np.stack([np.arange(n), -np.arange(n)], axis=1).astype(np.float32)
    y = np.arange(n).astype(np.int32)
    return tf.data.Dataset.from_tensor_slices((x, y))


def test_every_record_once_per_pass_in_fixed_size_batches():
    n, b = 23, 5
    sp = shuffled_passes(_dataset(n), population_size=n, batch_size=b, shuffle_buffer_size=n,
                         seed=1)
    assert sp.steps_per_epoch == 5 and sp.tf_dp_sampling == (n, b / n)
    assert sp.sampling == tf_dp.data.Sampling(n, b / n, "shuffle", "sampled")
    orders = []
    for _ in range(2):
        batches = list(sp.dataset.as_numpy_iterator())
        assert [len(w) for _, _, w in batches] == [5, 5, 5, 5, 3]
        ids = np.concatenate([y for _, y, _ in batches])
        assert sorted(ids) == list(range(n))
        np.testing.assert_array_equal(np.concatenate([x for x, _, _ in batches])[:, 0], ids)
        orders.append(ids)
    assert list(orders[0]) != list(orders[1])  # a new shuffle every pass


@pytest.mark.parametrize("records", [21, 26, 12])
def test_a_pass_of_another_size_raises_naming_population_size(records):
    sp = shuffled_passes(_dataset(records), population_size=23, batch_size=5)
    with pytest.raises(tf.errors.OpError, match="population_size=23"):
        list(sp.dataset.as_numpy_iterator())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"population_size": 0, "batch_size": 1}, "population_size"),
        ({"population_size": 10, "batch_size": 11}, r"batch_size must be in \[1, population_size"),
        ({"population_size": 10, "batch_size": 2, "shuffle_buffer_size": 0},
         "shuffle_buffer_size"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        shuffled_passes(_dataset(10), **kwargs)


def test_bad_datasets_are_refused():
    with pytest.raises(ValueError, match="dataset must be finite"):
        shuffled_passes(_dataset(10).repeat(), 10, 2)
    with pytest.raises(ValueError, match=r"single records \(x, y\)"):
        shuffled_passes(_dataset(10).map(lambda x, y: x), 10, 2)
    with pytest.raises(TypeError, match="dataset must be a tf.data.Dataset"):
        shuffled_passes(np.zeros((10, 2)), 10, 2)


def test_poisson_batches_hand_over_a_sampled_poisson_claim():
    x = np.zeros((50, 2), np.float32)
    pb = poisson_batches(x, np.zeros(50, np.int32), sampling_probability=0.1)
    assert pb.sampling == tf_dp.data.Sampling(50, 0.1, "poisson", "sampled")


def test_fit_records_shuffle_sampling_and_the_bound_without_amplification():
    n, b, epochs, z = 40, 8, 3, 1.0
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=z, learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ds = _dataset(n).map(lambda x, y: (x / n, y % 3))
    model.fit(shuffled_passes(ds, n, b), epochs=epochs, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == epochs * 5
    for e in entries:
        assert e.sampling.policy == "shuffle"
        assert (e.sampling.population_size, e.sampling.selection_probability) == (n, b / n)
    # Independent: each pass is one Gaussian mechanism of a replace-one neighbour (sensitivity
    # 2C), so the run is exactly mu-GDP with mu = sqrt(epochs) * 2 / z; its exact epsilon at
    # delta (closed form of Dong, Roth & Su) is a lower bound for any valid accountant.
    delta = 1e-5
    mu = math.sqrt(epochs) * 2 / z

    def gdp_delta(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2)

    from scipy.optimize import brentq

    exact = brentq(lambda e: gdp_delta(e) - delta, 0, 100)
    pld = tf_dp.accounting.compute_epsilon(model.optimizer.ledger, delta, accountant="pld")
    assert exact <= pld.epsilon <= exact * 1.02


def test_declaring_poisson_for_shuffled_batches_understates_epsilon():
    """The gap of a false 'poisson' declaration (docs/data.md): 60000 records, batch 256,
    noise 1.1, 5 epochs, delta 1e-5, against dp_accounting as the independent accountant."""
    import dp_accounting
    n, b, z, epochs, delta = 60000, 256, 1.1, 5, 1e-5
    steps = epochs * math.ceil(n / b)
    declared = tf_dp.accounting.dp_sgd_epsilon(n, b, z, delta, steps=steps).epsilon
    real = tf_dp.accounting.dp_sgd_epsilon(n, b, z, delta, epochs=epochs, sampling="shuffle")
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(
        b / n, dp_accounting.GaussianDpEvent(z)), steps)
    assert declared == pytest.approx(acc.get_epsilon(delta), rel=0.02)
    assert round(declared, 2) == 0.92
    # Shuffled: 5 full-batch Gaussian mechanisms with sensitivity 2C (noise z / 2 each).
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(z / 2), epochs)
    assert real.epsilon == pytest.approx(acc.get_epsilon(delta), rel=0.02)
    assert round(real.epsilon, 1) == 26.5


@pytest.mark.parametrize("records", [21, 25, 40])
def test_a_pass_longer_than_population_size_raises_before_its_last_batch(records):
    # population_size a multiple of batch_size: the last batch of the declared pass is full, so
    # the excess records are only seen by reading past it.
    n, b = 20, 5
    sp = shuffled_passes(_dataset(records), population_size=n, batch_size=b)
    iterator = iter(sp.dataset)
    delivered = 0
    with pytest.raises(tf.errors.OpError, match="population_size=20: .* more than 20 records"):
        for _ in range(sp.steps_per_epoch):
            next(iterator)
            delivered += 1
    assert delivered == n // b - 1  # the pass's last batch was never handed over


def test_fit_on_a_pass_longer_than_population_size_stops_before_the_passs_last_step():
    n, b, records = 20, 5, 21  # one record more than declared
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    ds = _dataset(records).map(lambda x, y: (x / records, y % 3))
    assert sum(1 for _ in ds) == records  # counted by tf.data itself
    with pytest.raises(tf.errors.OpError, match="population_size=20"):
        model.fit(shuffled_passes(ds, n, b), epochs=2, verbose=0)
    # the steps before the last batch of the first pass ran and were recorded; no more
    assert int(model.optimizer.iterations.numpy()) == n // b - 1
    assert model.optimizer.ledger.num_samples == n // b - 1
