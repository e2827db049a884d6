"""How a layer's per-example gradient factors, and what the ghost engine does with each form.

A norm rule (see :mod:`tf_dp.gradients.ghost.rules`) describes the per-example gradient of each of
its layer's variables with one of three *factors*, all with the batch on axis 0:

- :class:`Outer` ``(a [B, T, C], g [B, T, D])``: the per-example gradient is ``sum_t a_t g_t^T``
  (a ``C x D`` matrix, then reshaped/transposed to the variable). Dense kernels (``T = 1`` for 2-D
  inputs, ``T`` = sequence length otherwise), convolution kernels (``a`` = unfolded patches) and
  EinsumDense kernels have this form.
- :class:`Rows` ``(ids [B, T], g [B, T, D])``: the per-example gradient of a ``[V, D]`` table whose
  row ``ids[b, t]`` receives ``g[b, t]`` (embeddings).
- :class:`PerExample` ``(grads [B, *variable.shape])``: the per-example gradient itself, for
  variables that are cheap to materialise (biases, normalisation scales and offsets).

The engine never needs more than this: squared norms come from the factors without materialising
large per-example gradients (Goodfellow 2015 for ``T = 1``; the Gram-matrix "ghost norm"
``sum_{t,s} (a_t . a_s)(g_t . g_s)`` of Li et al. 2021 when ``T^2 (C + D) < C D`` or when
``[B, C, D]`` would be large, materialised ``[B, C, D]`` otherwise; see ``_use_ghost``), and the clipped sum ``sum_b w_b grad_b`` is computed from the same
factors (book-keeping, Bu et al. 2022), so the clipped record is exactly the vector whose norm was
measured. A layer called several times (shared weights) contributes one factor per call; factors of
one variable are concatenated along ``T`` (or summed, for :class:`PerExample`), which gives the
exact norm of the summed per-example gradient, cross terms between calls included.

The weighted sums select records of weight 0 out of the factors (``tf.where``) instead of
multiplying them by 0: a non-finite record (weight 0) may have NaN or inf factors, and 0 * NaN is
NaN. A record's factors hold only its own values, so its NaN does not reach other records.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import tensorflow as tf

from tf_dp.dp_query.xla import in_xla_context
from tf_dp.gradients.base import weighted_sum, zero_rows


def _f32(t: tf.Tensor) -> tf.Tensor:
    t = tf.convert_to_tensor(t)
    return t if t.dtype in (tf.float32, tf.float64) else tf.cast(t, tf.float32)


def _as_btx(t: tf.Tensor) -> tf.Tensor:
    """``[B, C]`` -> ``[B, 1, C]``; ``[B, T, C]`` unchanged."""
    t = _f32(t)
    if t.shape.rank == 2:
        return tf.expand_dims(t, 1)  # a reshape (a strided slice would copy)
    if t.shape.rank != 3:
        raise ValueError(f"expected a [B, T, C] or [B, C] tensor, got shape {t.shape}")
    return t


@dataclasses.dataclass
class Outer:
    """Per-example gradient ``sum_t a[b, t] (x) g[b, t]``, shape ``[C, D]``.

    Args:
      a: ``[B, T, C]`` (or ``[B, C]`` for ``T = 1``), e.g. a dense layer's inputs or a
        convolution's unfolded patches.
      g: ``[B, T, D]`` (or ``[B, D]``), the matching output gradients.
      unflat_shape: shape the ``[C, D]`` matrix is reshaped to (default: the variable's shape).
      perm: then transposed by this permutation (default: none).
    """

    a: tf.Tensor
    g: tf.Tensor
    unflat_shape: Optional[Sequence[int]] = None
    perm: Optional[Sequence[int]] = None
    #: ``(a, g)`` as given when both are ``[B, C]`` (T = 1), else None: the norm reads these,
    #: so that ``||g_b||^2`` is the same op as a bias's norm on the same ``g`` (grappler then
    #: computes it once)
    flat: Optional[tuple] = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self):
        a, g = _f32(self.a), _f32(self.g)
        if self.flat is None and a.shape.rank == 2 and g.shape.rank == 2:
            self.flat = (a, g)
        self.a = _as_btx(a)
        self.g = _as_btx(g)


@dataclasses.dataclass
class Rows:
    """Per-example gradient of a ``[V, D]`` table: row ``ids[b, t]`` gets ``g[b, t]``.

    Args:
      ids: integer ``[B, T]`` (or ``[B]``) row indices.
      g: ``[B, T, D]`` (or ``[B, D]``) gradients of the gathered rows.
      num_rows: ``V``.
    """

    ids: tf.Tensor
    g: tf.Tensor
    num_rows: int

    def __post_init__(self):
        ids = tf.convert_to_tensor(self.ids)
        if ids.dtype not in (tf.int32, tf.int64):
            ids = tf.cast(ids, tf.int64)
        ids = tf.cast(ids if ids.shape.rank != 1 else ids[:, None], tf.int64)
        # a negative id reads row id + V, as Keras's ops.take (every Embedding's lookup) does:
        # the gradient goes to that row, so its norm and sum must count it there
        self.ids = tf.where(ids < 0, ids + int(self.num_rows), ids)
        self.g = _as_btx(self.g)


@dataclasses.dataclass
class PerExample:
    """The per-example gradients themselves, ``[B, *variable.shape]``."""

    grads: tf.Tensor

    def __post_init__(self):
        self.grads = _f32(self.grads)


Factor = (Outer, Rows, PerExample)  # what a rule returns (RowsPlus is built by combine)


# -- combining the factors of several calls --------------------------------------------------------


def combine(factors: list, variable_shape: Sequence[int]):
    """One factor for a variable from the factors of all calls of its layer (exact cross terms)."""
    if len(factors) == 1:
        return factors[0]
    kinds = {type(f) for f in factors}
    if kinds == {Outer} and _same_layout(factors):
        return Outer(
            tf.concat([f.a for f in factors], axis=1),
            tf.concat([f.g for f in factors], axis=1),
            factors[0].unflat_shape,
            factors[0].perm,
        )
    if kinds == {Rows}:
        return Rows(
            tf.concat([f.ids for f in factors], axis=1),
            tf.concat([f.g for f in factors], axis=1),
            factors[0].num_rows,
        )
    if Rows in kinds:  # a tied table: looked up (Rows) and used as a matrix (Outer/PerExample)
        rows = combine([f for f in factors if isinstance(f, Rows)], variable_shape)
        dense = combine([f for f in factors if not isinstance(f, Rows)], variable_shape)
        return RowsPlus(rows, dense)
    return PerExample(tf.add_n([materialize(f, variable_shape) for f in factors]))


@dataclasses.dataclass
class RowsPlus:
    """The per-example gradient ``R + M`` of a ``[V, D]`` table used both as a lookup table
    (``R``, :class:`Rows`) and as a matrix (``M``, :class:`Outer` or :class:`PerExample`), e.g. a
    tied input/output embedding. Its squared norm is ``|R|^2 + |M|^2 + 2 <R, M>``; the cross term
    reads ``M`` only at the looked-up rows (see :func:`_rows_inner`). Built by :func:`combine`."""

    rows: Rows
    dense: object


def _same_layout(factors) -> bool:
    f0 = factors[0]
    return all(
        _tuple(f.unflat_shape) == _tuple(f0.unflat_shape) and _tuple(f.perm) == _tuple(f0.perm)
        for f in factors
    )


def _tuple(x):
    return None if x is None else tuple(int(v) for v in x)


def _to_variable(m: tf.Tensor, f: Outer, variable_shape, batched: bool) -> tf.Tensor:
    """Reshapes ``[.., C, D]`` to the variable's layout (keeping a leading batch axis if any)."""
    lead = [tf.shape(m)[0]] if batched else []
    if f.unflat_shape is not None:
        m = tf.reshape(m, lead + list(f.unflat_shape))
        if f.perm is not None:
            perm = list(f.perm)
            m = tf.transpose(m, ([0] + [p + 1 for p in perm]) if batched else perm)
    return tf.reshape(m, lead + list(variable_shape))


def materialize(f, variable_shape) -> tf.Tensor:
    """Per-example gradients ``[B, *variable_shape]`` from a factor."""
    if isinstance(f, PerExample):
        return tf.reshape(f.grads, [tf.shape(f.grads)[0]] + list(variable_shape))
    if isinstance(f, Outer):
        m = tf.transpose(_per_example_dc(f), [0, 2, 1])
        return _to_variable(m, f, variable_shape, batched=True)
    raise TypeError("Rows factors are not materialised")


def group(f, k: int):
    """The factor of the per-*group* gradients: records ``j k .. j k + k - 1`` form group ``j``.

    A group's gradient is the sum of its records' gradients, which keeps each factor's form:
    an :class:`Outer` or :class:`Rows` factor of ``[B, T, .]`` becomes one of ``[B / k, k T, .]``
    (a reshape: the group's terms are concatenated along ``T``), a :class:`PerExample` factor is
    summed over each group. Norms and weighted sums of the result are per group (user-level
    clipping, :mod:`tf_dp.gradients.per_user`). ``B`` must be a multiple of ``k``.
    """
    if k == 1:
        return f

    def regroup(t):
        shape = tf.shape(t)
        static = t.shape
        out = tf.reshape(t, tf.concat([[-1, k * shape[1]], shape[2:]], 0))
        if static[1] is not None:
            out.set_shape([None, k * static[1]] + static[2:].as_list())
        return out

    if isinstance(f, Outer):
        return Outer(regroup(f.a), regroup(f.g), f.unflat_shape, f.perm)
    if isinstance(f, Rows):
        return Rows(regroup(f.ids), regroup(f.g), f.num_rows)
    if isinstance(f, PerExample):
        g = f.grads
        grouped = tf.reshape(g, tf.concat([[-1, k], tf.shape(g)[1:]], 0))
        return PerExample(tf.reduce_sum(grouped, axis=1))
    if isinstance(f, RowsPlus):
        return RowsPlus(group(f.rows, k), group(f.dense, k))
    raise TypeError(f"cannot group a {type(f).__name__} factor")


# -- norms and weighted sums -----------------------------------------------------------------------


def _per_example_dc(f: Outer) -> tf.Tensor:
    """Per-example gradients transposed, ``[B, D, C] = g^T a``: on CPU (oneDNN) 1.5x faster
    than ``a^T g`` for the reference CNN's convolutions (``research/ghost/kernel_bench.py``)."""
    return tf.matmul(f.g, f.a, transpose_a=True)


def _use_ghost(f: Outer) -> bool:
    """Gram ("ghost") norms or materialised ``[B, C, D]`` per-example gradients?

    Per example, the Gram route costs ``T^2 (C + D)`` multiply-adds for the norm plus ``T C D``
    for its share of the book-kept sum; materialising costs ``T C D`` once (the weighted sum is
    then ``C D``). So materialise unless ``T^2 (C + D) < C D``, or unless ``[B, C, D]`` would be
    larger than the factors ``a``, ``g`` themselves (peak memory; on the reference CNN's second
    convolution both routes take the same time and the Gram route saves 16 MB).
    """
    return use_gram(f.a.shape[1], f.a.shape[2], f.g.shape[2])


def use_gram(t: Optional[int], c: Optional[int], d: Optional[int]) -> bool:
    """:func:`_use_ghost`'s choice for an :class:`Outer` factor of ``a [B, t, c]``,
    ``g [B, t, d]`` (the Gram route when a size is unknown while tracing); a rule that can
    materialise the per-example gradient more cheaply than from the factors asks it first
    (the convolution rule)."""
    if t is None or c is None or d is None:
        return True
    return t * t * (c + d) < c * d or c * d > t * (c + d)


def _row_sums(t: tf.Tensor) -> tf.Tensor:
    """``[B]`` sums of ``t [B, ...]`` over all its other axes.

    Under XLA, with ``t`` flattened to ``[B, N]`` (static ``N >= 64``), the sum is a
    matrix-vector product with ones: XLA's CPU backend splits a long row reduction (or a sum over
    several axes) into a windowed reduction that runs several times slower than the product, and
    does not fuse an elementwise producer (a square) into it (``python -m
    research.ghost.xla_reductions``: 151 against 32 us of work for the squares of a
    ``[256, 784]`` input; the sums of squares of a ``[64, 256, 128]`` per-example gradient took
    4-6 ms each on the reference Transformer's step; 2-core AMD EPYC)."""
    n = t.shape[1:].num_elements()
    if in_xla_context() and n is not None and n >= _XLA_MATVEC_MIN:
        flat = t if t.shape.rank == 2 else tf.reshape(t, [tf.shape(t)[0], n])
        return tf.linalg.matvec(flat, tf.ones([n], t.dtype))
    return tf.reduce_sum(t, axis=list(range(1, t.shape.rank)))


def _row_squares(t: tf.Tensor) -> tf.Tensor:
    """``[B]`` squared norms of ``t [B, ...]`` over all its other axes (:func:`_row_sums` of
    the squares)."""
    return _row_sums(tf.square(t))


#: Row length from which :func:`_row_sums` sums by a matrix-vector product under XLA.
_XLA_MATVEC_MIN = 64


def squared_norm_and_sum(f, variable_shape):
    """``(squared norms [B], weighted_sum_fn)`` for one variable's combined factor.

    The caller first collects every variable's squared norms, asks the query for clip weights,
    then calls ``weighted_sum_fn(w, select)`` for ``sum_b w_b grad_b`` (book-keeping: no second
    backward); ``select`` as in :func:`tf_dp.gradients.base.weighted_sum`.
    """
    if isinstance(f, PerExample):
        grads = f.grads
        sq = _row_squares(grads)
        return sq, lambda w, select: tf.reshape(weighted_sum(w, grads, select), variable_shape)
    if isinstance(f, Outer):
        a, g = f.a, f.g
        if f.flat is not None:
            sq = _row_squares(f.flat[0]) * _row_squares(f.flat[1])
            return sq, lambda w, select: _outer_weighted(f, w, variable_shape, select)
        if a.shape[1] == 1:
            sq = _row_squares(tf.squeeze(a, 1)) * _row_squares(tf.squeeze(g, 1))
            return sq, lambda w, select: _outer_weighted(f, w, variable_shape, select)
        if _use_ghost(f):
            aa = tf.matmul(a, a, transpose_b=True)
            gg = tf.matmul(g, g, transpose_b=True)
            sq = _row_sums(aa * gg)
            return sq, lambda w, select: _outer_weighted(f, w, variable_shape, select)
        m = _per_example_dc(f)  # [B, D, C]
        sq = _row_squares(m)
        return sq, lambda w, select: _to_variable(
            tf.transpose(weighted_sum(w, m, select)), f, variable_shape, batched=False
        )
    if isinstance(f, Rows):
        return _rows_sq(f), lambda w, select: _rows_weighted(f, w, variable_shape, select)
    if isinstance(f, RowsPlus):
        sq_r, sum_r = squared_norm_and_sum(f.rows, variable_shape)
        sq_m, sum_m = squared_norm_and_sum(f.dense, variable_shape)
        # exact up to rounding; rounding must not make a squared norm negative
        sq = tf.maximum(sq_r + sq_m + 2.0 * _rows_inner(f.rows, f.dense, variable_shape), 0.0)
        return sq, lambda w, select: sum_r(w, select) + sum_m(w, select)
    raise TypeError(f"a norm rule returned {type(f).__name__}; expected Outer, Rows or PerExample")


def _outer_weighted(f: Outer, w: tf.Tensor, variable_shape, select: bool = True) -> tf.Tensor:
    w = tf.cast(w, f.g.dtype)
    # records of weight 0 may hold NaN or inf (non-finite records): select them out of both
    # factors, since 0 * NaN is NaN (select=False: base.guarded_sums checks the result instead)
    a, g = zero_rows(tf.not_equal(w, 0), [f.a, f.g]) if select else (f.a, f.g)
    if g.shape[2] is not None and a.shape[2] is not None and a.shape[2] < g.shape[2]:
        a = a * w[:, None, None]
    else:
        g = g * w[:, None, None]
    c, d = tf.shape(a)[2], tf.shape(g)[2]
    m = tf.matmul(tf.reshape(a, [-1, c]), tf.reshape(g, [-1, d]), transpose_a=True)
    return _to_variable(m, f, variable_shape, batched=False)


def _rows_keys(f: Rows):
    batch = tf.shape(f.ids, out_type=tf.int64)[0]
    b = tf.range(batch, dtype=tf.int64)[:, None] * tf.cast(f.num_rows, tf.int64)
    keys = tf.reshape(f.ids + b, [-1])
    uniq, idx = tf.unique(keys)
    return batch, uniq, idx


#: Under XLA, the longest static ``T`` for which :func:`_rows_sq` takes the Gram route.
_XLA_ROWS_GRAM_MAX_T = 512


def _rows_sq(f: Rows) -> tf.Tensor:
    """``[B]`` squared norms of the per-example table gradients: ``sum_v |sum_{t: ids_t = v}
    g_t|^2``, by the distinct ``(example, id)`` keys (``tf.unique``) and segment sums.

    Under XLA with a static ``T <= _XLA_ROWS_GRAM_MAX_T``, as the Gram sum
    ``sum_{t, s: ids_t = ids_s} g_t . g_s`` instead (the same value; ``B T^2 (D + 1)``
    multiply-adds, no unique): XLA sorts for ``tf.unique``, and on 8192 keys (``B T`` = 64 x 128,
    ``D`` = 128) that route takes 4.5 ms against 0.95 ms for the Gram sum (2-core AMD EPYC; at
    ``T`` = 512 and 1024 with the same ``B T``: 4.3 against 3.1 ms, 4.5 against 7.3 ms)."""
    t = f.ids.shape[1]
    if in_xla_context() and t is not None and t <= _XLA_ROWS_GRAM_MAX_T:
        gram = tf.matmul(f.g, f.g, transpose_b=True)  # [B, T, T]
        same = tf.equal(f.ids[:, :, None], f.ids[:, None, :])
        sq = _row_sums(tf.where(same, gram, tf.zeros_like(gram)))
        return tf.maximum(sq, 0.0)  # rounding must not make a squared norm negative
    batch, uniq, idx = _rows_keys(f)
    d = tf.shape(f.g)[2]
    sums = tf.math.unsorted_segment_sum(tf.reshape(f.g, [-1, d]), idx, tf.size(uniq))
    per_row = tf.reduce_sum(tf.square(sums), axis=1)
    return tf.math.unsorted_segment_sum(per_row, uniq // tf.cast(f.num_rows, tf.int64), batch)


def _rows_weighted(f: Rows, w: tf.Tensor, variable_shape, select: bool = True) -> tf.Tensor:
    w = tf.cast(w, f.g.dtype)
    g = (zero_rows(tf.not_equal(w, 0), f.g) if select else f.g) * w[:, None, None]
    d = tf.shape(g)[2]
    out = tf.math.unsorted_segment_sum(
        tf.reshape(g, [-1, d]), tf.reshape(f.ids, [-1]), tf.cast(f.num_rows, tf.int64)
    )
    return tf.reshape(out, variable_shape)


def _rows_inner(r: Rows, m, variable_shape) -> tf.Tensor:
    """Per-example ``<R, M>``: ``sum_t <r.g[b, t], M_b[ids[b, t]]>``.

    For ``M = Outer(a [B, S, V], g [B, S, D])`` (``M_b = sum_s a_s g_s^T``, no reshape):
    ``sum_{t, s} a[b, s, ids[b, t]] (r.g[b, t] . g[b, s])``, cost ``B T S (D + 1)``; otherwise
    ``M`` is materialised and its looked-up rows are gathered."""
    ids = r.ids
    if (
        isinstance(m, Outer)
        and m.unflat_shape is None
        and m.perm is None
        and m.a.shape[2] == variable_shape[0]
    ):
        a_at = tf.gather(m.a, ids, axis=2, batch_dims=1)  # [B, S, T]
        gg = tf.matmul(m.g, r.g, transpose_b=True)  # [B, S, T]
        return tf.reduce_sum(a_at * gg, axis=[1, 2])
    full = materialize(m, variable_shape)  # [B, V, D]
    picked = tf.gather(full, ids, axis=1, batch_dims=1)  # [B, T, D]
    return tf.reduce_sum(picked * r.g, axis=[1, 2])
