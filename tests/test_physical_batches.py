"""max_physical_batch_size: a sampled batch clipped in pieces gives the whole batch's clipped sum.

References are independent of the piece logic: the slow per-example loop of
``test_gradients_exact`` (one tape per example) clipped by hand, and, for training, the same
model trained without pieces (same initial weights and noise seed).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
import tf_dp.keras as dpk
from tests.helpers.tolerance import (
    dense_gradient_terms,
    model_gradient_terms,
    norm_terms,
    sgd_tolerance,
    tolerance,
)
from tests.test_gradients_exact import (
    compiled,
    conv_model,
    data,
    derived_atol,
    norm_rtol,
    per_example_loss_value,
    reference_clipped_sum,
    reference_grads,
    sequential_model,
)
from tests.test_recurrent_ghost import loop_reference, rng, seq_model, tokens
from tf_dp.dp_query.gaussian_query import GaussianSumQuery
from tf_dp.gradients import make_clipper
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers


def _forward_atol(model, values, extra_terms=0):
    """The float32 tolerance of a forward value (a logit or a per-example loss) computed in pieces
    vs whole (other kernel shapes, tests/helpers/tolerance.py): at most the roundings
    ``model_gradient_terms`` counts (forward and backward, an upper count of the forward path),
    plus ``extra_terms`` for reductions it does not see (a pooling), times the largest value."""
    terms = model_gradient_terms(model, classes=3) + extra_terms
    return tolerance("float32", terms, float(np.max(np.abs(values))))


def _loss_atol(weight_atol, gradients, losses, forward_terms):
    """The tolerance of a training loss evaluated at weights that differ by at most
    ``weight_atol`` per entry: to first order ``weight_atol`` times the largest L1 norm of a
    per-example gradient (``gradients``: per-example lists of flat arrays, or per-variable
    ``[B, ...]`` arrays when given as a tuple), plus the forward pass's own roundings. A batch's
    mean loss moves at most as much as its worst example."""
    if isinstance(gradients, tuple):
        l1 = np.sum([np.abs(g).reshape(len(g), -1).sum(axis=1) for g in gradients], axis=0).max()
    else:
        l1 = max(sum(float(np.abs(g).sum()) for g in rec) for rec in gradients)
    return weight_atol * float(l1) + tolerance("float32", forward_terms, float(np.max(losses)))


def _run(strategy, model, x, y, sw=None, clip=0.3, compile_as=None):
    """The strategy's outputs as numpy: eagerly (None), in a tf.function ("graph") or under XLA."""
    query = GaussianSumQuery(clip, 0.0)
    loss_fn = PerExampleLoss(model)

    def step(x, y, sw):
        params = query.derive_sample_params(query.initial_global_state())
        out = strategy.clipped_sum(loss_fn, (x, y, sw), model.trainable_variables, query, params)
        return {
            "clipped_sum": out.clipped_sum, "norms": out.norms, "losses": out.losses,
            "y_pred": out.y_pred, "record_mask": out.record_mask, "num_records": out.num_records,
        }

    if compile_as is not None:
        step = tf.function(step, jit_compile=compile_as == "xla")
    out = step(tf.constant(x), tf.constant(y), None if sw is None else tf.constant(sw))
    return {k: tf.nest.map_structure(np.asarray, v) for k, v in out.items()}


