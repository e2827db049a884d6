"""Ghost clipping (``gradient_mode="ghost"``) against the vectorized strategy.

For every built-in norm rule (and sequence inputs, masks, shared layers, mixed models with
unregistered layers, tied weights, a user-registered rule), the ghost per-example, per-variable
norms must equal the norms of the vectorized strategy's materialised per-example gradients to
1e-5 relative, and the clipped sums must agree with noise 0 (clip set so that some examples are
clipped and some are not).
"""

import logging
import os
import types

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import model_gradient_terms, norm_terms, tolerance
from tf_dp.gradients import make_clipper
from tf_dp.gradients.ghost import (
    GhostClipper,
    PerExample,
    register_layer_norm_rule,
    factors,
    unregister_layer_norm_rule,
)
from tf_dp.gradients.vectorized import VectorizedClipper
from tf_dp.keras.losses import PerExampleLoss

RTOL = 1e-5
L = keras.layers


class RecordingQuery(tf_dp.GaussianSumQuery):
    """A GaussianSumQuery that keeps the per-variable squared norms it was asked to clip."""

    def clip_weights(self, params, squared_norms):
        self.squared = squared_norms
        return super().clip_weights(params, squared_norms)


class RecordingNested(tf_dp.NestedQuery):
    def clip_weights(self, params, squared_norms):
        self.squared = squared_norms
        return super().clip_weights(params, squared_norms)


def _compile(model, loss=None):
    model.compile(
        loss=loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd"
    )
    return model


def _run(strategy, model, data, query):
    params = query.derive_sample_params(query.initial_global_state())
    out = strategy.clipped_sum(PerExampleLoss(model), data, model.trainable_variables, query, params)
    return [np.sqrt(np.asarray(s, np.float64)) for s in tf.nest.flatten(query.squared)], out


class LoopReference(VectorizedClipper):
    """Per-example gradients by a Python loop over batches of one (an independent oracle).

    Used where ``tf.vectorized_map`` itself crashes: on TF 2.21 the vectorized strategy aborts the
    process (``munmap_chunk(): invalid pointer``) on EinsumDense layers with multi-axis kernels
    such as ``abc,cde->abde`` (MultiHeadAttention's projections).
    """

    def per_example_gradients(self, loss_fn, data, variables):
        x, y, sw = data
        n = len(y)
        tf_vars = tf_dp.gradients.base.as_tf_variables(variables)
        grads, preds, losses = [], [], []
        for i in range(n):
            pick = lambda t: tf.nest.map_structure(lambda a: a[i : i + 1], t)  # noqa: E731
            with tf.GradientTape() as tape:
                loss, y_pred = loss_fn(pick(x), pick(y), None if sw is None else pick(sw))
                loss = tf.reduce_sum(loss)
            grads.append(tape.gradient(loss, tf_vars, unconnected_gradients="zero"))
            preds.append(y_pred[0])
            losses.append(loss)
        per_var = [tf.stack([g[j] for g in grads]) for j in range(len(tf_vars))]
        return per_var, tf.stack(preds), tf.stack(losses)


def _norms_from(model, data, reference=VectorizedClipper):
    q = RecordingQuery(1e9, 0.0)
    norms, _ = _run(reference(), model, data, q)
    return norms


