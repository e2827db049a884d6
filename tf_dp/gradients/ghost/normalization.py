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

import contextlib

import keras
import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.ghost.common import batch_size, f32, trainable
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


# -- channelwise parameters, by forward-mode differentiation -----------------------------------


def _channel_variables(layer) -> list:
    """The layer's own trainable variables (those the channelwise rule covers)."""
    return [v for v in (_compat.own_trainable_variables(layer) or []) if trainable(v)]


def channelwise_supports(layer):
    """A channelwise layer's variables must be vectors (one entry per output channel)."""
    bad = [v.path for v in _channel_variables(layer) if len(v.shape) != 1]
    if bad:
        return (
            f"{layer.name}: the channelwise rule needs 1-D variables (one entry per channel of "
            f"the output's last axis); {', '.join(bad)} are not"
        )
    return None


def channelwise_forward(layer, call, args, kwargs, watch):
    """Runs ``call`` inside one ``tf.autodiff.ForwardAccumulator`` per variable (tangent: all
    ones), so that each variable's Jacobian-vector product with the output comes out of the same
    forward pass, in the layer's own autocast scope; the output is watched."""
    variables = [_compat.tf_variable(v) for v in _channel_variables(layer)]
    accumulators = [
        tf.autodiff.ForwardAccumulator([v], [tf.ones_like(v)]) for v in variables
    ]
    with contextlib.ExitStack() as stack:
        for acc in accumulators:
            stack.enter_context(acc)
        out = call(*args, **kwargs)
    zero = tf.UnconnectedGradients.ZERO
    return watch(out), [acc.jvp(out, unconnected_gradients=zero) for acc in accumulators]


@norm_rule(
    _compat.keras_layer_scale(), supports=channelwise_supports, forward=channelwise_forward
)
def channelwise_rule(layer, tangents, grads):
    """Exact per-example gradients of a layer whose every variable ``v`` is a vector acting
    channelwise on the output's last axis: output channel ``h`` depends on ``v`` through ``v[h]``
    alone (RMS and layer norms' scale and offset, ``(1 + scale)`` forms, layer scales,
    ``x * gamma``). Then ``dy[..., h] / dv[k]`` is zero for ``k != h``, the forward-mode product
    with an all-ones tangent is the diagonal ``dy[..., h] / dv[h]`` itself (whatever the formula),
    and example ``b``'s gradient is ``sum_t g[b, t, h] * jvp[b, t, h]`` (:class:`PerExample`,
    ``[B, H]``). Registered (with :func:`channelwise_forward`) for keras-hub's norms and layer
    scales without a closed-form rule and, by its decorator, for ``keras.applications``'
    ``LayerScale``; a user's layer of this kind::

        from tf_dp.gradients.ghost import register_layer_norm_rule
        from tf_dp.gradients.ghost.normalization import (
            channelwise_forward, channelwise_rule, channelwise_supports)

        register_layer_norm_rule(MyNorm, channelwise_rule, forward=channelwise_forward,
                                 supports=channelwise_supports)

    A layer that mixes channels through a variable (``x * softmax(v)``) breaks the contract and
    gets wrong (still clipped) gradients: check it with ``tf_dp.keras.conformance.check_model``.
    """
    g = f32(grads[0])
    rank = g.shape.rank
    out = []
    for v, tangent in zip(_channel_variables(layer), tangents):
        per_ex = g * f32(tangent)
        if rank > 2:
            per_ex = tf.reduce_sum(per_ex, axis=list(range(1, rank - 1)))
        out.append((v, PerExample(tf.reshape(per_ex, [batch_size(g), v.shape[0]]))))
    return out

