"""Exact ghost rules for ``Conv3D``, ``Conv3DTranspose`` (and their ``Convolution3D`` aliases) and
``PReLU``, which fell back to per-example gradients before (issue 35). Each is checked against
per-example gradients from a ``GradientTape`` loop over the examples (``LoopReference``), clipped
and summed (eager, ``tf.function``), and the unclipped sums of a model with all three under XLA and mixed float16; the plan
must cover every variable (mode ``"ghost"``, no fallback). Also: layers whose parameter Keras
applies along another axis than the layer's ``axis`` says (a channels_first bias, an
``RMSNormalization`` scale) are measured as applied.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import tolerance
from tests.test_ghost import LoopReference, _compile, check, rng
from tests.test_ghost_finetuning_rules import _sum_fn
from tests.test_ghost_more_rules import _magnitude
from tf_dp.gradients.ghost import GhostClipper

L = keras.layers


def _pool(rank):
    return {1: L.GlobalAveragePooling1D, 2: L.GlobalAveragePooling2D,
            3: L.GlobalAveragePooling3D}[rank]()


def _inputs(r, shape, n=6):
    scale = r.uniform(0.2, 3.0, (n,) + (1,) * len(shape))
    return (r.normal(size=(n,) + shape) * scale).astype("float32")


@pytest.mark.parametrize(
    "layer, shape, graph",
    [
        (lambda: L.Conv3D(4, (2, 3, 2), strides=(1, 2, 1), padding="same"), (4, 5, 4, 2), False),
        (lambda: L.Conv3D(3, 2, padding="valid", activation="relu"), (4, 4, 3, 3), False),
        (lambda: L.Convolution3D(2, 3, strides=2, use_bias=False), (5, 5, 5, 1), False),
        (lambda: L.Conv3DTranspose(3, 2, strides=2, padding="same"), (3, 3, 3, 2), False),
        (lambda: L.Conv3DTranspose(2, (3, 2, 2), padding="valid"), (3, 4, 3, 2), False),
        (
            lambda: L.Convolution3DTranspose(2, 3, strides=2, padding="same", use_bias=False),
            (3, 3, 2, 2),
            False,
        ),
    ],
)
def test_conv3d(layer, shape, graph):
    r = rng(71)
    model = keras.Sequential(
        [keras.Input(shape), layer(), L.Activation("tanh"), L.Flatten(), L.Dense(3)]
    )
    check(model, _inputs(r, shape), r.integers(0, 3, 6), graph=graph, reference=LoopReference)


@pytest.mark.parametrize(
    "shape, shared_axes, graph",
    [((5,), None, False), ((4, 5), [1], True), ((4, 4, 3), [1, 2], False), ((4, 5), None, False)],
)
def test_prelu(shape, shared_axes, graph):
    r = rng(72)
    rank = len(shape) - 1
    layers = [keras.Input(shape), L.Dense(shape[-1]), L.PReLU(shared_axes=shared_axes)]
    if rank:
        layers.append(_pool(rank))
    model = keras.Sequential(layers + [L.Dense(3)])
    prelu = model.layers[1]
    # alpha starts at 0 (its gradient would be all that matters): draw it
    prelu.alpha.assign(r.uniform(0.05, 0.5, prelu.alpha.shape).astype("float32"))
    sw = r.uniform(0.5, 2.0, 6).astype("float32")
    check(model, _inputs(r, shape), r.integers(0, 3, 6), sw, graph=graph, reference=LoopReference)


def _volume(dtype=None):
    model = keras.Sequential(
        [
            keras.Input((4, 4, 4, 2)),
            L.Conv3D(3, 2, padding="same", dtype=dtype),
            L.PReLU(shared_axes=[1, 2, 3], dtype=dtype),
            L.Conv3DTranspose(2, 2, strides=2, padding="same", dtype=dtype),
            L.GlobalAveragePooling3D(dtype=dtype),
            L.Dense(3, dtype="float32"),
        ]
    )
    model.layers[1].alpha.assign(np.array([[[[0.1, 0.3, 0.2]]]], "float32"))
    return _compile(model)


# roundings of one gradient entry: forward Conv3D 2^3 x 2 products + bias, PReLU 2, the transpose's
# 3 products + bias per output voxel, the mean over 8^3 voxels, the head 2 + 1, log-softmax 3;
# the backward pass the same without the softmax; the kernels' and alpha's sums over the 64 input
# voxels (3 of them); 2 casts
VOLUME_TERMS = 2 * (17 + 2 + 4 + 512 + 3) + 3 + 3 * 64 + 2


def _volume_data():
    r = rng(73)
    return _inputs(r, (4, 4, 4, 2)), r.integers(0, 3, 6)


def test_volume_xla():
    model = _volume()
    x, y = _volume_data()
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
    strategy = GhostClipper()
    got = _sum_fn(strategy, model, (tf.constant(x), tf.constant(y), None), True)()
    assert strategy.mode == "ghost", strategy.description
    atol = tolerance("float32", VOLUME_TERMS, _magnitude(model, (x, y, None)))
    for v, a, b in zip(model.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


def test_volume_mixed_precision():
    model = _volume()
    x, y = _volume_data()
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
    magnitude = _magnitude(model, (x, y, None))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = _volume()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    strategy = GhostClipper()
    got = _sum_fn(strategy, half, (tf.constant(x), tf.constant(y), None), False)()
    assert strategy.mode == "ghost", strategy.description
    atol = tolerance("float16", VOLUME_TERMS, magnitude)
    for v, a, b in zip(half.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


@pytest.mark.parametrize(
    "make, shape, mode",
    [
        # last output axis == filters: Keras adds the bias along the last axis (ops.add's
        # bias_add shortcut), so the per-channel rule would measure another gradient
        (lambda: L.Conv2D(4, 3, padding="same", data_format="channels_first"), (2, 4, 4), "mixed"),
        (lambda: L.Conv1D(4, 1, data_format="channels_first"), (2, 4), "mixed"),
        (lambda: L.Conv2D(4, 3, padding="same", data_format="channels_first"), (2, 5, 5), "ghost"),
    ],
)
def test_channels_first_bias_on_the_last_axis_falls_back(make, shape, mode):
    r = rng(5)
    model = keras.Sequential(
        [keras.Input(shape), make(), L.Activation("tanh"), L.Flatten(), L.Dense(3)]
    )
    x = r.normal(size=(6,) + shape).astype("float32")
    check(model, x, r.integers(0, 3, 6), reference=LoopReference, expect_mode=mode)


@pytest.mark.parametrize(
    "make, shape",
    [
        # Keras 3.15 multiplies by scale ([4]) by broadcasting, so along the LAST axis, not axis 1
        (lambda: L.RMSNormalization(axis=1), (4, 3, 4)),
        (lambda: L.RMSNormalization(axis=[1, 2]), (3, 3, 3)),
        (lambda: L.RMSNormalization(axis=-1), (4, 3, 5)),
        (lambda: L.RMSNormalization(axis=[2, 3]), (4, 3, 5)),
    ],
)
def test_rms_normalization_scale_follows_the_applied_broadcast(make, shape):
    """The rule measures the gradient of the scale as Keras applies it (broadcast on the trailing
    axes), also where ``axis`` is not the trailing axes (the rule reduced over the wrong axes)."""
    r = rng(9)
    model = keras.Sequential(
        [keras.Input(shape), L.Dense(shape[-1]), make(), L.Activation("tanh"), L.Flatten(),
         L.Dense(3)]
    )
    model.build((None,) + shape)
    for v in model.layers[1].weights:
        v.assign(r.uniform(0.5, 2.0, v.shape).astype("float32"))
    x = r.normal(size=(6,) + shape).astype("float32")
    check(model, x, r.integers(0, 3, 6), reference=LoopReference, expect_mode="ghost")