@pytest.mark.parametrize("compile_as", [None, "graph", "xla"])
@pytest.mark.parametrize("mode", ["vectorized", "ghost"])
@pytest.mark.parametrize("builder", [sequential_model, conv_model])
def test_pieces_give_the_reference_clipped_sum(builder, mode, compile_as):
    model = compiled(builder())
    x, y = data(batch=10, shape=tuple(model.inputs[0].shape[1:]))
    sw = np.linspace(0.5, 1.5, 10).astype("float32")
    sw[4] = 0.0  # a zero-weight row (like Poisson padding) inside a piece
    clip = 0.3
    # 10 records in pieces of 3: a first piece of 1, then three of 3
    out = _run(PhysicalBatches(make_clipper(mode, model=model), 3), model, x, y, sw, clip,
               compile_as)
    records = reference_grads(model, x, y, sw)
    want, norms = reference_clipped_sum(records, clip)
    assert np.sum(norms > clip) >= 3, "the clip must bind for several examples"
    # derived tolerances (tests/test_gradients_exact.py), plus the sum of the 4 pieces
    atol = derived_atol(model, records, clip, group=4)
    for got, ref in zip(out["clipped_sum"], want):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    np.testing.assert_allclose(out["norms"], norms, rtol=norm_rtol(model))
    # forward values in pieces vs whole: a wrong row (a piece's rows shifted) moves them by O(1)
    want_losses = np.asarray(per_example_loss_value(model, x, y, sw))
    np.testing.assert_allclose(out["losses"], want_losses, rtol=0,
                               atol=_forward_atol(model, want_losses))
    real = sw != 0  # zero-weight rows are computed as copies of a real row (by design)
    logits = np.asarray(model(x, training=True))
    np.testing.assert_allclose(out["y_pred"][real], logits[real], rtol=0,
                               atol=_forward_atol(model, logits))
    np.testing.assert_array_equal(out["record_mask"], sw != 0)
    assert int(out["num_records"]) == 10


@pytest.mark.parametrize("size", [1, 4, 6, 7])
def test_any_piece_size_gives_the_unsplit_ghost_sum_on_a_masked_bilstm(size):
    r = rng(0)
    model = compiled(seq_model(L.Bidirectional(L.LSTM(3)), L.Dense(2)))
    x, y = tokens(r, batch=7)
    ref = loop_reference(model, x, y)
    total = np.sqrt(sum(np.sum(g.reshape(7, -1) ** 2, axis=1) for g in ref))
    clip = float(np.median(total))
    want = [np.tensordot(np.minimum(1.0, clip / total), g, axes=1) for g in ref]
    split = _run(PhysicalBatches(make_clipper("ghost", model=model), size), model, x, y,
                 clip=clip, compile_as="graph")
    # tests/helpers/tolerance.py: per time step and direction the LSTM takes 14 roundings, 7
    # steps forward and back, the embedding's 7 positions, the dense head (6 + 2), the
    # log-softmax (2), 2 casts; then the norm, the sum of 7 records and of at most 7 pieces
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    gradient = 2 * 7 * 14 + 7 + 8 + 2 + 2
    magnitude = max(float(np.max(np.tensordot(np.minimum(1.0, clip / total), np.abs(g), axes=1)))
                    for g in ref)
    atol = tolerance("float32", gradient + norm_terms(params) + 7 + 7, magnitude)
    for got, ref_sum in zip(split["clipped_sum"], want):  # a lost or doubled row moves it by O(clip)
        np.testing.assert_allclose(got, ref_sum, rtol=0, atol=atol)
    np.testing.assert_allclose(split["norms"], total,
                               rtol=tolerance("float32", gradient + norm_terms(params)))


def test_a_non_finite_record_in_one_piece_adds_nothing():
    model = compiled(sequential_model())
    x, y = data(batch=9)
    x[5, 1] = np.nan  # in the second piece of 3 (pieces: 3, 3, 3)
    out = _run(PhysicalBatches(make_clipper("ghost", model=model), 3), model, x, y,
               compile_as="graph")
    good = [i for i in range(9) if i != 5]
    records = reference_grads(model, x[good], y[good])
    want, _ = reference_clipped_sum(records, 0.3)
    atol = derived_atol(model, records, 0.3, group=3)  # + the sum of 3 pieces
    for got, ref in zip(out["clipped_sum"], want):
        assert np.all(np.isfinite(got))
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


