"""Gradient clippers: from a per-example loss to the clipped sum of per-example gradients.

A clipper receives

- ``loss_fn``: a :class:`PerExampleLoss`-like callable ``loss_fn(x, y, sample_weight)`` that runs
  the model forward (training mode) and returns ``(per_example_losses [B], y_pred)``;
- ``data``: the batch ``(x, y, sample_weight)`` (``sample_weight`` may be None);
- ``variables``: the trainable variables (Keras 3 or ``tf.Variable``);
- ``query`` and ``params``: the DP sum query and its sample params. Exact clippers clip through
  the query's clipping rule (:meth:`tf_dp.dp_query.DPQuery.clip_weights` from per-record squared
  norms, one leaf per variable), so per-layer (nested) and joint clipping work on every path.

and returns a :class:`ClippedGradients`: the clipped sum (one tensor per variable, the query's
sample state), the per-record norms (for metrics), the number of records (examples, or
microbatches), the L2 sensitivity multiplier of one record (1 for single examples, 2 for
randomly assigned microbatches under add/remove adjacency), and ``y_pred`` and the per-example
losses for metrics.

Clippers never add noise: the DP optimizer's query does (``get_noised_result``).

Non-finite records. Clipping bounds a record only if its gradient is finite: ``min(1, C/||g||)``
of a NaN gradient is NaN, and ``0 * NaN`` is NaN, so one NaN or inf in one example would make the
whole sum (and every weight after the update) NaN. Every clipper therefore gives a record whose
per-example loss or gradient norm is not finite clip weight 0 (:func:`record_weights`) and
*removes* it from the sum by selection, never by multiplying it by 0 (:func:`weighted_sum`,
:func:`guarded_sums`).
Clippers whose sum goes through a backward pass shared by several records (a microbatch, JL's
weighted backward pass) re-run that pass with the bad records replaced by copies of a kept record
of weight 0 (:func:`fill_rows`): NaN activations of one record would otherwise reach every
parameter gradient. The clipped sum is then exactly the clipped sum of the other records.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf

from tf_dp import _compat
from tf_dp.dp_query.xla import in_xla_context


@dataclasses.dataclass
class ClippedGradients:
    clipped_sum: list[Any]
    norms: tf.Tensor
    num_records: tf.Tensor
    sensitivity_multiplier: Any = 1.0
    y_pred: Any = None
    losses: Any = None
    jl_projections: int = 0
    #: ask the DP optimizer to draw the noise only once the clipped sum exists (a control
    #: dependency). By default the executor may draw it early, next to the forward and backward
    #: pass (faster on a free core, but the noise is then held through the step's peak).
    noise_after_sum: bool = False
    #: ``[B]`` bool, the records of the sample (``None``: every record): False for the
    #: zero-weight padding rows of Poisson batches and for empty microbatches. Queries that count
    #: records (adaptive clipping) leave the others out, since their number depends on the
    #: sample's size.
    record_mask: Any = None


LossFn = Callable[[Any, Any, Any], tuple[tf.Tensor, Any]]


def as_tf_variables(variables: Sequence[Any]) -> list[tf.Variable]:
    """The ``tf.Variable`` behind each (Keras 3 or TF) variable."""
    out = []
    for v in variables:
        inner = getattr(v, "value", None) if not isinstance(v, tf.Variable) else v
        out.append(inner if isinstance(inner, tf.Variable) else v)
    return out


def squared_norms_of(per_example_grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Per-example squared norms ``[B]`` of stacked per-example gradients ``[B, ...]``."""
    out = []
    for g in per_example_grads:
        g = tf.cast(g, tf.float32) if g.dtype != tf.float64 else g
        out.append(tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1))
    return out