def check(
    model, x, y, sw=None, query_fn=None, expect_mode="ghost", graph=False,
    reference=VectorizedClipper,
):
    """Ghost norms and clipped sum == vectorized; returns the ghost strategy."""
    _compile(model)
    data = (x, y, sw)
    ref = _norms_from(model, data, reference)
    total = np.sqrt(sum(n**2 for n in ref))
    assert np.all(total > 0)
    clip = float(np.median(total))  # some examples clipped, some not
    if query_fn is None:
        query_fn = lambda: RecordingQuery(clip, 0.0)  # noqa: E731
    ghost = GhostClipper()
    assert ghost.supports(model) is None
    assert ghost.mode == expect_mode, ghost.description
    results = {}
    for name, strategy in (("vectorized", reference()), ("ghost", ghost)):
        query = query_fn()
        if graph and name == "ghost":
            params = query.derive_sample_params(query.initial_global_state())
            loss_fn = PerExampleLoss(model)

            @tf.function(jit_compile=graph == "xla")
            def fn():
                o = strategy.clipped_sum(loss_fn, data, model.trainable_variables, query, params)
                sq = query.squared
                return {"sum": o.clipped_sum, "norms": o.norms, "losses": o.losses, "sq": sq}

            r = fn()
            out = types.SimpleNamespace(
                clipped_sum=r["sum"], norms=r["norms"], losses=r["losses"]
            )
            norms = [np.sqrt(np.asarray(t, np.float64)) for t in tf.nest.flatten(r["sq"])]
        else:
            norms, out = _run(strategy, model, data, query)
        results[name] = (norms, [np.asarray(c) for c in out.clipped_sum], out)
    (n_v, s_v, o_v), (n_g, s_g, o_g) = results["vectorized"], results["ghost"]
    # float32 tolerances from the computation (tests/helpers/tolerance.py): a per-example gradient
    # (model_gradient_terms), ghost's sums over pairs of the T positions of a sequence or image
    # (T^2), the squared norm over all parameters; clipped sums: plus the B records; losses: the
    # gradient's roundings (an upper count for the forward pass alone)
    outputs = tf.nest.flatten(o_v.y_pred) if o_v.y_pred is not None else []
    classes = max([int(np.prod(np.shape(t)[1:])) for t in outputs] + [1])
    forward = model_gradient_terms(model, classes=classes)
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    terms = forward + _positions(model) ** 2 + norm_terms(params)
    rtol = tolerance("float32", terms)
    largest = max(float(np.max(a)) for a in n_v)
    for v, a, b in zip(model.trainable_variables, n_v, n_g):
        np.testing.assert_allclose(b, a, rtol=rtol, atol=rtol * largest, err_msg=v.path)
    np.testing.assert_allclose(np.asarray(o_g.norms), np.asarray(o_v.norms), rtol=rtol)
    # (a clipped entry is at most its record's unclipped norm: the scale is their sum)
    atol = tolerance("float32", terms + len(total), float(np.sum(total)))
    for v, a, b in zip(model.trainable_variables, s_v, s_g):
        np.testing.assert_allclose(b, a, rtol=0, atol=atol, err_msg=v.path)
    np.testing.assert_allclose(np.asarray(o_g.losses), np.asarray(o_v.losses),
                               rtol=tolerance("float32", forward))
    return ghost


def _positions(model):
    """The most positions (sequence steps, image pixels) any layer's output has."""
    most = 1
    for layer in model._flatten_layers(include_self=False, recursive=True):
        shape = getattr(getattr(layer, "output", None), "shape", None)
        if shape is not None and len(shape) > 2:
            most = max(most, int(np.prod([d for d in shape[1:-1] if d is not None])))
    return most


def rng(seed=0):
    keras.utils.set_random_seed(seed)
    return np.random.default_rng(seed)


# -- dense ------------------------------------------------------------------------------------------


def test_dense_mlp_with_sample_weights():
    r = rng(0)
    model = keras.Sequential(
        [keras.Input((7,)), L.Dense(9, activation="relu"), L.Dense(5, activation="tanh"), L.Dense(3)]
    )
    x = r.normal(size=(8, 7)).astype("float32")
    y = r.integers(0, 3, 8)
    sw = r.uniform(0.2, 2.0, 8).astype("float32")
    check(model, x, y, sw)


