"""Norm rule for keras-hub Qwen3.5's ``Qwen3_5GatedDeltaNet`` (gated delta-rule linear attention).

Its five projections are ``Dense`` layers with their own rule; the rule here covers the layer's
other variables, each from one tensor watched with the examples on axis 0:

- ``conv1d_kernel`` ``[C, K]``: the causal depthwise convolution ``out[b, c, t] = sum_k w[c, k]
  xpad[b, c, t + k]`` (``xpad`` the input left-padded by ``K - 1``), computed by keras-hub's
  ``_causal_conv1d``, whose output is watched and input kept: example ``b``'s gradient is
  ``sum_t G[b, c, t] xpad[b, c, t + k]``;
- ``A_log`` and ``dt_bias`` ``[heads]``: read by the call only in the gate ``g = -exp(A_log) *
  softplus(a + dt_bias)`` with ``a`` of shape ``[B, T, heads]``; for the call each is replaced by
  its broadcast to ``[B, 1, heads]`` (the same values), watched, so its gradient is example ``b``'s
  gradient in row ``b``, summed over the middle axis;
- the gated RMS norm's ``scale`` ``[head_dim]``: the call applies the norm to
  ``reshape(core, (-1, head_dim))``, its recurrence output ``core`` ``[B, T, heads, head_dim]``
  flattened into axis 0. The forward makes that reshape itself (the module's ``ops.reshape`` of
  exactly the recorded ``core``, row-major, so batch-major by construction) and applies the norm
  to ``core`` unflattened, watched, returning its flattened output: example ``b``'s gradient is
  ``sum_{t, h} G[b, t, h] * xhat[b, t, h]`` (the RMS-norm rule).

``supports`` accepts keras-hub's own ``Qwen3_5GatedDeltaNet`` with its own gated norm; the forward
refuses a cached (generation) call and raises if a hook did not see exactly the use it expects
(a changed keras-hub), never leaving a gradient out silently.
"""

from __future__ import annotations

import sys
from typing import Optional

import tensorflow as tf
from keras import ops

from tf_dp import _compat
from tf_dp.gradients.ghost.common import f32, trainable
from tf_dp.gradients.ghost.factors import PerExample
from tf_dp.gradients.ghost.normalization import last_axis_rms_norm_rule

_MODULE = "keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net"


def delta_net_supports(layer) -> Optional[str]:
    from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import Qwen3_5GatedDeltaNet
    from keras_hub.src.models.qwen3_5.qwen3_5_layers import Qwen3_5RMSNormGated

    if type(layer) is not Qwen3_5GatedDeltaNet:
        return f"{layer.name}: not keras-hub's own Qwen3_5GatedDeltaNet"
    if type(getattr(layer, "norm", None)) is not Qwen3_5RMSNormGated:
        return f"{layer.name}: its output norm is not keras-hub's Qwen3_5RMSNormGated"
    try:
        _compat.Qwen3_5DeltaNetHooks(None, None)
    except (ImportError, AttributeError) as e:
        return f"{layer.name}: keras-hub's delta-net module lacks a function the rule hooks ({e})"
    if tuple(layer.conv1d_weight.shape) != (2 * layer.key_dim + layer.value_dim,
                                            layer.conv_kernel_size):
        return f"{layer.name}: a convolution kernel of unexpected shape"
    return None


def delta_net_variables(layer) -> list:
    """The convolution kernel, ``A_log``, ``dt_bias`` and the gated norm's scale."""
    return [layer.conv1d_weight, layer.A_log, layer.dt_bias, layer.norm.scale]


class _ReshapeOf:
    """``keras.ops`` whose ``reshape`` of ``source()`` is kept in ``made`` (an identity record)."""

    def __init__(self, ops_module, source):
        self._ops, self._source = ops_module, source
        self.made: list = []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def reshape(self, x, newshape):
        out = self._ops.reshape(x, newshape)
        src = self._source()
        if src is not None and x is src:
            self.made.append(out)
        return out


