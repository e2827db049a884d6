"""Microbatched gradients: clip the mean gradient of each microbatch instead of each example.

The batch of ``B`` examples is split into ``num_microbatches`` (``M``) groups of
``ceil(B / M)`` consecutive examples (the last groups may be shorter or empty when ``M`` does not
divide ``B``; missing places are padded with zero-weight examples). Each microbatch's gradient is
the mean gradient of its real examples; it is clipped by the query's rule and the clipped
microbatch gradients are summed.

Sensitivity (recorded in the ledger): with one example per microbatch, adding or removing an
example changes one clipped record, sensitivity ``C``. With several examples per microbatch,
adding/removing one example can change one microbatch's clipped mean into any other vector of norm
``<= C``: sensitivity ``2C``. The multiplier is decided per step from the actual microbatch size.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_dp.gradients import base
from tf_dp.gradients.vectorized import fast_pfor_converters


class MicrobatchStrategy(base.GradientStrategy):
    """Per-microbatch gradients (vectorized over microbatches) clipped by the query's rule.

    Args:
      num_microbatches: ``M`` >= 1.

    Example::

        strategy = tf_dp.gradients.MicrobatchStrategy(num_microbatches=32)
    """

    name = "microbatch"

    def supports(self, model):
        return base.vectorized_map_blocker(model)

    def __init__(self, num_microbatches: int):
        if isinstance(num_microbatches, bool) or not isinstance(num_microbatches, int) or (
            num_microbatches < 1
        ):
            raise ValueError(f"num_microbatches must be an integer >= 1, got {num_microbatches!r}")
        self.num_microbatches = num_microbatches

    def clipped_sum(self, loss_fn, data, variables, query, params) -> base.ClippedGradients:
        x, y, sw = data
        m = self.num_microbatches
        b = base.batch_size_of(x)
        size = (b + m - 1) // m  # examples per microbatch
        pad = size * m - b
        real = tf.concat([tf.ones([b], tf.float32), tf.zeros([pad], tf.float32)], 0)
        if sw is not None:
            weight = tf.concat([tf.cast(tf.reshape(sw, [b]), tf.float32), tf.zeros([pad])], 0)
        else:
            weight = real

        def split(t):
            if t is None:
                return None
            padded = tf.concat([t, tf.zeros(tf.concat([[pad], tf.shape(t)[1:]], 0), t.dtype)], 0)
            return tf.reshape(padded, tf.concat([[m, size], tf.shape(t)[1:]], 0))

        xs = tf.nest.map_structure(split, x)
        ys = tf.nest.map_structure(split, y)
        ws = tf.reshape(weight, [m, size])
        # A microbatch's mean is over its rows of non-zero weight: padding rows (ours, or the
        # zero-weight rows of Poisson batches) do not dilute it. Clipping bounds the record either
        # way, so the count does not affect the sensitivity.
        counts = tf.reduce_sum(tf.cast(tf.not_equal(ws, 0.0), tf.float32), axis=1)
        tf_vars = base.as_tf_variables(variables)

        def one(mb):
            mx, my, mw, count = mb
            with tf.GradientTape() as tape:
                losses, y_pred = loss_fn(mx, my, mw)
                loss = tf.math.divide_no_nan(tf.reduce_sum(losses), count)
            grads = tape.gradient(loss, tf_vars, unconnected_gradients="zero")
            return [tf.convert_to_tensor(g) for g in grads], y_pred, losses

        with fast_pfor_converters():
            per_mb, y_pred, losses = tf.vectorized_map(
                one, (xs, ys, ws, counts), fallback_to_while_loop=True
            )
        sq = base.squared_norms_of(per_mb)
        weights = query.clip_weights(params, sq)
        clipped = [base.weighted_sum(w, g) for w, g in zip(weights, per_mb)]
        y_pred = tf.nest.map_structure(
            lambda t: tf.reshape(t, tf.concat([[m * size], tf.shape(t)[2:]], 0))[:b], y_pred
        )
        losses = tf.reshape(losses, [m * size])[:b]
        multiplier = tf.where(size > 1, 2.0, 1.0)
        return base.ClippedGradients(
            clipped_sum=clipped,
            norms=base.global_norms(sq),
            num_records=tf.constant(m),
            sensitivity_multiplier=multiplier,
            y_pred=y_pred,
            losses=losses,
        )
