"""Norm rules for embedding layers.

- ``keras.layers.Embedding``: the table's per-example gradient is the output gradient's rows at
  the looked-up ids (:class:`Rows`).
- ``keras.layers.ReversibleEmbedding`` (also ``keras_hub.layers.ReversibleEmbedding``, a subclass
  that keeps its ``call``): called with token ids it looks rows up (:class:`Rows`); called with
  ``reverse=True`` on hidden states ``h`` it returns logits ``h E^T`` (tied weights) or
  ``h R`` (``tie_weights=False``, a separate ``reverse_embeddings`` matrix). For the tied table the
  rule gives ``Outer(dlogits, h)`` for the reverse call, and the clipper combines it with the
  lookup's :class:`Rows` into one per-example gradient whose squared norm includes the cross term
  (:class:`~tf_dp.gradients.ghost.factors.RowsPlus`). With ``logit_soft_cap`` the recorded pass
  runs the reverse call without the cap and applies it after the watched logits, so the output
  gradient is taken before the cap.
- ``keras_hub.layers.PositionEmbedding``: the output is the rows ``start_index ...
  start_index + T - 1`` (or ``positions``) of the table broadcast over the batch: :class:`Rows`
  with those ids and the output gradient summed over any axes between the batch and the sequence.

- keras-hub DeBERTa-v3's ``RelativeEmbedding``: the layer norm of its table, repeated over the
  batch; the per-example gradients of the table and the norm's gamma and beta in closed form
  (:func:`relative_embedding_rule`).

Embeddings with LoRA or quantization enabled have no rule here (their variables fall back to
per-example gradients of the layer's own call).
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.ghost.common import batch_size, f32, plain
from tf_dp.gradients.ghost.factors import Outer, PerExample, Rows
from tf_dp.gradients.ghost.registry import norm_rule


@norm_rule(keras.layers.Embedding, supports=plain)
def embedding_rule(layer, inputs, grad_output):
    ids = tf.convert_to_tensor(inputs)
    g = f32(grad_output)
    d = g.shape[-1]
    return [
        (
            layer.embeddings,
            Rows(tf.reshape(ids, [batch_size(ids), -1]), tf.reshape(g, [batch_size(g), -1, d]), layer.input_dim),
        )
    ]


def _arg(args, kwargs, name, index, default):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


def _table(layer):
    return _compat.embeddings_variable(layer)


def _reversible_supports(layer):
    if getattr(layer, "lora_enabled", False):
        return f"{layer.name}: LoRA-enabled embeddings have no built-in norm rule"
    if getattr(layer, "quantization_mode", None) is not None:
        return f"{layer.name}: quantized embeddings have no built-in norm rule"
    return None


def reversible_forward(layer, call, args, kwargs, watch):
    inputs = _arg(args, kwargs, "inputs", 0, None)
    if not _arg(args, kwargs, "reverse", 1, False):
        return watch(call(*args, **kwargs)), ("lookup", inputs)
    cap = layer.logit_soft_cap
    object.__setattr__(layer, "logit_soft_cap", None)
    try:
        logits = watch(call(*args, **kwargs))
    finally:
        object.__setattr__(layer, "logit_soft_cap", cap)
    if cap is not None:
        logits = tf.tanh(logits / cap) * cap
    return logits, ("reverse", inputs)


@norm_rule(
    getattr(keras.layers, "ReversibleEmbedding", None),
    supports=_reversible_supports,
    forward=reversible_forward,
)
def reversible_embedding_rule(layer, context, grads):
    kind, inputs = context
    g = f32(grads[0])
    batch = tf.shape(g)[0]
    table = _table(layer)
    if kind == "lookup":
        if not getattr(table, "trainable", True):
            return []
        ids = tf.reshape(tf.convert_to_tensor(inputs), [batch, -1])
        out = [(table, Rows(ids, tf.reshape(g, [batch, -1, g.shape[-1]]), layer.input_dim))]
        reverse = None if layer.tie_weights else layer.reverse_embeddings
        if reverse is not None and getattr(reverse, "trainable", True):
            # an untied output matrix that only a reverse call reads (a backbone under a
            # classifier head never makes one): an empty Outer (T = 0), a zero gradient that a
            # reverse call's Outer extends along T at no cost
            d, v = reverse.shape
            out.append((reverse, Outer(tf.zeros([batch, 0, d]), tf.zeros([batch, 0, v]))))
        return out
    h = f32(inputs)
    h = tf.reshape(h, [batch, -1, h.shape[-1]])
    g = tf.reshape(g, [batch, -1, g.shape[-1]])
    if layer.tie_weights:
        return [(table, Outer(g, h))] if getattr(table, "trainable", True) else []  # [V, D]
    reverse = layer.reverse_embeddings
    return [(reverse, Outer(h, g))] if getattr(reverse, "trainable", True) else []  # [D, V]


def position_forward(layer, call, args, kwargs, watch):
    out = watch(call(*args, **kwargs))
    return out, (_arg(args, kwargs, "start_index", 1, 0), _arg(args, kwargs, "positions", 2, None))


def position_embedding_rule(layer, context, grads):
    start, positions = context
    g = f32(grads[0])
    batch, t, d = tf.shape(g)[0], tf.shape(g)[-2], g.shape[-1]
    g = tf.reduce_sum(tf.reshape(g, [batch, -1, t, d]), axis=1)  # [B, T, D]
    if positions is None:
        ids = tf.range(t, dtype=tf.int64) + tf.cast(start, tf.int64)
    else:
        ids = tf.cast(positions, tf.int64)
    ids = tf.broadcast_to(ids, [batch, t])
    return [(layer.position_embeddings, Rows(ids, g, layer.sequence_length))]


def relative_embedding_variables(layer) -> list:
    """keras-hub DeBERTa-v3 ``RelativeEmbedding``'s table and its layer norm's gamma and beta."""
    return [layer.rel_embeddings] + list(layer.layer_norm.trainable_variables)


def relative_embedding_rule(layer, inputs, grad_output):
    """keras-hub DeBERTa-v3 ``RelativeEmbedding``: every example's output is ``LN(E)`` (the
    layer-normalised ``[2k, D]`` table, repeated over the batch), so example ``b``'s gradient is
    the layer norm's VJP at ``E`` applied to ``g[b]``: for each row, with ``xhat = (E - mu) / s``
    and ``gy = g[b] gamma``, ``dE = (gy - mean(gy) - xhat mean(gy xhat)) / s``; ``gamma``'s is
    ``sum_rows g[b] xhat``, ``beta``'s ``sum_rows g[b]``. All materialised (:class:`PerExample`,
    the size of the layer's output)."""
    del inputs
    ln = layer.layer_norm
    g = f32(grad_output)  # [B, 2k, D]
    e = f32(layer.rel_embeddings)[None]  # [1, 2k, D]
    mean, var = tf.nn.moments(e, axes=[-1], keepdims=True)
    inv = tf.math.rsqrt(var + ln.epsilon)
    xhat = (e - mean) * inv
    gamma = getattr(ln, "gamma", None)
    gy = g * f32(gamma) if gamma is not None else g
    de = inv * (
        gy
        - tf.reduce_mean(gy, -1, keepdims=True)
        - xhat * tf.reduce_mean(gy * xhat, -1, keepdims=True)
    )
    out = [(layer.rel_embeddings, PerExample(de))]
    if gamma is not None:
        out.append((gamma, PerExample(tf.reduce_sum(g * xhat, axis=1))))
    beta = getattr(ln, "beta", None)
    if beta is not None:
        out.append((beta, PerExample(tf.reduce_sum(g, axis=1))))
    return out


