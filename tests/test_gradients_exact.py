"""Gradient strategies against independent references (noise 0, fixed seeds).

References are a slow per-example loop: a plain ``tf.GradientTape`` per example (or microbatch),
clipping in numpy. The strategies are called as the DP train step calls them, through
``PerExampleLoss`` of a compiled model.
"""

import numpy as np
import pytest
import keras
import tensorflow as tf

from tf_dp.dp_query import GaussianSumQuery
from tf_dp.gradients import MicrobatchClipper, VectorizedClipper, make_clipper
from tf_dp.keras import PerExampleLoss
from tests.helpers.tolerance import model_gradient_terms, norm_terms, tolerance

HUGE_CLIP = 1e9


# -- models -----------------------------------------------------------------------------------------


def sequential_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, activation="tanh"),
            keras.layers.Dense(3),
        ]
    )


def functional_model(seed=0):
    keras.utils.set_random_seed(seed)
    inp = keras.Input((6,))
    h = keras.layers.Dense(4, activation="relu")(inp)
    h2 = keras.layers.Dense(4, activation="tanh")(inp)
    out = keras.layers.Dense(3)(keras.layers.Concatenate()([h, h2]))
    return keras.Model(inp, out)


class Subclassed(keras.Model):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.d1 = keras.layers.Dense(5, activation="tanh")
        self.d2 = keras.layers.Dense(3)

    def call(self, x, training=False):
        return self.d2(self.d1(x) * 2.0)


def subclassed_model(seed=0):
    keras.utils.set_random_seed(seed)
    m = Subclassed()
    m(np.zeros((1, 6), np.float32))
    return m


def conv_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((9, 9, 2)),
            keras.layers.Conv2D(3, 3, strides=2, padding="same", activation="relu"),
            keras.layers.Conv2D(4, 2, strides=1, padding="valid", dilation_rate=1),
            keras.layers.Flatten(),
            keras.layers.Dense(3),
        ]
    )


BUILDERS = {
    "sequential": sequential_model,
    "functional": functional_model,
    "subclassed": subclassed_model,
}


def data(batch=7, seed=1, shape=(6,)):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(batch,) + shape).astype(np.float32)
    y = rng.integers(0, 3, batch).astype(np.int32)
    return x, y


def compiled(model, loss=None):
    model.compile(
        optimizer="sgd",
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def run(strategy, model, x, y, sw=None, clip=1.0, graph=False):
    """The strategy's output as a dict of numpy values (inside a tf.function if ``graph``)."""
    query = GaussianSumQuery(clip, 0.0)
    loss_fn = PerExampleLoss(model)

    def step():
        params = query.derive_sample_params(query.initial_global_state())
        out = strategy.clipped_sum(
            loss_fn,
            (tf.constant(x), tf.constant(y), None if sw is None else tf.constant(sw)),
            model.trainable_variables,
            query,
            params,
        )
        return {k: v for k, v in out.__dict__.items() if k != "jl_projections"}

    out = tf.function(step)() if graph else step()
    return {k: tf.nest.map_structure(np.asarray, v) for k, v in out.items()}


# -- references -------------------------------------------------------------------------------------


def per_example_loss_value(model, x, y, sw=None):
    """The per-example loss of the tests' models: sparse CE on logits, times the sample weight."""
    logits = model(x, training=True)
    loss = keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)
    if sw is not None:
        loss = loss * sw
    return loss


def reference_grads(model, x, y, sw=None, groups=None):
    """Per-record gradients (flattened numpy), one example per record or one group per record."""
    groups = groups or [[i] for i in range(len(x))]
    out = []
    for idx in groups:
        idx = np.asarray(idx)
        with tf.GradientTape() as tape:
            loss = per_example_loss_value(
                model, x[idx], y[idx], None if sw is None else sw[idx].astype(np.float32)
            )
            # a microbatch's mean is over its rows of non-zero weight
            rows = len(idx) if sw is None else max(int(np.count_nonzero(sw[idx])), 1)
            loss = tf.reduce_sum(loss) / rows
        grads = tape.gradient(loss, model.trainable_variables)
        out.append([np.asarray(tf.convert_to_tensor(g)) for g in grads])  # IndexedSlices too
    return out


def reference_clipped_sum(records, clip):
    total = [np.zeros_like(g, dtype=np.float64) for g in records[0]]
    norms = []
    for rec in records:
        norm = np.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in rec))
        norms.append(norm)
        factor = min(1.0, clip / norm) if norm > 0 else 0.0
        total = [t + factor * g for t, g in zip(total, rec)]
    return total, np.array(norms)


