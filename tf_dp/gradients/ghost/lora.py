"""Norm-rule factors of Keras's built-in LoRA (``Dense`` / ``EinsumDense`` after
``layer.enable_lora(rank)``).

With LoRA enabled the layer computes ``einsum(eq, x, W)`` with ``W = W0 + s A B``: ``A`` (the
``lora_kernel_a`` variable) has the kernel's shape with its last axis ``n`` replaced by the rank
``r``, ``B`` (``lora_kernel_b``) is ``[r, n]`` and ``s = lora_alpha / lora_rank``. When ``n`` is an
output-only axis (every Dense; the usual EinsumDense projections), the LoRA branch is two einsums
with an intermediate ``u`` of the output's shape with ``n`` replaced by ``r``::

    u = einsum(eq_a, x, A)         eq_a: the equation with the kernel's and output's n -> r
    y_lora = s * einsum(eq_b, u, B)    eq_b: "u,rn->output"

so ``A``'s per-example gradient is that of an einsum kernel with input ``x`` and output gradient
``s g B^T`` (projected to ``r``), and ``B``'s that of an einsum kernel with input ``u`` and output
gradient ``s g``. Both are the factors of :func:`~tf_dp.gradients.ghost.common.einsum_kernel_factor`
(an ``Outer`` of sizes ``[T, C]`` x ``[T, r]`` or ``[T, r]`` x ``[T, n]``): no per-example
``[C, n]`` gradient is formed. The frozen kernel ``W0`` gets no factor unless it is trainable.
"""

from __future__ import annotations

import tensorflow as tf

from tf_dp.gradients.ghost.common import einsum_kernel_factor, f32, parse_einsum, trainable


def lora_factors(layer, equation: str, x, g) -> list:
    """``[(lora_kernel_a, factor), (lora_kernel_b, factor)]`` (trainable ones only) for a LoRA
    layer computing ``einsum(equation, x, kernel)``; ``x``, ``g`` (float32) the recorded input
    and the output gradient before the activation."""
    x_spec, k_spec, o_spec = parse_einsum(equation)
    n = k_spec[-1]
    r = next(c for c in "zyxwvutsrqponmlkjihgfedcba" if c not in equation)
    a_spec, u_spec = k_spec[:-1] + r, o_spec.replace(n, r)
    scale = float(layer.lora_alpha) / float(layer.lora_rank)
    a_var, b_var = layer.lora_kernel_a, layer.lora_kernel_b
    a, b = f32(a_var), f32(b_var)
    out = []
    if trainable(a_var):
        g_u = tf.einsum(f"{o_spec},{r}{n}->{u_spec}", g, b) * scale
        out.append((a_var, einsum_kernel_factor(f"{x_spec},{a_spec}->{u_spec}", x, g_u, a.shape)))
    if trainable(b_var):
        u = tf.einsum(f"{x_spec},{a_spec}->{u_spec}", x, a)
        out.append((b_var, einsum_kernel_factor(f"{u_spec},{r}{n}->{o_spec}", u, g * scale, b.shape)))
    return out
