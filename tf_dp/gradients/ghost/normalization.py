"""Norm rules for normalisation layers.

- ``keras.layers.LayerNormalization`` and ``keras.layers.GroupNormalization``: the per-example
  gradients of ``gamma`` and ``beta`` are sums of ``g * xhat`` and ``g`` over the other axes;
- ``keras.layers.RMSNormalization``: ``y = x / sqrt(mean(x^2, axis) + eps) * scale``;
- keras-hub's Gemma ``RMSNormalization`` (``keras_hub.src.models.gemma``) and Qwen3.5's
  ``Qwen3_5LayerNorm``: ``y = x / sqrt(mean(x^2, -1) + eps) * (1 + scale)``;
- keras-hub's RMS layer norms ``LlamaLayerNorm``, ``MistralLayerNormalization``,
  ``MixtralLayerNormalization``, ``GptOssLayerNormalization``, ``Phi3LayerNorm``,
  ``QwenLayerNorm``, ``Qwen3LayerNorm`` (``y = x / sqrt(mean(x^2, -1) + eps) * scale``) and
  ``T5LayerNorm`` (the same, its scale named ``weight``).

In both, ``dy/dscale = xhat`` elementwise (``xhat`` the normalised input), so the per-example
gradient of ``scale`` is ``g * xhat`` summed over the axes ``scale`` is broadcast along: a small
:class:`PerExample` factor (``[B, *scale.shape]``).
"""

from __future__ import annotations

import keras
import tensorflow as tf

from tf_dp.gradients.ghost.common import batch_size, f32
from tf_dp.gradients.ghost.factors import PerExample
from tf_dp.gradients.ghost.registry import norm_rule


def _scale_factor(layer, x, g, axes, epsilon, variable=None):
    """``xhat`` normalised over ``axes``; ``scale`` multiplies it by broadcasting, so along the
    trailing ``scale.ndim`` axes whatever ``axes`` are: Keras 3.15's ``ops.rms_normalization``
    does not reshape ``scale`` to ``axes``, so ``RMSNormalization(axis=1)`` on a ``[B, C, H, C]``
    input scales along the last axis (on another shape the call fails). The gradient measured is
    the one applied."""
    rank = x.shape.rank
    axes = sorted(a % rank for a in axes)
    xhat = x * tf.math.rsqrt(tf.reduce_mean(tf.square(x), axis=axes, keepdims=True) + epsilon)
    scale = layer.scale if variable is None else variable
    reduce_axes = list(range(1, rank - len(scale.shape)))
    per_ex = g * xhat
    if reduce_axes:
        per_ex = tf.reduce_sum(per_ex, axis=reduce_axes)
    return [(scale, PerExample(tf.reshape(per_ex, [tf.shape(g)[0]] + list(scale.shape))))]


@norm_rule(getattr(keras.layers, "RMSNormalization", None))
def rms_normalization_rule(layer, inputs, grad_output):
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    eps = layer.epsilon if layer.epsilon is not None else keras.config.epsilon()
    return _scale_factor(layer, f32(inputs), f32(grad_output), axes, eps)


def gemma_rms_normalization_rule(layer, inputs, grad_output):
    return _scale_factor(layer, f32(inputs), f32(grad_output), [-1], layer.epsilon)


def last_axis_rms_norm_rule(layer, inputs, grad_output):
    """keras-hub's RMS layer norms over the last axis, ``x * rsqrt(mean(x^2) + eps) * scale``
    (Llama, Mistral, Mixtral, GPT-OSS, Phi-3, Qwen, Qwen3; T5's scale is named ``weight``). For ``(1 + scale)``
    variants (Gemma, Qwen3.5) the gradient is the same: use :func:`gemma_rms_normalization_rule`.
    """
    variable = getattr(layer, "scale", None)
    if variable is None:
        variable = layer.weight
    return _scale_factor(layer, f32(inputs), f32(grad_output), [-1], layer.epsilon, variable)


def _affine_norm_factors(layer, xhat, g, param_axes, rank, beta_used=True):
    """Per-example gamma/beta gradients: sums of ``g * xhat`` / ``g`` over the other axes."""
    reduce_axes = [a for a in range(1, rank) if a not in param_axes]
    out = []
    gamma = getattr(layer, "gamma", None)
    beta = getattr(layer, "beta", None)
    if gamma is not None:
        per_ex = tf.reduce_sum(g * xhat, axis=reduce_axes) if reduce_axes else g * xhat
        out.append((gamma, PerExample(tf.reshape(per_ex, [batch_size(g)] + list(gamma.shape)))))
    if beta is not None:
        per_ex = tf.reduce_sum(g, axis=reduce_axes) if reduce_axes else g
        if not beta_used:  # e.g. LayerNormalization(rms_scaling=True) ignores beta
            per_ex = tf.zeros_like(per_ex)
        out.append((beta, PerExample(tf.reshape(per_ex, [batch_size(g)] + list(beta.shape)))))
    return out


@norm_rule(keras.layers.LayerNormalization)
def layer_norm_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    rank = x.shape.rank
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    axes = sorted(a % rank for a in axes)
    xhat = keras.ops.layer_normalization(
        x, None, None, axis=axes, epsilon=layer.epsilon, rms_scaling=layer.rms_scaling
    )
    return _affine_norm_factors(
        layer, f32(xhat), g, axes, rank, beta_used=not layer.rms_scaling
    )


@norm_rule(keras.layers.GroupNormalization)
def group_norm_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    rank = x.shape.rank
    axis = layer.axis % rank
    shape = tf.shape(x)
    grouped = [shape[i] for i in range(rank)]
    grouped[axis] = x.shape[axis] // layer.groups
    grouped.insert(axis, layer.groups)
    xg = tf.reshape(x, grouped)
    red = [a for a in range(1, rank + 1) if a != axis]
    mean, var = keras.ops.moments(xg, axes=red, keepdims=True)
    xhat = tf.reshape((xg - mean) * tf.math.rsqrt(var + layer.epsilon), shape)
    return _affine_norm_factors(layer, xhat, g, [axis], rank)