def weighted_sum(
    weights: tf.Tensor, per_example_grads: tf.Tensor, select: bool = True
) -> tf.Tensor:
    """``sum_i w_i g_i`` for ``g`` of shape ``[B, ...]``, where records of weight 0 add exactly 0.

    A record of weight 0 may have a NaN or inf gradient (see :func:`record_weights`); ``0 * NaN``
    is NaN, so such rows are selected out (``tf.where``), not multiplied by 0. ``select=False``
    skips the selection: the fast half of :func:`guarded_sums`, which checks the result.
    """
    w = tf.cast(weights, per_example_grads.dtype)
    g = zero_rows(tf.not_equal(w, 0), per_example_grads) if select else per_example_grads
    flat = tf.reshape(g, [tf.shape(g)[0], -1])
    if in_xla_context():
        # XLA's CPU backend emits a matrix-vector product whose operand is reshaped or computed
        # as a naive loop (a [64, 16384] sum: 1.9 ms against 0.07 ms): a product with two
        # columns (w and zeros) stays a matrix product (research.ghost.xla_reductions)
        both = tf.stack([w, tf.zeros_like(w)], axis=1)
        total = tf.matmul(both, flat, transpose_a=True)[0]
    else:
        # a matrix-vector product: the same work as tf.tensordot, a third of its tracing time
        total = tf.linalg.matvec(flat, w, transpose_a=True)
    shape = g.shape[1:]
    return tf.reshape(total, shape if shape.is_fully_defined() else tf.shape(g)[1:])


def zero_rows(keep: tf.Tensor, t: Any) -> Any:
    """``t`` (a ``[B, ...]`` tensor or a list of them) with the rows where ``keep`` (``[B]``
    bool) is False set to exactly 0."""
    ts = list(t) if isinstance(t, (list, tuple)) else [t]
    out = []
    for x in ts:
        shape = tf.concat([tf.shape(keep), tf.ones([tf.rank(x) - 1], tf.int32)], 0)
        out.append(tf.where(tf.reshape(keep, shape), x, tf.zeros_like(x)))
    return out if isinstance(t, (list, tuple)) else out[0]


def guarded_sums(sums: Callable[[bool], list], weights: Any = None) -> list:
    """Every variable's weighted sum, with one conditional per step instead of one per variable.

    ``sums(select)`` returns the list of dense weighted sums, with (``select=True``) or without
    the selection of weight-0 rows (:func:`zero_rows`). The sums are computed without it first.
    A weight-0 row adds ``0 * x`` to them, which is exactly 0 when ``x`` is finite and NaN when
    it is not (a kept row is finite: :func:`record_weights`), so if every sum is finite they equal
    the selected sums, the same products in the same order; only if one is not (a step with a
    non-finite record, or an overflow) are they recomputed with the selection.

    ``weights`` (the weights ``sums`` selects by, any structure of ``[B]`` tensors), if given,
    spares the check in the common case: when no weight is 0 the selection selects nothing, so
    the sums computed without it are the selected sums whatever they hold, and the pass over
    every sum's elements that the check takes (a reduction over all the model's parameters) is
    not run. A non-finite record always has weight 0 (:func:`record_weights`), so a step with
    one still takes the checked route.
    """
    fast = sums(False)
    if not fast:
        return fast

    def checked() -> list:
        total = tf.add_n([tf.reduce_sum(tf.cast(x, tf.float32)) for x in fast])
        return tf.cond(tf.math.is_finite(total), lambda: [tf.identity(x) for x in fast],
                       lambda: sums(True))

    if weights is None:
        return checked()
    nonzero = tf.reduce_all(tf.stack([
        tf.reduce_all(tf.not_equal(w, tf.zeros([], w.dtype))) for w in tf.nest.flatten(weights)
    ]))
    return tf.cond(nonzero, lambda: [tf.identity(x) for x in fast], checked)


def weighted_sums(weights: Any, per_example_grads: Sequence[tf.Tensor]) -> list:
    """:func:`weighted_sum` of each variable's stacked per-record gradients ``[B, ...]`` with
    its leaf of ``weights``, under one :func:`guarded_sums` conditional."""
    ws = tf.nest.flatten(weights)
    return guarded_sums(
        lambda select: [weighted_sum(w, g, select) for w, g in zip(ws, per_example_grads)], ws)


def finite_records(squared_norms: Any, losses: Any = None) -> tf.Tensor:
    """``[B]`` bool: records whose squared norm (every leaf) and loss (if given) are finite.

    ``losses`` may be ``[B]`` or ``[B, k]`` (e.g. the slots of a microbatch: all must be finite).
    """
    leaves = [tf.cast(s, tf.float32) for s in tf.nest.flatten(squared_norms)]
    keep = tf.math.is_finite(tf.add_n(leaves))  # NaN or inf in any leaf makes the sum non-finite
    if losses is not None:
        lf = tf.math.is_finite(tf.cast(losses, tf.float32))
        if lf.shape.rank is not None and lf.shape.rank > 1:
            lf = tf.reduce_all(tf.reshape(lf, [tf.shape(lf)[0], -1]), axis=1)
        keep = tf.logical_and(keep, lf)
    return keep