def delta_net_forward(layer, call, args, kwargs, watch):
    """The layer's own call with its convolution, gate variables and gated norm observed as the
    module docstring says. Context: the convolution input and the norm input, unflattened."""
    hidden = args[0] if args else kwargs["hidden_states"]
    cache = kwargs.get("cache", args[2] if len(args) > 2 else None)
    if cache is not None:
        raise ValueError(f"{layer.name}: a cached (generation) call has no ghost rule")
    batch = tf.shape(hidden)[:1]
    seen: dict = {}

    def per_example(v):
        t = ops.convert_to_tensor(v)
        return watch(tf.broadcast_to(t, tf.concat([batch, [1], tf.shape(t)], 0)))

    a_log, dt_bias = per_example(layer.A_log), per_example(layer.dt_bias)
    order = []

    def conv1d(original, x, weight, bias=None):
        if weight is not layer.conv1d_weight or bias is not None or "conv" in seen:
            raise ValueError(f"{layer.name}: unexpected causal convolution call")
        seen["conv"] = x
        order.append("conv")
        return watch(original(x, weight, bias))

    def chunk_rule(original, *a, **k):
        out, state = original(*a, **k)
        seen.setdefault("core", out)
        return out, state

    module = sys.modules[_MODULE]
    proxy = _ReshapeOf(module.ops, lambda: seen.get("core"))
    norm = layer.norm
    norm_call = type(norm).call.__get__(norm)

    def norm_on_unflattened(x):
        # x must be the module's reshape of the recorded core output (proxy.made): a row-major
        # [B, T, H, d] -> [B T H, d] reshape, undone exactly by reshaping core itself
        if not any(x is m for m in proxy.made) or "norm" in seen:
            raise ValueError(f"{layer.name}: the gated norm's input is not the flattened core")
        core = seen["core"]
        seen["norm"] = core
        order.append("norm")
        y = watch(norm_call(core))
        return ops.reshape(y, (-1, core.shape[-1]))

    saved = {"A_log": layer.A_log, "dt_bias": layer.dt_bias, "norm": norm}
    module.ops = proxy
    for name, value in (("A_log", a_log), ("dt_bias", dt_bias), ("norm", norm_on_unflattened)):
        object.__setattr__(layer, name, value)
    try:
        with _compat.Qwen3_5DeltaNetHooks(conv1d, chunk_rule):
            out = call(*args, **kwargs)
    finally:
        module.ops = proxy._ops
        for name, value in saved.items():
            object.__setattr__(layer, name, value)
    if order != ["conv", "norm"]:
        raise ValueError(f"{layer.name}: expected one convolution then one gated norm, saw {order}")
    return out, (seen["conv"], seen["norm"])


def delta_net_rule(layer, context, grads):
    """Per-example gradients of the convolution kernel, ``A_log``, ``dt_bias`` and the norm's
    scale from the watched tensors' gradients (order: ``A_log``, ``dt_bias``, convolution output,
    norm output); see the module docstring."""
    conv_in, core = context
    g_alog, g_dt, g_conv, g_norm = (f32(g) for g in grads)
    kernel = layer.conv1d_weight
    k = int(kernel.shape[1])
    x = f32(conv_in)  # [B, C, T]
    t = tf.shape(x)[2]
    xpad = tf.pad(x, [[0, 0], [0, 0], [k - 1, 0]])
    conv = tf.stack([tf.reduce_sum(g_conv * xpad[:, :, j : j + t], axis=2) for j in range(k)], -1)
    pairs = [
        (kernel, PerExample(conv)),
        (layer.A_log, PerExample(tf.reduce_sum(g_alog, axis=1))),
        (layer.dt_bias, PerExample(tf.reduce_sum(g_dt, axis=1))),
    ]
    out = [(v, f) for v, f in pairs if trainable(v)]
    if trainable(layer.norm.scale):
        out.extend(last_axis_rms_norm_rule(layer.norm, core, g_norm))
    return out


def registrations() -> list:
    """``(module, class, register options)`` of this module's rule, for
    :func:`tf_dp.gradients.ghost.keras_hub_rules.register`."""
    return [
        (_MODULE, "Qwen3_5GatedDeltaNet",
         dict(rule=delta_net_rule, forward=delta_net_forward, supports=delta_net_supports,
              variables=delta_net_variables)),
    ]
