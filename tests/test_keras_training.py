"""Keras 3 DP training end to end: fit/evaluate/predict, exactness of one step, ledger, saving,
and the errors users meet. Small models, fixed seeds, noise 0 where values are compared."""

import dataclasses
import os

import numpy as np
import pytest
import keras
import tensorflow as tf

import tf_dp.keras as dpk
from tests.helpers.tolerance import dense_gradient_terms, sgd_tolerance
from tf_dp.dp_query import GaussianSumQuery

HUGE_CLIP = 1e9


def mlp(seed=0, regularizer=None):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh", kernel_regularizer=regularizer),
            keras.layers.Dense(3),
        ]
    )


def data(n=20, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, 6)).astype(np.float32), rng.integers(0, 3, n).astype(np.int32)


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def one_step_nonprivate(model, x, y, lr):
    model.compile(optimizer=keras.optimizers.SGD(lr), loss=LOSS)
    model.fit(x, y, batch_size=len(x), epochs=1, shuffle=False, verbose=0)
    return [w.numpy() for w in model.trainable_variables]


@pytest.mark.parametrize(
    "mode,kwargs",
    [
        ("vectorized", {}),
        ("microbatch", {"num_microbatches": 1}),  # one microbatch: its mean is the batch mean
        ("auto", {}),
    ],
)
def test_huge_clip_no_noise_step_equals_nonprivate(mode, kwargs):
    x, y = data(8)
    expected = one_step_nonprivate(mlp(regularizer=keras.regularizers.L2(0.1)), x, y, 0.5)
    model = dpk.make_private(mlp(regularizer=keras.regularizers.L2(0.1)))
    opt = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=HUGE_CLIP, noise_multiplier=0.0, learning_rate=0.5, gradient_mode=mode,
        **kwargs,
    )
    model.compile(optimizer=opt, loss=LOSS)
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    # one step of two op orders in float32 (tests/helpers/tolerance.py): a per-example gradient of
    # the 6-5-3 MLP, the sum of 8, the division, the regulariser's term and the learning rate; the
    # update's scale is the mean of the examples' |gradients| plus the regulariser's 0.2 |w|
    start = mlp(regularizer=keras.regularizers.L2(0.1))
    w0 = max(float(np.abs(w).max()) for w in start.get_weights())
    per_example = []
    for i in range(8):
        with tf.GradientTape() as tape:
            value = LOSS(y[i:i + 1], start(x[i:i + 1]))
        per_example.append(max(float(np.abs(g).max())
                               for g in tape.gradient(value, start.trainable_variables)))
    atol = sgd_tolerance("float32", 1, 0.5, float(np.mean(per_example)) + 0.2 * w0,
                         dense_gradient_terms([6, 5, 3]) + 8 + 1 + 2, weight_scale=w0 + 1.0)
    for a, e in zip(model.trainable_variables, expected):
        np.testing.assert_allclose(a.numpy(), e, rtol=0, atol=atol)


def test_regularizer_gradient_added_after_clipping():
    # Tiny clip: the data gradient is clipped to norm <= C per example; the L2 penalty's gradient
    # (2 * 0.1 * W, large) must still be applied in full.
    x, y = data(8)
    reg = 0.1
    model = dpk.make_private(mlp(regularizer=keras.regularizers.L2(reg)))
    w0 = [v.numpy() for v in model.trainable_variables]
    clip = 1e-6
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0, gradient_mode="vectorized"
        ),
        loss=LOSS,
    )
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    delta_kernel = w0[0] - model.trainable_variables[0].numpy()
    # data part has norm <= clip (average of clipped per-example gradients)
    np.testing.assert_allclose(delta_kernel, 2 * reg * w0[0], atol=2 * clip)
    delta_other = [a - b.numpy() for a, b in zip(w0[1:], model.trainable_variables[1:])]
    assert np.sqrt(sum(np.sum(d**2) for d in delta_other)) <= clip * 1.001


def _train(model_builder, mode="vectorized", n=20, batch=5, **opt_kwargs):
    x, y = data(n)
    model = model_builder()
    opt = dpk.DPKerasAdamOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-2, gradient_mode=mode,
        noise_seed=3, **opt_kwargs,
    )
    model.compile(optimizer=opt, loss=LOSS, metrics=["accuracy"])
    history = model.fit(x, y, batch_size=batch, epochs=2, verbose=0)
    return model, history, x, y


