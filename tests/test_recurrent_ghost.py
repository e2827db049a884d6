"""Exact ghost clipping for recurrent layers (LSTM, GRU, SimpleRNN, Bidirectional) and for a
Transformer block, against per-example references (one ``tf.GradientTape`` per example).

For each model: the per-example, per-variable norms of the ghost strategy equal the reference
norms to 1e-5 relative, and the clipped sum (noise 0, a clip norm at the median so that some
examples are clipped and some are not) equals the reference ``sum_i min(1, C/|g_i|) g_i`` to 1e-5
relative to its largest entry. ``auto`` picks the recurrent route and says so.
"""

import logging
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import tolerance
from tf_dp.gradients import make_clipper
from tf_dp.gradients.ghost import GhostClipper, find_rule
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers
RTOL = 1e-5


class RecordingQuery(tf_dp.GaussianSumQuery):
    def clip_weights(self, params, squared_norms):
        self.squared = squared_norms
        return super().clip_weights(params, squared_norms)


def rng(seed):
    keras.utils.set_random_seed(seed)
    return np.random.default_rng(seed)


def compiled(model):
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), optimizer="sgd")
    return model


def loop_reference(model, x, y):
    """Per-example gradients, one tape per example: ``[n_vars]`` of ``[B, *shape]`` (float64)."""
    loss_fn = PerExampleLoss(model)
    per_var = [[] for _ in model.trainable_variables]
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss, _ = loss_fn(x[i : i + 1], y[i : i + 1], None)
            loss = tf.reduce_sum(loss)
        grads = tape.gradient(loss, model.trainable_variables, unconnected_gradients="zero")
        for j, g in enumerate(grads):
            per_var[j].append(np.asarray(tf.convert_to_tensor(g), np.float64))
    return [np.stack(p) for p in per_var]


def ghost_run(model, x, y, clip, graph=False):
    strategy = GhostClipper()
    query = RecordingQuery(clip, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    loss_fn = PerExampleLoss(model)
    data = (tf.constant(x), tf.constant(y), None)

    def run():
        out = strategy.clipped_sum(loss_fn, data, model.trainable_variables, query, params)
        return out.clipped_sum, tf.nest.flatten(query.squared)

    sums, squared = tf.function(run)() if graph else run()
    return strategy, [np.asarray(s, np.float64) for s in sums], [
        np.sqrt(np.asarray(s, np.float64)) for s in squared
    ]


def check(model, x, y, graph=False):
    """Ghost norms and clipped sum == the per-example loop; returns the strategy."""
    compiled(model)
    ref = loop_reference(model, x, y)
    b = len(y)
    ref_norms = [np.sqrt(np.sum(g.reshape(b, -1) ** 2, axis=1)) for g in ref]
    total = np.sqrt(sum(n**2 for n in ref_norms))
    assert np.all(total > 0)
    clip = float(np.median(total))
    strategy, sums, norms = ghost_run(model, x, y, clip, graph=graph)
    assert strategy.mode == "ghost", strategy.description
    for v, want, got in zip(model.trainable_variables, ref_norms, norms):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=1e-7 * max(1.0, want.max()), err_msg=v.path)
    w = np.minimum(1.0, clip / total)
    ref_sums = [np.tensordot(w, g, axes=1) for g in ref]
    scale = max(np.abs(s).max() for s in ref_sums)
    for v, want, got in zip(model.trainable_variables, ref_sums, sums):
        np.testing.assert_allclose(got / scale, want / scale, rtol=0, atol=RTOL, err_msg=v.path)
    return strategy


def tokens(r, batch=6, steps=7, vocab=9, pad_rows=3, pad=2):
    x = r.integers(1, vocab, (batch, steps)).astype("int32")
    x[:pad_rows, -pad:] = 0  # post-padding: masked when the embedding has mask_zero=True
    x[pad_rows, 1:3] = 0  # a masked step in the middle of one sequence
    return x, r.integers(0, 2, batch).astype("int32")


def seq_model(*layers, mask=True, vocab=9, dim=4, steps=7):
    return keras.Sequential(
        [keras.Input((steps,), dtype="int32"), L.Embedding(vocab, dim, mask_zero=mask), *layers]
    )


RECURRENT = {
    "lstm": lambda **kw: L.LSTM(3, **kw),
    "gru": lambda **kw: L.GRU(3, **kw),
    "gru_reset_before": lambda **kw: L.GRU(3, reset_after=False, **kw),
    "simple_rnn": lambda **kw: L.SimpleRNN(3, **kw),
}


