"""Vectorized per-example gradients: ``tf.vectorized_map`` of a per-example gradient.

Each example's gradient is computed by running the model on a batch of one inside
``tf.vectorized_map`` (which auto-vectorises the per-example computation), then every example's
gradient is weighted by the query's clipping rule and summed. Exact, works for most models; memory
grows with ``batch_size * num_parameters``.
"""

from __future__ import annotations

from typing import Any, Sequence

import tensorflow as tf

from tf_dp.gradients import base


def _expand(t: Any) -> Any:
    return None if t is None else tf.expand_dims(t, 0)


class VectorizedStrategy(base.GradientStrategy):
    """Per-example gradients with ``tf.vectorized_map``; clipping by the query's rule.

    Example::

        strategy = tf_dp.gradients.VectorizedStrategy()
        out = strategy.clipped_sum(loss_fn, (x, y, None), model.trainable_variables, query, params)
    """

    name = "vectorized"

    def __init__(self, fallback_to_while_loop: bool = True):
        self._fallback = fallback_to_while_loop

    def per_example_gradients(self, loss_fn, data, variables: Sequence[Any]):
        x, y, sw = data
        tf_vars = base.as_tf_variables(variables)

        def one(example):
            ex_x, ex_y, ex_sw = example if sw is not None else (*example, None)
            with tf.GradientTape() as tape:
                loss, y_pred = loss_fn(
                    tf.nest.map_structure(_expand, ex_x),
                    tf.nest.map_structure(_expand, ex_y),
                    _expand(ex_sw),
                )
                loss = tf.reduce_sum(loss)
            grads = tape.gradient(loss, tf_vars, unconnected_gradients="zero")
            grads = [tf.convert_to_tensor(g) for g in grads]
            y_pred = tf.nest.map_structure(lambda t: t[0], y_pred)
            return grads, y_pred, loss

        elems = (x, y) if sw is None else (x, y, sw)
        return tf.vectorized_map(one, elems, fallback_to_while_loop=self._fallback)

    def clipped_sum(self, loss_fn, data, variables, query, params) -> base.ClippedGradients:
        per_example, y_pred, losses = self.per_example_gradients(loss_fn, data, variables)
        sq = base.squared_norms_of(per_example)
        weights = query.clip_weights(params, sq)
        clipped = [base.weighted_sum(w, g) for w, g in zip(weights, per_example)]
        return base.ClippedGradients(
            clipped_sum=clipped,
            norms=base.global_norms(sq),
            num_records=base.batch_size_of(data[0]),
            sensitivity_multiplier=1.0,
            y_pred=y_pred,
            losses=losses,
        )