def _fit_atol(steps, max_batch, compute="float32"):
    """The weight tolerance of ``steps`` steps of :func:`_fit` of ``sequential_model`` (6-5-3,
    53 parameters), with and without pieces of 5 (another summation order, other kernel shapes;
    tests/helpers/tolerance.py): a per-example gradient's roundings in the compute dtype, its
    norm, the sum of at most ``max_batch`` rows and of at most 8 pieces, the division, in
    float32; updates <= 0.2 * 0.5, |w| <= 0.74 (Glorot) + steps * 0.1 <= 2."""
    gradient = dense_gradient_terms([6, 5, 3])
    atol = sgd_tolerance("float32", steps, 0.2, 0.5, gradient + norm_terms(53) + max_batch + 8 + 1,
                         weight_scale=2.0)
    if compute != "float32":
        atol += sgd_tolerance(compute, steps, 0.2, 0.5, gradient, weight_scale=0.0)
    return atol


def _fit(model_fn, inputs, size, jit, **fit_kwargs):
    model = dpk.make_private(model_fn())  # sets the global seed: the data are drawn after it
    # no noise: the noise path is the same code with or without pieces
    opt = dpk.DPKerasSGDOptimizer(l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=0.2,
                                  max_physical_batch_size=size)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=jit)
    history = model.fit(*inputs(), epochs=2, verbose=0, **fit_kwargs)
    return model, opt, history


@pytest.mark.parametrize("jit", [False, True])
def test_fit_with_pieces_equals_fit_without(jit):
    """Same initial weights and batches: the pieces change neither the update nor the ledger.
    Poisson batches (padded, random sizes) and arrays with a short last batch."""
    x, y = data(batch=40, seed=4)

    def model_fn():
        return sequential_model(seed=2)

    poisson = lambda: (tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=5),)
    for inputs, kwargs in ((poisson, {}), (lambda: (x, y), {"batch_size": 12, "shuffle": False})):
        whole, opt_whole, h_whole = _fit(model_fn, inputs, None, jit, **kwargs)
        split, opt_split, h_split = _fit(model_fn, inputs, 5, jit, **kwargs)
        atol = _fit_atol(8, max_batch=40)
        for a, b in zip(whole.get_weights(), split.get_weights()):  # 2 epochs of 4 steps
            np.testing.assert_allclose(b, a, rtol=0, atol=atol)
        # the loss of weights that differ by atol (a step lost or taken twice moves it by ~0.1)
        loss_atol = _loss_atol(atol, reference_grads(whole, x, y), h_whole.history["loss"],
                               dense_gradient_terms([6, 5, 3]) + 40)
        np.testing.assert_allclose(h_split.history["loss"], h_whole.history["loss"], rtol=0,
                                   atol=loss_atol)
        assert opt_split.ledger.samples() == opt_whole.ledger.samples()
        assert "physical batches of at most 5" in opt_split.gradient_clipper.description


def test_arguments_and_config():
    assert dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                   max_physical_batch_size=np.int64(8)).max_physical_batch_size == 8
    ftrl = dpk.DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                    max_physical_batch_size=8)
    assert ftrl.get_config()["max_physical_batch_size"] == 8
    for bad in (0, -2, 2.5, True, "8"):
        with pytest.raises(ValueError, match="max_physical_batch_size must be None or an integer"):
            dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                    max_physical_batch_size=bad)
    with pytest.raises(ValueError, match="max_physical_batch_size splits"):
        dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, num_microbatches=4,
                                max_physical_batch_size=8)
    with pytest.raises(ValueError, match="max_physical_batch_size splits"):
        dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode="jl",
                                jl_projections=4, max_physical_batch_size=8)
    opt = dpk.DPKerasAdamOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                   max_physical_batch_size=16)
    again = dpk.DPKerasAdamOptimizer.from_config(opt.get_config())
    assert again.max_physical_batch_size == 16
    assert dpk.DPKerasAdamOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0).max_physical_batch_size is None
    with pytest.raises(ValueError, match="per-example gradient mode"):
        PhysicalBatches(tf_dp.gradients.MicrobatchClipper(4), 8)


class _Spy(tf_dp.gradients.GradientClipper):
    """Records the number of records of every call of the wrapped strategy (eager)."""

    name = "ghost"

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def clipped_sum(self, loss_fn, data, variables, query, params):
        self.sizes.append(int(tf.shape(tf.nest.flatten(data[0])[0])[0]))
        return self.inner.clipped_sum(loss_fn, data, variables, query, params)