@pytest.mark.parametrize("mask", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("kind", sorted(RECURRENT))
def test_single_layer(kind, mask):
    r = rng(1)
    x, y = tokens(r)
    check(seq_model(RECURRENT[kind](), L.Dense(2), mask=mask), x, y)


@pytest.mark.parametrize("mask", [False, True], ids=["unmasked", "masked"])
@pytest.mark.parametrize("kind", ["lstm", "gru", "simple_rnn"])
def test_bidirectional(kind, mask):
    r = rng(2)
    x, y = tokens(r)
    s = check(seq_model(L.Bidirectional(RECURRENT[kind]()), L.Dense(2), mask=mask), x, y)
    assert "forward_" in s.description and "backward_" in s.description


@pytest.mark.parametrize("mask", [False, True], ids=["unmasked", "masked"])
def test_stacked_return_sequences(mask):
    r = rng(3)
    x, y = tokens(r)
    model = seq_model(
        L.Bidirectional(L.LSTM(3, return_sequences=True), merge_mode="sum"),
        L.GRU(4, return_sequences=True),
        L.SimpleRNN(3, return_sequences=True),
        L.GlobalAveragePooling1D(),
        L.Dense(2),
        mask=mask,
    )
    check(model, x, y)


def test_go_backwards_no_bias_and_activations():
    r = rng(4)
    x, y = tokens(r)
    model = seq_model(
        L.LSTM(3, go_backwards=True, return_sequences=True, use_bias=False, activation="relu"),
        L.GRU(3, go_backwards=True, recurrent_activation="tanh", use_bias=False),
        L.Dense(2),
    )
    check(model, x, y)


def test_return_state_and_unroll_in_a_functional_model():
    r = rng(5)
    x, y = tokens(r)
    inp = keras.Input((7,), dtype="int32")
    e = L.Embedding(9, 4, mask_zero=True)(inp)
    out, h, c = L.LSTM(3, return_state=True, unroll=True)(e)
    seq = L.GRU(3, return_sequences=True)(e, initial_state=h)
    z = L.Concatenate()([out, c, L.GlobalAveragePooling1D()(seq)])
    check(keras.Model(inp, L.Dense(2)(z)), x, y)


def test_float_sequences_and_graph_mode():
    r = rng(6)
    x = r.normal(size=(5, 6, 3)).astype("float32")
    y = r.integers(0, 2, 5).astype("int32")
    model = keras.Sequential(
        [keras.Input((6, 3)), L.Bidirectional(L.GRU(4)), L.Dense(2)]
    )
    check(model, x, y, graph=True)


def test_layer_called_twice_shares_weights():
    r = rng(7)
    x, y = tokens(r)
    inp = keras.Input((7,), dtype="int32")
    emb = L.Embedding(9, 4, mask_zero=True)
    lstm = L.LSTM(3)
    a = lstm(emb(inp))
    b = lstm(emb(inp[:, ::-1]))
    check(keras.Model(inp, L.Dense(2)(L.Concatenate()([a, b]))), x, y)


def test_unsupported_configurations_fall_back():
    stateful = L.LSTM(3, stateful=True)
    assert find_rule(stateful)[0] is None
    gate_masks = L.GRU(3, dropout=0.2, implementation=1)
    assert "implementation=1" in find_rule(gate_masks)[1]
    assert find_rule(L.LSTM(3, dropout=0.3))[0] is not None
    assert find_rule(L.RNN(L.LSTMCell(3)))[0] is None


def test_input_dropout_is_applied_and_training_runs():
    """With dropout (random masks) there is no per-example reference, but the step runs on the
    recurrent route (input dropout, and SimpleRNN's recurrent dropout) with finite results."""
    r = rng(8)
    x, y = tokens(r)
    model = compiled(
        seq_model(
            L.LSTM(3, dropout=0.5, return_sequences=True),
            L.SimpleRNN(2, dropout=0.3, recurrent_dropout=0.5),
            L.Dense(2),
        )
    )
    strategy, sums, norms = ghost_run(model, x, y, clip=1.0)
    assert strategy.mode == "ghost"
    assert all(np.all(np.isfinite(s)) for s in sums)
    assert all(np.all(np.isfinite(n)) for n in norms)


def test_auto_picks_the_recurrent_rule_and_logs_it(caplog):
    model = seq_model(L.Bidirectional(L.LSTM(3)), L.Dense(2))
    with caplog.at_level(logging.INFO, logger="tf_dp"):
        s = make_clipper("auto", model=model)
    assert isinstance(s, GhostClipper) and s.mode == "ghost"
    assert s.description.startswith("ghost (recurrent rule: ")
    assert any("recurrent rule" in rec.message for rec in caplog.records)


def test_fit_with_auto_on_a_bilstm():
    r = rng(9)
    x, y = tokens(r, batch=8)
    model = tf_dp.keras.make_private(seq_model(L.Bidirectional(L.LSTM(3)), L.Dense(2)))
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, gradient_mode="auto"
    )
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=4, epochs=1, verbose=0)
    assert opt.gradient_clipper.mode == "ghost"
    assert "recurrent rule" in opt.gradient_clipper.description


# -- Transformer ------------------------------------------------------------------------------------


