"""What the ledger records, and when: each fit declares its own sampling, the ledger travels with
the model (``.keras`` files, weights, recompiles), and seeded runs are not called guarantees."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp import accounting
from tf_dp.keras import DPKerasSGDOptimizer, make_private

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _data(n=200, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    return x, y


def _model(seed=0, **opt):
    keras.utils.set_random_seed(seed)
    model = make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
    model.compile(
        optimizer=DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=opt.pop("noise_multiplier", 1.1),
            learning_rate=0.1, **opt),
        loss=LOSS, metrics=["accuracy"])
    return model


def test_a_later_fit_does_not_reuse_an_earlier_fits_sampling():
    x, y = _data()
    model = _model()
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=1), verbose=0)
    recorded = model.optimizer.ledger.num_samples
    weights = [w.numpy() for w in model.weights]
    dataset = tf.data.Dataset.from_tensor_slices((x[:100], y[:100])).batch(50)
    with pytest.raises(ValueError, match="set_sampling"):
        model.fit(dataset, epochs=3, verbose=0)
    assert model.optimizer.ledger.num_samples == recorded
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights))
    # An explicit declaration for this input is used as declared.
    model.optimizer.set_sampling(100, 0.5, "shuffle")
    model.fit(dataset, epochs=3, verbose=0)
    late = model.optimizer.ledger.samples()[recorded:]
    assert len(late) == 6
    assert {(e.sampling.population_size, e.sampling.selection_probability, e.sampling.policy)
            for e in late} == {(100, 0.5, "shuffle")}


def test_array_fit_sampling_is_not_inherited_either():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=50, verbose=0)
    with pytest.raises(ValueError, match="cannot tell how this input samples"):
        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(20), verbose=0)


def test_ledger_travels_through_save_weights_and_recompile(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=50, epochs=2, verbose=0)
    recorded = model.optimizer.ledger.samples()
    assert len(recorded) == 8
    path = str(tmp_path / "w.weights.h5")
    model.save_weights(path)

    fresh = _model(seed=1)
    fresh.fit(x, y, batch_size=100, epochs=1, verbose=0)  # 2 steps
    assert fresh.optimizer.ledger.num_samples == 2
    fresh.load_weights(path)  # the saved ledger (8 steps) is longer: it replaces the current one
    assert fresh.optimizer.ledger.samples() == recorded

    # Recompiling with a new DP optimizer continues the model's ledger.
    fresh.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=2.0, noise_multiplier=3.0),
                  loss=LOSS)
    assert fresh.optimizer.ledger.samples() == recorded
    fresh.fit(x, y, batch_size=100, verbose=0)
    entries = fresh.optimizer.ledger.samples()
    assert entries[:8] == recorded and len(entries) == 10
    assert entries[9].queries[0].noise_stddev == pytest.approx(6.0)


def test_make_private_on_a_reloaded_plain_model_keeps_the_ledger(tmp_path):
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=50, verbose=0)
    recorded = model.optimizer.ledger.samples()
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)  # a plain Sequential with its DP optimizer
    assert loaded.optimizer.ledger.samples() == recorded
    loaded = make_private(loaded)
    loaded.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1),
                   loss=LOSS)
    assert loaded.optimizer.ledger.samples() == recorded
    budget = tf_dp.keras.PrivacyBudget(target_epsilon=50.0, delta=1e-5)
    loaded.fit(x, y, batch_size=50, verbose=0, callbacks=[budget])
    assert loaded.optimizer.ledger.num_samples == len(recorded) + 4


def test_training_on_with_a_ledger_that_misses_steps_is_refused():
    x, y = _data()
    model = _model()
    model.fit(x, y, batch_size=50, verbose=0)
    model.optimizer.ledger.reset()  # e.g. a model restored from a file written without it
    weights = [w.numpy() for w in model.weights]
    with pytest.raises(ValueError, match="applied 4 steps but its ledger records only 0"):
        model.fit(x, y, batch_size=50, verbose=0)
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.weights))
    # a recompile does not launder the missing steps
    model.compile(optimizer=DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1),
                  loss=LOSS)
    with pytest.raises(ValueError, match="ledger records only 0"):
        model.fit(x, y, batch_size=50, verbose=0)


def test_seeded_noise_is_recorded_and_not_called_a_guarantee(tmp_path):
    x, y = _data()
    model = _model(noise_seed=1234)
    model.fit(x, y, batch_size=50, verbose=0)
    path = tmp_path / "ledger.json"
    model.optimizer.ledger.save(path)
    entries = tf_dp.ledger.read_ledger_file(path)
    assert {q.noise_seed for e in entries for q in e.queries} == {1234}
    for acc in ("rdp", "pld"):
        result = accounting.compute_epsilon(path, delta=1e-5, accountant=acc)
        assert not result.certified and result.noise_seeds == (1234,)
        text = str(result)
        assert "NOT A PRIVACY GUARANTEE" in text and "1234" in text
        assert "proven upper bound" not in text
    unseeded = _model()
    unseeded.fit(x, y, batch_size=50, verbose=0)
    result = accounting.compute_epsilon(unseeded.optimizer.ledger, delta=1e-5)
    assert result.certified and not result.noise_seeds
    assert "proven upper bound" in str(result)


def test_empty_arrays_are_refused_with_a_clear_error():
    model = _model()
    with pytest.raises(ValueError, match="x holds 0 examples"):
        model.fit(np.zeros((0, 8), np.float32), np.zeros((0,), np.int64), verbose=0)
    assert model.optimizer.ledger.num_samples == 0


def test_class_weight_with_poisson_batches_weighs_the_per_example_loss():
    x, y = _data()
    y = np.ones_like(y)
    model = _model(noise_multiplier=0.0)
    weights = [w.numpy() for w in model.trainable_weights]
    # Class 1 weighted 0: every per-example loss is 0, so the (noise-free) update is exactly 0.
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=3),
              class_weight={0: 1.0, 1: 0.0}, verbose=0)
    assert model.optimizer.ledger.num_samples > 0
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.trainable_weights))
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=3),
              class_weight={1: 1.0}, verbose=0)
    assert not all(np.array_equal(a, w.numpy()) for a, w in zip(weights, model.trainable_weights))


def test_a_non_finite_update_is_withheld_and_counted():
    model = _model()
    x, y = _data(10)
    model.fit(x, y, batch_size=10, verbose=0)
    opt = model.optimizer
    variables = model.trainable_variables
    before = [v.numpy() for v in variables]
    iterations = int(opt.iterations.numpy())

    @tf.function
    def apply(grads):
        opt.apply_dp_gradients(grads, variables)

    apply([tf.fill(v.shape, np.nan) for v in variables])
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
    assert int(opt.iterations.numpy()) == iterations and opt.skipped_steps == 1
    apply([tf.ones(v.shape) for v in variables])
    assert not all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))
    assert opt.skipped_steps == 1
