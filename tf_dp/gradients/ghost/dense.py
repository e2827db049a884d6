"""Norm rules for ``Dense`` and ``EinsumDense`` (kernel ``Outer(x, g)`` or its einsum form; bias
per example; LoRA factors when LoRA is enabled)."""

from __future__ import annotations

from typing import Optional

import keras
import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.ghost.common import (
    batch_size,
    bias_per_example,
    einsum_kernel_factor,
    f32,
    kernel_variable,
    not_quantized,
    parse_einsum,
    trainable,
)
from tf_dp.gradients.ghost.factors import Outer, PerExample
from tf_dp.gradients.ghost.lora import lora_factors
from tf_dp.gradients.ghost.registry import norm_rule


def _dense_supports(layer) -> Optional[str]:
    return not_quantized(layer)


@norm_rule(keras.layers.Dense, supports=_dense_supports, split_activation=True)
def dense_rule(layer, inputs, grad_output):
    """Kernel ``Outer(x, g)``, bias, and (with LoRA enabled) the LoRA factors."""
    x, g = f32(inputs), f32(grad_output)
    kernel = kernel_variable(layer)
    d, p = kernel.shape
    x = tf.reshape(x, [batch_size(x), -1, d])
    g = tf.reshape(g, [batch_size(g), -1, p])
    out = []
    if trainable(kernel):
        out.append((kernel, Outer(x, g)))
    if getattr(layer, "lora_enabled", False):
        out.extend(lora_factors(layer, "btc,cd->btd", x, g))
    if trainable(layer.bias):
        out.append((layer.bias, bias_per_example(g, layer.bias)))
    return out


def _einsum_supports(layer) -> Optional[str]:
    reason = not_quantized(layer)
    if reason:
        return reason
    try:
        x_spec, k_spec, o_spec = parse_einsum(layer.equation)
    except ValueError:
        return f"{layer.name}: cannot parse equation {layer.equation!r}"
    if "." in layer.equation:
        return f"{layer.name}: equations with '...' have no built-in norm rule"
    if not x_spec or not o_spec or x_spec[0] != o_spec[0] or x_spec[0] in k_spec:
        return f"{layer.name}: the batch axis must be the first axis of input and output"
    if set(k_spec) - set(x_spec) - set(o_spec):
        return f"{layer.name}: kernel axes must appear in the input or the output"
    if layer.bias_axes and o_spec[0] in layer.bias_axes:
        return f"{layer.name}: a bias over the batch axis is not supported"
    if getattr(layer, "lora_enabled", False) and (k_spec[-1] in x_spec or k_spec[-1] not in o_spec):
        return f"{layer.name}: LoRA needs the kernel's last axis to be an output-only axis"
    return None


@norm_rule(keras.layers.EinsumDense, supports=_einsum_supports, split_activation=True)
def einsum_dense_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    kernel = kernel_variable(layer)
    out = []
    if trainable(kernel):
        out.append((kernel, einsum_kernel_factor(layer.equation, x, g, kernel.shape)))
    if getattr(layer, "lora_enabled", False):
        out.extend(lora_factors(layer, layer.equation, x, g))
    if trainable(layer.bias):
        _, _, o_spec = parse_einsum(layer.equation)
        bias_letters = "".join(c for c in o_spec if c in layer.bias_axes)
        per_ex = tf.einsum(f"{o_spec}->{o_spec[0]}{bias_letters}", g)
        out.append(
            (layer.bias, PerExample(tf.reshape(per_ex, [batch_size(g)] + list(layer.bias.shape))))
        )
    return out


# -- keras-hub's MaskedLMHead ------------------------------------------------------------------------

def masked_lm_head_supports(layer) -> Optional[str]:
    try:
        _, _, kernel, _ = _compat.masked_lm_head_parts(layer)
    except AttributeError as e:
        return (
            f"{layer.name}: this keras-hub MaskedLMHead lacks a part the rule reads ({e}; the "
            "rule follows keras-hub 0.32's layer); per-example gradients"
        )
    if not layer.token_embedding and kernel is None:
        return f"{layer.name}: an untied MaskedLMHead without its projection kernel"
    return not_quantized(layer)


def masked_lm_head_forward(layer, call, args, kwargs, watch):
    """keras-hub's ``MaskedLMHead.call`` step by step: gather the masked positions, the
    intermediate ``Dense`` and ``LayerNormalization`` and the tied ``token_embedding(x,
    reverse=True)`` are called as layers (so each is recorded with its own rule, the tied table's
    two uses included); the logits before the head's own bias and activation are watched, and the
    projection's input is kept for an untied kernel."""
    del call
    dense, norm, kernel, bias = _compat.masked_lm_head_parts(layer)
    inputs = args[0] if args else kwargs["inputs"]
    positions = args[1] if len(args) > 1 else kwargs["mask_positions"]
    x = keras.ops.take_along_axis(inputs, keras.ops.expand_dims(positions, axis=-1), axis=1)
    x = norm(dense(x))
    if layer.token_embedding:
        logits = layer.token_embedding(x, reverse=True)
    else:
        logits = keras.ops.matmul(x, kernel)
    logits = watch(keras.ops.cast(logits, layer.compute_dtype) + bias)
    out = layer.activation(logits) if layer.activation is not None else logits
    return out, x


def masked_lm_head_rule(layer, x, grads):
    """keras-hub ``MaskedLMHead``'s own variables: the output bias (per example, ``[B, V]``) and,
    without a tied embedding, the ``[D, V]`` projection ``Outer(x, g)`` (``x`` the layer-normed
    features at the masked positions, ``g`` the gradient of the logits). Its intermediate
    ``Dense``, ``LayerNormalization`` and tied ``ReversibleEmbedding`` have their own rules."""
    _, _, kernel, bias = _compat.masked_lm_head_parts(layer)
    g = f32(grads[0])
    out = [(bias, bias_per_example(g, bias))]
    if kernel is not None:
        xs = f32(x)
        out.append(
            (
                kernel,
                Outer(
                    tf.reshape(xs, [batch_size(xs), -1, xs.shape[-1]]),
                    tf.reshape(g, [batch_size(g), -1, g.shape[-1]]),
                ),
            )
        )
    return out
