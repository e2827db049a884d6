"""Multi-output models: per-example losses match Keras's compiled loss, and a private step with no
noise and no clipping is the non-private SGD step.

Cases follow ``keras.Model.compile``: a loss dict (and targets, weights) keyed by output name on a
functional model whose outputs are a list; one loss for several outputs (applied to each, summed);
a list of losses with list or dict targets; ``loss_weights`` in each form.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import (
    dense_gradient_terms,
    norm_terms,
    sgd_tolerance,
    tolerance,
)
from tf_dp.keras.losses import PerExampleLoss

B = 16
#: roundings of one per-example gradient entry of the 5-4-(3 + 1) models (tests/helpers/tolerance.py)
GRADIENT_TERMS = dense_gradient_terms([5, 4, 4])


def _mean_abs_gradient(model, x, y, sw):
    """The largest entry of ``mean_i |g_i|`` over the per-example gradients (one tape per
    example): the magnitude a batch mean of the gradients sums, cancellations included."""
    loss_fn = PerExampleLoss(model)
    total = [np.zeros(v.shape) for v in model.trainable_variables]
    for i in range(B):
        yi = tf.nest.map_structure(lambda t, i=i: t[i : i + 1], y)
        with tf.GradientTape() as tape:
            loss, _ = loss_fn(x[i : i + 1], yi, None if sw is None else sw[i : i + 1])
            loss = tf.reduce_sum(loss)
        grads = tape.gradient(loss, model.trainable_variables)
        total = [t + np.abs(np.asarray(g)) for t, g in zip(total, grads)]
    return max(float(t.max()) for t in total) / B


def _two_output_model(seed=0):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((5,))
    hidden = keras.layers.Dense(4, activation="tanh", name="hidden")(inputs)
    cls = keras.layers.Dense(3, name="cls")(hidden)
    reg = keras.layers.Dense(1, name="reg")(hidden)
    return keras.Model(inputs, [cls, reg])


def _one_output_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(1)]
    )


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(B, 5)).astype(np.float32)
    labels = rng.integers(0, 3, size=(B,)).astype(np.int32)
    onehot = np.eye(3, dtype=np.float32)[labels]
    reg = rng.normal(size=(B, 1)).astype(np.float32)
    sw = rng.uniform(0.5, 2.0, size=(B,)).astype(np.float32)
    return x, labels, onehot, reg, sw


def _sce():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _case(name):
    """(model factory, compile kwargs, x, targets, sample_weight) for a named case.

    Sample weights go with list targets only: Keras's own ``fit`` nests them like dict targets and
    then cannot match them to list outputs."""
    x, labels, onehot, reg, sw = _data()
    cases = {
        # a dict keyed by output name on a list-output model (loss, targets and loss_weights)
        "dict_loss_dict_targets": (
            _two_output_model,
            dict(loss={"reg": "mse", "cls": _sce()}, loss_weights={"cls": 0.5, "reg": 2.0}),
            {"cls": labels, "reg": reg}, None),
        "dict_loss_list_targets": (
            _two_output_model,
            dict(loss={"reg": keras.losses.MeanAbsoluteError(), "cls": _sce()}),
            [labels, reg], sw),
        # one loss for several outputs: applied to each output and summed
        "one_loss_two_outputs": (
            _two_output_model, dict(loss="mse"), {"reg": reg, "cls": onehot}, None),
        "one_loss_two_outputs_float_weight": (
            _two_output_model, dict(loss=keras.losses.MeanSquaredError(), loss_weights=3.0),
            [onehot, reg], sw),
        "list_loss_dict_targets": (
            _two_output_model,
            dict(loss=[_sce(), "mae"], loss_weights=[1.5, 0.25]),
            {"reg": reg, "cls": labels}, None),
        "single_output_float_weight": (
            _one_output_model, dict(loss="mse", loss_weights=4.0), reg, sw),
    }
    factory, kwargs, y, w = cases[name]
    return factory, kwargs, x, y, w


CASES = [
    "dict_loss_dict_targets",
    "dict_loss_list_targets",
    "one_loss_two_outputs",
    "one_loss_two_outputs_float_weight",
    "list_loss_dict_targets",
    "single_output_float_weight",
]


@pytest.mark.parametrize("name", CASES)
def test_per_example_losses_average_to_keras_compiled_loss(name):
    factory, kwargs, x, y, sw = _case(name)
    model = factory()
    model.compile(optimizer="sgd", **kwargs)
    losses, y_pred = PerExampleLoss(model)(tf.constant(x), y, None if sw is None else tf.constant(sw))
    assert losses.shape == (B,)
    expected = model.compute_loss(x, y, y_pred, sample_weight=sw)
    # the same predictions reduced in another order (per output element, the 2 outputs and
    # their weights, the sample weight, the mean over B): a wrong weight or a dropped output
    # changes the loss by far more than these roundings
    rtol = tolerance("float32", terms=4 + 2 + 2 + 1 + B + 1)
    np.testing.assert_allclose(float(tf.reduce_mean(losses)), float(expected), rtol=rtol)


@pytest.mark.parametrize("name", CASES)
def test_private_step_without_noise_or_clipping_is_the_sgd_step(name):
    factory, kwargs, x, y, sw = _case(name)
    plain = factory(seed=1)
    plain.compile(optimizer=keras.optimizers.SGD(learning_rate=0.1), **kwargs)
    private = tf_dp.keras.make_private(factory(seed=1))
    private.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1e6, noise_multiplier=0.0, learning_rate=0.1,
            gradient_mode="vectorized"),
        **kwargs,
    )
    for a, b in zip(plain.get_weights(), private.get_weights()):
        np.testing.assert_array_equal(a, b)
    before = [w.copy() for w in private.get_weights()]
    # One full batch: the private step divides the clipped sum by the number of records (B, shuffle
    # sampling), so with nothing clipped it is the mean gradient, as in the plain SGD step.
    plain.fit(x, y, sample_weight=sw, batch_size=B, epochs=1, shuffle=False, verbose=0)
    private.fit(x, y, sample_weight=sw, batch_size=B, epochs=1, shuffle=False, verbose=0)
    assert private.optimizer.ledger.num_samples == 1
    # one step: per-example gradients summed over B and divided (private) vs the batch gradient
    # (plain), another op order; a missed loss weight or sample weight moves the update by a
    # fraction of itself, ~1e-2, far above this bound
    params = sum(int(np.prod(w.shape)) for w in before)
    start = factory(seed=1)  # the starting weights, for the gradients' magnitude
    start.compile(optimizer="sgd", **kwargs)
    scale = _mean_abs_gradient(start, x, y, sw)
    atol = sgd_tolerance("float32", 1, 0.1, scale, GRADIENT_TERMS + norm_terms(params) + B + 1,
                         weight_scale=max(float(np.abs(w).max()) for w in before))
    changed = False
    for a, b, w0 in zip(plain.get_weights(), private.get_weights(), before):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)
        changed = changed or not np.allclose(b, w0)
    assert changed


def test_loss_dict_with_keys_that_are_not_output_names_is_refused():
    model = _two_output_model()
    model.compile(optimizer="sgd", loss={"cls": _sce(), "regression": "mse"})
    x, labels, _, reg, _ = _data()
    with pytest.raises(ValueError, match="output names"):
        PerExampleLoss(model)(tf.constant(x), {"cls": labels, "regression": reg})


def test_list_loss_weights_with_one_loss_for_several_outputs_is_refused():
    # Keras refuses it too ("loss_weights must match the number of losses").
    model = _two_output_model()
    model.compile(optimizer="sgd", loss="mse", loss_weights=[1.0, 2.0])
    x, _, onehot, reg, _ = _data()
    with pytest.raises(ValueError, match="loss_weights"):
        PerExampleLoss(model)(tf.constant(x), [onehot, reg])