def test_every_piece_holds_at_most_p_records():
    model = compiled(sequential_model())
    x, y = data(batch=10)
    spy = _Spy(make_clipper("ghost", model=model))
    out = _run(PhysicalBatches(spy, 3), model, x, y)
    assert spy.sizes == [1, 3, 3, 3], spy.sizes  # the remainder first, then full pieces
    records = reference_grads(model, x, y)
    want, _ = reference_clipped_sum(records, 0.3)
    atol = derived_atol(model, records, 0.3, group=4)  # + the sum of 4 pieces
    for got, ref in zip(out["clipped_sum"], want):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", ["vectorized", "ghost"])
def test_pieces_made_only_of_padding_rows_stay_valid_input(mode):
    """Poisson padding rows (weight 0) are zeros; a piece of them alone would be all padding
    tokens (a masked mean of nothing: NaN). They are filled from a real row of the whole batch."""
    model = compiled(keras.Sequential([
        keras.Input((5,), dtype="int32"), L.Embedding(12, 4, mask_zero=True),
        L.GlobalAveragePooling1D(), L.Dense(3)]))
    x = np.random.default_rng(0).integers(1, 12, (6, 5)).astype("int32")
    x[2:] = 0  # four padding rows: pieces of 2 -> [real, real], [pad, pad], [pad, pad]
    y = np.array([0, 1, 0, 0, 0, 0], "int32")
    sw = np.array([1, 1, 0, 0, 0, 0], "float32")
    whole = _run(make_clipper(mode, model=model), model, x, y, sw, compile_as="graph")
    split = _run(PhysicalBatches(make_clipper(mode, model=model), 2), model, x, y, sw,
                 compile_as="graph")
    assert np.all(np.isfinite(split["losses"])), split["losses"]
    # the embedding's mean over 5 positions, forward and back, besides the dense layer
    np.testing.assert_allclose(split["losses"], whole["losses"], rtol=0,
                               atol=_forward_atol(model, whole["losses"], extra_terms=10))
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # a clipped sum of 6 rows (each entry <= the clip 0.3), in pieces of 2: the gradient, its
    # norm, the sums over 6 rows and 3 pieces; a padding row counted as real moves it by O(0.3)
    atol = tolerance("float32", model_gradient_terms(model, classes=3) + 10 + norm_terms(params)
                     + 6 + 3, 6 * 0.3)
    for a, b in zip(whole["clipped_sum"], split["clipped_sum"]):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def _fit_query(query_fn, size):
    r = np.random.default_rng(0)
    x = r.normal(size=(80, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    keras.utils.set_random_seed(0)
    model = dpk.make_private(keras.Sequential(
        [keras.Input((6,)), L.Dense(8, activation="relu"), L.Dense(2)]))
    query = query_fn()
    opt = dpk.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=0.1,
                                  max_physical_batch_size=size)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=1), epochs=2,
              verbose=0)
    return model, opt, query


QUERIES = {
    # the adaptive clip moves with the count of unclipped records: the pieces' norms and record
    # masks must give the same count (its noise is seeded, so both runs draw the same)
    "adaptive": lambda: tf_dp.dp_query.QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=0.05, noise_multiplier=0.0, target_unclipped_quantile=0.5,
        learning_rate=0.3, clipped_count_stddev=1.0, expected_num_records=20, seed=7),
    "automatic": lambda: tf_dp.dp_query.AutomaticClipSumQuery(0.5, 0.0, gamma=0.1),
    "per_layer": lambda: tf_dp.dp_query.NestedQuery(
        [tf_dp.dp_query.GaussianSumQuery(c, 0.0) for c in (0.2, 0.05, 0.3, 0.02)]),
}