# ghost (Gram) branch for the first Dense when T^2 (C + D) < C D (2, 40), materialised otherwise
@pytest.mark.parametrize("seq_len,width", [(3, 6), (40, 6), (2, 40)])
def test_dense_sequence_inputs(seq_len, width):
    from tf_dp.gradients.ghost import factors

    r = rng(1)
    branch = factors._use_ghost(factors.Outer(tf.zeros([1, seq_len, width]), tf.zeros([1, seq_len, width])))
    assert branch == (seq_len == 2)
    model = keras.Sequential(
        [
            keras.Input((seq_len, 6)),
            L.Dense(width, activation="relu"),
            L.Dense(4),
            L.GlobalAveragePooling1D(),
            L.Dense(3),
        ]
    )
    x = r.normal(size=(6, seq_len, 6)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


def test_dense_rank4_inputs_in_graph():
    r = rng(2)
    model = keras.Sequential(
        [keras.Input((3, 4, 5)), L.Dense(6, activation="relu"), L.Flatten(), L.Dense(3)]
    )
    x = r.normal(size=(6, 3, 4, 5)).astype("float32")
    check(model, x, r.integers(0, 3, 6), graph=True)


# -- einsum dense and attention ------------------------------------------------------------------


def test_einsum_dense_variants():
    r = rng(3)
    inp = keras.Input((4, 6))
    h = L.EinsumDense("abc,cde->abde", output_shape=(4, 2, 3), bias_axes="de", activation="relu")(inp)
    h = L.EinsumDense("abde,deg->abg", output_shape=(4, 5), bias_axes="g")(h)
    h = L.EinsumDense("abg,bgh->ah", output_shape=(3,), bias_axes="h")(h)  # contracts time
    model = keras.Model(inp, h)
    x = r.normal(size=(6, 4, 6)).astype("float32")
    check(model, x, r.integers(0, 3, 6), reference=LoopReference)


def test_einsum_dense_shared_axis_materialised():
    r = rng(4)
    inp = keras.Input((4, 6))
    # 'b' appears in input, kernel and output: per-time-step kernels (materialised rule)
    h = L.EinsumDense("abc,bcd->abd", output_shape=(4, 3), bias_axes="bd")(inp)
    out = L.Dense(3)(L.Flatten()(h))
    model = keras.Model(inp, out)
    x = r.normal(size=(6, 4, 6)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


def test_multi_head_attention_with_layer_norm():
    r = rng(5)
    inp = keras.Input((5, 8))
    att = L.MultiHeadAttention(num_heads=2, key_dim=4)(inp, inp)
    h = L.LayerNormalization()(inp + att)
    out = L.Dense(3)(L.GlobalAveragePooling1D()(h))
    model = keras.Model(inp, out)
    x = r.normal(size=(6, 5, 8)).astype("float32")
    check(model, x, r.integers(0, 3, 6), reference=LoopReference)


# -- convolutions and normalisation ----------------------------------------------------------------


def test_conv2d_reference_cnn():
    r = rng(6)
    model = keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            L.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
            L.MaxPooling2D(2, 1),
            L.Flatten(),
            L.Dense(32, activation="relu"),
            L.Dense(10),
        ]
    )
    x = r.random((6, 28, 28, 1)).astype("float32")
    check(model, x, r.integers(0, 10, 6))


def test_conv2d_dilation_same_padding_and_group_norm():
    r = rng(7)
    model = keras.Sequential(
        [
            keras.Input((9, 10, 3)),
            L.Conv2D(4, (3, 2), dilation_rate=2, padding="same", activation="relu"),
            L.GroupNormalization(groups=2),
            L.Conv2D(6, 3, strides=(2, 1), padding="same", use_bias=False),
            L.GroupNormalization(groups=3, axis=-1),
            L.GlobalAveragePooling2D(),
            L.Dense(3),
        ]
    )
    x = r.normal(size=(6, 9, 10, 3)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


@pytest.mark.parametrize("cin", [1, 3, 8, 16])
@pytest.mark.parametrize(
    "ks,st,dr,padding",
    [
        ((8, 8), (2, 2), (1, 1), "SAME"),
        ((4, 4), (2, 2), (1, 1), "VALID"),
        ((3, 2), (1, 1), (2, 2), "SAME"),
        ((3, 3), (2, 1), (1, 1), "SAME"),
        ((2, 3), (3, 2), (1, 2), "VALID"),
        ((1, 3), (1, 2), (1, 1), "SAME"),
    ],
)
def test_unfold_equals_extract_patches(cin, ks, st, dr, padding):
    from tf_dp.gradients.ghost.conv import _unfold

    x = tf.constant(rng(30).normal(size=(3, 11, 9, cin)).astype("float32"))
    want = tf.image.extract_patches(
        x, sizes=[1, *ks, 1], strides=[1, *st, 1], rates=[1, *dr, 1], padding=padding
    )
    got = _unfold(x, list(ks), list(st), list(dr), padding)
    assert got.shape == want.shape
    np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-6)


