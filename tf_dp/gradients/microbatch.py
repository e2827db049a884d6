"""Microbatched gradients: clip the mean gradient of each microbatch instead of each example.

Every example of the batch is assigned to one of ``num_microbatches`` (``M``) microbatches
*independently and uniformly at random*: from an OS-entropy-keyed Philox generator, or, with a
``seed`` and the step's number (what the DP optimizers pass with ``noise_seed``), from a
stateless draw keyed by ``(seed, step, replica)`` (:func:`tf_dp.gradients.base.step_seed`), the
same in every process. Each microbatch's gradient is the mean gradient of its examples of
non-zero weight (an empty microbatch contributes zero); it is clipped by the query's rule and the
clipped microbatch gradients are summed.

Why random, not consecutive slices: with consecutive slices, adding one example to the batch
shifts every later example into the next microbatch, so *every* later microbatch changes and the
L2 sensitivity is not ``2C`` but up to ``2C`` per microbatch. With independent assignment, the
other examples' microbatches do not depend on the added or removed example (couple the two runs
on the same assignment), so exactly one microbatch's clipped mean changes, by at most ``2C``.

Sensitivity recorded in the ledger: ``2C`` (a microbatch of the neighbouring batch may hold
several examples, whatever the sizes in this batch). For ``C``, clip every example on its own
(``num_microbatches=None``).

Slots that hold no example of the microbatch -- the empty slots of a microbatch smaller than the
largest one, and rows of sample weight 0 such as Poisson padding -- are computed as copies of a
real example of the *same* microbatch, with weight 0: a row of zeros need not be a valid input
(a sequence of padding tokens only gives a masked mean of ``0/0`` = NaN), and since the examples of
a microbatch share one backward pass, ``0 * NaN`` would make the whole microbatch's gradient NaN.

Non-finite records: an example whose loss is NaN or inf is left out of its microbatch (the
microbatch's backward pass is re-run without it, in steps that have such an example): the
microbatch's mean is over its other examples. A microbatch whose mean gradient is still not
finite (e.g. a finite loss with a non-finite gradient), or that holds no example, gets clip weight
0 and adds exactly 0 to the clipped sum (selected out, not multiplied by 0).
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.dp_query.xla import in_xla_context
from tf_dp.dp_query.noise import make_generator
from tf_dp.gradients import base
from tf_dp.gradients.vectorized import map_records


class MicrobatchClipper(base.GradientClipper):
    """Per-microbatch gradients (vectorized over microbatches) clipped by the query's rule.

    Args:
      num_microbatches: ``M`` >= 1.
      seed: tests and debugging only. With the step's number (``clipped_sum(..., step=)``) the
        assignment is a function of ``(seed, step)`` (and the replica under ``tf.distribute``);
        without a step it comes from a Philox generator seeded with ``seed``. ``None``: a
        generator keyed from OS entropy.

    Example::

        clipper = tf_dp.gradients.MicrobatchClipper(num_microbatches=32)
    """

    name = "microbatch"
    needs_step = True

    def supports(self, model):
        reason = base.vectorized_map_blocker(model)
        if reason is None:
            return None
        return (
            reason + "; microbatch gradients are computed with vectorized_map: leave "
            "num_microbatches unset and use gradient_mode='ghost' or 'auto', which cover it"
        )

    def __init__(self, num_microbatches: int, seed: Optional[int] = None):
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
            num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, (int, np.integer))
        ):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        self.num_microbatches = num_microbatches
        self._seed = None if seed is None else int(seed)
        self._generator: Optional[tf.random.Generator] = None

    def assignment(self, batch_size: Any, step: Any = None) -> tf.Tensor:
        """Draws the microbatch of each of ``batch_size`` examples: int32 ``[batch_size]`` in
        ``[0, M)``, independent and uniform (keyed by ``(seed, step)`` when both are given)."""
        if self._seed is not None and step is not None:
            seed = base.step_seed(self._seed, base.MICROBATCH_STREAM, step)
            return tf.random.stateless_uniform(
                [batch_size], seed, minval=0, maxval=self.num_microbatches, dtype=tf.int32,
                alg="philox",
            )
        if self._generator is None:
            self._generator = make_generator(self._seed)
        return self._generator.uniform(
            [batch_size], minval=0, maxval=self.num_microbatches, dtype=tf.int32
        )

    def layout(self, ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        """``(index [M, cap], position [B])``: ``index[j, k]`` is the example in slot ``k`` of
        microbatch ``j`` (``B`` for an empty slot); ``position[i]`` is example ``i``'s slot."""
        m = self.num_microbatches
        b = tf.shape(ids)[0]
        counts = tf.reduce_sum(tf.one_hot(ids, m, dtype=tf.int32), axis=0)
        if in_xla_context():  # XLA needs a static shape: room for the whole batch in each
            cap = tf.maximum(b, 1)
        else:
            cap = tf.maximum(tf.reduce_max(counts), 1)
        order = tf.argsort(ids, stable=True)
        starts = tf.cumsum(counts, exclusive=True)
        slot_sorted = tf.range(b) - tf.gather(starts, tf.gather(ids, order))
        position = tf.scatter_nd(order[:, None], slot_sorted, [b])
        index = tf.tensor_scatter_nd_update(
            tf.fill([m, cap], b), tf.stack([ids, position], axis=1), tf.range(b)
        )
        return index, position

    def _gradients(self, loss_fn, x, y, weight, index, tf_vars):
        """Per-microbatch mean gradients for the rows of non-zero ``weight`` (``[B]``).

        Returns ``(grads [M, ...] per variable, y_pred [M, cap, ...], losses [M, cap], counts [M])``.
        """
        padded_w = tf.concat([weight, tf.zeros([1], weight.dtype)], 0)
        ws = tf.gather(padded_w, index)  # [M, cap]; empty slots get weight 0
        real = tf.not_equal(ws, 0.0)
        # A microbatch's mean is over its rows of non-zero weight: empty slots and zero-weight
        # rows (e.g. Poisson padding) do not dilute it. Clipping bounds the record either way, so
        # the count does not affect the sensitivity.
        counts = tf.reduce_sum(tf.cast(real, tf.float32), axis=1)
        # Every other slot reads the microbatch's first real row (weight 0, so it adds 0 * a
        # finite gradient); a microbatch with no real row keeps its slots and gets weight 0.
        first = tf.argmax(tf.cast(real, tf.int32), axis=1, output_type=tf.int32)
        filler = tf.gather(index, first, batch_dims=1)  # [M]
        slot_index = tf.where(real, index, filler[:, None])

        def group(t):
            if t is None:
                return None
            padded = tf.concat([t, tf.zeros(tf.concat([[1], tf.shape(t)[1:]], 0), t.dtype)], 0)
            return tf.gather(padded, slot_index)  # [M, cap, ...]

        xs = tf.nest.map_structure(group, x)
        ys = tf.nest.map_structure(group, y)

        def one(mb):
            mx, my, mw, count = mb
            with tf.GradientTape() as tape:
                losses, y_pred = loss_fn(mx, my, mw)
                loss = tf.math.divide_no_nan(tf.reduce_sum(losses), count)
            grads = tape.gradient(loss, tf_vars, unconnected_gradients="zero")
            return [tf.convert_to_tensor(g) for g in grads], y_pred, losses

        per_mb, y_pred, losses = map_records(
            one, (xs, ys, ws, counts), getattr(loss_fn, "model", None), what="microbatch"
        )
        return per_mb, y_pred, losses, counts

    def clipped_sum(
        self, loss_fn, data, variables, query, params, step: Any = None
    ) -> base.ClippedGradients:
        data = base.fill_padding_rows(data)  # finite predictions and losses for metrics
        x, y, sw = data
        m = self.num_microbatches
        b = base.batch_size_of(x)
        ids = self.assignment(b, step)
        index, position = self.layout(ids)
        if sw is not None:
            weight = tf.cast(tf.reshape(sw, [b]), tf.float32)
        else:
            weight = tf.ones([b], tf.float32)
        tf_vars = base.as_tf_variables(variables)
        per_mb, y_pred, losses, counts = self._gradients(loss_fn, x, y, weight, index, tf_vars)
        slots = tf.stack([ids, position], axis=1)  # back to the batch's order
        y_pred = tf.nest.map_structure(lambda t: tf.gather_nd(t, slots), y_pred)
        losses = tf.gather_nd(losses, slots)

        # Examples with a non-finite loss: their NaN reached their microbatch's shared backward
        # pass. Re-run those passes without them (only in steps that have one).
        # An input feature that is not finite can give a finite loss and a non-finite gradient
        # (e.g. tanh saturates): such examples are left out too.
        finite = tf.logical_and(tf.math.is_finite(losses), base.finite_rows(x))
        bad = tf.logical_and(tf.not_equal(weight, 0.0), tf.logical_not(finite))

        def without_bad():
            w = tf.where(bad, tf.zeros_like(weight), weight)
            grads, _, _, c = self._gradients(loss_fn, x, y, w, index, tf_vars)
            return grads, c

        per_mb, counts = tf.cond(
            tf.reduce_any(bad), without_bad, lambda: ([tf.identity(g) for g in per_mb], counts)
        )
        sq = base.squared_norms_of(per_mb)
        weights, _ = base.record_weights(query, params, sq, keep=tf.greater(counts, 0))
        clipped = base.weighted_sums(weights, per_mb)
        multiplier = 2.0
        return base.ClippedGradients(
            clipped_sum=clipped,
            norms=base.global_norms(sq),
            num_records=tf.constant(m),
            sensitivity_multiplier=multiplier,
            record_mask=tf.greater(counts, 0),  # empty microbatches are not records
            y_pred=y_pred,
            losses=losses,
        )