@pytest.mark.parametrize("mode,opts", [("vectorized", {}), ("microbatch", {"num_microbatches": 5})])
def test_fit_evaluate_predict_and_ledger(mode, opts):
    model, history, x, y = _train(lambda: dpk.make_private(mlp()), mode=mode, **opts)
    assert set(history.history) >= {"loss", "accuracy"}
    assert np.all(np.isfinite(history.history["loss"]))
    result = model.evaluate(x, y, verbose=0, return_dict=True)
    assert set(result) >= {"loss", "accuracy"}
    assert model.predict(x, verbose=0).shape == (20, 3)
    samples = model.optimizer.ledger.samples()
    assert len(samples) == 8  # 2 epochs x 4 steps, one sample per step
    for s in samples:
        assert s.sampling.population_size == 20
        assert s.sampling.selection_probability == pytest.approx(5 / 20)
        assert s.sampling.policy == "shuffle"
        assert len(s.queries) == 1
        # vectorized: one example per record -> C; microbatches (random groups) -> 2C
        assert s.queries[0].l2_sensitivity == pytest.approx(1.0 if mode == "vectorized" else 2.0)
        assert s.queries[0].noise_stddev == pytest.approx(1.1)


def test_microbatches_of_several_examples_record_sensitivity_2c():
    model, _, _, _ = _train(lambda: dpk.make_private(mlp()), mode="microbatch", num_microbatches=2)
    samples = model.optimizer.ledger.samples()
    assert len(samples) == 8
    assert all(s.queries[0].l2_sensitivity == pytest.approx(2.0) for s in samples)


def test_validation_split_population():
    x, y = data(20)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    model.fit(x, y, batch_size=4, epochs=1, validation_split=0.2, verbose=0)
    s = model.optimizer.ledger.samples()
    assert len(s) == 4 and s[0].sampling.population_size == 16
    assert s[0].sampling.selection_probability == pytest.approx(4 / 16)


def test_dp_sequential_and_dp_model_functional_and_subclassed():
    _train(lambda: dpk.DPSequential([keras.Input((6,)), keras.layers.Dense(3)]))

    def functional():
        inp = keras.Input((6,))
        return dpk.DPModel(inp, keras.layers.Dense(3)(keras.layers.Dense(4)(inp)))

    _train(functional)

    class Sub(dpk.DPModel):
        def __init__(self):
            super().__init__()
            self.d = keras.layers.Dense(3)

        def call(self, x):
            return self.d(x)

    model, _, _, _ = _train(Sub)
    assert model.optimizer.ledger.num_samples == 8


def test_multi_output_dict_losses_with_weights():
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,), name="x")
    h = keras.layers.Dense(4, activation="tanh")(inp)
    out_a = keras.layers.Dense(3, name="a")(h)
    out_b = keras.layers.Dense(1, name="b")(h)
    model = dpk.make_private(keras.Model(inp, {"a": out_a, "b": out_b}))
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0),
        loss={"a": LOSS, "b": "mse"},
        loss_weights={"a": 1.0, "b": 0.5},
    )
    x, y = data(6)
    yb = np.arange(6, dtype=np.float32)[:, None]
    losses, _ = dpk.PerExampleLoss(model)(x, {"a": y, "b": yb}, None)
    pred = model(x, training=True)
    expected = keras.losses.sparse_categorical_crossentropy(
        y, pred["a"], from_logits=True
    ).numpy() + 0.5 * np.mean((pred["b"].numpy() - yb) ** 2, axis=1)
    np.testing.assert_allclose(losses, expected, rtol=1e-5)
    model.fit(x, {"a": y, "b": yb}, batch_size=3, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 2


def test_save_and_reload_keras_file(tmp_path):
    model, _, x, _ = _train(
        lambda: dpk.DPSequential([keras.Input((6,)), keras.layers.Dense(3)]),
        mode="microbatch", num_microbatches=5,
    )
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    recorded = model.optimizer.ledger.samples()
    assert recorded
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, dpk.DPSequential)
    assert loaded.optimizer.ledger.samples() == recorded  # the ledger travels in the .keras file
    assert type(loaded.optimizer).__name__ == "DPKerasAdamOptimizer"
    assert loaded.optimizer.l2_norm_clip == 1.0
    assert loaded.optimizer.noise_multiplier == 1.1
    assert loaded.optimizer.num_microbatches == 5
    assert loaded.optimizer.gradient_mode == "microbatch"
    np.testing.assert_allclose(loaded.predict(x, verbose=0), model.predict(x, verbose=0), rtol=1e-6)
    # training continues with privacy
    loaded.fit(x, data(20)[1], batch_size=5, epochs=1, verbose=0)
    assert loaded.optimizer.ledger.num_samples == len(recorded) + 4
    assert loaded.optimizer.ledger.samples()[: len(recorded)] == recorded