@pytest.mark.parametrize("kind", sorted(QUERIES))
def test_every_clipping_query_gives_the_same_training_with_pieces(kind):
    whole, opt_whole, q_whole = _fit_query(QUERIES[kind], None)
    split, opt_split, q_split = _fit_query(QUERIES[kind], 3)
    steps = len(opt_whole.ledger.samples())
    # tests/helpers/tolerance.py: a 6-8-2 gradient, its norm (74 parameters), the sum of at most
    # 80 rows and 27 pieces of 3, the division; updates <= 0.1 x 0.5 (every clip here, the
    # adaptive one included, stays below 0.5), |w| <= 2. A wrong count or clip moves them by
    # O(learning rate x clip) = 1e-2 per step.
    atol = sgd_tolerance("float32", steps, 0.1, 0.5,
                         dense_gradient_terms([6, 8, 2]) + norm_terms(74) + 80 + 27 + 1,
                         weight_scale=2.0)
    for a, b in zip(whole.get_weights(), split.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)
    assert opt_split.ledger.samples() == opt_whole.ledger.samples()
    if kind == "adaptive":
        clips = [e.queries[0].l2_sensitivity for e in opt_split.ledger.samples()]
        assert len(set(clips)) > 2  # the clip moved during training, identically in both runs
        # the clip follows integer counts (the same in both runs) through the same ops: one
        # rounding per step at most; a count off by one moves it by exp(0.3 / 20) - 1 = 1.5e-2
        assert float(q_split.l2_norm_clip.numpy()) == pytest.approx(
            float(q_whole.l2_norm_clip.numpy()), rel=tolerance("float32", steps))


def _fit_sequence(model_fn, inputs, size, metrics, sampling=None, **fit_kwargs):
    keras.utils.set_random_seed(3)
    model = dpk.make_private(model_fn())
    opt = dpk.DPKerasSGDOptimizer(l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=0.2,
                                  gradient_mode="ghost", max_physical_batch_size=size)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
                  if metrics == ["accuracy"] else "mse", metrics=metrics)
    if sampling is not None:
        opt.set_sampling(*sampling)
    history = model.fit(*inputs, epochs=1, verbose=0, **fit_kwargs)
    return model, history


def test_masked_sequence_outputs_keep_their_mask_for_metrics():
    r = np.random.default_rng(0)
    x = r.integers(1, 20, (24, 6)).astype("int32")
    x[:, 3:] = 0  # the last three steps are masked
    y = r.integers(0, 3, (24, 6)).astype("int32")

    def model_fn():
        return keras.Sequential([keras.Input((6,), dtype="int32"),
                                 L.Embedding(20, 4, mask_zero=True), L.Dense(3)])

    whole, h_whole = _fit_sequence(model_fn, (x, y), None, ["accuracy"], batch_size=12,
                                   shuffle=False)
    _, h_split = _fit_sequence(model_fn, (x, y), 5, ["accuracy"], batch_size=12,
                                   shuffle=False)
    # accuracy counts agreements: one flipped token of the 72 moves it by 1/72; the two runs
    # only differ in the rounding of the count's sum and division
    assert h_split.history["accuracy"] == pytest.approx(h_whole.history["accuracy"],
                                                        rel=tolerance("float32", 2))
    # 1 epoch of 2 steps: weights within sgd_tolerance (an embedding row is a 1-term gradient,
    # the dense head sums 6 positions, the log-softmax 3, norm over 92 parameters, 12 rows and 3
    # pieces), the loss within that times the largest per-example gradient's L1 norm
    gradient = 2 * (4 + 2) + 6 + 3 + 2
    atol = sgd_tolerance("float32", 2, 0.2, 0.5, gradient + norm_terms(92) + 12 + 3 + 1, 2.0)
    loss_atol = _loss_atol(atol, loop_reference(whole, x, y), h_whole.history["loss"],
                           gradient + 6 * 3)
    np.testing.assert_allclose(h_split.history["loss"], h_whole.history["loss"], rtol=0,
                               atol=loss_atol)


