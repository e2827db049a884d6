"""Helpers shared by the layer-family rule modules (dtype, batch size, variables, einsum)."""

from __future__ import annotations

from typing import Optional

import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.ghost.factors import Outer, PerExample


def f32(t):
    t = tf.convert_to_tensor(t)
    return t if t.dtype in (tf.float32, tf.float64) else tf.cast(t, tf.float32)


def batch_size(t):
    return tf.shape(t)[0]


def plain(layer) -> Optional[str]:
    if getattr(layer, "lora_enabled", False):
        return f"{layer.name}: LoRA-enabled layers of this kind have no built-in norm rule"
    return not_quantized(layer)


def not_quantized(layer) -> Optional[str]:
    if getattr(layer, "quantization_mode", None) is not None:
        return f"{layer.name}: quantized layers have no built-in norm rule"
    return None


def trainable(v) -> bool:
    return v is not None and bool(getattr(v, "trainable", True))


def kernel_variable(layer):
    """The kernel *variable* of a Dense/EinsumDense (``layer.kernel`` is a tensor under LoRA)."""
    return _compat.kernel_variable(layer)


def bias_per_example(g, bias):
    """Per-example bias gradient: ``g`` summed over every axis but the batch and the last."""
    g = f32(g)
    if g.shape.rank == 2:  # [B, D]: the gradient itself (a sum over one position would copy it)
        return PerExample(g)
    d = g.shape[-1]
    return PerExample(tf.reduce_sum(tf.reshape(g, [batch_size(g), -1, d]), axis=1))


def parse_einsum(equation: str):
    lhs, out = equation.replace(" ", "").split("->")
    x_spec, k_spec = lhs.split(",")
    return x_spec, k_spec, out


def einsum_kernel_factor(equation: str, x, g, kernel_shape):
    """The factor of the per-example gradient of ``kernel`` in ``einsum(equation, x, kernel)``
    (batch on the first axis of ``x`` and the output; ``g`` the output gradient)."""
    x_spec, k_spec, o_spec = parse_einsum(equation)
    b = x_spec[0]
    xs, ks, os_ = set(x_spec), set(k_spec), set(o_spec)
    # Sum away input axes that appear nowhere else.
    x_only = [c for c in x_spec[1:] if c not in ks and c not in os_]
    if x_only:
        x_spec_r = "".join(c for c in x_spec if c not in x_only)
        x = tf.einsum(f"{x_spec}->{x_spec_r}", x)
        x_spec = x_spec_r
    shared = [c for c in k_spec if c in xs and c in os_]
    if shared:
        return PerExample(tf.einsum(f"{x_spec},{o_spec}->{b}{k_spec}", x, g))
    t_letters = [c for c in x_spec[1:] if c in os_ and c not in ks]
    c_letters = [c for c in k_spec if c in xs]
    d_letters = [c for c in k_spec if c in os_]
    x_t = tf.einsum(f"{x_spec}->{b}{''.join(t_letters + c_letters)}", x)
    g_t = tf.einsum(f"{o_spec}->{b}{''.join(t_letters + d_letters)}", g)
    kdims = dict(zip(k_spec, kernel_shape))
    cn = 1
    for c in c_letters:
        cn *= kdims[c]
    dn = 1
    for c in d_letters:
        dn *= kdims[c]
    order = c_letters + d_letters
    perm = [order.index(c) for c in k_spec]
    return Outer(
        tf.reshape(x_t, [batch_size(x_t), -1, cn]),
        tf.reshape(g_t, [batch_size(g_t), -1, dn]),
        unflat_shape=[kdims[c] for c in order],
        perm=None if perm == list(range(len(perm))) else perm,
    )
