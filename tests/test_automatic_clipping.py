"""AutomaticClipSumQuery (Bu, Zhang, Mao and Karypis 2022): weight C / (||g|| + gamma), global and
per layer, in every gradient mode; sensitivity C recorded; bad input refused."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, tolerance
from tf_dp.dp_query import AutomaticClipSumQuery, NestedQuery
from tf_dp.gradients import MicrobatchClipper, make_clipper
from tf_dp.keras import PerExampleLoss

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


#: float32 against closed forms in float64: the norm (2 squares, a sum, a sqrt), + gamma, the
#: division, the product; a wrong gamma or norm is off by >= 1e-3
WEIGHT_RTOL = tolerance("float32", terms=2 + 1 + 1 + 1 + 1 + 1)


def test_weights_equal_the_closed_form_global_and_per_layer():
    q = AutomaticClipSumQuery(2.0, 0.0, gamma=0.1)
    sq = [tf.constant([9.0, 0.0, 1.0]), tf.constant([16.0, 0.0, 3.0])]
    w = q.clip_weights(q.derive_sample_params(q.initial_global_state()), sq)
    expected = [2.0 / (5.0 + 0.1), 2.0 / 0.1, 2.0 / (2.0 + 0.1)]
    for leaf in w:
        np.testing.assert_allclose(leaf.numpy(), expected, rtol=WEIGHT_RTOL)
    nested = NestedQuery([AutomaticClipSumQuery(2.0, 0.0, gamma=0.1),
                          AutomaticClipSumQuery(0.5, 0.0, gamma=0.01)])
    w = nested.clip_weights(nested.derive_sample_params(nested.initial_global_state()), sq)
    np.testing.assert_allclose(w[0].numpy(), [2 / 3.1, 2 / 0.1, 2 / 1.1], rtol=WEIGHT_RTOL)
    np.testing.assert_allclose(w[1].numpy(), [0.5 / 4.01, 0.5 / 0.01, 0.5 / (3 ** 0.5 + 0.01)],
                               rtol=WEIGHT_RTOL)


def test_preprocess_record_normalises_below_the_clip_and_records_sensitivity_c():
    q = AutomaticClipSumQuery(1.0, 0.7, gamma=0.01)
    gs = q.initial_global_state()
    params = q.derive_sample_params(gs)
    for r in ([3.0, 4.0], [1e-3, 0.0], [100.0, 0.0]):
        out = q.preprocess_record(params, tf.constant(r)).numpy()
        n = float(np.linalg.norm(r))
        np.testing.assert_allclose(out, np.array(r) / (n + 0.01), rtol=WEIGHT_RTOL)
        assert np.linalg.norm(out) < 1.0
    (spec,) = q.sum_query_specs(gs)
    assert (float(spec.l2_sensitivity), float(spec.noise_stddev)) == pytest.approx((1.0, 0.7))


@pytest.mark.parametrize("gamma", [0.0, -0.1, float("nan"), float("inf"), None, "0.1"])
def test_bad_gamma_refused(gamma):
    with pytest.raises((ValueError, TypeError), match="gamma must be a finite number > 0"):
        AutomaticClipSumQuery(1.0, 1.0, gamma=gamma)


def test_bad_clip_and_stddev_refused():
    with pytest.raises(ValueError, match="l2_norm_clip must be a finite number > 0"):
        AutomaticClipSumQuery(0.0, 1.0)
    with pytest.raises(ValueError, match="l2_norm_clip must be a finite number > 0"):
        AutomaticClipSumQuery(None, 1.0)
    with pytest.raises(ValueError, match="stddev must be a finite number >= 0"):
        AutomaticClipSumQuery(1.0, -1.0)


# -- every gradient mode against a slow per-example loop -----------------------------------------


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                          keras.layers.Dense(3)])
    m.compile(optimizer="sgd", loss=LOSS)
    return m


def _reference(model, x, y, sw, clips, gamma, groups=None, per_layer=False, norms=None):
    """sum_i w_i g_i with w_i = C / (||g_i|| + gamma), records one example (or one group's mean
    gradient over its rows of non-zero weight) each; per_layer: each variable by its own norm.
    ``norms``: use these per-record norms in the weights (JL's estimates) instead of ||g_i||."""
    groups = groups or [[i] for i in range(len(x))]
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for idx in groups:
        idx = [i for i in idx if sw[i] != 0]
        if not idx:
            continue
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(
                y[idx], model(x[idx], training=True), from_logits=True)
            loss = tf.reduce_sum(loss * sw[idx]) / len(idx)
        g = [np.asarray(t, np.float64) for t in tape.gradient(loss, model.trainable_variables)]
        if per_layer:
            ws = [c / (np.linalg.norm(a) + gamma) for a, c in zip(g, clips)]
        else:
            n = math.sqrt(sum(float(np.sum(a * a)) for a in g))
            if norms is not None:
                assert len(idx) == 1
                n = float(norms[idx[0]])
            ws = [clips[0] / (n + gamma)] * len(g)
        total = [t + w * a for t, w, a in zip(total, ws, g)]
    return total


# jl clips by one total norm per example only (per-group refusal is tested in test_jl)
@pytest.mark.parametrize("mode, per_layer", [(m, p) for m in ("vectorized", "ghost", "microbatch")
                                             for p in (False, True)] + [("jl", False)])
def test_every_mode_gives_the_reference_clipped_sum(mode, per_layer):
    model = _model()
    rng = np.random.default_rng(2)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int32)
    sw = np.array([1, 2, 1, 1, 0.5, 1, 0, 0], np.float32)  # two padding rows
    gamma = 0.05
    n_vars = len(model.trainable_variables)
    clips = [0.3, 0.7, 0.2, 1.1][:n_vars] if per_layer else [0.3]
    if per_layer:
        query = NestedQuery([AutomaticClipSumQuery(c, 0.0, gamma=gamma) for c in clips])
    else:
        query = AutomaticClipSumQuery(clips[0], 0.0, gamma=gamma)
    query = tf_dp.QueryWithLedger(query)
    groups = None
    if mode == "microbatch":
        strategy = MicrobatchClipper(4, seed=5)
        ids = MicrobatchClipper(4, seed=5).assignment(8).numpy()
        groups = [list(np.flatnonzero(ids == j)) for j in range(4)]
    else:
        strategy = make_clipper(mode, model=model,
                                 **({"jl_projections": 8} if mode == "jl" else {}))
    params = query.derive_sample_params(query.initial_global_state())

    @tf.function
    def step():
        c = strategy.clipped_sum(PerExampleLoss(model), (tf.constant(x), tf.constant(y),
                                                         tf.constant(sw)),
                                 model.trainable_variables, query, params)
        return c.clipped_sum, c.norms

    out, norms = step()
    # JL weights each example by its *estimated* norm (r = 8 projections): the reference takes
    # those estimates, so the check is exact; how close they are to ||g_i|| is test_jl's concern.
    expected = _reference(model, x, y, sw, clips, gamma, groups, per_layer,
                          norms=norms.numpy() if mode == "jl" else None)
    # the 6-5-3 gradient (of a microbatch's mean of up to 8 rows), its norm over 53 parameters,
    # the weight, the sum of 8 records, on entries of at most 8 x max(clips) (each normalised
    # record is below its clip; tests/helpers/tolerance.py); a wrong gamma, norm or weight is off
    # by O(gamma / norm x clip) ~ 1e-2
    atol = tolerance(
        "float32", dense_gradient_terms([6, 5, 3]) + 8 + norm_terms(53) + 2 + 8, 8 * max(clips)
    )
    for a, e in zip(out, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=0, atol=atol)


def test_keras_fit_records_sensitivity_c_in_every_step():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 6)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        dp_sum_query=AutomaticClipSumQuery(1.0, 1.1, gamma=0.01), learning_rate=0.5), loss=LOSS)
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=1), epochs=1,
              verbose=0)
    entries = model.optimizer.ledger.samples()
    assert entries and all(
        [(q.l2_sensitivity, q.noise_stddev, q.mechanism) for q in e.queries]
        == [(1.0, pytest.approx(1.1), "gaussian")] for e in entries)
    assert all(np.all(np.isfinite(w.numpy())) for w in model.weights)
