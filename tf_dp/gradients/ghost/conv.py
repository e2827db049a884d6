"""Norm rules for convolutions, from the unfolded input patches ``[B, T, kh*kw*C]``.

- ``Conv1D``, ``Conv2D`` and ``Conv3D`` (3-D: no dilation): the kernel's factor is
  ``Outer(patches, g)``; the bias is per example. 3-D patches ``[B, od, oh, ow, kd*kh*kw*C]``
  are a gather of voxel rows with precomputed indices (static sizes; XLA-compilable), else a
  convolution with a one-hot kernel. Where the engine would materialise a 1-D or 2-D kernel's
  per-example gradients from that factor anyway (:func:`~tf_dp.gradients.ghost.factors.use_gram`)
  they come from the native ``TfDpConvKernelGrads`` instead (float32, static sizes; under XLA as an
  XLA custom call; :func:`_native_kernel_grads`), which never writes the patches.
- Grouped ``Conv1D/2D/3D`` (``groups > 1``): per block of channels, the kernel's per-example
  gradient materialised (:class:`PerExample`).
- ``DepthwiseConv1D`` and ``DepthwiseConv2D``: output channel ``c M + m`` only reads input
  channel ``c``, so the per-example gradient of the ``[kh, kw, C, M]`` kernel is
  ``sum_t patches[t, k, c] g[t, c, m]``, materialised per example (:class:`PerExample`; it has
  the kernel's size, small, and costs what the forward convolution costs); the bias is per example.
- ``SeparableConv1D`` and ``SeparableConv2D``: the recorded pass runs the depthwise and the
  pointwise (1x1) convolution apart and watches both outputs; the depthwise kernel's factor is the
  depthwise rule's, from the layer input and the gradient at the depthwise output; the pointwise
  kernel's is ``Outer(depthwise output, g)``; the bias is per example.
- ``Conv1DTranspose``, ``Conv2DTranspose`` and ``Conv3DTranspose`` (no ``output_padding``, no
  dilation): the layer is
  the adjoint of a convolution from its output to its input, so its ``[kh, kw, F, C]`` kernel's
  per-example gradient is ``sum_t patches(g)[t] x[t]^T``, the output gradient unfolded with the
  layer's kernel size, strides and padding (one patch per input position): ``Outer(patches(g), x)``.
"""

from __future__ import annotations

from typing import Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _compat
from tf_dp._compat import build_input_shape
from tf_dp.dp_query import native
from tf_dp.gradients.ghost.common import batch_size, bias_per_example, f32, plain
from tf_dp.gradients.ghost.factors import Outer, PerExample, use_gram
from tf_dp.gradients.ghost.registry import norm_rule


def _bias_axis_hazard(layer) -> Optional[str]:
    """Keras 3's TensorFlow ``ops.add`` turns ``x + reshape(bias, [1, C, 1, ...])`` into a
    ``bias_add`` over the LAST axis whenever that axis also has C entries, so a
    ``channels_first`` convolution whose last output axis equals its bias size adds the bias
    along the wrong axis (keras 3.15). The rules assume the per-channel bias the layer means;
    there the model's real gradient differs, so such layers (or ones whose output size is not
    known when planned) go to the per-example fallback, which differentiates what runs."""
    if getattr(layer, "data_format", None) != "channels_first":
        return None
    if not getattr(layer, "use_bias", False) or getattr(layer, "bias", None) is None:
        return None
    size = int(layer.bias.shape[0])
    try:
        input_shape = build_input_shape(layer)
        last = layer.compute_output_shape(input_shape)[-1] if input_shape else None
    except Exception:  # noqa: BLE001 - an output size we cannot tell is treated as a match
        last = None
    if last is None or int(last) == size:
        return (
            f"{layer.name}: channels_first with a bias of {size} and a last output axis of "
            f"{last if last is not None else 'unknown'} size (Keras adds such a bias along the "
            "last axis); per-example gradients"
        )
    return None