def vit_patching_variables(layer) -> list:
    """keras-hub ViT ``ViTPatchingAndEmbedding``'s class token (if any) and position table (its
    patch convolution keeps the convolution rule)."""
    token = [layer.class_token] if getattr(layer, "use_class_token", False) else []
    return token + [layer.position_embedding.embeddings]


def vit_patching_rule(layer, inputs, grad_output):
    """keras-hub ViT ``ViTPatchingAndEmbedding``: the output is ``concat(class token tiled over the
    batch, patches) + table[arange(P)]`` broadcast over the batch, so example ``b``'s gradient of
    the ``[P, D]`` table is its output gradient ``g[b]`` and of the ``[1, 1, D]`` class token
    ``g[b, 0]`` (both :class:`PerExample`, at most the size of one example's output)."""
    del inputs
    g = f32(grad_output)  # [B, P, D]
    out = [(layer.position_embedding.embeddings, PerExample(g))]
    if getattr(layer, "use_class_token", False):
        out.append((layer.class_token, PerExample(g[:, :1, None, :])))
    return out


def pali_gemma_vit_embeddings_variables(layer) -> list:
    """keras-hub PaliGemma ``PaliGemmaVitEmbeddings``' position table (its patch convolution keeps
    the convolution rule)."""
    return [layer.position_embedding.embeddings]


