"""Sequence models in every exact mode: masked embeddings with pooling, Embedding + LSTM.

- A masked mean over a row of padding tokens only is 0/0 = NaN. Such rows are Poisson padding
  (weight 0) and the empty slots of a microbatch; ``0 * NaN`` is NaN, so they must be computed as
  copies of real rows, never as rows of zeros, or a shared backward pass turns every weight NaN.
- A looping (``tf.while_loop``) LSTM cannot run under ``tf.vectorized_map`` when its input needs a
  gradient (``dtype variant``): per-example gradients fall back to the unrolled layer, then to a
  loop over the records. The references are a slow per-example (or per-microbatch) loop.
"""

import keras
import numpy as np
import pytest

import tf_dp
from tests.helpers.tolerance import tolerance
from tests.test_gradients_exact import (
    assert_close_list,
    compiled,
    derived_atol,
    reference_clipped_sum,
    reference_grads,
    run,
    twin_groups,
)
from tf_dp.gradients import MicrobatchClipper, VectorizedClipper

L = keras.layers


def masked_pooling_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((7,), dtype="int32"),
        L.Embedding(30, 8, mask_zero=True),
        L.GlobalAveragePooling1D(),
        L.Dense(5),
    ])


def lstm_model(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6,), dtype="int32"),
        L.Embedding(20, 4),
        L.LSTM(3),
        L.Dense(3),
    ])


def tokens(batch, length, vocab, seed=0, zero_tail=2):
    rng = np.random.default_rng(seed)
    x = rng.integers(1, vocab, size=(batch, length)).astype(np.int32)
    if zero_tail:
        x[:, -zero_tail:] = 0
    y = rng.integers(0, 3, batch).astype(np.int32)
    return x, y


@pytest.mark.parametrize(
    "mode, m", [("microbatch", 4), ("microbatch", 16), ("vectorized", None), ("ghost", None),
                ("jl", None)])
def test_masked_pooling_trains_to_finite_weights_in_every_mode(mode, m):
    """Before, microbatch turned every weight NaN (empty microbatch slots were rows of padding
    tokens only, whose masked mean is 0/0)."""
    x, y = tokens(64, 7, 30, seed=1)
    y = y % 5
    model = tf_dp.keras.make_private(masked_pooling_model())
    options = {"num_microbatches": m} if mode == "microbatch" else {}
    if mode == "jl":
        options = {"jl_projections": 1}
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.5, gradient_mode=mode,
            **options),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    history = model.fit(
        tf_dp.data.poisson_batches(x, y, sampling_probability=16 / 64, seed=0), epochs=1,
        verbose=0)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    assert np.isfinite(history.history["loss"][0])
    assert int(model.optimizer.skipped_steps) == 0


def test_masked_pooling_microbatches_match_the_reference():
    model = compiled(masked_pooling_model())
    x, y = tokens(16, 7, 30, seed=2)
    y = y % 5
    # 16 microbatches over 16 examples: several are empty (their slots read padding tokens)
    out = run(MicrobatchClipper(16, seed=5), model, x, y, clip=0.2, graph=True)
    groups = twin_groups(16, 16, seed=5)
    assert len(groups) < 16
    expected, _ = reference_clipped_sum(reference_grads(model, x, y, groups=groups), 0.2)
    assert_close_list(out["clipped_sum"], expected)


def test_zero_weight_rows_of_padding_tokens_add_nothing():
    model = compiled(masked_pooling_model())
    x, y = tokens(10, 7, 30, seed=3)
    y = y % 5
    sw = np.ones(10, np.float32)
    x[[1, 6]] = 0  # rows like Poisson padding: only padding tokens, weight 0
    sw[[1, 6]] = 0.0
    kept = [i for i in range(10) if sw[i] > 0]
    expected, _ = reference_clipped_sum(
        reference_grads(model, x, y, groups=[[i] for i in kept]), 0.3)
    for strategy in (VectorizedClipper(), MicrobatchClipper(10, seed=1)):
        out = run(strategy, model, x, y, sw=sw, clip=0.3, graph=True)
        if isinstance(strategy, MicrobatchClipper):
            groups = [[i for i in g if sw[i] > 0] for g in twin_groups(10, 10, seed=1)]
            expected_mb, _ = reference_clipped_sum(
                reference_grads(model, x, y, sw=sw, groups=[g for g in groups if g]), 0.3)
            assert_close_list(out["clipped_sum"], expected_mb)
        else:
            assert_close_list(out["clipped_sum"], expected)


@pytest.mark.parametrize("strategy", ["vectorized", "microbatch"])
def test_embedding_lstm_per_example_gradients_match_the_reference(strategy):
    """Before, both modes failed at trace time with a ``dtype variant`` TypeError."""
    model = compiled(lstm_model())
    x, y = tokens(6, 6, 20, seed=4, zero_tail=0)
    if strategy == "vectorized":
        out = run(VectorizedClipper(), model, x, y, clip=0.05, graph=True)
        groups = None
    else:
        out = run(MicrobatchClipper(3, seed=2), model, x, y, clip=0.05, graph=True)
        groups = twin_groups(3, 6, seed=2)
    records = reference_grads(model, x, y, groups=groups)
    expected, norms = reference_clipped_sum(records, 0.05)
    assert np.all(norms > 0.05), "the clip must bind for this test to mean much"
    # derived_atol counts each layer's reduction; the LSTM's 6 time steps add 14 roundings per
    # step forward and back (tests/helpers/tolerance.py), on entries of at most the clip per
    # record. A record clipped by the wrong norm is off by O(0.05 x the norm's error) >> this
    atol = derived_atol(model, records, 0.05, group=2) + tolerance(
        "float32", 2 * 6 * 14, len(records) * 0.05
    )
    assert_close_list(out["clipped_sum"], expected, rtol=0, atol=atol)