def test_dp_model_functional_save_reload(tmp_path):
    keras.utils.set_random_seed(0)
    inp = keras.Input((6,))
    model = dpk.DPModel(inp, keras.layers.Dense(3)(inp))
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    x, y = data(10)
    model.fit(x, y, batch_size=5, verbose=0)
    path = os.path.join(tmp_path, "f.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert isinstance(loaded, dpk.DPModel)
    assert type(loaded.optimizer).__name__ == "DPKerasSGDOptimizer"


def test_optimizer_config_round_trip_and_rmsprop():
    opt = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=0.7, noise_multiplier=1.3, num_microbatches=4, gradient_mode="microbatch",
        learning_rate=0.2, momentum=0.5,
    )
    config = opt.get_config()
    clone = dpk.DPKerasSGDOptimizer.from_config(config)
    assert clone.get_config() == config
    assert (clone.l2_norm_clip, clone.noise_multiplier, clone.num_microbatches) == (0.7, 1.3, 4)
    assert clone.ledger is not opt.ledger
    DPRMSprop = dpk.make_dp_optimizer_class(keras.optimizers.RMSprop)
    assert dpk.make_dp_optimizer_class(keras.optimizers.RMSprop) is DPRMSprop
    assert DPRMSprop.__name__ == "DPKerasRMSpropOptimizer"
    x, y = data(10)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=DPRMSprop(l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3),
        loss=LOSS,
    )
    model.fit(x, y, batch_size=5, verbose=0)
    assert model.optimizer.ledger.num_samples == 2
    rms = DPRMSprop.from_config(model.optimizer.get_config())
    assert isinstance(rms, keras.optimizers.RMSprop)


# -- errors -----------------------------------------------------------------------------------------


def test_dp_optimizer_on_nonprivate_model_raises():
    x, y = data(10)
    model = mlp()
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    w0 = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(RuntimeError, match="make_private"):
        model.fit(x, y, batch_size=5, verbose=0)
    for a, b in zip(model.trainable_variables, w0):
        np.testing.assert_array_equal(a.numpy(), b)
    assert model.optimizer.ledger.num_samples == 0


def test_private_model_needs_dp_optimizer():
    x, y = data(10)
    model = dpk.make_private(mlp())
    model.compile(optimizer="sgd", loss=LOSS)
    with pytest.raises(TypeError, match="DP optimizer"):
        model.fit(x, y, batch_size=5, verbose=0)


@pytest.mark.parametrize("build", ["make_private", "dp_sequential"])
def test_batch_normalization_refused(build):
    layers = [keras.Input((6,)), keras.layers.BatchNormalization(name="bn_1"), keras.layers.Dense(3)]
    with pytest.raises(ValueError, match="bn_1") as err:
        if build == "make_private":
            dpk.make_private(keras.Sequential(layers))
        else:
            model = dpk.DPSequential(layers)
            model.compile(
                optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0),
                loss=LOSS,
            )
            model.fit(*data(10), batch_size=5, verbose=0)
    assert "GroupNormalization" in str(err.value) and "LayerNormalization" in str(err.value)


@pytest.mark.parametrize(
    "kwargs,exc,pattern",
    [
        ({"l2_norm_clip": 0.0, "noise_multiplier": 1.0}, ValueError, "l2_norm_clip.*> 0"),
        ({"l2_norm_clip": -1.0, "noise_multiplier": 1.0}, ValueError, "l2_norm_clip.*> 0"),
        ({"l2_norm_clip": float("inf"), "noise_multiplier": 1.0}, ValueError, "l2_norm_clip.*finite"),
        ({"l2_norm_clip": "1", "noise_multiplier": 1.0}, TypeError, "l2_norm_clip"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": -0.1}, ValueError, "noise_multiplier.*>= 0"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": float("nan")}, ValueError, "noise_multiplier"),
        ({"l2_norm_clip": 1.0}, ValueError, "noise_multiplier"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "num_microbatches": 0}, ValueError,
         r"num_microbatches must be None or an integer in \[1, 2\*\*31 - 1\], got 0"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "num_microbatches": 2.0}, ValueError,
         "num_microbatches.*integer"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "gradient_mode": "fast"}, ValueError,
         "gradient_mode must be one of"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "gradient_mode": "microbatch"},
         ValueError, "num_microbatches"),
        ({"l2_norm_clip": 1.0, "noise_multiplier": 1.0, "gradient_mode": "vectorized",
          "num_microbatches": 4}, ValueError, "num_microbatches"),
    ],
)
def test_bad_optimizer_arguments(kwargs, exc, pattern):
    with pytest.raises(exc, match=pattern):
        dpk.DPKerasSGDOptimizer(**kwargs)