def _depthwise_supports(layer) -> Optional[str]:
    reason = plain(layer)
    if reason:
        return reason
    reason = _bias_axis_hazard(layer)
    if reason:
        return reason
    if getattr(layer, "rank", None) not in (1, 2):
        return f"{layer.name}: only 1-D and 2-D depthwise convolutions have a built-in norm rule"
    return None


def _conv_supports(layer) -> Optional[str]:
    reason = plain(layer)
    if reason:
        return reason
    reason = _bias_axis_hazard(layer)
    if reason:
        return reason
    if getattr(layer, "rank", None) not in (1, 2, 3):
        return f"{layer.name}: only 1-D, 2-D and 3-D convolutions have a built-in norm rule"
    if layer.rank == 3 and any(d != 1 for d in layer.dilation_rate):
        return f"{layer.name}: dilated 3-D convolutions have no built-in norm rule"
    return None


def _unfold3d(x, ks, st, padding):
    """Patches ``[B, od, oh, ow, kd*kh*kw*C]`` in (kd, kh, kw, C) order, the order of a
    ``[kd, kh, kw, C, F]`` kernel flattened to ``[K, F]`` (what ``tf.extract_volume_patches``
    gives, which XLA cannot compile): a gather of voxel rows with precomputed indices when the
    sizes are static, else a convolution with a one-hot ``[kd, kh, kw, C, K]`` kernel."""
    d, h, w, cin = x.shape[1], x.shape[2], x.shape[3], x.shape[4]
    if None in (d, h, w, cin):
        k = int(np.prod(ks)) * cin
        eye = tf.reshape(tf.eye(k, dtype=x.dtype), [*ks, cin, k])
        return tf.nn.conv3d(x, eye, [1, *st, 1], padding)
    if padding == "SAME":
        pads = [_same_pads(n, kk, ss, 1) for n, kk, ss in zip((d, h, w), ks, st)]
        x = tf.pad(x, [[0, 0], *[list(p) for p in pads], [0, 0]])
        d, h, w = (n + p[0] + p[1] for n, p in zip((d, h, w), pads))
    out = [(n - kk) // ss + 1 for n, kk, ss in zip((d, h, w), ks, st)]
    grid = np.meshgrid(*[np.arange(o) for o in out], *[np.arange(kk) for kk in ks], indexing="ij")
    (p, q, r), (i, j, l) = grid[:3], grid[3:]
    idx = ((st[0] * p + i) * h + (st[1] * q + j)) * w + (st[2] * r + l)
    voxels = tf.reshape(x, [-1, d * h * w, cin])
    gathered = tf.gather(voxels, idx.reshape(-1).astype(np.int32), axis=1)
    return tf.reshape(gathered, [-1, *out, int(np.prod(ks)) * cin])


def _unfold(x, ks, st, dr, padding):
    """Patches ``[B, oh, ow, kh*kw*C]`` in (kh, kw, C) order, like ``tf.image.extract_patches``.

    - Where tf_dp's native ops are available (a C++ compiler, no GPU or TPU) and outside XLA:
      ``TfDpExtractPatches`` (:func:`tf_dp.dp_query.native.extract_patches_op`), one copy pass,
      the same values bit for bit: on the reference CNN 1.6 ms instead of the one-hot
      convolution's 2.9 ms (first layer) and 0.37 instead of the gather's 0.67 ms (second).
    - Static sizes and ``C >= 8``: a gather along the pixel axis of ``[B, H*W, C]`` with
      precomputed indices (rows of ``C`` floats; a pure memory pass, no arithmetic). On the
      reference CNN's second convolution this is 7x cheaper than a one-hot convolution, whose
      cost is ``B T K^2`` multiply-adds.
    - Small ``C`` (a gather of single floats is slow) and ``K = kh kw C <= 256``: a convolution
      with a one-hot kernel.
    - Otherwise ``tf.image.extract_patches``.
    See ``research/ghost/conv_bench.py`` for the measurements.
    """
    if native.available() and not _compat.graph_in_xla_context():
        return native.extract_patches_op(x, ks, st, dr, padding)
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


def _channels_last(layer, x, g):
    """``(x, g, kernel sizes, strides, dilations, padding)`` in channels-last layout, a 1-D
    convolution as a 2-D one of height 1 (causal padding as explicit left padding); padding
    upper-cased."""
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
    return x, g, ks, st, dr, padding.upper()


def _patches(layer, x, g):
    """``(patches [B, ..., K], g [B, ..., F])`` in channels-last layout (``K = kh kw C``)."""
    x, g, ks, st, dr, padding = _channels_last(layer, x, g)
    if layer.rank == 3:
        return _unfold3d(x, ks, st, padding), g
    return _unfold(x, ks, st, dr, padding), g


#: Under XLA, the largest ratio of a convolution's per-example kernel gradients ``k f`` to its
#: patches and output gradient ``t (k + f)`` (per example) for which :func:`_native_kernel_grads`
#: is used instead of the Gram route (the reference CNN's second convolution: 1.14).
_XLA_NATIVE_MAX_RATIO = 2


def _native_kernel_grads(layer, x, g):
    """``(per-example kernel gradients [B, *kernel.shape], g channels-last)`` from
    ``TfDpConvKernelGrads`` (:func:`tf_dp.dp_query.native.conv_kernel_grads_op`: no patches
    written to memory), or None.

    Outside XLA, used where the engine would materialise them from the patches anyway (the cost
    model of :func:`tf_dp.gradients.ghost.factors.use_gram`: ``T^2 (K + F) >= K F`` and
    ``[B, K, F]`` no larger than the patches), for float32 1-D and 2-D convolutions with static
    sizes, where the native ops are available. On the reference CNN's first convolution (T = 196
    patches of K = 64, F = 16, B = 256) it takes about a third of the patches' route's time.
    Under XLA (static shapes, the batch's included, and
    :func:`tf_dp.dp_query.native.xla_available`) the same kernel runs as an XLA custom call
    (:func:`tf_dp.dp_query.native.conv_kernel_grads_xla`), also where ``[B, K, F]`` is up to
    ``_XLA_NATIVE_MAX_RATIO`` times the patches and output gradient: XLA's unfold and small
    batched products are the slower route there (the reference CNN under XLA,
    ``bench/README.md``)."""
    if layer.rank not in (1, 2) or getattr(layer, "groups", 1) != 1:
        return None
    if x.dtype != tf.float32 or g.dtype != tf.float32:
        return None
    in_xla = _compat.graph_in_xla_context()
    if not (native.xla_available() if in_xla else native.available()):
        return None
    x, g, ks, st, dr, padding = _channels_last(layer, x, g)
    # under XLA the custom call's result shape is fixed when the function is traced
    static = (x.shape, g.shape) if in_xla else (x.shape[1:], g.shape[1:])
    if not all(shape.is_fully_defined() for shape in static):
        return None
    t, k, f = g.shape[1] * g.shape[2], ks[0] * ks[1] * x.shape[3], g.shape[3]
    if in_xla:
        # Under XLA the Gram route's unfold (a gather or a one-hot convolution) and its small
        # batched products run several times slower than the native kernel: it is taken unless
        # the Gram route is the cheaper by its cost alone (t^2 (k + f) < k f) or the per-example
        # gradients would exceed twice the patches and output gradient (memory).
        if t * t * (k + f) < k * f or k * f > _XLA_NATIVE_MAX_RATIO * t * (k + f):
            return None
    elif use_gram(t, k, f):
        return None
    kernel_grads = native.conv_kernel_grads_xla if in_xla else native.conv_kernel_grads_op
    grads = kernel_grads(x, g, ks, st, dr, padding)
    return tf.reshape(grads, [batch_size(x)] + list(layer.kernel.shape)), g


@norm_rule(
    getattr(keras.layers, "DepthwiseConv1D", None),
    getattr(keras.layers, "DepthwiseConv2D", None),
    supports=_depthwise_supports,
    split_activation=True,
)
def depthwise_conv_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    patches, g = _patches(layer, x, g)
    kernel = layer.kernel  # [kh, (kw,) C, M]
    c, m = kernel.shape[-2], kernel.shape[-1]
    taps = int(np.prod(kernel.shape[:-2]))
    b = batch_size(x)
    p = tf.reshape(patches, [b, -1, taps, c])
    gg = tf.reshape(g, [b, -1, c, m])
    per_example = tf.einsum("btkc,btcm->bkcm", p, gg)
    out = [(kernel, PerExample(tf.reshape(per_example, [b] + list(kernel.shape))))]
    if layer.bias is not None:
        out.append((layer.bias, bias_per_example(g, layer.bias)))
    return out


def _grouped_kernel_factor(kernel, patches, g, groups):
    """A grouped convolution (``groups`` G: input channels and filters in G contiguous blocks,
    block j of the filters reading only block j of the channels; ConvNeXt's depthwise
    ``Conv2D(groups=C)``): its ``[*taps, C/G, F]`` kernel's per-example gradient is, per block,
    ``sum_t patches[t, k, j, c] g[t, j, f]``, materialised (:class:`PerExample`, the kernel's
    size per example: small for the depthwise case; costs what the forward convolution costs)."""
    cg, f = kernel.shape[-2], kernel.shape[-1]
    taps = int(np.prod(kernel.shape[:-2]))
    b = batch_size(g)
    p = tf.reshape(patches, [b, -1, taps, groups, cg])
    gg = tf.reshape(g, [b, -1, groups, f // groups])
    per_example = tf.einsum("btkjc,btjf->bkcjf", p, gg)
    return PerExample(tf.reshape(per_example, [b] + list(kernel.shape)))


@norm_rule(
    keras.layers.Conv1D,
    keras.layers.Conv2D,
    keras.layers.Conv3D,
    supports=_conv_supports,
    split_activation=True,
)
def conv_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    native_grads = _native_kernel_grads(layer, x, g)
    if native_grads is not None:
        grads, g = native_grads
        out = [(layer.kernel, PerExample(grads))]
        if layer.bias is not None:
            out.append((layer.bias, bias_per_example(g, layer.bias)))
        return out
    patches, g = _patches(layer, x, g)
    k = patches.shape[-1]
    f = g.shape[-1]
    groups = getattr(layer, "groups", 1)
    if groups != 1:
        out = [(layer.kernel, _grouped_kernel_factor(layer.kernel, patches, g, groups))]
        if layer.bias is not None:
            out.append((layer.bias, bias_per_example(g, layer.bias)))
        return out
    out = [
        (
            layer.kernel,
            Outer(
                tf.reshape(patches, [batch_size(x), -1, k]), tf.reshape(g, [batch_size(g), -1, f])
            ),
        )
    ]
    if layer.bias is not None:
        out.append((layer.bias, bias_per_example(g, layer.bias)))
    return out


def _separable_supports(layer) -> Optional[str]:
    reason = plain(layer)
    if reason:
        return reason
    reason = _bias_axis_hazard(layer)
    if reason:
        return reason
    if getattr(layer, "rank", None) not in (1, 2):
        return f"{layer.name}: only 1-D and 2-D separable convolutions have a built-in norm rule"
    if layer.padding == "causal":
        return f"{layer.name}: causal separable convolutions have no built-in norm rule"
    return None


def separable_forward(layer, call, args, kwargs, watch):
    """The separable convolution as its two convolutions, both outputs watched (no activation:
    the rule is registered with ``split_activation``)."""
    x = args[0] if args else kwargs["inputs"]
    mid = keras.ops.depthwise_conv(
        x,
        layer.depthwise_kernel,
        strides=layer.strides,
        padding=layer.padding,
        data_format=layer.data_format,
        dilation_rate=layer.dilation_rate,
    )
    mid = watch(mid)
    out = keras.ops.conv(
        mid, layer.pointwise_kernel, strides=1, padding="valid", data_format=layer.data_format
    )
    if layer.use_bias:
        axis = -1 if layer.data_format == "channels_last" else 1
        shape = [1] * (layer.rank + 2)
        shape[axis] = layer.filters
        out = out + keras.ops.reshape(layer.bias, shape)
    return watch(out), (x, mid)


@norm_rule(
    getattr(keras.layers, "SeparableConv1D", None),
    getattr(keras.layers, "SeparableConv2D", None),
    supports=_separable_supports,
    split_activation=True,
    forward=separable_forward,
)
def separable_conv_rule(layer, context, grads):
    x, mid = context
    g_mid, g = f32(grads[0]), f32(grads[1])
    patches, g_mid = _patches(layer, f32(x), g_mid)
    kernel = layer.depthwise_kernel  # [kh, (kw,) C, M]
    c, m = kernel.shape[-2], kernel.shape[-1]
    taps = int(np.prod(kernel.shape[:-2]))
    b = batch_size(g)
    p = tf.reshape(patches, [b, -1, taps, c])
    per_example = tf.einsum("btkc,btcm->bkcm", p, tf.reshape(g_mid, [b, -1, c, m]))
    mid = f32(mid)
    if layer.data_format == "channels_first":
        perm = [0] + list(range(2, layer.rank + 2)) + [1]
        mid, g = tf.transpose(mid, perm), tf.transpose(g, perm)
    f = g.shape[-1]
    out = [
        (kernel, PerExample(tf.reshape(per_example, [b] + list(kernel.shape)))),
        (
            layer.pointwise_kernel,
            Outer(tf.reshape(mid, [b, -1, c * m]), tf.reshape(g, [b, -1, f])),
        ),
    ]
    if layer.use_bias:
        out.append((layer.bias, bias_per_example(g, layer.bias)))
    return out


def _transpose_supports(layer) -> Optional[str]:
    reason = plain(layer)
    if reason:
        return reason
    reason = _bias_axis_hazard(layer)
    if reason:
        return reason
    if getattr(layer, "rank", None) not in (1, 2, 3):
        return (
            f"{layer.name}: only 1-D, 2-D and 3-D transposed convolutions have a built-in norm "
            "rule"
        )
    if getattr(layer, "output_padding", None) is not None:
        return f"{layer.name}: transposed convolutions with output_padding have no built-in rule"
    if any(d != 1 for d in layer.dilation_rate):
        return f"{layer.name}: dilated transposed convolutions have no built-in norm rule"
    return None


@norm_rule(
    getattr(keras.layers, "Conv1DTranspose", None),
    getattr(keras.layers, "Conv2DTranspose", None),
    getattr(keras.layers, "Conv3DTranspose", None),
    supports=_transpose_supports,
    split_activation=True,
)
def conv_transpose_rule(layer, inputs, grad_output):
    x, g = f32(inputs), f32(grad_output)
    rank = layer.rank
    if layer.data_format == "channels_first":
        perm = [0] + list(range(2, rank + 2)) + [1]
        x, g = tf.transpose(x, perm), tf.transpose(g, perm)
    ks, st = list(layer.kernel_size), list(layer.strides)
    if rank == 1:
        x, g = x[:, None], g[:, None]
        ks, st = [1] + ks, [1] + st
    if rank == 3:  # [B, D_in, H_in, W_in, kd kh kw F]
        patches = _unfold3d(g, ks, st, layer.padding.upper())
    else:  # [B, H_in, W_in, kh kw F]
        patches = _unfold(g, ks, st, [1, 1], layer.padding.upper())
    b = batch_size(x)
    c = x.shape[-1]
    out = [
        (
            layer.kernel,
            Outer(
                tf.reshape(patches, [b, -1, patches.shape[-1]]), tf.reshape(x, [b, -1, c])
            ),
        )
    ]
    if layer.bias is not None:
        out.append((layer.bias, bias_per_example(g, layer.bias)))
    return out
