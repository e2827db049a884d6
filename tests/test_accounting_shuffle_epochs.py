"""Shuffled fixed-size batches: epochs are counted as they ran (the last batch of a Keras epoch is
partial, so an epoch is ceil(n / b) steps), from hyperparameters and from a ledger; long runs are
composed without being listed."""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

from tf_dp import accounting as acc
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent


def _shuffle_entry(n, b, noise=2.0, q=None):
    q = b / n if q is None else q
    return SampleEntry(SamplingEvent(n, q, "shuffle"), (SumQueryEvent(1.0, noise),))


def test_given_epochs_are_counted_not_rounded_up():
    # 10000 / 64: 157 steps per epoch, the last one of 16 examples. Five epochs are five full-batch
    # Gaussians with noise multiplier 2 / 2 = 1: mu = sqrt(5), not sqrt(6).
    r = acc.dp_sgd_epsilon(10000, 64, 2.0, 1e-5, epochs=5, sampling="shuffle", accountant="gdp")
    assert r.steps == 5 * 157
    assert r.mu == pytest.approx(math.sqrt(5.0), rel=1e-12)
    # A fractional epoch still counts as a whole one.
    r = acc.dp_sgd_epsilon(10000, 64, 2.0, 1e-5, epochs=4.5, sampling="shuffle",
                           accountant="gdp")
    assert r.mu == pytest.approx(math.sqrt(5.0), rel=1e-12)
    # Poisson plans the steps its samplers run: round(n / b) = 156 per epoch (expected batch b).
    assert acc.dp_sgd_epsilon(10000, 64, 2.0, 1e-5, epochs=5).steps == 5 * 156


@pytest.mark.parametrize("steps,epochs", [(785, 5), (786, 6), (157, 1), (158, 2), (782, 5)])
def test_ledger_of_keras_epochs_counts_them(steps, epochs):
    for q in (64 / 10000, float(np.float32(64 / 10000))):  # q as float64 and as float32
        r = acc.compute_epsilon([_shuffle_entry(10000, 64, q=q)] * steps, 1e-5, "gdp")
        assert r.mu == pytest.approx(math.sqrt(epochs), rel=1e-12), (steps, q)
    assert acc.shuffle_epochs(steps, 10000, 64 / 10000) == epochs


def test_ledger_of_exact_division_unchanged():
    # b divides n: 100 steps per epoch; 250 steps touch 3 epochs.
    assert acc.shuffle_steps_per_epoch(10000, 0.01) == 100
    r = acc.compute_epsilon([_shuffle_entry(10000, 100, noise=1.0)] * 250, 1e-5, "gdp")
    assert r.mu == pytest.approx(2.0 * math.sqrt(3.0))


def test_keras_fit_ledger_counts_the_epochs_it_ran():
    import keras

    import tf_dp.keras as dpk

    keras.utils.set_random_seed(0)
    model = dpk.make_private(keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=2.0),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = np.random.default_rng(0).normal(size=(10, 3)).astype(np.float32)
    y = np.arange(10) % 2
    model.fit(x, y, batch_size=4, epochs=5, verbose=0)  # batches of 4, 4, 2 in each epoch
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 15
    r = acc.compute_epsilon(entries, 1e-5, "gdp")
    # Five epochs of one full-batch Gaussian with noise multiplier 2 / 2 (replace-one: 2C).
    assert r.mu == pytest.approx(math.sqrt(5.0), rel=1e-6)
    same = acc.dp_sgd_epsilon(10, 4, 2.0, 1e-5, epochs=5, sampling="shuffle", accountant="gdp")
    assert same.steps == 15 and same.mu == pytest.approx(r.mu, rel=1e-6)


def test_long_runs_are_composed_without_listing_them():
    # 1e9 epochs of MNIST of round(60000 / 256) = 234 steps: 2.3e11 steps, never materialised.
    r = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=1e9)
    assert r.steps == 234000000000 and math.isfinite(r.epsilon) and r.epsilon > 1e6
    assert acc.dp_sgd_run(60000, 256, 1.1, epochs=1e9)[1] == 234000000000
    with pytest.raises(ValueError, match="too many to list"):
        acc.dp_sgd_entries(60000, 256, 1.1, epochs=1e9)
    with pytest.raises(ValueError, match=r"epochs must be in \(0, "):
        acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=1e300)
    # The PLD accountant reports losses beyond its cap as epsilon = inf (it used to fail with an
    # IndexError once all the mass had moved above the cap), and says what that means.
    p = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=1e9, accountant="pld")
    assert p.epsilon == math.inf and "loss cap" in str(p)


def test_pld_calibration_names_pld_when_unreachable():
    with pytest.raises(ValueError, match="'pld' accountant") as e:
        acc.calibrate_noise_multiplier(1e-6, 1e-10, 100, 100, epochs=1000, accountant="pld")
    assert "'rdp'" not in str(e.value)
