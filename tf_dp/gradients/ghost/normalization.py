"""Norm rules for RMS normalisation layers.

- ``keras.layers.RMSNormalization``: ``y = x / sqrt(mean(x^2, axis) + eps) * scale``;
- keras-hub's Gemma ``RMSNormalization`` (``keras_hub.src.models.gemma``):
  ``y = x / sqrt(mean(x^2, -1) + eps) * (1 + scale)``.

In both, ``dy/dscale = xhat`` elementwise (``xhat`` the normalised input), so the per-example
gradient of ``scale`` is ``g * xhat`` summed over the axes ``scale`` is broadcast along: a small
:class:`PerExample` factor (``[B, *scale.shape]``).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.gradients.ghost.factors import PerExample


def _f32(t):
    t = tf.convert_to_tensor(t)
    return t if t.dtype in (tf.float32, tf.float64) else tf.cast(t, tf.float32)


def _scale_factor(layer, x, g, axes, epsilon):
    rank = x.shape.rank
    axes = sorted(a % rank for a in axes)
    xhat = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=axes, keepdims=True) + epsilon)
    reduce_axes = [a for a in range(1, rank) if a not in axes]
    per_ex = g * xhat
    if reduce_axes:
        per_ex = tf.reduce_sum(per_ex, axis=reduce_axes)
    return [(layer.scale, PerExample(tf.reshape(per_ex, [tf.shape(g)[0]] + list(layer.scale.shape))))]


def rms_normalization_rule(layer, inputs, grad_output):
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    eps = layer.epsilon if layer.epsilon is not None else keras.config.epsilon()
    return _scale_factor(layer, _f32(inputs), _f32(grad_output), axes, eps)


def gemma_rms_normalization_rule(layer, inputs, grad_output):
    return _scale_factor(layer, _f32(inputs), _f32(grad_output), [-1], layer.epsilon)


def register() -> None:
    from tf_dp.gradients.ghost.rules import register_layer_norm_rule

    rms = getattr(keras.layers, "RMSNormalization", None)
    if rms is not None:
        register_layer_norm_rule(rms, rms_normalization_rule)


def register_keras_hub() -> None:
    from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

    from tf_dp.gradients.ghost.rules import register_layer_norm_rule

    register_layer_norm_rule(RMSNormalization, gemma_rms_normalization_rule)
