"""Norm rule for keras-hub's Swin Transformer block (window attention).

keras-hub 0.32's ``SwinTransformerBlock`` partitions its ``[B, H, W, C]`` feature map into
windows flattened into axis 0 (``[B*nW, w*w, C]``) and calls its ``WindowAttention`` on them: the
attention's ``qkv`` and ``proj`` ``Dense`` layers and its relative position bias see rows that are
windows, not examples, so the clipper moved them to a per-example fallback.

The rule registered for the block never folds ``B*nW`` rows back into examples. Its ``forward``
reimplements the block with its own window partition that keeps the batch axis apart:
``[B, H, W, C] -> [B, H/w, w, W/w, w, C] -> [B, nW, w*w, C]`` (a reshape that splits axes and a
transpose that never moves axis 0), so example ``b``'s windows are ``[b, :]`` by construction.
``qkv`` and ``proj`` are called on these ``[B, nW, w*w, .]`` tensors (recorded by the ``Dense``
rule, examples on axis 0); the bias ``table[index]`` (``[heads, N, N]``) is broadcast to ``[B,
heads, N, N]`` and watched before it is added to every window of example ``b``, so its gradient
is example ``b``'s sum over its windows, and the table's per-example gradient sums it over the
query/key pairs of each table row. The norms and the MLP are called as layers (their own rules).

``supports`` accepts keras-hub's own ``SwinTransformerBlock`` and ``WindowAttention`` (the
classes whose ``call`` the forward reproduces) with square windows matching the block's, a feature
map that the windows tile exactly (no padding) and ``heads * head_dim == C``; anything else keeps
the per-example fallback.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import tensorflow as tf
from keras import ops

from tf_dp.gradients.ghost.common import f32, trainable
from tf_dp.gradients.ghost.factors import PerExample


def swin_block_supports(layer) -> Optional[str]:
    from keras_hub.src.models.swin_transformer.swin_transformer_layers import (
        SwinTransformerBlock,
        WindowAttention,
    )

    if type(layer) is not SwinTransformerBlock:
        return f"{layer.name}: not keras-hub's own SwinTransformerBlock"
    attn = getattr(layer, "attn", None)
    if type(attn) is not WindowAttention:
        return f"{layer.name}: its attention is not keras-hub's WindowAttention"
    h, w = layer.input_resolution
    ws, shift = layer.window_size, layer.shift_size
    if (attn.win_h, attn.win_w) != (ws, ws):
        return f"{layer.name}: the attention's window differs from the block's"
    if h % ws or w % ws:
        return f"{layer.name}: windows that do not tile the feature map (padding) have no rule"
    if not 0 <= shift < ws:
        return f"{layer.name}: shift {shift} outside [0, window)"
    if attn.num_heads * attn.head_dim != attn.dim:
        return f"{layer.name}: heads * head_dim != channels"
    return None


def swin_block_variables(layer) -> list:
    """The attention's relative position bias table (the block's Dense and norm layers keep their
    own rules)."""
    return [layer.attn.relative_position_bias_table]


def _partition(x, ws):
    """``[B, H, W, C] -> [B, nW, ws*ws, C]``: windows in row-major order, batch axis kept."""
    b = ops.shape(x)[0]
    h, w, c = x.shape[1], x.shape[2], x.shape[3]
    x = ops.reshape(x, (b, h // ws, ws, w // ws, ws, c))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (b, (h // ws) * (w // ws), ws * ws, c))


def _merge(x, ws, h, w):
    """The inverse of :func:`_partition`: ``[B, nW, ws*ws, C] -> [B, H, W, C]``."""
    b, c = ops.shape(x)[0], x.shape[-1]
    x = ops.reshape(x, (b, h // ws, w // ws, ws, ws, c))
    x = ops.transpose(x, (0, 1, 3, 2, 4, 5))
    return ops.reshape(x, (b, h, w, c))


def shifted_window_mask(h: int, w: int, ws: int, shift: int) -> np.ndarray:
    """``[nW, N, N]`` additive mask of shifted-window attention: ``-100`` between two positions
    of a window that come from different regions of the unshifted map (the three bands
    ``[0, n - ws)``, ``[n - ws, n - shift)``, ``[n - shift, n)`` along each axis), else 0."""
    region = np.zeros((h, w), np.int64)
    rows = [(0, h - ws), (h - ws, h - shift), (h - shift, h)]
    cols = [(0, w - ws), (w - ws, w - shift), (w - shift, w)]
    for i, (r0, r1) in enumerate(rows):
        for j, (c0, c1) in enumerate(cols):
            region[r0:r1, c0:c1] = 3 * i + j
    windows = region.reshape(h // ws, ws, w // ws, ws).transpose(0, 2, 1, 3).reshape(-1, ws * ws)
    return (windows[:, None, :] != windows[:, :, None]).astype("float32") * -100.0


def swin_block_forward(layer, call, args, kwargs, watch):
    """``SwinTransformerBlock.call`` (with its ``WindowAttention``'s) on batch-kept windows; see
    the module docstring. Context: the ``[N, N]`` table row of each query/key pair."""
    del call
    x = args[0] if args else kwargs["x"]
    attn = layer.attn
    h, w = layer.input_resolution
    ws, shift = layer.window_size, layer.shift_size
    b, c = ops.shape(x)[0], x.shape[-1]
    heads, n = attn.num_heads, ws * ws
    y = ops.reshape(layer.norm1(x), (b, h, w, c))
    if shift:
        y = ops.roll(y, shift=(-shift, -shift), axis=(1, 2))
    windows = _partition(y, ws)  # [B, nW, N, C]
    nw = windows.shape[1]
    qkv = attn.qkv(windows)  # [B, nW, N, 3 heads d]
    qkv = ops.transpose(ops.reshape(qkv, (b, nw, n, 3, heads, -1)), (3, 0, 1, 4, 2, 5))
    q, k, v = ops.unstack(qkv, axis=0)  # [B, nW, heads, N, d]
    q = q * ops.cast(attn.scale, dtype=qkv.dtype)
    scores = ops.matmul(q, ops.transpose(k, (0, 1, 2, 4, 3)))  # [B, nW, heads, N, N]
    index = attn.relative_position_index
    bias = ops.transpose(ops.take(attn.relative_position_bias_table, index, axis=0), (2, 0, 1))
    bias = watch(tf.broadcast_to(bias, tf.concat([[b], tf.shape(bias)], 0)))  # [B, heads, N, N]
    scores = scores + ops.expand_dims(bias, 1)
    if shift:
        scores = scores + ops.convert_to_tensor(shifted_window_mask(h, w, ws, shift))[None, :, None]
    probs = attn.attention_dropout_layer(ops.softmax(scores, -1))
    out = ops.matmul(probs, v)  # [B, nW, heads, N, d]
    out = ops.reshape(ops.transpose(out, (0, 1, 3, 2, 4)), (b, nw, n, c))
    out = attn.proj_drop(attn.proj(out))
    y = _merge(out, ws, h, w)
    if shift:
        y = ops.roll(y, shift=(shift, shift), axis=(1, 2))
    y = x + layer.drop_path(ops.reshape(y, (b, h * w, c)))
    return y + layer.drop_path(layer.mlp(layer.norm2(y))), index


def swin_block_rule(layer, index, grads):
    """The relative position bias table ``[rows, heads]``: entry ``(h, q, k)`` of the bias is
    ``table[index[q, k], h]``, so example ``b``'s gradient sums its bias gradient ``G[b, h, q, k]``
    over the pairs of each row (:class:`PerExample`, ``[B, rows, heads]``)."""
    table = layer.attn.relative_position_bias_table
    if not trainable(table):
        return []
    g = f32(grads[0])  # [B, heads, N, N]
    b, heads = tf.shape(g)[0], table.shape[1]
    ids = tf.reshape(tf.cast(index, tf.int32), [-1])
    flat = tf.transpose(tf.reshape(g, [b, heads, -1]), [2, 0, 1])  # [N N, B, heads]
    per_row = tf.math.unsorted_segment_sum(flat, ids, table.shape[0])  # [rows, B, heads]
    return [(table, PerExample(tf.transpose(per_row, [1, 0, 2])))]


def registrations() -> list:
    """``(module, class, register options)`` of this module's rule, for
    :func:`tf_dp.gradients.ghost.keras_hub_rules.register`."""
    return [
        ("keras_hub.src.models.swin_transformer.swin_transformer_layers", "SwinTransformerBlock",
         dict(rule=swin_block_rule, forward=swin_block_forward, supports=swin_block_supports,
              variables=swin_block_variables)),
    ]