def test_outputs_of_dynamic_length_and_a_batch_shorter_than_a_piece():
    r = np.random.default_rng(1)
    lengths = [7, 5, 6, 7, 4, 7, 6, 5, 7, 3, 6]
    seqs = [(r.normal(size=(t, 3)).astype("float32"), r.normal(size=(t, 2)).astype("float32"))
            for t in lengths]

    def make_ds():  # time axis of unknown length when traced; batches of 8 and 3
        spec = (tf.TensorSpec((None, 3), tf.float32), tf.TensorSpec((None, 2), tf.float32))
        return tf.data.Dataset.from_generator(lambda: iter(seqs), output_signature=spec
                                              ).padded_batch(8)

    def model_fn():
        return keras.Sequential([keras.Input((None, 3)), L.Dense(2)])

    sampling = (11, 8 / 11, "shuffle")
    whole, h_whole = _fit_sequence(model_fn, (make_ds(),), None, ["mae"], sampling)
    # the batch of 3 has no full piece of 4
    split, h_split = _fit_sequence(model_fn, (make_ds(),), 4, ["mae"], sampling)
    # 1 epoch of 2 steps of a linear 3-2 layer applied at up to 7 steps, mean squared error over
    # 7 x 2 values: the gradient sums 7 positions; its norm over 8 parameters, 8 rows, 2 pieces.
    # Weights within atol give outputs within atol x (sum |x_t| + 1), and so the mean absolute
    # error. A dropped or doubled row moves the weights by O(0.2 x 0.5 / 8) = 1e-2.
    gradient = 2 * (3 + 2) + 14 + 7 + 2
    atol = sgd_tolerance("float32", 2, 0.2, 0.5, gradient + norm_terms(8) + 8 + 2 + 1, 2.0)
    x_l1 = max(float(np.abs(s).sum(axis=1).max()) for s, _ in seqs)
    mae_atol = atol * (x_l1 + 1) + tolerance("float32", gradient, max(h_whole.history["mae"]))
    np.testing.assert_allclose(h_split.history["mae"], h_whole.history["mae"], rtol=0,
                               atol=mae_atol)
    for a, b in zip(whole.get_weights(), split.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)


def test_mixed_float16_with_pieces():
    x, y = data(batch=24, seed=4)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        whole, opt_whole, _ = _fit(lambda: sequential_model(seed=2), lambda: (x, y), None, False,
                                   batch_size=12, shuffle=False)
        split, opt_split, _ = _fit(lambda: sequential_model(seed=2), lambda: (x, y), 5, False,
                                   batch_size=12, shuffle=False)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert all(w.dtype == np.float32 for w in split.get_weights())
    for a, b in zip(whole.get_weights(), split.get_weights()):
        # float16 forward pass, 2 epochs of 2 steps
        np.testing.assert_allclose(b, a, rtol=0, atol=_fit_atol(4, max_batch=12, compute="float16"))
    assert opt_split.ledger.samples() == opt_whole.ledger.samples()


def test_ftrl_with_pieces_equals_ftrl_without():
    """DP-FTRL's tree query clips per record too: pieces give the same updates and ledger."""
    x, y = data(batch=24, seed=4)

    def fit(size):
        model = dpk.make_private(sequential_model(seed=2))
        opt = dpk.DPKerasFTRLOptimizer(learning_rate=0.2, l2_norm_clip=0.5, noise_multiplier=0.0,
                                       max_physical_batch_size=size)
        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(x, y, batch_size=12, shuffle=False, epochs=2, verbose=0)
        return model, opt

    whole, opt_whole = fit(None)
    split, opt_split = fit(5)
    moved = max(float(np.max(np.abs(a - b))) for a, b in
                zip(whole.get_weights(), sequential_model(seed=2).get_weights()))
    assert moved > 1e-3
    # FTRL's update is the learning rate times the tree's running sum of the clipped means (at
    # most 4 steps of 0.5): _fit_atol's per-step error counted over the 4 steps of the tree
    atol = 4 * _fit_atol(4, max_batch=12)
    for a, b in zip(whole.get_weights(), split.get_weights()):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol)
    assert opt_split.ledger.samples() == opt_whole.ledger.samples()
    assert opt_split.gradient_clipper.description.endswith("physical batches of at most 5")
