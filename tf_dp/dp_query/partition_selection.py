"""Private partition selection of embedding rows and sparsity-preserving noise (DP-AdaFEST and
DP-FEST, Ghazi et al. 2023, "Sparsity-Preserving Differentially Private Training of Large
Embedding Models").

One DP-AdaFEST step on an embedding table of ``V`` rows:

1. Contribution map: example ``i`` touches the set ``R_i`` of rows (its ids, duplicates counted
   once); its map is the indicator of ``R_i`` scaled to L2 norm at most ``contribution_bound``
   (``c_i = min(1, C1 / sqrt(|R_i|))`` on each of its rows). The batch's map is the sum: a
   Gaussian sum query of L2 sensitivity ``C1`` (add/remove one example).
2. Selection: ``N(0, (sigma1 C1)^2)`` is added to every row's count and the rows whose noisy count
   exceeds ``threshold`` are selected (:func:`select_rows`).
3. Gradient: the clipped per-example gradient rows are summed and ``N(0, (sigma2 C2)^2)`` noise
   is added on the selected rows only; rows not selected get nothing, not noise
   (:func:`sparse_noised_sum`). The result is a ``tf.IndexedSlices`` over the selected rows.

Both noisy sums are Gaussian sum queries on the same sample, so the step's mechanism is their
composition (record both with the ledger: ``tf_dp.accounting.partition_selection``); the
threshold is post-processing. DP-FEST replaces step 2 by a fixed set of rows chosen once, from
public frequencies or from one privately counted histogram (:func:`top_rows`).

Example::

    ids = tf.constant([[3, 3, 7], [7, 1, -1]])           # -1 pads
    counts = contribution_map(ids, vocab_size=10, contribution_bound=1.0)
    gen = make_generator()
    rows = select_rows(gen, counts, threshold=0.5, noise_stddev=1.0)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_dp.dp_query.noise import gaussian_noise, make_generator

__all__ = [
    "contribution_weights",
    "contribution_map",
    "select_rows",
    "sparse_noised_sum",
    "top_rows",
    "make_generator",
]


def _check_nonneg(name: str, value: Any) -> None:
    v = tf.get_static_value(value)
    if v is not None and not float(v) >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {v!r}")


def _first_occurrences(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Sorted ids ``[B, L]`` and a mask of each example's distinct valid ids (first occurrence
    in sorted order; ids < 0 are padding)."""
    ids = tf.sort(tf.cast(ids, tf.int64), axis=1)
    prev = tf.concat([tf.fill([tf.shape(ids)[0], 1], tf.constant(-1, tf.int64)), ids[:, :-1]], 1)
    first = tf.logical_and(ids >= 0, tf.not_equal(ids, prev))
    return ids, first


def contribution_weights(ids: Any, contribution_bound: Any) -> tf.Tensor:
    """Per-example weight ``min(1, C1 / sqrt(|R_i|))`` of its distinct rows (``[B]``, float32):
    the contribution map of example ``i`` then has L2 norm ``<= contribution_bound``.

    ``ids``: ``[B, L]`` integer row ids, ``-1`` for padding."""
    _check_nonneg("contribution_bound", contribution_bound)
    _, first = _first_occurrences(tf.convert_to_tensor(ids))
    k = tf.reduce_sum(tf.cast(first, tf.float32), axis=1)
    c = tf.cast(contribution_bound, tf.float32)
    return tf.where(k > 0, tf.minimum(1.0, c * tf.math.rsqrt(tf.maximum(k, 1.0))), 0.0)


def contribution_map(ids: Any, vocab_size: int, contribution_bound: Any) -> tf.Tensor:
    """The batch's clipped contribution map: ``[vocab_size]`` float32, row ``r`` the sum over
    examples touching ``r`` of their weight (:func:`contribution_weights`). Its L2 sensitivity
    under add/remove-one is ``contribution_bound``.

    Args:
      ids: ``[B, L]`` integer row ids of each example (``-1`` pads; duplicates count once).
      vocab_size: number of rows ``V`` (> 0); ids must be in ``[-1, V)``.
      contribution_bound: ``C1 > 0``, the L2 bound of one example's map.
    """
    if not (isinstance(vocab_size, int) and vocab_size > 0):
        raise ValueError(f"vocab_size must be an integer > 0, got {vocab_size!r}")
    c = tf.get_static_value(tf.convert_to_tensor(contribution_bound))
    if c is not None and not float(c) > 0:
        raise ValueError(f"contribution_bound must be > 0, got {c!r}")
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank != 2:
        raise ValueError(f"ids must be a [batch, length] tensor, got shape {ids.shape}")
    sorted_ids, first = _first_occurrences(ids)
    k = tf.reduce_sum(tf.cast(first, tf.float32), axis=1)
    w = tf.where(
        k > 0, tf.minimum(1.0, tf.cast(contribution_bound, tf.float32) * tf.math.rsqrt(tf.maximum(k, 1.0))), 0.0
    )
    tf.debugging.assert_less(
        sorted_ids[:, -1:] if ids.shape[1] != 0 else tf.zeros([0, 1], tf.int64),
        tf.constant(vocab_size, tf.int64), message="ids must be < vocab_size",
    )
    per = tf.where(first, w[:, None] * tf.ones_like(sorted_ids, tf.float32), 0.0)
    rows = tf.where(first, sorted_ids, 0)
    return tf.tensor_scatter_nd_add(
        tf.zeros([vocab_size], tf.float32), tf.reshape(rows, [-1, 1]), tf.reshape(per, [-1])
    )


