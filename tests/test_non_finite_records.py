"""Non-finite records: a NaN or inf in one example gets clip weight 0 in every gradient mode.

Clipping bounds a record only if its gradient is finite; ``0 * NaN`` is NaN, so a mode that
multiplies a bad record by 0 instead of selecting it out leaks it into every weight. References:
the slow per-example loop of ``test_gradients_exact`` over the *other* examples.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.gradients import MicrobatchClipper, make_clipper
from tf_dp.dp_query import GaussianSumQuery
from tf_dp.gradients.jl import JLClipper
from tf_dp.keras import PerExampleLoss
from tests.test_gradients_exact import (
    HUGE_CLIP,
    assert_close_list,
    compiled,
    conv_model,
    data,
    reference_clipped_sum,
    reference_grads,
    run,
    sequential_model,
    twin_groups,
)

BAD = {"nan": np.nan, "inf": np.inf}


def _poisoned(x, rows, value):
    x = x.copy()
    for r in rows:
        x[r, ...] = 0.0
        x[r].flat[1] = value  # one feature of the example
    return x


def _strategy(mode, model, seed=0):
    if mode == "microbatch":
        return MicrobatchClipper(4, seed=seed)
    if mode == "jl":
        return JLClipper(jl_projections=2, seed=seed)
    return make_clipper(mode, model=model)


@pytest.mark.parametrize("value", sorted(BAD))
@pytest.mark.parametrize("mode", ["vectorized", "ghost", "microbatch"])
@pytest.mark.parametrize("builder", [sequential_model, conv_model])
def test_a_bad_example_adds_exactly_nothing_to_the_clipped_sum(mode, builder, value):
    model = compiled(builder())
    shape = tuple(model.inputs[0].shape[1:])
    x, y = data(batch=12, shape=shape)
    bad = [2, 7]
    xb = _poisoned(x, bad, BAD[value])
    good = [i for i in range(len(x)) if i not in bad]
    out = run(_strategy(mode, model, seed=3), model, xb, y, clip=0.3, graph=True)
    if mode == "microbatch":
        groups = [[i for i in g if i not in bad] for g in twin_groups(4, len(x), seed=3)]
        groups = [g for g in groups if g]
    else:
        groups = [[i] for i in good]
    expected, _ = reference_clipped_sum(reference_grads(model, x, y, groups=groups), 0.3)
    for g in out["clipped_sum"]:
        assert np.all(np.isfinite(g))
    assert_close_list(out["clipped_sum"], expected)


@pytest.mark.parametrize("value", sorted(BAD))
def test_jl_gives_a_bad_example_weight_zero(value):
    # with no clipping, JL's weighted backward pass is the plain sum of the kept examples'
    # gradients, whatever its norm estimates
    model = compiled(sequential_model())
    x, y = data(batch=10)
    bad = [0, 5]
    out = run(JLClipper(jl_projections=2, seed=1), model, _poisoned(x, bad, BAD[value]), y,
              clip=HUGE_CLIP, graph=True)
    records = reference_grads(model, x, y, groups=[[i] for i in range(10) if i not in bad])
    expected = [sum(r[k] for r in records) for k in range(len(records[0]))]
    assert_close_list(out["clipped_sum"], expected, rtol=1e-4, atol=1e-5)
    # with clipping, the sum stays finite and bounded by (kept records) * C
    out = run(JLClipper(jl_projections=2, seed=1), model, _poisoned(x, bad, BAD[value]), y,
              clip=0.3, graph=True)
    total = np.sqrt(sum(float(np.sum(np.square(g))) for g in out["clipped_sum"]))
    assert np.isfinite(total) and total <= 8 * 0.3 * (1 + 1e-5)


@pytest.mark.parametrize(
    "mode, options",
    [
        ("vectorized", {}),
        ("ghost", {}),
        ("microbatch", {"num_microbatches": 4}),
        ("jl", {"jl_projections": 1}),
        ("auto", {}),
    ],
)
def test_training_on_data_with_a_nan_example_keeps_every_weight_finite(mode, options):
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype(np.float32)
    y = rng.integers(0, 3, 64).astype(np.int32)
    x[5, 2] = np.nan
    x[40, 0] = np.inf
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, gradient_mode=mode,
            **options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=0), epochs=2,
              verbose=0)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    opt = model.optimizer
    assert int(opt.iterations) == len(opt.ledger.samples()) == 8
    assert int(opt.skipped_steps) == 0  # the step ran without the bad records


def test_weighted_sum_selects_rows_out_instead_of_multiplying_by_zero():
    from tf_dp.gradients.base import weighted_sum

    g = tf.constant([[1.0, 2.0], [np.nan, np.inf], [3.0, 4.0]])
    out = weighted_sum(tf.constant([0.5, 0.0, 1.0]), g).numpy()
    np.testing.assert_allclose(out, [3.5, 5.0])
    # under XLA the sum is a product with two columns (w, 0): the same values; exact here
    xla = tf.function(weighted_sum, jit_compile=True)
    np.testing.assert_array_equal(xla(tf.constant([0.5, 0.0, 1.0]), g).numpy(), [3.5, 5.0])


@pytest.mark.parametrize("shape", [(64, 128, 128), (7, 5), (3, 2, 2, 4)])
def test_weighted_sum_under_xla_is_the_sum_of_weighted_rows(shape):
    # float32 sums of B products in another order: within B * eps * sum_b |w_b g_b| of a
    # float64 reference, elementwise; a NaN row of weight 0 still adds exactly nothing
    from tf_dp.gradients.base import weighted_sum

    rng = np.random.default_rng(1)
    g = rng.normal(size=shape).astype(np.float32)
    w = rng.uniform(0.1, 1.0, size=shape[0]).astype(np.float32)
    w[1] = 0.0
    g[1] = np.nan
    keep = w != 0
    terms = w[keep].astype(np.float64).reshape((-1,) + (1,) * (len(shape) - 1)) * g[keep]
    reference = terms.sum(axis=0)
    bound = shape[0] * np.finfo(np.float32).eps * np.abs(terms).sum(axis=0) + 1e-30
    xla = tf.function(weighted_sum, jit_compile=True)
    out = xla(tf.constant(w), tf.constant(g)).numpy()
    assert out.shape == shape[1:]
    assert np.all(np.abs(out - reference) <= bound)


@pytest.mark.parametrize("value", sorted(BAD))
def test_guarded_sums_equal_the_selected_sums_bit_for_bit(value):
    """The fast sums (no selection) are taken only when finite; a weight-0 row holding NaN or inf
    makes them NaN, and the guard then returns the selected sums, exactly."""
    from tf_dp.gradients.base import guarded_sums, weighted_sum

    rng = np.random.default_rng(0)
    grads = [tf.constant(rng.normal(size=(6,) + s), tf.float32) for s in [(3,), (2, 4), (5,)]]
    w = tf.constant([0.5, 0.0, 1.0, 0.25, 0.0, 0.75])
    selected = [weighted_sum(w, g, select=True).numpy() for g in grads]
    for got, want, g in zip(guarded_sums(lambda s: [weighted_sum(w, g, s) for g in grads]),
                            selected, grads):
        np.testing.assert_array_equal(got.numpy(), want)  # no bad row
        # against another summation order: n rounding errors of at most eps * sum |w_i g_i|
        bound = len(w) * np.finfo(np.float32).eps * np.tensordot(np.abs(w), np.abs(g), axes=1)
        np.testing.assert_array_less(np.abs(want - tf.tensordot(w, g, axes=1).numpy()),
                                     bound + np.finfo(np.float32).tiny)
    bad = [tf.tensor_scatter_nd_update(g, [[1]], tf.fill([1] + g.shape[1:], BAD[value]))
           for g in grads]
    assert not np.all(np.isfinite(weighted_sum(w, bad[0], select=False).numpy()))

    @tf.function
    def graph(ws):
        return guarded_sums(lambda select: [weighted_sum(ws, g, select) for g in bad])

    for got in [guarded_sums(lambda select: [weighted_sum(w, g, select) for g in bad]), graph(w)]:
        for got_v, want in zip(got, selected):
            np.testing.assert_array_equal(got_v.numpy(), want)


@pytest.mark.parametrize("value", sorted(BAD))
def test_guarded_sums_given_the_weights_skip_the_check_only_when_no_weight_is_zero(value):
    """With the weights passed, a step where every weight is non-zero takes the sums without
    the selection and without reducing them (the selection would select nothing); a weight of 0
    (here on a row holding NaN or inf) takes the checked route, which returns the selected sums."""
    from tf_dp.gradients.base import guarded_sums, weighted_sum

    rng = np.random.default_rng(1)
    grads = [tf.constant(rng.normal(size=(5,) + s), tf.float32) for s in [(3,), (2, 4)]]
    dense_w = tf.constant([0.5, 0.1, 1.0, 0.25, 0.75])
    for got, g in zip(guarded_sums(lambda s: [weighted_sum(dense_w, g, s) for g in grads],
                                   dense_w), grads):
        np.testing.assert_array_equal(got.numpy(), weighted_sum(dense_w, g).numpy())
    w = tf.constant([0.5, 0.0, 1.0, 0.25, 0.75])
    bad = [tf.tensor_scatter_nd_update(g, [[1]], tf.fill([1] + g.shape[1:], BAD[value]))
           for g in grads]

    @tf.function
    def graph(ws):
        return guarded_sums(lambda select: [weighted_sum(ws, g, select) for g in bad], [ws])

    for got, g in zip(graph(w), bad):
        np.testing.assert_array_equal(got.numpy(), weighted_sum(w, g).numpy())
        assert np.all(np.isfinite(got.numpy()))
    # no weight 0: the sums are not reduced outside the conditional (only inside its
    # checked branch, a function of its own)
    concrete = graph.get_concrete_function(tf.TensorSpec([5], tf.float32))
    top = [op.type for op in concrete.graph.get_operations()]
    assert "Sum" not in top and "IsFinite" not in top, top
    assert top.count("If") + top.count("StatelessIf") == 1


def test_a_ghost_step_has_one_conditional_for_all_its_sums():
    """The selection of weight-0 rows is one conditional per step, not one per variable."""
    model = compiled(sequential_model())
    x, y = data(batch=8, shape=tuple(model.inputs[0].shape[1:]))
    clipper = make_clipper("ghost", model=model)
    query = GaussianSumQuery(1.0, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    loss_fn = PerExampleLoss(model)

    fn = tf.function(lambda xb, yb: clipper.clipped_sum(
        loss_fn, (xb, yb, None), model.trainable_variables, query, params).clipped_sum)
    graph = fn.get_concrete_function(tf.constant(x), tf.constant(y)).graph
    conds = [op for op in graph.get_operations() if op.type in ("If", "StatelessIf")]
    assert len(model.trainable_variables) >= 4
    assert len(conds) == 1, [op.name for op in conds]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_all_finite_under_xla_agrees_with_the_mask_reduction(dtype):
    # the XLA form sums t * 0 by products with ones: it must say False for any inf, -inf or
    # NaN anywhere (a single one, in any row or column) and True for any all-finite tensor,
    # also one of the dtype's largest values (whose sum would overflow; t * 0 does not)
    from tf_dp.engine.step import all_finite

    rng = np.random.default_rng(0)
    big = float(np.finfo(np.float16).max) if dtype == "float16" else (
        3.0e38 if dtype in ("float32", "bfloat16") else 1.0e308)
    check = tf.function(all_finite, jit_compile=True)
    for shape in [(784, 512), (3, 3, 16, 32), (64, 128)]:
        base = rng.normal(size=shape)
        cases = [(base, True), (np.full(shape, big), True), (-np.full(shape, big), True)]
        for bad in (np.inf, -np.inf, np.nan):
            for _ in range(4):
                t = base.copy()
                t[tuple(rng.integers(0, s) for s in shape)] = bad
                cases.append((t, False))
        corner = base.copy()
        corner[(-1,) * len(shape)] = np.nan
        cases.append((corner, False))
        for values, expected in cases:
            t = tf.cast(tf.constant(values), dtype)
            assert bool(check(t)) is expected, (shape, dtype, expected)
            assert bool(all_finite(t)) is expected  # eager: the mask reduction
