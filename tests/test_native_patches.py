"""The native patch extraction (``TfDpExtractPatches``, tf_dp/dp_query/native/patches_op.cc) used
by the ghost convolution rule's unfold: the values of ``tf.image.extract_patches`` bit for bit (a
copy: no tolerance) over paddings, strides, dilations, channel counts and dtypes, its gradient,
and the rule's per-example norms with it against a per-example GradientTape loop."""

from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.test_ghost import LoopReference, check, rng
from tf_dp.dp_query import native
from tf_dp.gradients.ghost import conv as ghost_conv

CASES = [
    # shape, kernel, strides, rates, padding
    ((4, 28, 28, 1), (8, 8), (2, 2), (1, 1), "SAME"),   # the reference CNN's first layer
    ((4, 13, 13, 16), (4, 4), (2, 2), (1, 1), "VALID"),  # its second
    ((3, 10, 11, 3), (3, 2), (1, 2), (2, 1), "SAME"),
    ((2, 9, 7, 5), (3, 3), (2, 1), (1, 2), "VALID"),
    ((2, 6, 5, 2), (5, 4), (3, 2), (1, 1), "SAME"),      # patches wider than the image
    ((2, 4, 4, 2), (5, 5), (1, 1), (1, 1), "VALID"),     # no patch fits: empty output
    ((1, 7, 9, 4), (1, 1), (1, 1), (1, 1), "VALID"),     # 1x1: a copy of x
]


def test_native_ops_are_built_on_this_machine():
    assert native.available(), native.status()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-k{c[1]}-s{c[2]}-r{c[3]}-{c[4]}"
                                             for c in CASES])
def test_patches_equal_tensorflows_extract_patches(case, dtype):
    shape, ks, st, dr, padding = case
    x = tf.cast(tf.constant(np.random.default_rng(0).normal(size=shape), tf.float32), dtype)
    got = native.extract_patches_op(x, ks, st, dr, padding)
    want = tf.image.extract_patches(x, [1, *ks, 1], [1, *st, 1], [1, *dr, 1], padding)
    assert got.shape == want.shape  # the static shape set in Python
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got.numpy().astype(np.float64),
                                  want.numpy().astype(np.float64))


def test_patches_gradient_is_extract_patches_gradient():
    x = tf.constant(np.random.default_rng(1).normal(size=(2, 9, 8, 3)), tf.float32)
    w = tf.constant(np.random.default_rng(2).normal(size=(2, 5, 4, 27)), tf.float32)
    grads = []
    for fn in (lambda v: native.extract_patches_op(v, (3, 3), (2, 2), (1, 1), "SAME"),
               lambda v: tf.image.extract_patches(v, [1, 3, 3, 1], [1, 2, 2, 1], [1, 1, 1, 1],
                                                  "SAME")):
        with tf.GradientTape() as tape:
            tape.watch(x)
            y = tf.reduce_sum(fn(x) * w)
        grads.append(tape.gradient(y, x).numpy())
    np.testing.assert_array_equal(grads[0], grads[1])


def test_the_rule_unfolds_natively_outside_xla_and_with_tensorflow_ops_under_it():
    x = tf.constant(np.random.default_rng(3).normal(size=(2, 12, 12, 1)), tf.float32)
    ops = {}
    for jit in (False, True):
        fn = tf.function(lambda v: ghost_conv._unfold(v, [8, 8], [2, 2], [1, 1], "SAME"),
                         jit_compile=jit)
        graph = fn.get_concrete_function(x).graph
        ops[jit] = {op.type for op in graph.get_operations()}
        np.testing.assert_array_equal(
            fn(x).numpy(),
            tf.image.extract_patches(x, [1, 8, 8, 1], [1, 2, 2, 1], [1, 1, 1, 1], "SAME").numpy())
    assert "TfDpExtractPatches" in ops[False]
    assert "TfDpExtractPatches" not in ops[True]


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
@pytest.mark.parametrize("padding", ["same", "valid"])
def test_ghost_conv_norms_with_native_patches_equal_the_per_example_loop(padding, graph,
                                                                        monkeypatch):
    """The ghost clipper (norms and clipped sum) on a CNN whose convolutions (1 and 4 input
    channels, strides, a dilation) are unfolded by the native op, against per-example gradients
    from a GradientTape loop (tests/test_ghost.py's ``check``). The per-example kernel gradients
    that would otherwise come from ``TfDpConvKernelGrads`` (tests/test_native_conv_grads.py) are
    taken from the patches here."""
    monkeypatch.setattr(ghost_conv, "_native_kernel_grads", lambda layer, x, g: None)
    r = rng(91)
    model = keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 5, strides=2, padding=padding, activation="tanh"),
        keras.layers.Conv2D(3, 2, padding=padding, dilation_rate=2),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])
    x = (r.normal(size=(6, 12, 12, 1)) * r.uniform(0.2, 3.0, (6, 1, 1, 1))).astype("float32")
    check(model, x, r.integers(0, 3, 6), graph=graph, reference=LoopReference)
