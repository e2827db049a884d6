"""Norm rules for activation layers with weights.

- ``PReLU``: ``y = max(x, 0) + alpha * min(x, 0)``, ``alpha`` of the input's shape without the
  batch, size 1 on ``shared_axes``. Example ``b``'s gradient of ``alpha`` is
  ``min(x_b, 0) * g_b`` summed over the shared axes, materialised per example
  (:class:`~tf_dp.gradients.ghost.factors.PerExample`: ``alpha`` has at most the size of one
  example's input).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.gradients.ghost.common import f32, plain
from tf_dp.gradients.ghost.factors import PerExample
from tf_dp.gradients.ghost.registry import norm_rule


@norm_rule(keras.layers.PReLU, supports=plain)
def prelu_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    shared = [i for i, n in enumerate(layer.alpha.shape, start=1) if n == 1]
    per_example = tf.minimum(x, 0.0) * g
    if shared:
        per_example = tf.reduce_sum(per_example, axis=shared, keepdims=True)
    return [(layer.alpha, PerExample(per_example))]
