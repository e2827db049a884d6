"""Per-example embedding-row gradients without dense per-example table gradients, and the
DP-AdaFEST update of an embedding table from them (:mod:`tf_dp.dp_query.partition_selection`).

The gradient of example ``i``'s loss with respect to an embedding table of ``V`` rows is
``sum_p g_ip e_{id_ip}^T`` (``g_ip`` the gradient at the layer's output at position ``p``): it is
non-zero only on the example's rows, and its squared norm is ``sum_r ||sum_{p: id_ip = r} g_ip||^2``.
:func:`embedding_rows` merges each example's positions by row (static shapes ``[B*L]``, no
``[B, V, d]`` tensor) and :func:`squared_norms` gives the per-example squared norms that joint
clipping adds to the rest of the model's.

Example::

    rows = embedding_rows(ids, output_grads)          # ids [B, L], output_grads [B, L, d]
    sq = squared_norms(rows, batch_size)              # [B]
    w = tf.minimum(1.0, clip / tf.sqrt(sq + sq_rest))  # joint clip weights
    update = adafest_update(gen, rows, w, ids, vocab_size, contribution_bound=1.0,
                            threshold=5.0, selection_stddev=3.0, gradient_stddev=clip * 1.1)
"""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from tf_dp.dp_query import partition_selection as ps

__all__ = ["EmbeddingRows", "embedding_rows", "squared_norms", "adafest_update", "sparse_table_keys",
           "sparse_table_names"]


class EmbeddingRows(NamedTuple):
    """Each example's gradient rows, positions with the same row merged; all ``[B*L]`` (padded
    with ``valid == False`` entries whose values are 0)."""

    example: tf.Tensor  # int64 example index
    row: tf.Tensor  # int64 table row
    values: tf.Tensor  # [B*L, d]
    valid: tf.Tensor  # bool


def embedding_rows(ids: Any, output_grads: Any) -> EmbeddingRows:
    """Merges the output gradients ``[B, L, d]`` of an embedding lookup ``ids`` ``[B, L]`` into
    per-example, per-row gradient rows (ids < 0 are padding and dropped)."""
    ids = tf.cast(tf.convert_to_tensor(ids), tf.int64)
    g = tf.convert_to_tensor(output_grads)
    if ids.shape.rank != 2 or g.shape.rank != 3:
        raise ValueError(
            f"ids must be [batch, length] and output_grads [batch, length, dim], got {ids.shape} "
            f"and {g.shape}"
        )
    b, length = tf.shape(ids, out_type=tf.int64)[0], tf.shape(ids, out_type=tf.int64)[1]
    order = tf.argsort(ids, axis=1, stable=True)
    sids = tf.gather(ids, order, batch_dims=1)
    sg = tf.gather(g, order, batch_dims=1)
    prev = tf.concat([tf.fill([b, 1], tf.constant(-2, tf.int64)), sids[:, :-1]], 1)
    new = tf.reshape(tf.not_equal(sids, prev), [-1])
    seg = tf.cumsum(tf.cast(new, tf.int64)) - 1  # one segment per (example, row)
    n = b * length
    flat_ids = tf.reshape(sids, [-1])
    ex = tf.reshape(tf.tile(tf.range(b)[:, None], tf.stack([1, length])), [-1])
    d = tf.shape(g)[2]
    values = tf.math.unsorted_segment_sum(tf.reshape(sg, tf.stack([-1, d])), seg, n)
    row = tf.math.unsorted_segment_max(flat_ids, seg, n)
    example = tf.math.unsorted_segment_max(ex, seg, n)
    used = tf.range(n) < tf.reduce_sum(tf.cast(new, tf.int64))
    valid = tf.logical_and(used, row >= 0)
    values = tf.where(valid[:, None], values, tf.zeros_like(values))
    return EmbeddingRows(tf.where(valid, example, 0), tf.where(valid, row, 0), values, valid)


def squared_norms(rows: EmbeddingRows, batch_size: Any) -> tf.Tensor:
    """Per-example squared norms of the table gradient, ``[batch_size]``."""
    sq = tf.reduce_sum(tf.square(rows.values), axis=1)
    return tf.math.unsorted_segment_sum(sq, rows.example, batch_size)


def adafest_update(
    generator: tf.random.Generator, rows: EmbeddingRows, clip_weights: Any, ids: Any,
    vocab_size: int, contribution_bound: Any, threshold: Any, selection_stddev: Any,
    gradient_stddev: Any,
) -> tf.IndexedSlices:
    """One DP-AdaFEST table update: rows selected by the noised, clipped contribution map of
    ``ids``; the clipped gradient rows (``clip_weights`` ``[B]``, the joint clip weights) summed
    and noised on those rows only. Returns ``tf.IndexedSlices`` of shape ``[vocab_size, d]``
    (the sum, before the public denominator)."""
    counts = ps.contribution_map(ids, vocab_size, contribution_bound)
    selected = ps.select_rows(generator, counts, threshold, selection_stddev)
    w = tf.gather(tf.cast(clip_weights, rows.values.dtype), rows.example)
    values = rows.values * w[:, None]
    row_ids = tf.where(rows.valid, rows.row, -1)  # -1 is never selected
    d = tf.shape(rows.values, out_type=tf.int64)[1]
    return ps.sparse_noised_sum(
        generator, selected, row_ids, values, gradient_stddev, tf.stack([vocab_size, d])
    )


def sparse_table_names(model: Any, config: Any) -> dict:
    """The embedding tables that ``config`` (a
    :class:`~tf_dp.dp_query.partition_selection.SparseEmbeddingConfig`) trains sparsely, as
    ``{key (as the ghost clipper keys variables): layer name}``: every trainable
    ``keras.layers.Embedding`` table of ``model`` (ReversibleEmbedding included), or those of the
    layers named in ``config.layers``. ValueError when there is none, a named layer is missing or
    not an Embedding, or DP-FEST's fixed ``rows`` lack a table or name a row beyond it."""
    import keras

    from tf_dp import _compat
    from tf_dp.gradients import base

    layers = _compat.flatten_layers(model) or []
    embeddings = {l.name: l for l in layers if isinstance(l, keras.layers.Embedding)}
    if config.layers is None:
        chosen = list(embeddings.values())
    else:
        missing = [n for n in config.layers if n not in embeddings]
        if missing:
            raise ValueError(
                f"SparseEmbeddingConfig(layers=...) names {missing}, which are not "
                f"keras.layers.Embedding layers of the model (its Embedding layers: "
                f"{sorted(embeddings)})")
        chosen = [embeddings[n] for n in config.layers]
    tables = []
    for layer in chosen:
        table = _compat.embeddings_variable(layer)
        if getattr(table, "trainable", True) and layer.trainable:
            tables.append((layer.name, table))
    if not tables:
        raise ValueError(
            "sparse_embeddings was given but the model has no trainable keras.layers.Embedding "
            "table to train sparsely: set sparse_embeddings=None")
    names = {}
    for name, table in tables:
        fixed = config.rows_for(name, len(tables)) if getattr(config, "rows", None) else None
        if fixed is not None and fixed[-1] >= int(table.shape[0]):
            raise ValueError(
                f"sparse_embeddings rows= for layer {name!r}: row id {fixed[-1]} is out of range "
                f"for its table of {int(table.shape[0])} rows (accepted: 0 .. "
                f"{int(table.shape[0]) - 1})")
        names[id(base.as_tf_variables([table])[0])] = name
    return names


def sparse_table_keys(model: Any, config: Any) -> frozenset:
    """The keys of :func:`sparse_table_names` (the tables trained sparsely)."""
    return frozenset(sparse_table_names(model, config))