def select_rows(
    generator: tf.random.Generator, counts: Any, threshold: Any, noise_stddev: Any
) -> tf.Tensor:
    """DP-AdaFEST's selection: the rows (int64 ``[n]``, ascending) whose count plus
    ``N(0, noise_stddev^2)`` exceeds ``threshold``.

    ``noise_stddev`` is ``sigma1 * contribution_bound``; ``noise_stddev = 0`` selects exactly
    the rows with ``count > threshold`` (no privacy; for tests). The noise is drawn for every row
    (``V`` scalars, one per row, not ``V x d``)."""
    _check_nonneg("noise_stddev", noise_stddev)
    counts = tf.convert_to_tensor(counts, tf.float32)
    noise = gaussian_noise(generator, tf.size(counts), tf.float32, tf.cast(noise_stddev, tf.float32))
    noisy = counts + tf.reshape(noise, tf.shape(counts))
    return tf.reshape(tf.where(noisy > tf.cast(threshold, tf.float32)), [-1])


def sparse_noised_sum(
    generator: tf.random.Generator,
    rows: Any,
    row_ids: Any,
    row_values: Any,
    noise_stddev: Any,
    dense_shape: Any,
) -> tf.IndexedSlices:
    """The noised sum of clipped per-example gradient rows, restricted to the selected ``rows``.

    Args:
      generator: noise generator (:func:`make_generator`).
      rows: selected row indices, int64 ``[n]``, distinct (from :func:`select_rows` or
        :func:`top_rows`).
      row_ids: ``[m]`` row index of each (already clipped and weighted) gradient row.
      row_values: ``[m, d]`` the gradient rows (several may share a row id: they are summed).
      noise_stddev: ``sigma2 * C2``, added i.i.d. to each of the ``n x d`` selected coordinates.
      dense_shape: the table's shape ``[V, d]``.

    Returns ``tf.IndexedSlices(values [n, d], indices rows, dense_shape)``: gradient rows whose id
    is not selected are dropped; selected rows nobody touched carry noise only.
    """
    _check_nonneg("noise_stddev", noise_stddev)
    rows = tf.cast(tf.reshape(rows, [-1]), tf.int64)
    row_ids = tf.cast(tf.reshape(row_ids, [-1]), tf.int64)
    row_values = tf.convert_to_tensor(row_values)
    d = tf.shape(row_values)[1]
    # position of each gradient row's id among the selected rows (or -1)
    pos = tf.searchsorted(rows, row_ids, side="left", out_type=tf.int64)
    padded = tf.concat([rows, tf.constant([-1], tf.int64)], 0)  # pos in [0, n] always gathers
    hit = tf.equal(tf.gather(padded, pos), row_ids)
    seg = tf.where(hit, pos, tf.size(rows, out_type=tf.int64))  # misses -> a dropped segment
    summed = tf.math.unsorted_segment_sum(row_values, seg, tf.size(rows) + 1)[:-1]
    n = tf.size(rows)
    noise = gaussian_noise(generator, n * d, row_values.dtype, tf.cast(noise_stddev, row_values.dtype))
    values = summed + tf.reshape(noise, [n, d])
    return tf.IndexedSlices(values, rows, tf.cast(dense_shape, tf.int64))


def top_rows(frequencies: Any, k: int) -> tf.Tensor:
    """DP-FEST's fixed selection: the ``k`` rows (int64, ascending) of largest frequency, from
    public frequencies or from a privately counted histogram (e.g. :func:`contribution_map`
    summed over the dataset plus Gaussian noise, recorded once as its own mechanism)."""
    freqs = tf.convert_to_tensor(frequencies, tf.float32)
    n = int(freqs.shape[0])
    if not (isinstance(k, int) and 0 < k <= n):
        raise ValueError(f"k must be an integer in [1, {n}], got {k!r}")
    return tf.sort(tf.cast(tf.math.top_k(freqs, k).indices, tf.int64))
