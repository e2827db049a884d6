"""Norm rules for ``Dense`` and ``EinsumDense`` (kernel ``Outer(x, g)`` or its einsum form; bias
per example; LoRA factors when LoRA is enabled)."""

from __future__ import annotations

import sys
from typing import Any, Optional

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
    if x.shape.rank != 2 or g.shape.rank != 2:  # [B, T, .]; a [B, .] pair stays as it is
        x = tf.reshape(x, [batch_size(x), -1, d])
        g = tf.reshape(g, [batch_size(g), -1, p])
    out = []
    if trainable(kernel):
        out.append((kernel, Outer(x, g)))
    if getattr(layer, "lora_enabled", False):
        out.extend(lora_factors(layer, "btc,cd->btd", tf.reshape(x, [batch_size(x), -1, d]),
                                tf.reshape(g, [batch_size(g), -1, p])))
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
        # a sum over the output axes the bias is broadcast along, in the output's axis order
        # (the bias's own): reduce_sum, not einsum("...->b<bias letters>"), which oneDNN runs
        # about 3.5x slower (0.87 against 0.25 ms on the reference Transformer's [64, 128, 4, 32]
        # query gradient, this 2-core AMD EPYC)
        summed = [i for i, c in enumerate(o_spec) if i > 0 and c not in layer.bias_axes]
        per_ex = tf.reduce_sum(g, axis=summed) if summed else g
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


# -- keras-hub Gemma 4's decoder block: feed-forward matmuls on its EinsumDense kernels --------------

#: Gemma 4's feed-forward layers: attribute -> the equation its ``ops.matmul(x, kernel)`` computes
GEMMA4_FEED_FORWARD = {
    "gating_ffw": "btd,df->btf",
    "gating_ffw_2": "btd,df->btf",
    "ffw_linear": "btf,fd->btd",
}


class _MatmulThroughLayers:
    """``keras.ops`` with ``matmul(x, w)`` for the kernels ``w`` in ``kernels`` (``id(w)`` ->
    layer) computed as ``layer(x)``: the same product, as a call the layer's rule records."""

    def __init__(self, ops, kernels: dict):
        self._ops, self._kernels = ops, kernels

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def matmul(self, x1, x2):
        layer = self._kernels.get(id(x2))
        return layer(x1) if layer is not None else self._ops.matmul(x1, x2)


def gemma4_decoder_supports(layer) -> Optional[str]:
    for name, equation in GEMMA4_FEED_FORWARD.items():
        sub = getattr(layer, name, None)
        if not isinstance(sub, keras.layers.EinsumDense):
            return f"{layer.name}: this Gemma 4 decoder block has no EinsumDense {name}"
        if sub.equation != equation or sub.bias is not None or sub.activation not in (
            None, keras.activations.linear
        ):
            return (f"{layer.name}: {name} is not a bias-free {equation} projection (its "
                    "matmul would not equal the layer's call)")
        if getattr(sub, "lora_enabled", False) or getattr(sub, "quantization_mode", None):
            return f"{layer.name}: {name} has LoRA or quantisation (kernel read as a new tensor)"
    if not hasattr(sys.modules.get(type(layer).__module__), "ops"):
        return f"{layer.name}: its module has no `ops` to route matmuls through"
    return None


def call_with_matmuls_through_layers(layer, call, args, kwargs, names) -> Any:
    """``call(*args, **kwargs)`` with the ``ops.matmul(x, sub.kernel)`` of ``layer``'s module
    computed as ``sub(x)`` for the sublayers ``sub = getattr(layer, name)`` (``names``): for a
    forward-only rule (``variables`` listing nothing) whose layer multiplies by a sublayer's
    kernel instead of calling it, so that the sublayer's rule records the use. The module's
    ``ops`` (``from keras import ops``) is replaced for the duration of the call; each ``sub``
    must be a bias-free ``Dense``/``EinsumDense`` whose call equals that matmul (the caller's
    ``supports`` checks it)."""
    module = sys.modules[type(layer).__module__]
    kernels = {id(getattr(layer, name).kernel): getattr(layer, name) for name in names}
    ops = module.ops
    module.ops = _MatmulThroughLayers(ops, kernels)
    try:
        return call(*args, **kwargs)
    finally:
        module.ops = ops


def gemma4_decoder_forward(layer, call, args, kwargs, watch):
    """keras-hub Gemma 4's ``Gemma4TextDecoderBlock`` computes its feed-forward network with
    ``ops.matmul(x, self.gating_ffw.kernel)`` (and ``gating_ffw_2``, ``ffw_linear``) instead of
    calling those ``EinsumDense`` layers, so their rules never see a call (the clipper would
    move their kernels to per-example gradients). For the block's call those three products are
    computed as the layers' own calls (the same bias-free products,
    :func:`gemma4_decoder_supports` checks the equations; :func:`call_with_matmuls_through_layers`),
    which their rule records; everything else runs as written."""
    del watch
    return call_with_matmuls_through_layers(layer, call, args, kwargs, GEMMA4_FEED_FORWARD), None


def gemma4_decoder_rule(layer, context, grads):
    """The block has no variables of its own: its sublayers' rules cover them."""
    del layer, context, grads
    return []


def no_own_variables(layer) -> list:
    """For a rule that only reroutes its layer's forward pass (:func:`gemma4_decoder_forward`)."""
    del layer
    return []
