"""Ghost embedding-row gradients and the DP-AdaFEST table update (tf_dp.gradients.embedding_rows)
against a per-example GradientTape loop (dense per-example table gradients, joint clip, sum)."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tf_dp.dp_query.partition_selection import make_generator
from tf_dp.gradients import embedding_rows as er

EPS32 = float(np.finfo(np.float32).eps)
V, D, L, B, CLASSES = 60, 4, 7, 12, 3


def _model(seed):
    keras.utils.set_random_seed(seed)
    emb = keras.layers.Embedding(V, D)
    pool = keras.layers.GlobalAveragePooling1D()
    dense = keras.layers.Dense(CLASSES)
    inp = keras.Input((L,), dtype="int32")
    model = keras.Model(inp, dense(pool(emb(inp))))
    return model, emb, pool, dense


def _data(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, V, size=(B, L)).astype(np.int32)
    ids[:, 1] = ids[:, 0]  # duplicates inside an example
    y = rng.integers(0, CLASSES, B)
    return ids, y


def _loss(logits, y):
    return keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True)


@pytest.mark.parametrize("clip", [0.05, 1e3])
def test_update_equals_per_example_reference_on_touched_rows(clip):
    model, emb, pool, dense = _model(0)
    ids, y = _data(1)
    # reference: per example, dense gradients of every variable, joint clip, sum
    ref_table = np.zeros((V, D))
    ref_norm_table = []
    for i in range(B):
        with tf.GradientTape() as tape:
            loss = _loss(model(ids[i : i + 1]), y[i : i + 1])
        grads = tape.gradient(loss, [emb.embeddings] + dense.trainable_variables)
        dense_grads = [tf.convert_to_tensor(g).numpy().astype(np.float64) for g in grads]
        norm = np.sqrt(sum((g**2).sum() for g in dense_grads))
        ref_norm_table.append((dense_grads[0] ** 2).sum())
        ref_table += dense_grads[0] * min(1.0, clip / norm)
    # ours: embedding rows by ghost (output gradients), the rest of the model per example
    with tf.GradientTape(persistent=True) as tape:
        e = emb(ids)
        tape.watch(e)
        losses = _loss(dense(pool(e)), y)
        total = tf.reduce_sum(losses)
    rows = er.embedding_rows(ids, tape.gradient(total, e))
    sq_emb = er.squared_norms(rows, B).numpy()
    np.testing.assert_allclose(sq_emb, ref_norm_table, rtol=64 * EPS32, atol=0)
    sq_rest = np.zeros(B)
    for i in range(B):  # the rest of the model (exact clipping elsewhere): its per-example norm
        with tf.GradientTape() as t2:
            li = _loss(model(ids[i : i + 1]), y[i : i + 1])
        sq_rest[i] = sum(float(tf.reduce_sum(g**2)) for g in t2.gradient(li, dense.trainable_variables))
    w = np.minimum(1.0, clip / np.sqrt(sq_emb + sq_rest)).astype(np.float32)
    update = er.adafest_update(make_generator(0), rows, w, ids, V, contribution_bound=1.0,
                               threshold=0.0, selection_stddev=0.0, gradient_stddev=0.0)
    assert isinstance(update, tf.IndexedSlices)
    touched = np.unique(ids)
    np.testing.assert_array_equal(update.indices.numpy(), touched)  # no other row
    scale = np.abs(ref_table).max()
    np.testing.assert_allclose(update.values.numpy(), ref_table[touched], rtol=0,
                               atol=64 * B * L * EPS32 * scale)


def test_threshold_drops_rare_rows():
    ids = np.array([[1, 1, 2], [1, 3, 3]])
    g = np.ones((2, 3, 2), np.float32)
    rows = er.embedding_rows(ids, g)
    sq = er.squared_norms(rows, 2).numpy()
    np.testing.assert_allclose(sq, [2 * 2**2 + 2, 2 + 2 * 2**2])  # rows {1: 2g, 2: g}, {1: g, 3: 2g}
    # contribution weights 1/sqrt(2) each (C1 = 1): row 1 counts sqrt(2), rows 2 and 3 0.707
    up = er.adafest_update(make_generator(0), rows, np.ones(2, np.float32), ids, 5, 1.0, 1.0,
                           0.0, 0.0)
    np.testing.assert_array_equal(up.indices.numpy(), [1])
    np.testing.assert_allclose(up.values.numpy(), [[3.0, 3.0]])


def test_embedding_rows_in_xla():
    ids, _ = _data(2)
    g = np.random.default_rng(0).normal(size=(B, L, D)).astype(np.float32)
    f = tf.function(lambda a, b: er.squared_norms(er.embedding_rows(a, b), B), jit_compile=True)
    want = np.zeros(B)
    for i in range(B):
        m = np.zeros((V, D))
        np.add.at(m, ids[i], g[i].astype(np.float64))
        want[i] = (m**2).sum()
    np.testing.assert_allclose(f(tf.constant(ids), tf.constant(g)).numpy(), want, rtol=64 * EPS32)


@pytest.mark.parametrize("opt", ["adam", "adagrad"])
def test_optimizer_slots_move_only_on_selected_rows(opt):
    """The table's tf.IndexedSlices update through a Keras optimizer: its slots (and the table)
    change only on the selected rows."""
    ids = np.array([[1, 1, 2], [1, 3, 3]])
    rows = er.embedding_rows(ids, np.ones((2, 3, 2), np.float32))
    up = er.adafest_update(make_generator(0), rows, np.ones(2, np.float32), ids, 5, 1.0, 1.0,
                           0.0, 0.0)
    table = keras.Variable(np.ones((5, 2), np.float32))
    optimizer = keras.optimizers.get(opt)
    optimizer.build([table])
    optimizer.apply([up], [table])
    moved = np.flatnonzero(np.any(table.numpy() != 1.0, axis=1))
    np.testing.assert_array_equal(moved, [1])
    for slot in optimizer.variables:
        if tuple(slot.shape) == (5, 2):
            a = slot.numpy()
            init = a[0]  # row 0 is never selected: its value is the slot's initial value
            changed = np.flatnonzero(np.any(a != init, axis=1))
            assert set(changed) == {1}, (slot.path, changed)