def test_shuffle_false_is_accounted_like_shuffled_batches():
    """Fixed-size batches in a fixed order: the bound used (no amplification) does not depend on
    the order, so fit accepts shuffle=False and records the same sampling."""
    x, y = data(10)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    model.fit(x, y, batch_size=5, shuffle=False, epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 4
    assert {(e.sampling.population_size, e.sampling.selection_probability, e.sampling.policy)
            for e in entries} == {(10, 0.5, "shuffle")}


def test_unknown_sampling_refused():
    x, y = data(10)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0), loss=LOSS
    )
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(5)
    with pytest.raises(ValueError, match="set_sampling"):
        model.fit(ds, verbose=0)
    model.optimizer.set_sampling(10, 0.5, "shuffle")
    model.fit(ds, verbose=0)
    assert model.optimizer.ledger.num_samples == 2


def test_failed_step_leaves_ledger_and_weights_unchanged():
    clip = tf.Variable(1.0)
    x, y = data(10)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(
            dp_sum_query=GaussianSumQuery(clip, 1.0), learning_rate=0.1
        ),
        loss=LOSS,
    )
    model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 2
    w = [v.numpy() for v in model.trainable_variables]
    clip.assign(float("nan"))
    with pytest.raises((tf.errors.InvalidArgumentError, ValueError)):
        model.fit(x, y, batch_size=5, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 2
    for a, b in zip(model.trainable_variables, w):
        np.testing.assert_array_equal(a.numpy(), b)


class _AddsLoss(keras.layers.Layer):
    def call(self, x):
        self.add_loss(0.1 * tf.reduce_sum(x))  # depends on the batch
        return x


@pytest.mark.parametrize("mode", ["vectorized", "auto"])
def test_add_loss_terms_refused_not_dropped(mode):
    x, y = data(10)
    model = dpk.make_private(
        keras.Sequential([keras.Input((6,)), _AddsLoss(), keras.layers.Dense(3)])
    )
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode=mode
        ),
        loss=LOSS,
    )
    w0 = [v.numpy() for v in model.trainable_variables]
    with pytest.raises(NotImplementedError, match="add_loss"):
        model.fit(x, y, batch_size=5, verbose=0)
    for a, b in zip(model.trainable_variables, w0):
        np.testing.assert_array_equal(a.numpy(), b)
    assert model.optimizer.ledger.num_samples == 0


@pytest.mark.parametrize("mode,opts", [("vectorized", {}), ("microbatch", {"num_microbatches": 2})])
def test_next_sample_entry_predicts_the_recorded_entry(mode, opts):
    x, y = data(12)
    model = dpk.make_private(mlp())
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(
            l2_norm_clip=0.7, noise_multiplier=1.3, gradient_mode=mode, **opts
        ),
        loss=LOSS,
    )
    model.optimizer.set_sampling(12, 0.5, "shuffle")
    predicted = model.optimizer.next_sample_entry()
    model.fit(x, y, batch_size=6, epochs=1, verbose=0)
    recorded = model.optimizer.ledger.samples()
    assert len(recorded) == 2
    # fit re-declares the arrays' sampling, as performed by tf_dp (origin "sampled")
    assert recorded[0] == dataclasses.replace(
        predicted, sampling=dataclasses.replace(predicted.sampling, origin="sampled"))
    assert recorded[1] == model.optimizer.next_sample_entry()


@pytest.mark.parametrize("mode,opts", [("vectorized", {}), ("microbatch", {"num_microbatches": 2})])
def test_vectorized_map_strategies_refuse_rank3_einsum_instead_of_crashing(mode, opts):
    # TF 2.21's vectorized_map segfaults on these layers; the strategy must refuse them up front.
    inputs = keras.Input((4, 6))
    h = keras.layers.MultiHeadAttention(num_heads=2, key_dim=3)(inputs, inputs)
    model = dpk.make_private(keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Flatten()(h))))
    model.compile(
        optimizer=dpk.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode=mode, **opts
        ),
        loss=LOSS,
    )
    x = np.random.default_rng(0).normal(size=(8, 4, 6)).astype(np.float32)
    y = np.zeros(8, np.int32)
    with pytest.raises(ValueError, match="EinsumDense.*ghost"):
        model.fit(x, y, batch_size=4, verbose=0)
    assert model.optimizer.ledger.num_samples == 0