def record_weights(query, params, squared_norms: Any, losses: Any = None, keep: Any = None):
    """The query's clip weights, with weight exactly 0 for every non-finite record.

    A record whose loss or squared norm (in any leaf) is NaN or inf gets weight 0 in every leaf,
    whatever the query's own rule does with a non-finite norm. ``keep`` (``[B]`` bool), if given,
    further restricts the records kept. Returns ``(weights, keep)``.
    """
    finite = finite_records(squared_norms, losses)
    keep = finite if keep is None else tf.logical_and(finite, keep)
    # the query never sees a non-finite norm: a NaN could break rules that compare norms
    safe = tf.nest.map_structure(
        lambda s: tf.where(keep, s, tf.zeros_like(s)), squared_norms
    )
    weights = query.clip_weights(params, safe)
    weights = tf.nest.map_structure(
        lambda w: tf.where(keep, w, tf.zeros_like(w)), weights
    )
    return weights, keep


def fill_rows(data: Any, replace: tf.Tensor, source: tf.Tensor) -> tuple[Any, tf.Tensor]:
    """Replaces the rows where ``replace`` is True by a copy of the first row where ``source`` is.

    For a backward pass shared by several records: a record that must contribute nothing is
    swapped for a copy of a record that gives finite values, and is given weight 0 by the caller
    (its contribution is then ``0 * finite = 0``). ``data`` is any structure of ``[B, ...]``
    tensors (``None`` leaves stay ``None``). Without any source row, rows are left as they are
    (the caller must discard the result). Returns ``(data, has_source)``.
    """
    b = tf.shape(replace)[0]
    has_source = tf.reduce_any(source)
    first = tf.cast(tf.argmax(tf.cast(source, tf.int32)), tf.int32)
    rows = tf.range(b)
    index = tf.where(tf.logical_and(replace, has_source), tf.fill([b], first), rows)

    def take(t):
        return None if t is None else tf.gather(t, index)

    return tf.nest.map_structure(take, data), has_source


def finite_rows(x: Any) -> tf.Tensor:
    """``[B]`` bool: rows of ``x`` whose floating-point features are all finite."""
    leaves = tf.nest.flatten(x)
    keep = tf.ones([tf.shape(leaves[0])[0]], tf.bool)
    for t in leaves:
        t = tf.convert_to_tensor(t)
        if t.dtype.is_floating:
            f = tf.math.is_finite(t)
            keep = tf.logical_and(keep, tf.reduce_all(tf.reshape(f, [tf.shape(f)[0], -1]), 1))
    return keep