def derived_atol(model, records, clip, group=1):
    """The float32 tolerance of a clipped sum computed in another op order or kernel than the
    reference (tests/helpers/tolerance.py): a record's gradient (``model_gradient_terms``, plus
    the mean over a microbatch of up to ``group`` rows), its norm, the sum over the records, times
    the largest sum over the records of one entry's clipped absolute values."""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    terms = model_gradient_terms(model, classes=3) + group + norm_terms(params) + len(records)
    magnitude = 0.0
    if records:
        total = None
        for rec in records:
            norm = np.sqrt(sum(float(np.sum(np.square(g.astype(np.float64)))) for g in rec))
            factor = min(1.0, clip / norm) if norm > 0 else 0.0
            absolute = [factor * np.abs(g.astype(np.float64)) for g in rec]
            total = absolute if total is None else [t + a for t, a in zip(total, absolute)]
        magnitude = max(float(t.max()) for t in total)
    return tolerance("float32", terms, magnitude)


def norm_rtol(model):
    """The float32 relative tolerance of a per-record gradient norm (the gradient's roundings and
    the sum of squares)."""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return tolerance("float32", model_gradient_terms(model, classes=3) + norm_terms(params))


def assert_close_list(actual, expected, rtol=1e-4, atol=1e-5):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=atol)


# -- tests ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_vectorized_matches_slow_loop(kind):
    model = compiled(BUILDERS[kind]())
    x, y = data()
    out = run(VectorizedClipper(), model, x, y, clip=0.5, graph=True)
    records = reference_grads(model, x, y)
    expected, norms = reference_clipped_sum(records, 0.5)
    assert np.all(norms > 0.5), "the clip must bind for some examples for this test to mean much"
    assert_close_list(out["clipped_sum"], expected, rtol=0, atol=derived_atol(model, records, 0.5))
    np.testing.assert_allclose(out["norms"], norms, rtol=norm_rtol(model))
    assert int(out["num_records"]) == len(x)
    np.testing.assert_allclose(
        out["losses"], per_example_loss_value(model, x, y).numpy(), rtol=1e-5
    )


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("strategy", ["vectorized", "microbatch"])
def test_huge_clip_gives_nonprivate_gradient(kind, strategy):
    model = compiled(BUILDERS[kind]())
    x, y = data(batch=8)
    # microbatch: one microbatch holding the whole batch, whose clipped mean is the mean gradient
    strat = VectorizedClipper() if strategy == "vectorized" else MicrobatchClipper(1)
    out = run(strat, model, x, y, clip=HUGE_CLIP)
    with tf.GradientTape() as tape:
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)(
            y, model(x, training=True)
        )
    mean_grads = tape.gradient(loss, model.trainable_variables)
    records = 8 if strategy == "vectorized" else 1
    assert_close_list(
        [g / records for g in out["clipped_sum"]], [g.numpy() for g in mean_grads], rtol=1e-4
    )


def test_vectorized_chunked_equals_unchunked_and_reference():
    model = compiled(sequential_model())
    x, y = data(batch=11)
    sw = np.linspace(0.5, 2.0, 11).astype(np.float32)
    records = reference_grads(model, x, y, sw)
    expected, norms = reference_clipped_sum(records, 0.3)
    whole = VectorizedClipper(chunk_bytes=None)
    chunked = VectorizedClipper(chunk_bytes=4 * 60 * 4)  # ~4 examples per chunk, 3 chunks
    assert chunked.chunk_size(model.trainable_variables) == 4
    for strat in (whole, chunked):
        out = run(strat, model, x, y, sw, clip=0.3, graph=True)
        assert_close_list(out["clipped_sum"], expected, rtol=0,
                          atol=derived_atol(model, records, 0.3))
        np.testing.assert_allclose(out["norms"], norms, rtol=norm_rtol(model))
        assert out["y_pred"].shape == (11, 3)
        assert out["losses"].shape == (11,)


def test_conv_fast_path_matches_reference_and_default_converter():
    model = compiled(conv_model())
    x, y = data(batch=5, shape=(9, 9, 2))
    records = reference_grads(model, x, y)
    expected, _ = reference_clipped_sum(records, 0.2)
    for strat in (VectorizedClipper(), VectorizedClipper(fast_conv=False)):
        out = run(strat, model, x, y, clip=0.2, graph=True)
        assert_close_list(out["clipped_sum"], expected, rtol=0,
                          atol=derived_atol(model, records, 0.2))


def test_sample_weights_scale_per_example_losses():
    model = compiled(sequential_model())
    x, y = data(batch=6)
    sw = np.array([0.0, 1.0, 2.0, 0.5, 1.0, 3.0], np.float32)
    out = run(VectorizedClipper(), model, x, y, sw, clip=HUGE_CLIP)
    records = reference_grads(model, x, y, sw)
    expected, _ = reference_clipped_sum(records, HUGE_CLIP)
    assert_close_list(out["clipped_sum"], expected, rtol=0,
                      atol=derived_atol(model, records, HUGE_CLIP))
    np.testing.assert_allclose(
        out["losses"], per_example_loss_value(model, x, y, sw).numpy(), rtol=1e-5
    )
    assert float(out["norms"][0]) == 0.0  # weight 0: no gradient