def pali_gemma_vit_embeddings_supports(layer) -> Optional[str]:
    ids = getattr(layer, "position_ids", None)
    num = getattr(layer, "num_positions", None)
    if ids is None or num is None or not hasattr(layer, "position_embedding"):
        return f"{layer.name}: this PaliGemmaVitEmbeddings has no position table and ids"
    if not np.array_equal(np.asarray(keras.ops.convert_to_numpy(ids)).reshape(-1), np.arange(num)):
        return f"{layer.name}: position ids other than 0 .. {num - 1} have no built-in norm rule"
    return None


def pali_gemma_vit_embeddings_rule(layer, inputs, grad_output):
    """keras-hub PaliGemma ``PaliGemmaVitEmbeddings``: ``patches + table[arange(P)]``, the
    ``[1, P, D]`` lookup broadcast over the batch, so example ``b``'s gradient of the ``[P, D]``
    table is its output gradient ``g[b]`` (:class:`PerExample`, one example's output)."""
    del inputs
    return [(layer.position_embedding.embeddings, PerExample(f32(grad_output)))]


def deit_supports(layer) -> Optional[str]:
    if getattr(layer, "use_mask_token", False):
        return f"{layer.name}: DeiT embeddings with a mask token have no built-in norm rule"
    missing = [
        a
        for a in ("patch_embedding", "class_token", "distillation_token", "position_embedding")
        if not hasattr(layer, a)
    ]
    if missing:
        return f"{layer.name}: this DeiTEmbeddings has no {', '.join(missing)}"
    return None


def deit_forward(layer, call, args, kwargs, watch):
    """keras-hub ``DeiTEmbeddings.call`` step by step: the patch convolution is called as a layer
    (recorded with the convolution rule), the sum ``concat(class, distillation, patches) +
    position table`` is watched *before* the layer's dropout."""
    del call
    inputs = args[0] if args else kwargs["inputs"]
    patches = layer.patch_embedding(inputs)
    if layer.data_format == "channels_first":
        patches = keras.ops.transpose(patches, axes=(0, 2, 3, 1))
    shape = keras.ops.shape(patches)
    patches = keras.ops.reshape(patches, [shape[0], -1, shape[-1]])
    tokens = [
        keras.ops.tile(layer.class_token, (shape[0], 1, 1)),
        keras.ops.tile(layer.distillation_token, (shape[0], 1, 1)),
    ]
    summed = watch(keras.ops.concatenate(tokens + [patches], axis=1) + layer.position_embedding)
    return layer.dropout(summed), None


