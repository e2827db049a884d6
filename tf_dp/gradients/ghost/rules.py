"""The per-layer norm-rule registry, and the built-in rules.

A *norm rule* tells the ghost strategy how the per-example gradient of each of a layer's variables
factors into things the forward and backward passes already computed. Signature::

    def rule(layer, inputs, grad_output) -> Sequence[tuple[variable, factor]]

- ``layer``: the layer instance (a ``keras.layers.Layer``);
- ``inputs``: the first positional argument its ``call`` received in this call (as received:
  the ghost strategy records every call, so a layer used twice is seen twice);
- ``grad_output``: the gradient of the batch's summed per-example losses with respect to the
  output of ``call`` -- taken *before* the layer's ``activation`` when the rule was registered with
  ``split_activation=True`` (Dense, EinsumDense, Conv). Row ``b`` is example ``b``'s gradient;
  sample weights and masks are already in it.
- returns, for each of the layer's variables that the rule covers, a factor from
  :mod:`tf_dp.gradients.ghost.factors`: ``Outer(a, g)`` (gradient ``sum_t a_t g_t^T``),
  ``Rows(ids, g, num_rows)`` (embedding tables) or ``PerExample(grads)`` (materialised, for small
  variables). The strategy derives the per-example norms, the cross terms between several calls,
  and the clipped sum from these factors. A rule must return a factor for every trainable
  variable of its layer: the strategy raises a ``ValueError`` naming the variables a rule left
  out. (A layer whose class has no rule, or whose ``supports`` refuses it, is not an error: all its
  variables get per-example gradients from the vectorized fallback.)

Register with :func:`register_layer_norm_rule`; the built-in rules for ``Dense``, ``EinsumDense``,
``Conv1D``, ``Conv2D``, ``Embedding``, ``LayerNormalization`` and ``GroupNormalization`` are
registered the same way (``MultiHeadAttention`` owns no variables itself: its four projections are
``EinsumDense`` layers), and so are the rules for ``LSTM``, ``GRU`` and ``SimpleRNN``
(:mod:`tf_dp.gradients.ghost.recurrent`), which use the optional ``forward`` and ``variables``
hooks of :func:`register_layer_norm_rule`.

Example (a layer computing ``x * scale`` elementwise, ``scale`` of shape ``[d]``)::

    from tf_dp.gradients.ghost import PerExample, register_layer_norm_rule

    def scale_rule(layer, inputs, grad_output):
        per_example = tf.reduce_sum(tf.reshape(inputs * grad_output, [tf.shape(inputs)[0], -1,
                                                                      layer.scale.shape[0]]), 1)
        return [(layer.scale, PerExample(per_example))]

    register_layer_norm_rule(MyScale, scale_rule)
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Sequence

import keras
import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.ghost.factors import Outer, PerExample, Rows

NormRule = Callable[[Any, Any, tf.Tensor], Sequence[tuple[Any, Any]]]


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    layer_class: type
    rule: NormRule
    supports: Optional[Callable[[Any], Optional[str]]] = None
    split_activation: bool = False
    #: optional ``forward(layer, call, args, kwargs, watch) -> (outputs, context)``: runs the
    #: layer's forward pass in place of ``call`` during the recorded pass, passing every tensor
    #: whose gradient the rule needs through ``watch`` (which returns it) right after creating it;
    #: the rule then receives ``context`` as ``inputs`` and the list of those tensors' gradients
    #: as ``grad_output`` (in ``watch`` order). Used by the recurrent rules.
    forward: Optional[Callable[..., Any]] = None
    #: optional ``variables(layer) -> [variable]``: the variables the rule covers when they are
    #: owned by sublayers (an LSTM's cell owns its kernels); default: the layer's own variables.
    variables: Optional[Callable[[Any], list]] = None


_RULES: dict[type, RuleEntry] = {}


def register_layer_norm_rule(
    layer_class: type,
    rule: NormRule,
    *,
    supports: Optional[Callable[[Any], Optional[str]]] = None,
    split_activation: bool = False,
    forward: Optional[Callable[..., Any]] = None,
    variables: Optional[Callable[[Any], list]] = None,
) -> None:
    """Registers ``rule`` (see the module docstring) for ``layer_class``.

    Args:
      layer_class: a ``keras.layers.Layer`` subclass. The rule also applies to its subclasses
        that do not override ``call``.
      rule: ``rule(layer, inputs, grad_output) -> [(variable, factor), ...]``.
      supports: optional ``supports(layer) -> None | reason``; a layer it refuses (e.g. a
        configuration the rule does not handle) falls back to vectorized per-example gradients.
      split_activation: the layer has an ``activation`` attribute applied last in ``call``; the
        strategy runs ``call`` with ``activation=None`` and applies the activation itself, so
        ``grad_output`` is the gradient before the activation.
      forward: optional replacement forward pass for the recorded pass (see ``RuleEntry``); the
        rule is then called with the context it returns and the gradients of what it watched.
      variables: optional ``variables(layer)`` listing the variables the rule covers, for layers
        whose variables are owned by sublayers (recurrent layers and their cells).
    """
    if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
        raise TypeError(f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}")
    if not callable(rule):
        raise TypeError(f"rule must be callable, got {rule!r}")
    _RULES[layer_class] = RuleEntry(
        layer_class, rule, supports, bool(split_activation), forward, variables
    )


def unregister_layer_norm_rule(layer_class: type) -> None:
    _RULES.pop(layer_class, None)


def registered_layer_classes() -> tuple[type, ...]:
    return tuple(_RULES)


_KERAS_HUB_RULES = {"loaded": False}


def _load_keras_hub_rules() -> None:
    """Registers the rules for keras-hub layers the first time a keras-hub layer is met (so that
    importing tf_dp never imports keras-hub)."""
    _KERAS_HUB_RULES["loaded"] = True
    from tf_dp.gradients.ghost import embeddings, normalization

    embeddings.register_keras_hub()
    normalization.register_keras_hub()


def find_rule(layer: Any) -> tuple[Optional[RuleEntry], Optional[str]]:
    """The rule entry for ``layer`` (or None, with the reason)."""
    cls = type(layer)
    if not _KERAS_HUB_RULES["loaded"] and cls.__module__.startswith("keras_hub"):
        _load_keras_hub_rules()
    for base in cls.__mro__:
        entry = _RULES.get(base)
        if entry is None:
            continue
        if base is not cls and getattr(cls, "call", None) is not getattr(base, "call", None):
            return None, f"{cls.__name__} overrides call() of {base.__name__}"
        if entry.supports is not None:
            reason = entry.supports(layer)
            if reason is not None:
                return None, reason
        return entry, None
    return None, f"no norm rule registered for {cls.__name__}"


# -- helpers ---------------------------------------------------------------------------------------


def _f32(t):
    t = tf.convert_to_tensor(t)
    return t if t.dtype in (tf.float32, tf.float64) else tf.cast(t, tf.float32)


def _batch(t):
    return tf.shape(t)[0]


def _plain(layer) -> Optional[str]:
    if getattr(layer, "lora_enabled", False):
        return f"{layer.name}: LoRA-enabled layers of this kind have no built-in norm rule"
    return _not_quantized(layer)


def _not_quantized(layer) -> Optional[str]:
    if getattr(layer, "quantization_mode", None) is not None:
        return f"{layer.name}: quantized layers have no built-in norm rule"
    return None


def _trainable(v) -> bool:
    return v is not None and bool(getattr(v, "trainable", True))


def kernel_variable(layer):
    """The kernel *variable* of a Dense/EinsumDense (``layer.kernel`` is a tensor under LoRA)."""
    return _compat.kernel_variable(layer)


def _bias_per_example(g, bias):
    """Per-example bias gradient: ``g`` summed over every axis but the batch and the last."""
    g = _f32(g)
    d = g.shape[-1]
    return PerExample(tf.reduce_sum(tf.reshape(g, [_batch(g), -1, d]), axis=1))


# -- Dense ----------------------------------------------------------------------------------------


def _dense_supports(layer) -> Optional[str]:
    return _not_quantized(layer)


def dense_rule(layer, inputs, grad_output):
    """Kernel ``Outer(x, g)``, bias, and (with LoRA enabled) the LoRA factors."""
    x, g = _f32(inputs), _f32(grad_output)
    kernel = kernel_variable(layer)
    d, p = kernel.shape
    x = tf.reshape(x, [_batch(x), -1, d])
    g = tf.reshape(g, [_batch(g), -1, p])
    out = []
    if _trainable(kernel):
        out.append((kernel, Outer(x, g)))
    if getattr(layer, "lora_enabled", False):
        from tf_dp.gradients.ghost.lora import lora_factors

        out.extend(lora_factors(layer, "btc,cd->btd", x, g))
    if _trainable(layer.bias):
        out.append((layer.bias, _bias_per_example(g, layer.bias)))
    return out


# -- EinsumDense ----------------------------------------------------------------------------------


def _parse_einsum(equation: str):
    lhs, out = equation.replace(" ", "").split("->")
    x_spec, k_spec = lhs.split(",")
    return x_spec, k_spec, out


def _einsum_supports(layer) -> Optional[str]:
    reason = _not_quantized(layer)
    if reason:
        return reason
    try:
        x_spec, k_spec, o_spec = _parse_einsum(layer.equation)
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


def einsum_kernel_factor(equation: str, x, g, kernel_shape):
    """The factor of the per-example gradient of ``kernel`` in ``einsum(equation, x, kernel)``
    (batch on the first axis of ``x`` and the output; ``g`` the output gradient)."""
    x_spec, k_spec, o_spec = _parse_einsum(equation)
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
        tf.reshape(x_t, [_batch(x_t), -1, cn]),
        tf.reshape(g_t, [_batch(g_t), -1, dn]),
        unflat_shape=[kdims[c] for c in order],
        perm=None if perm == list(range(len(perm))) else perm,
    )


def einsum_dense_rule(layer, inputs, grad_output):
    x, g = _f32(inputs), _f32(grad_output)
    kernel = kernel_variable(layer)
    out = []
    if _trainable(kernel):
        out.append((kernel, einsum_kernel_factor(layer.equation, x, g, kernel.shape)))
    if getattr(layer, "lora_enabled", False):
        from tf_dp.gradients.ghost.lora import lora_factors

        out.extend(lora_factors(layer, layer.equation, x, g))
    if _trainable(layer.bias):
        _, _, o_spec = _parse_einsum(layer.equation)
        bias_letters = "".join(c for c in o_spec if c in layer.bias_axes)
        per_ex = tf.einsum(f"{o_spec}->{o_spec[0]}{bias_letters}", g)
        out.append((layer.bias, PerExample(tf.reshape(per_ex, [_batch(g)] + list(layer.bias.shape)))))
    return out


# -- Conv1D / Conv2D ------------------------------------------------------------------------------


def _conv_supports(layer) -> Optional[str]:
    plain = _plain(layer)
    if plain:
        return plain
    if getattr(layer, "rank", None) not in (1, 2):
        return f"{layer.name}: only 1-D and 2-D convolutions have a built-in norm rule"
    if getattr(layer, "groups", 1) != 1:
        return f"{layer.name}: grouped convolutions have no built-in norm rule"
    return None


def _unfold(x, ks, st, dr, padding):
    """Patches ``[B, oh, ow, kh*kw*C]`` in (kh, kw, C) order, like ``tf.image.extract_patches``.

    - Static sizes and ``C >= 8``: a gather along the pixel axis of ``[B, H*W, C]`` with
      precomputed indices (rows of ``C`` floats; a pure memory pass, no arithmetic). On the
      reference CNN's second convolution this is 7x cheaper than a one-hot convolution, whose
      cost is ``B T K^2`` multiply-adds.
    - Small ``C`` (a gather of single floats is slow) and ``K = kh kw C <= 256``: a convolution
      with a one-hot kernel.
    - Otherwise ``tf.image.extract_patches``.
    See ``research/ghost/conv_bench.py`` for the measurements.
    """
    h, w, cin = x.shape[1], x.shape[2], x.shape[3]
    k = ks[0] * ks[1] * cin if cin is not None else None
    if h is not None and w is not None and cin is not None and cin >= 8:
        return _unfold_gather(x, ks, st, dr, padding)
    if cin is not None and k <= 256 and (all(s == 1 for s in st) or all(d == 1 for d in dr)):
        eye = tf.reshape(tf.eye(k, dtype=x.dtype), [ks[0], ks[1], cin, k])
        return tf.nn.conv2d(x, eye, [1, *st, 1], padding, dilations=[1, *dr, 1])
    return tf.image.extract_patches(
        x, sizes=[1, *ks, 1], strides=[1, *st, 1], rates=[1, *dr, 1], padding=padding
    )


def _same_pads(size, k, s, d):
    out = -(-size // s)
    total = max((out - 1) * s + (k - 1) * d + 1 - size, 0)
    return total // 2, total - total // 2


def _unfold_gather(x, ks, st, dr, padding):
    import numpy as np

    (kh, kw), (sh, sw), (dh, dw) = ks, st, dr
    h, w, cin = x.shape[1], x.shape[2], x.shape[3]
    if padding == "SAME":
        (pt, pb), (pl, pr) = _same_pads(h, kh, sh, dh), _same_pads(w, kw, sw, dw)
        x = tf.pad(x, [[0, 0], [pt, pb], [pl, pr], [0, 0]])
        h, w = h + pt + pb, w + pl + pr
    oh = (h - (kh - 1) * dh - 1) // sh + 1
    ow = (w - (kw - 1) * dw - 1) // sw + 1
    p, q, i, j = np.meshgrid(
        np.arange(oh), np.arange(ow), np.arange(kh), np.arange(kw), indexing="ij"
    )
    idx = ((sh * p + dh * i) * w + (sw * q + dw * j)).reshape(-1).astype(np.int32)
    pixels = tf.reshape(x, [-1, h * w, cin])
    return tf.reshape(tf.gather(pixels, idx, axis=1), [-1, oh, ow, kh * kw * cin])


def conv_rule(layer, inputs, grad_output):
    x, g = _f32(inputs), _f32(grad_output)
    rank = layer.rank
    if layer.data_format == "channels_first":
        perm = [0] + list(range(2, rank + 2)) + [1]
        x, g = tf.transpose(x, perm), tf.transpose(g, perm)
    padding = layer.padding
    ks, st, dr = list(layer.kernel_size), list(layer.strides), list(layer.dilation_rate)
    if rank == 1:
        if padding == "causal":
            x = tf.pad(x, [[0, 0], [dr[0] * (ks[0] - 1), 0], [0, 0]])
            padding = "valid"
        x, g = x[:, None], g[:, None]
        ks, st, dr = [1] + ks, [1] + st, [1] + dr
    patches = _unfold(x, ks, st, dr, padding.upper())
    k = patches.shape[-1]
    f = g.shape[-1]
    out = [(layer.kernel, Outer(tf.reshape(patches, [_batch(x), -1, k]), tf.reshape(g, [_batch(g), -1, f])))]
    if layer.bias is not None:
        out.append((layer.bias, _bias_per_example(g, layer.bias)))
    return out


# -- Embedding ------------------------------------------------------------------------------------


def embedding_rule(layer, inputs, grad_output):
    ids = tf.convert_to_tensor(inputs)
    g = _f32(grad_output)
    d = g.shape[-1]
    return [
        (
            layer.embeddings,
            Rows(tf.reshape(ids, [_batch(ids), -1]), tf.reshape(g, [_batch(g), -1, d]), layer.input_dim),
        )
    ]


# -- LayerNormalization / GroupNormalization ------------------------------------------------------


def _affine_norm_factors(layer, xhat, g, param_axes, rank, beta_used=True):
    """Per-example gamma/beta gradients: sums of ``g * xhat`` / ``g`` over the other axes."""
    reduce_axes = [a for a in range(1, rank) if a not in param_axes]
    out = []
    gamma = getattr(layer, "gamma", None)
    beta = getattr(layer, "beta", None)
    if gamma is not None:
        per_ex = tf.reduce_sum(g * xhat, axis=reduce_axes) if reduce_axes else g * xhat
        out.append((gamma, PerExample(tf.reshape(per_ex, [_batch(g)] + list(gamma.shape)))))
    if beta is not None:
        per_ex = tf.reduce_sum(g, axis=reduce_axes) if reduce_axes else g
        if not beta_used:  # e.g. LayerNormalization(rms_scaling=True) ignores beta
            per_ex = tf.zeros_like(per_ex)
        out.append((beta, PerExample(tf.reshape(per_ex, [_batch(g)] + list(beta.shape)))))
    return out


def layer_norm_rule(layer, inputs, grad_output):
    x, g = _f32(inputs), _f32(grad_output)
    rank = x.shape.rank
    axes = layer.axis if isinstance(layer.axis, (list, tuple)) else [layer.axis]
    axes = sorted(a % rank for a in axes)
    xhat = keras.ops.layer_normalization(
        x, None, None, axis=axes, epsilon=layer.epsilon, rms_scaling=layer.rms_scaling
    )
    return _affine_norm_factors(
        layer, _f32(xhat), g, axes, rank, beta_used=not layer.rms_scaling
    )


def group_norm_rule(layer, inputs, grad_output):
    x, g = _f32(inputs), _f32(grad_output)
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


def _register_builtins() -> None:
    L = keras.layers
    register_layer_norm_rule(L.Dense, dense_rule, supports=_dense_supports, split_activation=True)
    register_layer_norm_rule(
        L.EinsumDense, einsum_dense_rule, supports=_einsum_supports, split_activation=True
    )
    for cls in (L.Conv1D, L.Conv2D):
        register_layer_norm_rule(cls, conv_rule, supports=_conv_supports, split_activation=True)
    register_layer_norm_rule(L.Embedding, embedding_rule, supports=_plain)
    register_layer_norm_rule(L.LayerNormalization, layer_norm_rule)
    register_layer_norm_rule(L.GroupNormalization, group_norm_rule)
    from tf_dp.gradients.ghost import embeddings, normalization, recurrent

    recurrent.register()
    embeddings.register()
    normalization.register()


_register_builtins()