def test_transformer_block_matches_the_per_example_loop():
    from bench.models import TokenAndPositionEmbedding, TransformerBlock

    r = rng(10)
    x = r.integers(0, 20, (5, 6)).astype("int32")
    y = r.integers(0, 2, 5).astype("int32")
    model = keras.Sequential(
        [
            keras.Input((6,), dtype="int32"),
            TokenAndPositionEmbedding(20, 6, 8),
            TransformerBlock(8, 2, 12),
            L.GlobalAveragePooling1D(),
            L.Dense(2),
        ]
    )
    s = check(model, x, y)
    assert s.description == "ghost"


def test_xla_and_mixed_precision():
    r = rng(11)
    x, y = tokens(r)
    model = compiled(seq_model(L.Bidirectional(L.LSTM(3)), L.Dense(2)))
    per_example = loop_reference(model, x, y)
    ref = [g.sum(0) for g in per_example]
    loss_fn = PerExampleLoss(model)
    query = RecordingQuery(1e9, 0.0)  # no clipping: the sum of the per-example gradients
    params = query.derive_sample_params(query.initial_global_state())
    data = (tf.constant(x), tf.constant(y), None)
    strategy = GhostClipper()
    xla = tf.function(
        lambda: strategy.clipped_sum(loss_fn, data, model.trainable_variables, query, params).clipped_sum,
        jit_compile=True,
    )()
    scale = max(np.abs(g).max() for g in ref)
    for got, want in zip(xla, ref):
        np.testing.assert_allclose(np.asarray(got) / scale, want / scale, rtol=0, atol=RTOL)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = compiled(seq_model(L.Bidirectional(L.LSTM(3)), L.Dense(2, dtype="float32")))
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    strategy = GhostClipper()
    out = strategy.clipped_sum(
        PerExampleLoss(half), data, half.trainable_variables, RecordingQuery(1e9, 0.0), params
    )
    assert "recurrent rule" in strategy.description
    # float16 activations (tests/helpers/tolerance.py): per time step the LSTM takes 14 roundings
    # (gates: fan-in 4 + 3 + bias, activation; cell: 3; output: 2), 7 steps forward and 7 back;
    # then the Dense (fan-in 6 + bias, log-softmax over 2, 3 back), the embedding's sum over 7
    # steps and 2 casts: 217, relative to the sum of the 6 examples' |gradients|
    magnitude = max(np.abs(g).sum(0).max() for g in per_example)
    atol = tolerance("float16", terms=2 * 7 * 14 + 7 + 2 + 3 + 7 + 2, scale=magnitude)
    for got, want in zip(out.clipped_sum, ref):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=atol)


def test_unknown_sequence_length_and_bidirectional_states():
    r = rng(12)
    x, y = tokens(r)
    inp = keras.Input((None,), dtype="int32")
    e = L.Embedding(9, 4, mask_zero=True)(inp)
    out, fh, fc, bh, bc = L.Bidirectional(L.LSTM(3, return_state=True))(e)
    z = L.Concatenate()([out, fh, bc])
    check(keras.Model(inp, L.Dense(2)(z)), x, y, graph=True)


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_unmasked_layers_take_h_prev_from_their_shifted_outputs(graph):
    """Without a mask an LSTM's or SimpleRNN's h_{t-1} is its previous step's output (the initial
    state for the first step), so the loop emits h_t only: with a non-zero initial state from
    another layer, go_backwards, unroll, return_state and a stacked layer, the norms and clipped
    sum still equal the per-example loop."""
    r = rng(21)
    x = r.normal(size=(6, 5, 3)).astype("float32")
    y = r.integers(0, 2, 6).astype("int32")
    inp = keras.Input((5, 3))
    h0 = L.Dense(4, activation="tanh")(L.Flatten()(inp))
    c0 = L.Dense(4)(L.Flatten()(inp))
    seq, h, c = L.LSTM(4, return_sequences=True, return_state=True)(inp, initial_state=[h0, c0])
    back = L.LSTM(4, go_backwards=True, unroll=True)(seq, initial_state=[h, c])
    rnn = L.SimpleRNN(4, go_backwards=True)(seq, initial_state=h0)
    model = keras.Model(inp, L.Dense(2)(L.Concatenate()([back, rnn])))
    shifted = []
    real = tf_dp.gradients.ghost.recurrent._inner_loop

    def spy(layer, sequences, initial_state, mask, training, watch, ctx):
        out = real(layer, sequences, initial_state, mask, training, watch, ctx)
        shifted.append(ctx["shifted"])  # the loop emitted h_t only
        return out

    tf_dp.gradients.ghost.recurrent._inner_loop = spy
    try:
        check(model, x, y, graph=graph)
    finally:
        tf_dp.gradients.ghost.recurrent._inner_loop = real
    assert len(shifted) == 3 and all(shifted), shifted
    # a masked layer keeps emitting [h_t, h_{t-1}] (its state is carried over masked steps)
    shifted.clear()
    tf_dp.gradients.ghost.recurrent._inner_loop = spy
    try:
        tok, lab = tokens(r)
        check(seq_model(L.LSTM(3), L.Dense(2)), tok, lab, graph=graph)
    finally:
        tf_dp.gradients.ghost.recurrent._inner_loop = real
    assert shifted == [False]