@pytest.mark.parametrize(
    "loss",
    [
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum"),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="mean"),
    ],
    ids=["default", "sum", "none", "mean"],
)
def test_any_reduction_gives_same_per_example_losses(loss):
    model = compiled(sequential_model(), loss=loss)
    x, y = data(batch=5)
    losses, _ = PerExampleLoss(model)(x, y, None)
    np.testing.assert_allclose(losses, per_example_loss_value(model, x, y).numpy(), rtol=1e-6)


def test_string_and_function_losses():
    model = compiled(sequential_model(), loss="mse")
    x = data(batch=4)[0]
    y = np.arange(12, dtype=np.float32).reshape(4, 3)
    losses, _ = PerExampleLoss(model)(x, y, None)
    pred = model(x, training=True).numpy()
    np.testing.assert_allclose(losses, np.mean((pred - y) ** 2, axis=1), rtol=1e-5)
    model2 = compiled(sequential_model(), loss=keras.losses.mean_absolute_error)
    losses2, _ = PerExampleLoss(model2)(x, y, np.array([1, 2, 0, 1], np.float32))
    np.testing.assert_allclose(
        losses2, np.mean(np.abs(pred - y), axis=1) * [1, 2, 0, 1], rtol=1e-5
    )


def twin_groups(m, batch, seed):
    """The microbatches a MicrobatchClipper(m, seed=seed) draws first, from an identical twin."""
    ids = MicrobatchClipper(m, seed=seed).assignment(batch).numpy()
    assert np.all((ids >= 0) & (ids < m))
    return [list(np.flatnonzero(ids == j)) for j in range(m) if np.any(ids == j)]


@pytest.mark.parametrize("batch,m", [(12, 4), (10, 4), (7, 3), (3, 5), (6, 6), (0, 3)])
def test_microbatch_matches_reference(batch, m):
    model = compiled(sequential_model())
    x, y = data(batch=batch)
    out = run(MicrobatchClipper(m, seed=batch), model, x, y, clip=0.3, graph=True)
    groups = twin_groups(m, batch, seed=batch)
    records = reference_grads(model, x, y, groups=groups) if groups else []
    if groups:
        expected, _ = reference_clipped_sum(records, 0.3)
    else:  # an empty batch: every microbatch is empty, the clipped sum is zero
        expected = [np.zeros(v.shape, np.float32) for v in model.trainable_variables]
    group = max((len(g) for g in groups), default=1)
    assert_close_list(out["clipped_sum"], expected, rtol=0,
                      atol=derived_atol(model, records, 0.3, group))
    assert int(out["num_records"]) == m
    # Random microbatches of a neighbouring batch may hold several examples: always 2C.
    assert float(out["sensitivity_multiplier"]) == 2.0
    assert out["losses"].shape == (batch,)
    assert out["y_pred"].shape == (batch, 3)
    # losses and predictions come back in the batch's order
    np.testing.assert_allclose(out["y_pred"], model(x, training=True).numpy(), rtol=1e-5, atol=1e-6)


def test_microbatch_assignment_is_uniform_and_independent_of_the_data():
    # 20000 draws over 4 microbatches: each count ~ Binomial(20000, 1/4), sd ~61; 5 sd bounds.
    ids = MicrobatchClipper(4, seed=7).assignment(20000).numpy()
    counts = np.bincount(ids, minlength=4)
    assert np.all(np.abs(counts - 5000) < 5 * np.sqrt(20000 * 0.25 * 0.75))
    # the layout puts every example in exactly one slot of its microbatch
    strat = MicrobatchClipper(3, seed=1)
    ids = strat.assignment(10)
    index, position = strat.layout(ids)
    index, ids, position = index.numpy(), ids.numpy(), position.numpy()
    assert sorted(index[index < 10].tolist()) == list(range(10))
    for i in range(10):
        assert index[ids[i], position[i]] == i


def test_microbatch_sample_weights():
    model = compiled(sequential_model())
    x, y = data(batch=6)
    sw = np.array([1.0, 0.0, 2.0, 1.0, 0.5, 1.0], np.float32)
    out = run(MicrobatchClipper(3, seed=5), model, x, y, sw, clip=0.4)
    groups = twin_groups(3, 6, seed=5)
    records = reference_grads(model, x, y, sw, groups=groups)
    expected, _ = reference_clipped_sum(records, 0.4)
    assert_close_list(out["clipped_sum"], expected, rtol=0,
                      atol=derived_atol(model, records, 0.4, max(len(g) for g in groups)))


def test_bad_strategy_arguments():
    with pytest.raises(ValueError, match="num_microbatches"):
        MicrobatchClipper(0)
    with pytest.raises(ValueError, match="num_microbatches"):
        MicrobatchClipper(2.5)
    with pytest.raises(ValueError, match="chunk_bytes"):
        VectorizedClipper(chunk_bytes=0)
    with pytest.raises(ValueError, match="gradient_mode"):
        make_clipper("bogus")
    with pytest.raises(ValueError, match="num_microbatches"):
        make_clipper("microbatch")
    assert isinstance(make_clipper("auto", num_microbatches=2), MicrobatchClipper)
