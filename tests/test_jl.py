"""Tests of JL clipping (``gradient_mode="jl"``, Bu et al. 2020, DP-SGD-JL).

Statistical tests use fixed seeds and tolerances derived from the number of draws: with
``K`` independent draws, a sample mean of ``S = r M^2 / ||g||^2 ~ chi2_r`` has standard deviation
``sqrt(2r / K)`` and the sample variance about ``sqrt((8 r^2 + 48 r) / K)`` (chi2_r has variance
``2r`` and fourth central moment ``12 r^2 + 48 r``); the tests allow 5 of those standard deviations.
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests.helpers.tolerance import model_gradient_terms, tolerance
from tf_dp.gradients import VectorizedClipper, make_clipper
from tf_dp.gradients.jl import JLClipper, check_query, forward_mode_blocker
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers


def _compiled(layers, seed=0):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential(layers)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


def _mlp(seed=0):
    return _compiled([keras.Input((6,)), L.Dense(5, activation="tanh"), L.Dense(3)], seed)


def _cnn(seed=0):
    # ReLU before max-pooling: many windows of equal zeros (ties) exercise the MaxPool rule.
    return _compiled(
        [
            keras.Input((10, 10, 1)),
            L.Conv2D(4, 3, strides=1, padding="same", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Conv2D(4, 3, strides=2, padding="valid", activation="relu"),
            L.MaxPooling2D(3, 2, padding="same"),  # padded windows
            L.Flatten(),
            L.Dense(6, activation="relu"),
            L.Dense(3),
        ],
        seed,
    )


def _lstm(unroll=False, seed=0):
    return _compiled(
        [
            keras.Input((7,), dtype="int32"),
            L.Embedding(20, 4),
            L.Bidirectional(L.LSTM(3, unroll=unroll)),
            L.Dense(2),
        ],
        seed,
    )


def _data(model, batch, seed=0):
    rng = np.random.default_rng(seed)
    shape = model.input_shape[1:]
    if model.inputs[0].dtype in ("int32", "int64"):
        x = rng.integers(0, 20, (batch,) + shape).astype("int32")
    else:
        x = rng.normal(size=(batch,) + shape).astype("float32")
    y = rng.integers(0, model.output_shape[-1], batch).astype("int32")
    return tf.constant(x), tf.constant(y)


def _per_example_gradients(model, x, y):
    """Exact per-example gradients, one example (batch of one) at a time: ``[k][B, ...]``."""
    loss_fn = PerExampleLoss(model)
    rows = []
    for i in range(int(x.shape[0])):
        with tf.GradientTape() as tape:
            losses, _ = loss_fn(x[i : i + 1], y[i : i + 1], None)
            total = tf.reduce_sum(losses)
        grads = tape.gradient(total, model.trainable_variables)
        rows.append([tf.convert_to_tensor(g).numpy() for g in grads])
    return [np.stack(col) for col in zip(*rows)]


def _exact_squared_norms(model, x, y):
    per_example = _per_example_gradients(model, x, y)
    return sum(np.sum(np.reshape(g, (g.shape[0], -1)) ** 2, axis=1) for g in per_example)


def _gradient_terms(model):
    """Roundings of one per-example gradient entry (tests/helpers/tolerance.py), with the
    LSTM's 7 time steps (14 roundings per step and its fan-in 4 + 3, forward and back) that
    ``model_gradient_terms`` does not see inside ``Bidirectional``."""
    terms = model_gradient_terms(model, classes=model.output_shape[-1])
    if any(isinstance(la, L.Bidirectional) for la in model.layers):
        terms += 2 * 7 * (14 + 4 + 3)
    return terms


def _projection_atol(model, per_example, directions):
    """float32 tolerance of projections ``p_ij = <g_i, v_j>`` computed in two ways (forward mode,
    double vjp, or a dot product of explicit gradients): a gradient's roundings and the dot
    product over the ``d`` parameters, times ``max_ij sum_k |g_ik| |v_jk|``. A projection on the
    wrong direction or of the wrong example is off by O(|p|), far above it."""
    d = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    batch = per_example[0].shape[0]
    scale = max(
        float(np.max(sum(
            np.abs(np.reshape(g, (batch, -1))) @ np.abs(np.reshape(np.asarray(v), (-1,)))
            for g, v in zip(per_example, direction)
        )))
        for direction in directions
    )
    return tolerance("float32", _gradient_terms(model) + d + 1, scale)


def _params(query):
    return query.derive_sample_params(query.initial_global_state())


# -- the norm estimate ---------------------------------------------------------------------------


@pytest.mark.parametrize("r", [1, 4, 16])
def test_squared_estimate_is_unbiased_with_chi_square_spread(r):
    model = _mlp()
    x, y = _data(model, 3)
    exact = _exact_squared_norms(model, x, y)
    strategy = JLClipper(r, method="forward", seed=1000 + r)
    loss_fn = PerExampleLoss(model)
    proj = tf.function(lambda: strategy.projections(loss_fn, (x, y, None), model.trainable_variables)[0])
    draws = 400
    s = np.stack([np.mean(proj().numpy() ** 2, axis=0) for _ in range(draws)])  # [K, B]
    s = r * s / exact  # each column ~ chi2_r, independent across draws
    for i in range(s.shape[1]):
        mean_sd = math.sqrt(2 * r / draws)
        assert abs(s[:, i].mean() - r) < 5 * mean_sd, (r, i, s[:, i].mean())
        var_sd = math.sqrt((8 * r * r + 48 * r) / draws)
        assert abs(s[:, i].var(ddof=1) - 2 * r) < 5 * var_sd, (r, i, s[:, i].var())
        assert stats.kstest(s[:, i], stats.chi2(r).cdf).pvalue > 1e-3


def test_double_vjp_estimate_has_chi_square_law():
    model = _lstm()
    x, y = _data(model, 2)
    exact = _exact_squared_norms(model, x, y)
    r, draws = 4, 300
    strategy = JLClipper(r, method="double_vjp", seed=7)
    loss_fn = PerExampleLoss(model)
    proj = tf.function(lambda: strategy.projections(loss_fn, (x, y, None), model.trainable_variables)[0])
    s = np.stack([np.mean(proj().numpy() ** 2, axis=0) for _ in range(draws)]) * r / exact
    for i in range(s.shape[1]):
        assert abs(s[:, i].mean() - r) < 5 * math.sqrt(2 * r / draws)
        assert stats.kstest(s[:, i], stats.chi2(r).cdf).pvalue > 1e-3


# -- routes ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_fn", [_cnn, lambda: _lstm(unroll=True)], ids=["cnn", "lstm_unrolled"])
def test_double_vjp_equals_forward_mode(model_fn):
    model = model_fn()
    x, y = _data(model, 6)
    loss_fn = PerExampleLoss(model)
    forward = JLClipper(3, method="forward", seed=3)
    p_fwd, _, directions = forward.projections(loss_fn, (x, y, None), model.trainable_variables)
    p_vjp, _, _ = JLClipper(3, method="double_vjp").projections(
        loss_fn, (x, y, None), model.trainable_variables, directions=directions
    )
    assert float(np.max(np.abs(p_vjp))) > 0
    atol = _projection_atol(model, _per_example_gradients(model, x, y), directions)
    np.testing.assert_allclose(p_fwd.numpy(), p_vjp.numpy(), rtol=0, atol=atol)
    # and under tf.function
    p_graph = tf.function(
        lambda: forward.projections(loss_fn, (x, y, None), model.trainable_variables, directions)[0]
    )()
    np.testing.assert_allclose(p_graph.numpy(), p_vjp.numpy(), rtol=0, atol=atol)


def test_projections_match_explicit_dot_products():
    # p_ij = <g_i, v_j> against per-example gradients from the vectorized strategy.
    model = _cnn()
    x, y = _data(model, 5)
    per_example = _per_example_gradients(model, x, y)
    p, _, directions = JLClipper(2, method="forward", seed=11).projections(
        PerExampleLoss(model), (x, y, None), model.trainable_variables
    )
    expected = np.array(
        [
            sum(
                np.sum(np.reshape(g, (5, -1)) * np.reshape(v.numpy(), (1, -1)), axis=1)
                for g, v in zip(per_example, d)
            )
            for d in directions
        ]
    )
    atol = _projection_atol(model, per_example, directions)
    np.testing.assert_allclose(p.numpy(), expected, rtol=0, atol=atol)


def test_forward_replay_keeps_dropout_masks():
    # r > 1 in forward mode replays the forward pass with the model's non-trainable state (the
    # Keras seed generators) restored, so every projection is of the same per-example gradients:
    # the single-pass double-vjp route from the same starting state gives the same numbers.
    model = _compiled(
        [keras.Input((6,)), L.Dense(8, activation="relu"), L.Dropout(0.5), L.Dense(3)]
    )
    x, y = _data(model, 6)
    loss_fn = PerExampleLoss(model)
    state = [v.numpy().copy() for v in model.non_trainable_variables]
    assert state, "the dropout layer has a seed generator state"
    p_fwd, _, d = JLClipper(4, method="forward", seed=2).projections(
        loss_fn, (x, y, None), model.trainable_variables
    )
    after_forward = [v.numpy().copy() for v in model.non_trainable_variables]
    for v, s in zip(model.non_trainable_variables, state):
        v.assign(s)
    p_vjp, _, _ = JLClipper(4, method="double_vjp").projections(
        loss_fn, (x, y, None), model.trainable_variables, directions=d
    )
    # per-example gradients under the same dropout masks: the jacobian of the batch's losses
    # from the same starting state (then back to the state the double vjp left)
    after_vjp = [v.numpy().copy() for v in model.non_trainable_variables]
    for v, s in zip(model.non_trainable_variables, state):
        v.assign(s)
    with tf.GradientTape() as tape:
        losses, _ = loss_fn(x, y, None)
    per_example = [j.numpy() for j in tape.jacobian(losses, model.trainable_variables)]
    for v, s in zip(model.non_trainable_variables, after_vjp):
        v.assign(s)
    atol = _projection_atol(model, per_example, d)
    np.testing.assert_allclose(p_fwd.numpy(), p_vjp.numpy(), rtol=0, atol=atol)
    # the replays leave the state where one forward pass leaves it
    for a, b in zip(after_forward, model.non_trainable_variables):
        np.testing.assert_array_equal(a, b.numpy())


def test_auto_route_selection():
    assert forward_mode_blocker(_lstm()) is not None
    assert forward_mode_blocker(_lstm(unroll=True)) is None
    assert forward_mode_blocker(_cnn()) is None
    query = tf_dp.GaussianSumQuery(1.0, 0.0)
    for model, r, expected in [(_cnn(), 1, "forward"), (_lstm(), 1, "double_vjp"), (_cnn(), 3, "forward"), (_lstm(), 2, "double_vjp")]:
        strategy = make_clipper("jl", jl_projections=r)
        x, y = _data(model, 4)
        tf.function(
            lambda: strategy.clipped_sum(
                PerExampleLoss(model), (x, y, None), model.trainable_variables, query, _params(query)
            ).clipped_sum
        )()
        assert strategy.resolved_method == expected


@pytest.mark.parametrize(
    "method, option, expected",
    [("double_vjp", None, True), ("forward", None, False), ("forward", True, True),
     ("double_vjp", False, False)],
)
def test_noise_after_sum_defaults_to_the_double_vjp_route(method, option, expected):
    model = _cnn()
    x, y = _data(model, 4)
    query = tf_dp.GaussianSumQuery(1.0, 0.0)
    out = JLClipper(1, method=method, seed=0, noise_after_sum=option).clipped_sum(
        PerExampleLoss(model), (x, y, None), model.trainable_variables, query, _params(query)
    )
    assert out.noise_after_sum is expected


def _depends_on(op: tf.Operation, target: tf.Operation) -> bool:
    """Whether ``op`` depends on ``target`` through data or control inputs (one graph)."""
    stack, seen = [op], set()
    while stack:
        o = stack.pop()
        if o is target:
            return True
        if o.name in seen:
            continue
        seen.add(o.name)
        stack.extend(t.op for t in o.inputs)
        stack.extend(o.control_inputs)
    return False


@pytest.mark.parametrize("after", [True, False])
def test_optimizer_draws_the_noise_after_the_clipped_sum_when_asked(after):
    from tf_dp.gradients.base import ClippedGradients

    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    opt.set_sampling(1000, 0.01, "shuffle")
    variables = [tf.Variable(tf.zeros([300, 500])), tf.Variable(tf.zeros([7]))]
    opt.build(variables)

    def step(a, b):
        total = [tf.identity(a, name="clipped_marker"), b]
        clipped = ClippedGradients(total, tf.ones([10]), tf.constant(10), noise_after_sum=after)
        return opt.dp_aggregate(clipped)

    specs = [tf.TensorSpec([300, 500]), tf.TensorSpec([7])]
    graph = tf.function(step).get_concrete_function(*specs).graph
    marker = graph.get_operation_by_name("clipped_marker")
    draws = [o for o in graph.get_operations() if "Uniform" in o.type or "Rng" in o.type]
    assert draws  # the noise: the generator's Philox words (chunked: several draws)
    assert all(_depends_on(o, marker) for o in draws) is after


# -- clipping ----------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["forward", "double_vjp"])
def test_huge_clip_without_noise_is_the_nonprivate_gradient(method):
    model = _cnn()
    x, y = _data(model, 8)
    loss_fn = PerExampleLoss(model)
    query = tf_dp.GaussianSumQuery(1e9, 0.0)
    out = JLClipper(1, method=method, seed=0).clipped_sum(
        loss_fn, (x, y, None), model.trainable_variables, query, _params(query)
    )
    with tf.GradientTape() as tape:
        losses, _ = loss_fn(x, y, None)
        total = tf.reduce_sum(losses)
    expected = tape.gradient(total, model.trainable_variables)
    # the sum of 8 per-example gradients vs the batch gradient: a gradient's roundings and the
    # sum, times max sum_i |g_i| (a clip that bit or a missing example is off by O(|g_i|))
    per_example = _per_example_gradients(model, x, y)
    scale = max(float(np.abs(g).sum(axis=0).max()) for g in per_example)
    atol = tolerance("float32", _gradient_terms(model) + 8 + 1, scale)
    for g, e in zip(out.clipped_sum, expected):
        np.testing.assert_allclose(g.numpy(), e.numpy(), rtol=0, atol=atol)
    assert out.jl_projections == 1 and out.sensitivity_multiplier == 1.0


def test_large_r_converges_to_exact_clipping():
    model = _mlp()
    x, y = _data(model, 8)
    exact_sq = _exact_squared_norms(model, x, y)
    clip = float(np.median(np.sqrt(exact_sq)))  # about half the examples get clipped
    query = tf_dp.GaussianSumQuery(clip, 0.0)
    loss_fn = PerExampleLoss(model)
    exact = VectorizedClipper().clipped_sum(
        loss_fn, (x, y, None), model.trainable_variables, query, _params(query)
    )
    exact_flat = np.concatenate([g.numpy().ravel() for g in exact.clipped_sum])

    def error(r, seed):
        out = JLClipper(r, method="forward", seed=seed).clipped_sum(
            loss_fn, (x, y, None), model.trainable_variables, query, _params(query)
        )
        flat = np.concatenate([g.numpy().ravel() for g in out.clipped_sum])
        norm_err = np.max(np.abs(out.norms.numpy() / np.sqrt(exact_sq) - 1))
        return np.linalg.norm(flat - exact_flat) / np.linalg.norm(exact_flat), norm_err

    r = 400
    rel, norm_err = error(r, 1)
    # M / ||g|| = sqrt(chi2_r / r) has sd ~ 1/sqrt(2r) (3.5%); 5 sd bounds the max over 8.
    assert norm_err < 5 / math.sqrt(2 * r)
    # each weight is off by at most the relative norm error, so the clipped sum is too
    assert rel < 5 / math.sqrt(2 * r)
    small = np.mean([error(1, s)[0] for s in range(5)])
    assert small > 2 * rel  # r = 1 is far less accurate


def test_clip_weights_come_from_the_query():
    model = _mlp()
    x, y = _data(model, 4)
    query = tf_dp.GaussianSumQuery(1e-3, 0.0)  # every example clipped hard
    out = JLClipper(2, seed=4).clipped_sum(
        PerExampleLoss(model), (x, y, None), model.trainable_variables, query, _params(query)
    )
    # sum_i min(1, C/M_i) g_i with M_i the returned estimates: recompute from per-example grads
    per_example = _per_example_gradients(model, x, y)
    w = np.minimum(1.0, 1e-3 / out.norms.numpy())
    # a gradient's roundings, the weight and the sum of 4 (the weights from the returned
    # estimates: a weight from another estimate is off by O(the JL error) ~ 50% at r = 2)
    atol = tolerance(
        "float32",
        _gradient_terms(model) + 4 + 2,
        max(float(np.max(np.tensordot(w, np.abs(pe), 1))) for pe in per_example),
    )
    for g, pe in zip(out.clipped_sum, per_example):
        np.testing.assert_allclose(g.numpy(), np.tensordot(w, pe, 1), rtol=0, atol=atol)


def test_refuses_per_group_queries_naming_them():
    nested = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 1.0), tf_dp.GaussianSumQuery(1.0, 1.0)])
    with pytest.raises(TypeError, match="NestedQuery with 2 groups"):
        check_query(nested)
    joint = tf_dp.JointClipGaussianSumQuery(1.0, 1.0, scales=[1.0, 2.0])
    with pytest.raises(TypeError, match="JointClipGaussianSumQuery"):
        check_query(joint)
    check_query(tf_dp.NestedQuery(tf_dp.GaussianSumQuery(1.0, 1.0)))
    check_query(tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 1.0), 4.0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="jl_projections"):
        JLClipper(0)
    with pytest.raises(ValueError, match="method"):
        JLClipper(1, method="reverse")
    with pytest.raises(TypeError, match="noise_after_sum"):
        JLClipper(1, noise_after_sum="yes")


def test_directions_default_to_os_entropy():
    v = tf.Variable(tf.zeros([50]))
    a = JLClipper(1).draw_directions([v])[0][0].numpy()
    b = JLClipper(1).draw_directions([v])[0][0].numpy()
    assert not np.allclose(a, b)
    c = JLClipper(1, seed=3).draw_directions([v])[0][0].numpy()
    d = JLClipper(1, seed=3).draw_directions([v])[0][0].numpy()
    np.testing.assert_array_equal(c, d)


# -- end to end ------------------------------------------------------------------------------------


def test_lstm_trains_with_fit_in_jl_mode_and_ledger_gives_epsilon():
    from tf_dp.accounting import compute_epsilon, dp_sgd_epsilon

    model = tf_dp.keras.make_private(_lstm())
    n, batch = 96, 32
    x, y = _data(model, n)
    optimizer = tf_dp.keras.DPKerasAdamOptimizer(
        l2_norm_clip=1.0,
        noise_multiplier=3.0,
        learning_rate=1e-2,
        gradient_mode="jl",
        jl_projections=8,
    )
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [v.numpy().copy() for v in model.trainable_variables]
    history = model.fit(x.numpy(), y.numpy(), batch_size=batch, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))
    assert optimizer.gradient_clipper.name == "jl"
    assert optimizer.gradient_clipper.resolved_method == "double_vjp"
    samples = optimizer.ledger.samples()
    assert len(samples) == 2 * n // batch
    for s in samples:
        assert [q.mechanism for q in s.queries] == ["jl"]
        assert [q.jl_projections for q in s.queries] == [8]
    result = compute_epsilon(optimizer.ledger, 1e-5, accountant="pld")
    eps = result.epsilon
    assert np.isfinite(eps) and eps > 0
    # the ledger's accounting is that of the same run described by its hyperparameters
    expected = dp_sgd_epsilon(
        n, batch, 3.0, 1e-5, epochs=2, accountant="pld", sampling="shuffle", jl_projections=8
    ).epsilon
    # the same accountant on the same (n, batch, z, r, steps) in float64, no TensorFlow kernel:
    # equal up to float64 roundings; rel=1e-6 still tells apart one step more (about 1%)
    assert eps == pytest.approx(expected, rel=1e-6)


def test_cnn_fit_in_jl_mode_uses_forward_mode():
    model = tf_dp.keras.make_private(_cnn())
    x, y = _data(model, 32)
    optimizer = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.5, learning_rate=0.1, gradient_mode="jl", jl_projections=1
    )
    model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x.numpy(), y.numpy(), batch_size=16, epochs=1, verbose=0)
    assert optimizer.gradient_clipper.resolved_method == "forward"
    assert [q.jl_projections for s in optimizer.ledger.samples() for q in s.queries] == [1, 1]


class _UnseededNoise(L.Layer):
    """Randomness outside Keras seed generators: the forward pass cannot be replayed."""

    def call(self, x, training=False):
        return x + tf.random.normal(tf.shape(x)) if training else x


def test_forward_replay_refuses_unreplayable_randomness():
    model = _compiled([keras.Input((6,)), L.Dense(4), _UnseededNoise(), L.Dense(3)])
    x, y = _data(model, 4)
    query = tf_dp.GaussianSumQuery(1.0, 0.0)
    strategy = JLClipper(3, method="forward", seed=0)
    args = (PerExampleLoss(model), (x, y, None), model.trainable_variables, query, _params(query))
    with pytest.raises(ValueError, match="replayed forward pass"):
        strategy.clipped_sum(*args)
    with pytest.raises(tf.errors.InvalidArgumentError, match="replayed forward pass"):
        tf.function(lambda: strategy.clipped_sum(*args).clipped_sum)()
    # the single-pass route works on it
    JLClipper(3, method="double_vjp", seed=0).clipped_sum(*args)


@pytest.mark.parametrize(
    "ksize,strides,padding",
    [(2, 1, "VALID"), (3, 2, "SAME"), ((2, 3), (1, 2), "SAME"), (3, 3, "VALID")],
)
def test_max_pool_forward_rule_matches_tf_including_ties(ksize, strides, padding):
    # Many exact ties with different tangents: the rule must pick the element TF's MaxPoolGrad
    # routes the gradient to (TF's own forward rule is MaxPoolGradGrad).
    from tensorflow.python.ops import gen_nn_ops

    from tf_dp.gradients.jl import _max_pool_jvp

    rng = np.random.default_rng(0)
    x = tf.constant(rng.integers(0, 3, (2, 7, 8, 3)).astype("float32"))
    t = tf.constant(rng.normal(size=(2, 7, 8, 3)).astype("float32"))
    k = [1, *(ksize if isinstance(ksize, tuple) else (ksize, ksize)), 1]
    s = [1, *(strides if isinstance(strides, tuple) else (strides, strides)), 1]
    y = tf.nn.max_pool2d(x, k[1:3], s[1:3], padding)
    attrs = ("ksize", k, "strides", s, "padding", padding.encode(), "data_format", b"NHWC")
    ours = _max_pool_jvp(attrs, [x], [y], [t])[0]
    reference = gen_nn_ops.max_pool_grad_grad(x, y, t, k, s, padding)
    np.testing.assert_array_equal(ours.numpy(), reference.numpy())
    # adjoint of the backward pass the tape uses: <g, J t> == <J^T g, t> for J^T g = MaxPoolGrad
    g = tf.constant(rng.normal(size=y.shape).astype("float32"))
    back = gen_nn_ops.max_pool_grad(x, y, g, k, s, padding)
    # two float32 sums over the entries (a product and the sum each) in different orders, of
    # at most sum |g J t| (the J t entries are picks of t); a wrong pick is off by O(|t|)
    scale = max(float(tf.reduce_sum(tf.abs(g * ours))), float(tf.reduce_sum(tf.abs(back * t))))
    atol = tolerance("float32", int(np.prod(x.shape)) + 1, scale)
    np.testing.assert_allclose(
        float(tf.reduce_sum(g * ours)), float(tf.reduce_sum(back * t)), rtol=0, atol=atol
    )


def test_optimizer_passes_jl_method_and_round_trips_config():
    import tf_dp.keras as dpk

    opt = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode="jl", jl_projections=2,
        jl_method="double_vjp",
    )
    model = dpk.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    )
    model.compile(optimizer=opt, loss="mse")
    strategy = opt.clipper_for(model)
    assert strategy.method == "double_vjp"
    again = dpk.DPKerasSGDOptimizer.from_config(opt.get_config())
    assert again.get_config()["jl_method"] == "double_vjp"
    with pytest.raises(ValueError, match="jl_method"):
        dpk.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode="jl", jl_projections=1,
            jl_method="backwards",
        )
    with pytest.raises(ValueError, match="jl_method"):
        dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, jl_method="forward")


def test_auto_never_chooses_jl():
    """JL gives no finite epsilon for small r and is slower than exact clipping at a usable r
    (docs/jl.md, "When JL is worth it"): auto picks an exact strategy for every kind of model."""
    import keras

    from tf_dp.gradients import make_clipper

    class Custom(keras.layers.Layer):  # no ghost rule: a per-example fallback, never JL
        def build(self, shape):
            self.w = self.add_weight(shape=(shape[-1], 3))

        def call(self, x):
            return keras.ops.tanh(x @ self.w)

    models = [
        keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)]),
        keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(2, 3), keras.layers.Flatten(),
                          keras.layers.Dense(2)]),
        keras.Sequential([keras.Input((6,), dtype="int32"), keras.layers.Embedding(10, 4),
                          keras.layers.Bidirectional(keras.layers.LSTM(3)),
                          keras.layers.Dense(2)]),
        keras.Sequential([keras.Input((5,)), Custom()]),
    ]
    for model in models:
        strategy = make_clipper("auto", model=model)
        assert strategy.name != "jl" and strategy.exact, (model, strategy.name)