def deit_rule(layer, context, grads):
    """keras-hub DeiT ``DeiTEmbeddings``: ``concat(class token, distillation token, patches) +
    table`` with the ``[1, P + 2, D]`` table broadcast over the batch, so example ``b``'s gradient
    of the table is ``g[b]`` (the gradient before the dropout) and of the two ``[1, 1, D]`` tokens
    ``g[b, 0]`` and ``g[b, 1]`` (:class:`PerExample`)."""
    del context
    g = f32(grads[0])  # [B, P + 2, D]
    return [
        (layer.position_embedding, PerExample(g[:, None])),
        (layer.class_token, PerExample(g[:, None, :1])),
        (layer.distillation_token, PerExample(g[:, None, 1:2])),
    ]


# -- keras-hub T5's relative attention bias ---------------------------------------------------------


def t5_attention_supports(layer) -> Optional[str]:
    for a in ("compute_bias", "relative_attention_buckets", "relative_attention_max_distance"):
        if not hasattr(layer, a):
            return f"{layer.name}: this T5MultiHeadAttention has no {a}"
    return None


def t5_attention_forward(layer, call, args, kwargs, watch):
    """keras-hub ``T5MultiHeadAttention.call`` as it is, with its ``compute_bias`` replaced for
    the call by one returning the bias broadcast to ``[B, heads, Q, K]`` and watched: the bias
    is ``[1, heads, Q, K]`` shared by the batch (and handed on to the later layers as their
    ``position_bias``), so only a batch axis of its own gives each example's gradient, summed
    over every layer that adds it. The context is the ``[Q, K]`` bucket of each query/key pair."""
    hidden = args[0] if args else kwargs["hidden_states"]
    batch = tf.shape(hidden)[:1]
    original = layer.compute_bias
    buckets: list = []

    def compute_bias(query_length, key_length, query_start_index=0):
        values = original(query_length, key_length, query_start_index=query_start_index)
        context = keras.ops.arange(query_length)[:, None] + query_start_index
        memory = keras.ops.arange(key_length)[None, :]
        buckets.append(_compat.t5_relative_position_bucket(layer, memory - context))
        values = tf.convert_to_tensor(values)
        return watch(tf.broadcast_to(values, tf.concat([batch, tf.shape(values)[1:]], 0)))

    object.__setattr__(layer, "compute_bias", compute_bias)
    try:
        out = call(*args, **kwargs)
    finally:
        object.__delattr__(layer, "compute_bias")
    return out, buckets


def t5_attention_rule(layer, buckets, grads):
    """keras-hub T5 ``T5MultiHeadAttention`` owning the ``[buckets, heads]`` relative attention
    bias table: entry ``(q, k, h)`` of the bias is ``table[bucket(q, k), h]``, so example ``b``'s
    gradient of the table sums its bias gradient ``G[b, h, q, k]`` over the pairs of each bucket
    (:class:`PerExample`, ``[B, buckets, heads]``). A layer without the table (the later layers,
    cross-attention) owns no variable: its projections are ``Dense`` layers with their own
    rule."""
    if not getattr(layer, "use_relative_attention_bias", False):
        return []
    table = layer.relative_attention_bias
    if not buckets:  # the call was given a position_bias: the table was not read
        g = f32(grads[0])
        return [(table, PerExample(tf.zeros([batch_size(g)] + list(table.shape))))]
    g = f32(grads[0])  # [B, H, Q, K]
    b, h = tf.shape(g)[0], table.shape[1]
    ids = tf.reshape(tf.cast(buckets[0], tf.int32), [-1])  # [Q K]
    flat = tf.transpose(tf.reshape(g, [b, h, -1]), [2, 0, 1])  # [Q K, B, H]
    per_bucket = tf.math.unsorted_segment_sum(flat, ids, table.shape[0])  # [buckets, B, H]
    return [(table, PerExample(tf.transpose(per_bucket, [1, 0, 2])))]
