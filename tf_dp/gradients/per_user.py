"""User-level clipping: the sum of each user's per-example gradients is clipped to ``C``.

A user-level batch (:mod:`tf_dp.data.users`) has ``U * k`` rows in ``U`` slots of ``k``
consecutive rows: rows ``j k .. j k + k - 1`` are user slot ``j``'s records (rows of sample weight
0 pad a slot, add nothing and are inert). :class:`PerUserClipper` wraps a gradient clipper so
that its clipped record is a user's *summed* gradient ``G_j = sum_{i in slot j} g_i``: the
query's clipping rule weighs ``G_j`` by its own norms (``min(1, C / ||G_j||)`` for a Gaussian
sum query; per layer for nested queries), and the clipped sum is ``sum_j w_j G_j``. Adding or
removing one user changes that sum by one clipped ``G_j``: sensitivity ``C`` under add/remove-one-
user adjacency, whatever ``k``.

How each mode computes ``G_j``:

- ``vectorized``: the per-example gradients of the batch (``tf.vectorized_map``), summed over each
  slot (a reshape to ``[U, k, ...]`` and a sum).
- ``ghost``: no per-example gradients; each layer's gradient factors are regrouped by slot
  (:func:`tf_dp.gradients.ghost.factors.group`: the ``k`` records of a slot become one record with
  ``k`` times the terms), so the ghost norm and the book-kept sum are the user's.
- ``microbatch``: one backward pass per user (the gradient of the user's summed loss), vectorized
  over users; ``num_microbatches`` is not used (the users are the groups), and the sensitivity is
  ``C``, not the ``2C`` of random microbatches.

``max_physical_batch_size`` (vectorized, ghost) splits the batch in pieces of whole slots (the
piece size is rounded down to a multiple of ``k``, at least ``k``). A user with a non-finite loss
or gradient in any record gets weight 0 and adds exactly 0. The outputs are per row, as for
example-level strategies: ``norms[r]`` is the norm of row ``r``'s user and ``record_mask`` marks
the first row of each non-empty slot, so queries that count records count users. JL is refused
(its estimate is per example).

Example::

    clipper = PerUserClipper(tf_dp.gradients.VectorizedClipper(), records_per_user=4)
    out = clipper.clipped_sum(loss_fn, (x, y, sample_weight), variables, query, params)
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_dp.gradients import base
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.gradients.vectorized import map_records

#: The gradient-clipper base class (``GradientClipper``; ``GradientStrategy`` in older trees).
_Clipper = getattr(base, "GradientClipper", None) or base.GradientStrategy


def _group_sum(t: tf.Tensor, k: int) -> tf.Tensor:
    """``[U k, ...] -> [U, ...]``: the sum over each slot of ``k`` rows."""
    return tf.reduce_sum(tf.reshape(t, tf.concat([[-1, k], tf.shape(t)[1:]], 0)), axis=1)


def _slots(t: Any, k: int) -> Any:
    """``[U k, ...] -> [U, k, ...]`` for every leaf (None stays None)."""
    def split(a):
        if a is None:
            return None
        a = tf.convert_to_tensor(a)
        out = tf.reshape(a, tf.concat([[-1, k], tf.shape(a)[1:]], 0))
        out.set_shape([None, k] + a.shape[1:].as_list())
        return out

    return tf.nest.map_structure(split, t)


def _unslot(t: Any) -> Any:
    """``[U, k, ...] -> [U k, ...]`` for every leaf."""
    def join(a):
        out = tf.reshape(a, tf.concat([[-1], tf.shape(a)[2:]], 0))
        out.set_shape([None] + a.shape[2:].as_list())
        return out

    return tf.nest.map_structure(join, t)


class PerUserClipper(_Clipper):
    """Clips the summed gradient of each user slot of ``records_per_user`` consecutive rows.

    Args:
      inner: the ``vectorized``, ``ghost`` or ``microbatch`` clipper, or
        :class:`~tf_dp.gradients.physical_batches.PhysicalBatches` of one (pieces of whole user
        slots: the piece size is rounded down to a multiple of ``k``, at least ``k``).
      records_per_user: ``k``, rows per user slot (an integer >= 1).

    See the module docstring for the batch layout and what each mode computes.

    Example::

        clipper = PerUserClipper(make_clipper("ghost", model=model), records_per_user=4)
    """

    def __init__(self, inner: _Clipper, records_per_user: int):
        slots = _Slots(getattr(inner, "inner", inner), records_per_user)
        if isinstance(inner, PhysicalBatches):
            k = records_per_user
            size = max(k, inner.max_physical_batch_size // k * k)
            self._pieces: _Clipper = PhysicalBatches(slots, size)
        else:
            self._pieces = slots
        self.inner = inner
        self.records_per_user = records_per_user
        self.name = inner.name
        self.exact = True

    @property
    def description(self) -> str:
        inner = getattr(self.inner, "description", None) or self.inner.name
        return f"{inner}, per user (at most {self.records_per_user} records per user)"

    def supports(self, model):
        return self.inner.supports(model)

    @property
    def needs_model(self) -> bool:
        return bool(getattr(self.inner, "needs_model", False))

    def __repr__(self) -> str:
        return f"PerUserClipper({self.inner!r}, records_per_user={self.records_per_user})"

    def clipped_sum(
        self, loss_fn, data, variables, query, params, model=None
    ) -> base.ClippedGradients:
        extra = {"model": model} if model is not None and self.needs_model else {}
        out = self._pieces.clipped_sum(loss_fn, data, variables, query, params, **extra)
        out.num_records = tf.reduce_sum(tf.cast(out.record_mask, tf.int32))  # non-empty users
        return out


class _Slots(_Clipper):
    """The per-user clipped sum of a whole batch (or of a piece of whole slots)."""

    def __init__(self, inner: _Clipper, records_per_user: int):
        if isinstance(records_per_user, bool) or not isinstance(records_per_user, int) or (
            records_per_user < 1
        ):
            raise ValueError(
                f"records_per_user must be an integer >= 1, got {records_per_user!r}"
            )
        if inner.name not in ("vectorized", "ghost", "microbatch"):
            raise ValueError(
                "user-level clipping needs gradient_mode 'vectorized', 'ghost', 'microbatch' or "
                f"'auto' (a user's summed gradient must be clipped exactly); got {inner.name!r}"
            )
        self.inner = inner
        self.records_per_user = records_per_user
        self.name = inner.name
        self.exact = True
        self.needs_model = bool(getattr(inner, "needs_model", False))

    def clipped_sum(
        self, loss_fn, data, variables, query, params, model=None
    ) -> base.ClippedGradients:
        k = self.records_per_user
        static_b = tf.nest.flatten(data[0])[0].shape[0]
        if static_b is not None and static_b % k:
            raise ValueError(
                f"a user-level batch has user slots of k={k} rows, got a batch of {static_b} rows "
                "(build it with tf_dp.data.poisson_batches(..., user_ids=..., "
                "max_records_per_user=k))"
            )
        if self.inner.name == "ghost":
            out = self.inner.grouped_clipped_sum(
                loss_fn, data, variables, query, params, k, model=model
            )
        elif self.inner.name == "vectorized":
            out = self._vectorized(loss_fn, data, variables, query, params)
        else:
            out = self._per_user_backward(loss_fn, data, variables, query, params, model)
        # per-row outputs: each row carries its user's norm; one row per non-empty slot is a record
        norms = tf.repeat(tf.cast(out.norms, tf.float32), k)
        first = tf.concat([[True], tf.zeros([k - 1], tf.bool)], 0)
        mask = tf.logical_and(
            tf.repeat(out.record_mask, k), tf.tile(first, [tf.size(out.record_mask)])
        )
        out.norms, out.record_mask = norms, mask
        out.num_records = tf.shape(mask)[0]  # rows, as PhysicalBatches counts them
        out.sensitivity_multiplier = 1.0
        return out

    def _vectorized(self, loss_fn, data, variables, query, params) -> base.ClippedGradients:
        k = self.records_per_user
        data = base.fill_padding_rows(data)
        x, y, sw = data
        b = base.batch_size_of(x)
        per_example, y_pred, losses = self.inner.per_example_gradients(loss_fn, data, variables)
        per_user = [_group_sum(g, k) for g in per_example]
        sq = base.squared_norms_of(per_user)
        weights, _ = base.record_weights(query, params, sq, tf.reshape(losses, [-1, k]))
        clipped = base.weighted_sums(weights, per_user)
        real = tf.reduce_any(tf.reshape(base.real_records(sw, b), [-1, k]), axis=1)
        return base.ClippedGradients(
            clipped_sum=clipped, norms=base.global_norms(sq), num_records=b // k,
            record_mask=real, y_pred=y_pred, losses=losses,
        )

    def _per_user_backward(self, loss_fn, data, variables, query, params, model=None):
        k = self.records_per_user
        data = base.fill_padding_rows(data)
        x, y, sw = data
        b = base.batch_size_of(x)
        weight = (
            tf.ones([b], tf.float32) if sw is None else tf.cast(tf.reshape(sw, [b]), tf.float32)
        )
        tf_vars = base.as_tf_variables(variables)

        def one(user):
            ux, uy, uw = user
            with tf.GradientTape() as tape:
                losses, y_pred = loss_fn(ux, uy, uw)
                total = tf.reduce_sum(losses)
            grads = tape.gradient(total, tf_vars, unconnected_gradients="zero")
            return [tf.convert_to_tensor(g) for g in grads], y_pred, losses

        per_user, y_pred, losses = map_records(
            one, (_slots(x, k), _slots(y, k), _slots(weight, k)),
            model if model is not None else getattr(loss_fn, "model", None), what="user",
        )
        sq = base.squared_norms_of(per_user)
        real = tf.reduce_any(tf.not_equal(tf.reshape(weight, [-1, k]), 0), axis=1)
        weights, _ = base.record_weights(query, params, sq, losses, keep=real)
        clipped = base.weighted_sums(weights, per_user)
        return base.ClippedGradients(
            clipped_sum=clipped, norms=base.global_norms(sq), num_records=b // k,
            record_mask=real, y_pred=_unslot(y_pred), losses=_unslot(losses),
        )


def for_users(clipper: _Clipper, records_per_user: int) -> _Clipper:
    """``clipper`` made user-level (:class:`PerUserClipper`).

    Example::

        clipper = for_users(optimizer.clipper_for(model), 4)
    """
    return PerUserClipper(clipper, records_per_user)