def fill_padding_rows(data: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
    """Rows of sample weight 0 (e.g. the zero rows that pad Poisson batches) as copies of a real row.

    A row of zeros need not be a valid input (e.g. a sequence of padding tokens only: a masked
    mean over no time step is ``0/0``); its weight of 0 does not stop its NaN from reaching a
    backward pass or a loss metric, since ``0 * NaN`` is NaN. A copy of a real row (the first of
    non-zero weight with finite features) computes finite values, and its weight 0 still makes
    its contribution exactly 0. Metrics already leave rows of weight 0 out.
    """
    x, y, sw = data
    leaves = [tf.convert_to_tensor(w) for w in tf.nest.flatten(sw) if w is not None]
    if not leaves:
        return data
    # a row is padding when every weight it has (one per output, for per-output weights) is 0
    pad = None
    for w in leaves:
        zero = tf.reduce_all(tf.equal(tf.reshape(w, [tf.shape(w)[0], -1]), 0), axis=1)
        pad = zero if pad is None else tf.logical_and(pad, zero)
    source = tf.logical_and(tf.logical_not(pad), finite_rows(x))
    (x, y), _ = fill_rows((x, y), pad, source)
    return x, y, sw


def real_records(sample_weight: Any, batch: Any) -> tf.Tensor:
    """``[B]`` bool: rows with a non-zero sample weight (every weight, for per-output weights);
    all rows when ``sample_weight`` is None."""
    leaves = [tf.convert_to_tensor(w) for w in tf.nest.flatten(sample_weight) if w is not None]
    if not leaves:
        return tf.ones([batch], tf.bool)
    real = None
    for w in leaves:
        nz = tf.reduce_any(tf.not_equal(tf.reshape(w, [tf.shape(w)[0], -1]), 0), axis=1)
        real = nz if real is None else tf.logical_or(real, nz)
    return real


#: Constants folded into ``noise_seed`` for each kind of public randomness a clipper draws, so
#: that no two kinds (nor the DP noise, from its own generator) share a stream.
MICROBATCH_STREAM = 0x6D62  # "mb"
JL_STREAM = 0x6A6C  # "jl"


def step_seed(seed: int, stream: int, step: Any) -> tf.Tensor:
    """The stateless seed (``int64 [2]``) of a clipper's public randomness at ``step``.

    A function of ``(seed, stream, step)`` and, under ``tf.distribute`` with several replicas,
    of the replica id (each replica draws its own). For ``tf.random.stateless_*`` ops with
    ``alg="philox"`` (``"auto_select"`` picks another algorithm under XLA) and
    :func:`tf_dp.dp_query.noise.stateless_gaussian_noise`: the draws of a seeded run are the same
    in every process, eagerly, in a ``tf.function`` and under XLA.

    Example::

        ids = tf.random.stateless_uniform(
            [8], step_seed(7, MICROBATCH_STREAM, 3), minval=0, maxval=4, dtype=tf.int32,
            alg="philox")
    """
    fold = tf.random.experimental.stateless_fold_in
    key = fold(tf.constant([seed, stream], tf.int64), tf.cast(step, tf.int64), alg="philox")
    ctx = tf.distribute.get_replica_context() if tf.distribute.has_strategy() else None
    if ctx is not None and ctx.num_replicas_in_sync > 1:
        key = fold(key, tf.cast(ctx.replica_id_in_sync_group, tf.int64), alg="philox")
    return key


def global_norms(squared_norms: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.sqrt(tf.add_n([tf.cast(s, tf.float32) for s in squared_norms]))


def check_weights_structure(query, variables) -> None:
    if not query.supports_norm_clipping:
        raise TypeError(
            f"the gradient clipper needs a query with a norm-based clipping rule, but "
            f"{type(query).__name__} has none"
        )


class GradientClipper(abc.ABC):
    """Computes the clipped sum of per-record gradients. See the module docstring."""

    #: registry name (``gradient_mode``)
    name: str = ""
    #: exact clippers give the same clipped sum as per-example clipping
    exact: bool = True
    #: strategies that read the model's layers (ghost) take it as ``clipped_sum(..., model=)``
    needs_model: bool = False
    #: clippers that draw public randomness (microbatch assignment, JL directions) take the
    #: step's number as ``clipped_sum(..., step=)``: with a seed, their draws are keyed by it
    needs_step: bool = False

    @abc.abstractmethod
    def clipped_sum(
        self,
        loss_fn: LossFn,
        data: tuple[Any, Any, Any],
        variables: Sequence[Any],
        query: Any,
        params: Any,
    ) -> ClippedGradients:
        ...

    def supports(self, model: Optional[Any]) -> Optional[str]:
        """``None`` if the clipper supports ``model``; otherwise the reason it does not."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def vectorized_map_blocker(model: Optional[Any]) -> Optional[str]:
    """Why ``tf.vectorized_map`` cannot take per-example gradients of ``model`` (or None).

    On TF 2.21, vectorising the gradient of an ``EinsumDense`` whose kernel has rank >= 3 (every
    ``MultiHeadAttention`` has some) kills the process with a segmentation fault inside
    TensorFlow, so the clippers built on it refuse such models up front (each clipper adds
    what to use instead), and every fallback that would vectorise such a model or layer (the ghost
    clipper's per-layer and whole-model fallbacks, :func:`~tf_dp.gradients.vectorized.map_records`)
    computes the per-example gradients in a loop over the examples instead. ``model`` may be a
    model or a single layer (the layer itself is checked too).
    """
    if model is None:
        return None
    import keras  # local: the gradients layer does not otherwise need Keras

    layers = [model] + list(_compat.flatten_layers(model, include_self=False) or [])
    for layer in layers:
        kernel = getattr(layer, "kernel", None)
        if isinstance(layer, keras.layers.EinsumDense) and kernel is not None and len(
            kernel.shape
        ) >= 3:
            return (
                f"layer {layer.name!r} (EinsumDense with a rank-{len(kernel.shape)} kernel, e.g. "
                "inside MultiHeadAttention) crashes TensorFlow's vectorized_map (segmentation "
                "fault in TF 2.21)"
            )
    return None


def batch_size_of(x: Any) -> tf.Tensor:
    first = tf.nest.flatten(x)[0]
    return tf.shape(first)[0]