def test_conv_many_input_channels_strided_dilated():
    r = rng(31)
    model = keras.Sequential(
        [
            keras.Input((10, 9, 8)),
            L.Conv2D(9, (3, 2), dilation_rate=2, padding="same", activation="relu"),
            L.Conv2D(8, 3, strides=(2, 1), padding="same"),
            L.Reshape((5 * 9, 8)),
            L.Conv1D(8, 3, padding="causal", dilation_rate=2, activation="relu"),
            L.Conv1D(4, 2, strides=2, padding="valid"),
            L.Flatten(),
            L.Dense(3),
        ]
    )
    x = r.normal(size=(6, 10, 9, 8)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


def test_conv1d_causal_dilated_and_strided():
    r = rng(8)
    model = keras.Sequential(
        [
            keras.Input((12, 3)),
            L.Conv1D(5, 3, padding="causal", dilation_rate=2, activation="relu"),
            L.Conv1D(4, 2, strides=2, padding="valid"),
            L.Conv1D(4, 3, padding="same"),
            L.LayerNormalization(axis=[1, 2]),
            L.Flatten(),
            L.Dense(3),
        ]
    )
    x = r.normal(size=(6, 12, 3)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


def test_layer_norm_rms_scaling_and_no_center():
    r = rng(9)
    model = keras.Sequential(
        [
            keras.Input((4, 6)),
            L.Dense(6),
            L.LayerNormalization(rms_scaling=True),
            L.LayerNormalization(center=False),
            L.Flatten(),
            L.Dense(3),
        ]
    )
    x = r.normal(size=(6, 4, 6)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


# -- embeddings and masks ------------------------------------------------------------------------


@pytest.mark.parametrize("graph", [False, "xla"], ids=["eager", "xla"])
def test_embedding_mask_zero_repeated_tokens_and_masked_pooling(graph):
    """Under XLA the table's norms are Gram sums over equal ids (factors._rows_sq)."""
    r = rng(10)
    model = keras.Sequential(
        [
            keras.Input((9,), dtype="int32"),
            L.Embedding(7, 5, mask_zero=True),  # few tokens: many repeats within an example
            L.Dense(4, activation="tanh"),
            L.GlobalAveragePooling1D(),  # uses the mask
            L.Dense(3),
        ]
    )
    x = r.integers(0, 7, (6, 9)).astype("int32")
    x[:, -3:] = 0  # padding
    ghost = check(model, x, r.integers(0, 3, 6), graph=graph)
    assert ghost.mode == "ghost"


def test_mask_changes_the_norms():
    # Same weights, same tokens: masking the padding must change the embedding norms (so the
    # equality above is not vacuous about masks).
    r = rng(11)
    x = r.integers(1, 6, (4, 8)).astype("int32")
    x[:, -4:] = 0
    y = r.integers(0, 2, 4)
    norms = []
    for mask_zero in (True, False):
        keras.utils.set_random_seed(11)
        model = _compile(
            keras.Sequential(
                [
                    keras.Input((8,), dtype="int32"),
                    L.Embedding(6, 3, mask_zero=mask_zero),
                    L.GlobalAveragePooling1D(),
                    L.Dense(2),
                ]
            )
        )
        q = RecordingQuery(1e9, 0.0)
        n, _ = _run(GhostClipper(), model, (x, y, None), q)
        norms.append(n[0])
    assert not np.allclose(norms[0], norms[1], rtol=1e-3)


# -- shared layers -------------------------------------------------------------------------------


def test_shared_dense_chained_and_parallel():
    r = rng(12)
    inp = keras.Input((6,))
    shared = L.Dense(6, activation="tanh")
    a = shared(shared(inp))  # chained: the second call's input depends on the shared kernel
    b = shared(inp * 2.0)  # and a parallel call
    out = L.Dense(3)(L.Concatenate()([a, b]))
    model = keras.Model(inp, out)
    x = r.normal(size=(6, 6)).astype("float32")
    check(model, x, r.integers(0, 3, 6))


@pytest.mark.parametrize("graph", [False, "xla"], ids=["eager", "xla"])
def test_shared_embedding_and_conv_siamese(graph):
    r = rng(13)
    t1, t2 = keras.Input((5,), dtype="int32"), keras.Input((5,), dtype="int32")
    emb = L.Embedding(6, 4)
    conv = L.Conv1D(3, 2, padding="same")
    ln = L.LayerNormalization()
    e1, e2 = ln(conv(emb(t1))), ln(conv(emb(t2)))
    out = L.Dense(2)(L.Flatten()(L.Concatenate(axis=1)([e1, e2])))
    model = keras.Model([t1, t2], out)
    x = [r.integers(0, 6, (6, 5)).astype("int32"), r.integers(0, 6, (6, 5)).astype("int32")]
    check(model, x, r.integers(0, 2, 6), graph=graph)


# -- mixed models ---------------------------------------------------------------------------------


class Scale(L.Layer):
    """An unregistered layer with its own variable (and mask support)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.supports_masking = True

    def build(self, input_shape):
        self.scale = self.add_weight(shape=(input_shape[-1],), initializer="ones", name="scale")

    def call(self, inputs, mask=None):
        out = inputs * self.scale + tf.sin(inputs * self.scale)
        if mask is not None:
            out = out * tf.cast(mask, out.dtype)[..., None]
        return out


class TiedOutput(L.Layer):
    """Projects onto an embedding table it does not own but tracks (tied weights)."""

    def __init__(self, embedding, **kwargs):
        super().__init__(**kwargs)
        self.embedding = embedding

    def call(self, inputs):
        return tf.matmul(inputs, self.embedding.embeddings, transpose_b=True)


def test_mixed_unregistered_layer_masked_lstm():
    r = rng(14)
    model = keras.Sequential(
        [
            keras.Input((7,), dtype="int32"),
            L.Embedding(9, 4, mask_zero=True),
            Scale(),
            L.RNN(L.LSTMCell(3), name="generic_rnn"),  # a generic RNN has no rule (LSTM has)
            L.Dense(2),
        ]
    )
    x = r.integers(0, 9, (6, 7)).astype("int32")
    x[:, -2:] = 0
    # LoopReference: the vectorized strategy cannot run Keras's LSTM loop under pfor (a variant
    # dtype error); the ghost fallback switches to map_fn for that layer.
    ghost = check(model, x, r.integers(0, 2, 6), expect_mode="mixed", reference=LoopReference)
    assert ghost.description.startswith("ghost+vectorized (layers: ")
    assert "generic_rnn" in ghost.description and "scale" in ghost.description


def test_mixed_tied_weights_use_the_whole_model_fallback():
    r = rng(15)
    tok = keras.Input((4,), dtype="int32")
    emb = L.Embedding(6, 5)
    h = L.Dense(5, activation="tanh")(L.GlobalAveragePooling1D()(emb(tok)))
    out = L.Identity()(h)
    tied = TiedOutput(emb)
    model = keras.Model(tok, tied(out))
    x = r.integers(0, 6, (6, 4)).astype("int32")
    ghost = check(model, x, r.integers(0, 6, 6), expect_mode="mixed")
    assert "model-level variables" in ghost.description


def test_user_registered_rule():
    r = rng(16)

    def scale_rule(layer, inputs, grad_output):
        # d out / d scale = x (1 + cos(x * scale)), masked like the output
        x = tf.convert_to_tensor(inputs)
        local = x * (1.0 + tf.cos(x * layer.scale))
        per_ex = tf.reduce_sum(tf.reshape(local * grad_output, [tf.shape(x)[0], -1, x.shape[-1]]), 1)
        return [(layer.scale, PerExample(per_ex))]

    register_layer_norm_rule(Scale, scale_rule)
    try:
        model = keras.Sequential([keras.Input((4, 3)), Scale(), L.Flatten(), L.Dense(2)])
        x = r.normal(size=(6, 4, 3)).astype("float32")
        check(model, x, r.integers(0, 2, 6), expect_mode="ghost")
    finally:
        unregister_layer_norm_rule(Scale)


def test_wrong_user_rule_is_caught_by_the_comparison():
    # The equality check can fail: a rule that forgets the cos term gives different norms.
    r = rng(17)

    def bad_rule(layer, inputs, grad_output):
        x = tf.convert_to_tensor(inputs)
        per_ex = tf.reduce_sum(tf.reshape(x * grad_output, [tf.shape(x)[0], -1, x.shape[-1]]), 1)
        return [(layer.scale, PerExample(per_ex))]

    register_layer_norm_rule(Scale, bad_rule)
    try:
        model = keras.Sequential([keras.Input((4, 3)), Scale(), L.Flatten(), L.Dense(2)])
        x = r.normal(size=(6, 4, 3)).astype("float32")
        with pytest.raises(AssertionError):
            check(model, x, r.integers(0, 2, 6))
    finally:
        unregister_layer_norm_rule(Scale)


def test_rule_must_cover_every_variable():
    register_layer_norm_rule(Scale, lambda layer, inputs, g: [])
    try:
        model = _compile(keras.Sequential([keras.Input((3,)), Scale(), L.Dense(2)]))
        q = RecordingQuery(1.0, 0.0)
        with pytest.raises(ValueError, match="must cover every trainable variable"):
            _run(GhostClipper(), model, (np.ones((2, 3), "float32"), np.zeros(2), None), q)
    finally:
        unregister_layer_norm_rule(Scale)


def test_register_validates_arguments():
    with pytest.raises(TypeError, match="layer_class"):
        register_layer_norm_rule(int, lambda *a: [])
    with pytest.raises(TypeError, match="rule"):
        register_layer_norm_rule(Scale, "not callable")


# -- per-layer clipping ------------------------------------------------------------------------


def test_per_layer_clipping_with_nested_query():
    r = rng(18)
    model = keras.Sequential(
        [keras.Input((5, 4)), L.Conv1D(3, 2, activation="relu"), L.Flatten(), L.Dense(3)]
    )
    x = r.normal(size=(8, 5, 4)).astype("float32")
    y = r.integers(0, 3, 8)
    _compile(model)
    ref = _norms_from(model, (x, y, None))
    clips = [float(np.median(n)) for n in ref]  # each variable clipped separately, half clipped

    def query_fn():
        return RecordingNested([RecordingQuery(c, 0.0) for c in clips])

    # RecordingNested records the list it was given; make _run read it
    check(model, x, y, query_fn=query_fn, graph=True)


# -- strategy selection ---------------------------------------------------------------------------


def test_auto_picks_ghost_when_covered_and_mixed_otherwise(caplog):
    covered = keras.Sequential([keras.Input((3,)), L.Dense(4), L.Dense(2)])
    mixed = keras.Sequential([keras.Input((3,)), Scale(), L.Dense(2)])
    uncovered = keras.Sequential([keras.Input((3,)), Scale()])
    with caplog.at_level(logging.INFO, logger="tf_dp"):
        s = make_clipper("auto", model=covered)
        assert isinstance(s, GhostClipper) and s.mode == "ghost" and s.description == "ghost"
        s = make_clipper("auto", model=mixed)
        assert isinstance(s, GhostClipper) and s.mode == "mixed"
        assert s.description == "ghost+vectorized (layers: " + mixed.layers[0].name + ")"
    assert sum("ghost clipper" in rec.message for rec in caplog.records) == 2
    assert isinstance(make_clipper("auto", model=uncovered), VectorizedClipper)
    assert isinstance(make_clipper("ghost"), GhostClipper)


def test_fit_in_ghost_mode_records_the_ledger_and_exposes_the_strategy():
    r = rng(19)
    model = tf_dp.keras.make_private(
        keras.Sequential(
            [keras.Input((6,)), L.Dense(8, activation="relu"), L.LayerNormalization(), L.Dense(3)]
        )
    )
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=0.7, noise_multiplier=1.3, learning_rate=0.1, gradient_mode="ghost",
        noise_seed=1,
    )
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x = r.normal(size=(40, 6)).astype("float32")
    y = r.integers(0, 3, 40)
    before = [v.numpy().copy() for v in model.trainable_variables]
    model.fit(x, y, batch_size=10, epochs=2, verbose=0)
    assert isinstance(opt.gradient_clipper, GhostClipper)
    assert opt.gradient_clipper.mode == "ghost"
    samples = opt.ledger.samples()
    assert len(samples) == 8
    for s in samples:
        assert s.sampling.population_size == 40
        assert s.sampling.selection_probability == pytest.approx(0.25)
        assert s.sampling.policy == "shuffle"
        assert len(s.queries) == 1
        assert s.queries[0].l2_sensitivity == pytest.approx(0.7)
        assert s.queries[0].noise_stddev == pytest.approx(0.91)
        assert s.queries[0].mechanism == "gaussian"
    assert any(not np.allclose(b, v.numpy()) for b, v in zip(before, model.trainable_variables))


@pytest.mark.parametrize("t", [1, 7, 40])
def test_table_norms_under_xla_equal_the_distinct_rows_sums(t):
    """factors._rows_sq: under XLA (static T <= 512) the Gram sum over equal ids, outside XLA
    the unique-keys route; both against a float64 sum per distinct row, with repeated ids,
    negative ids (row id + V) and a row whose gradients cancel."""
    r = rng(31)
    b, d, v = 5, 6, 9
    ids = r.integers(-v, v, (b, t))
    g = r.normal(size=(b, t, d)).astype("float32")
    if t >= 2:
        ids[0, :2] = 3
        g[0, 1] = -g[0, 0]  # the two rows of id 3 cancel
    want = np.zeros(b)
    for i in range(b):
        rows = {}
        for j in range(t):
            key = int(ids[i, j]) % v
            rows[key] = rows.get(key, 0.0) + g[i, j].astype(np.float64)
        want[i] = sum(float(np.sum(s ** 2)) for s in rows.values())
    rows_factor = lambda: factors.Rows(tf.constant(ids, tf.int32), tf.constant(g), v)  # noqa: E731
    xla = tf.function(lambda: factors._rows_sq(rows_factor()), jit_compile=True)
    graph = tf.function(lambda: factors._rows_sq(rows_factor()))
    xla_ops = {op.type for op in xla.get_concrete_function().graph.get_operations()}
    assert "Unique" not in xla_ops and "BatchMatMulV2" in xla_ops
    assert "Unique" in {op.type for op in graph.get_concrete_function().graph.get_operations()}
    # float32 sums of at most t^2 dot products of d terms (or of t-term segment sums, squared
    # and summed over d): |error| <= gamma_n sum_k (sum_t |g_tk|)^2, n = t^2 + d + 2, the sum
    # over every pair of rows (Higham, Thm 3.1; gamma_n = n u / (1 - n u))
    u = 2.0 ** -24
    n = t * t + d + 2
    magnitude = np.sum(np.sum(np.abs(g.astype(np.float64)), axis=1) ** 2, axis=1)
    bound = n * u / (1 - n * u) * magnitude
    for got in (xla().numpy(), graph().numpy()):
        assert np.all(np.abs(got - want) <= bound + 1e-30), (got, want)
        assert np.all(got >= 0)
