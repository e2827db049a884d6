"""The native per-example convolution kernel gradients (``TfDpConvKernelGrads``,
tf_dp/dp_query/native/patches_op.cc) used by the ghost convolution rule where it materialises
per-example gradients: the values against a float64 product of TensorFlow's own patches over
paddings, strides, dilations, channel and filter counts (with the forward error bound of a float32
sum as the tolerance), its shape checks, the same kernel as an XLA custom call (equal to the op bit
for bit), where the rule uses either (and where not: the Gram route, an unknown batch size under
XLA), and the ghost clipper's norms and clipped sums with it, eagerly, in a graph and under XLA,
against a per-example GradientTape loop."""

from __future__ import annotations

import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers import warm_python
from tests.test_ghost import LoopReference, check, rng
from tf_dp.dp_query import native
from tf_dp.gradients.ghost import conv as ghost_conv

CASES = [
    # x shape, kernel, strides, rates, padding, filters
    ((5, 28, 28, 1), (8, 8), (2, 2), (1, 1), "SAME", 16),   # the reference CNN's first layer
    ((4, 13, 13, 16), (4, 4), (2, 2), (1, 1), "VALID", 32),  # its second (two 16-lane blocks)
    ((3, 10, 11, 3), (3, 2), (1, 2), (2, 1), "SAME", 5),     # K = 18: rows beyond blocks of 8
    ((2, 9, 7, 5), (3, 3), (2, 1), (1, 2), "VALID", 17),     # F = 17: a partial 16-lane block
    ((2, 6, 5, 2), (5, 4), (3, 2), (1, 1), "SAME", 40),      # patches wider than the image
    ((3, 7, 9, 4), (1, 1), (1, 1), (1, 1), "VALID", 1),      # 1x1, one filter
    ((2, 1, 15, 3), (1, 4), (1, 3), (1, 2), "VALID", 64),    # a 1-D convolution (height 1)
]


def _float64_grads(x, g, ks, st, dr, padding):
    """``sum_t patches[b, t, k] g[b, t, f]`` and ``sum_t |patches| |g|`` in float64, from
    ``tf.image.extract_patches`` (TensorFlow's kernel, independent of tf_dp's)."""
    p = tf.image.extract_patches(x, [1, *ks, 1], [1, *st, 1], [1, *dr, 1], padding).numpy()
    b = x.shape[0]
    p = p.reshape(b, -1, p.shape[-1]).astype(np.float64)
    gg = g.numpy().reshape(b, -1, g.shape[-1]).astype(np.float64)
    return (np.einsum("btk,btf->bkf", p, gg),
            np.einsum("btk,btf->bkf", np.abs(p), np.abs(gg)), p.shape[1])


def test_native_ops_are_built_on_this_machine():
    assert native.available(), native.status()


def _case_inputs(case, seed):
    """``(x, g)`` for a case: random input and an output gradient of the convolution's shape."""
    shape, ks, st, dr, padding, f = case
    r = np.random.default_rng(seed)
    x = tf.constant(r.normal(size=shape), tf.float32)
    oshape = tf.image.extract_patches(x, [1, *ks, 1], [1, *st, 1], [1, *dr, 1], padding).shape
    return x, tf.constant(r.normal(size=(*oshape[:3], f)), tf.float32)


CASE_IDS = [f"{c[0]}-k{c[1]}-s{c[2]}-r{c[3]}-{c[4]}-f{c[5]}" for c in CASES]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_kernel_grads_equal_the_patches_product(case):
    _, ks, st, dr, padding, _ = case
    x, g = _case_inputs(case, 0)
    got = native.conv_kernel_grads_op(x, g, ks, st, dr, padding)
    want, magnitude, t = _float64_grads(x, g, ks, st, dr, padding)
    assert got.shape == want.shape  # the static shape set in Python
    # a float32 sum of t products, each rounded once, then t - 1 additions: the classic bound
    # |error| <= gamma_t sum |p g|, gamma_t = t u / (1 - t u), u = 2^-24 (Higham, Thm 3.1)
    u = 2.0 ** -24
    gamma = (t + 1) * u / (1 - (t + 1) * u)
    err = np.abs(got.numpy().astype(np.float64) - want)
    assert np.all(err <= gamma * magnitude + 1e-30), float(np.max(err / (magnitude + 1e-30)))
    assert np.any(want != 0)


def test_no_output_position_gives_zero_gradients():
    x = tf.ones([2, 4, 4, 2])
    g = tf.zeros([2, 0, 0, 3])
    got = native.conv_kernel_grads_op(x, g, (5, 5), (1, 1), (1, 1), "VALID")
    assert got.shape == (2, 50, 3)
    np.testing.assert_array_equal(got.numpy(), np.zeros((2, 50, 3), np.float32))


def test_an_output_gradient_of_the_wrong_shape_is_refused():
    x = tf.ones([2, 28, 28, 1])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"g must be \[2, 14, 14, F\]"):
        native.conv_kernel_grads_op(x, tf.ones([2, 13, 14, 16]), (8, 8), (2, 2), (1, 1), "SAME")
    with pytest.raises(tf.errors.InvalidArgumentError, match="padding must be SAME or VALID"):
        native.conv_kernel_grads_op(x, tf.ones([2, 14, 14, 16]), (8, 8), (2, 2), (1, 1), "FULL")


def _rule_ops(layer, x, jit, batch=-1):
    """The op types of the rule's graph for input ``x``, traced with the batch size ``batch``
    (-1: ``x``'s; None: unknown)."""
    g = tf.ones_like(layer(x))

    def rule(x, g):
        return [f.grads if hasattr(f, "grads") else f.a for _, f in ghost_conv.conv_rule(
            layer, x, g)]

    fn = tf.function(rule, jit_compile=jit)
    specs = [tf.TensorSpec([t.shape[0] if batch == -1 else batch, *t.shape[1:]], t.dtype)
             for t in (x, g)]
    return {op.type for op in fn.get_concrete_function(*specs).graph.get_operations()}


def test_the_rule_uses_the_kernel_where_it_materialises_eagerly_and_under_xla():
    r = rng(5)
    first = keras.layers.Conv2D(16, 8, strides=2, padding="same")  # T = 196, K = 64, F = 16
    x = tf.constant(r.normal(size=(2, 28, 28, 1)), tf.float32)
    assert "TfDpConvKernelGrads" in _rule_ops(first, x, jit=False)
    # under XLA: the same kernel as a custom call; with an unknown batch size (the call's shape
    # is fixed when traced) the patches' route
    under_xla = _rule_ops(first, x, jit=True)
    assert "XlaCustomCallV2" in under_xla and "TfDpConvKernelGrads" not in under_xla
    dynamic = _rule_ops(first, x, jit=True, batch=None)
    assert "XlaCustomCallV2" not in dynamic and "Conv2D" in dynamic
    # the reference CNN's second convolution (T = 25, K = 256, F = 32): the Gram route outside
    # XLA (K F > T (K + F)), the kernel under XLA (K F <= 2 T (K + F))
    second = keras.layers.Conv2D(32, 4, strides=2)
    z = tf.constant(r.normal(size=(2, 13, 13, 16)), tf.float32)
    assert "TfDpConvKernelGrads" not in _rule_ops(second, z, jit=False)
    assert "XlaCustomCallV2" in _rule_ops(second, z, jit=True)
    # few positions, many channels: the Gram route (T^2 (K + F) < K F) unfolds the patches
    late = keras.layers.Conv2D(64, 3)  # T = 4, K = 576, F = 64
    y = tf.constant(r.normal(size=(2, 4, 4, 64)), tf.float32)
    ops = _rule_ops(late, y, jit=False)
    assert "TfDpConvKernelGrads" not in ops and "TfDpExtractPatches" in ops
    assert "XlaCustomCallV2" not in _rule_ops(late, y, jit=True)


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_the_xla_custom_call_equals_the_op_bit_for_bit(case):
    """The custom call runs the op's computation (the same sums in the same order): equal values,
    so the op's error bound above holds for it too."""
    _, ks, st, dr, padding, _ = case
    x, g = _case_inputs(case, 1)
    want = native.conv_kernel_grads_op(x, g, ks, st, dr, padding)
    fn = tf.function(lambda x, g: native.conv_kernel_grads_xla(x, g, ks, st, dr, padding),
                     jit_compile=True)
    got = fn(x, g)
    assert got.shape == want.shape
    np.testing.assert_array_equal(got.numpy(), want.numpy())
    # a batch larger than the CPUs: every thread's share of the examples is written
    xb = tf.concat([x] * 5, 0)
    gb = tf.concat([g] * 5, 0)
    np.testing.assert_array_equal(fn(xb, gb).numpy(), np.concatenate([want.numpy()] * 5))


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_under_a_mixed_policy_and_xla_the_rule_takes_the_kernel_on_float32_values(policy):
    """A layer computing in 16 bits: the rule casts its input and output gradient to float32
    and, under XLA, takes the custom call; the result is the op's on the same float32 values,
    bit for bit."""
    keras.mixed_precision.set_global_policy(policy)
    try:
        layer = keras.layers.Conv2D(16, 8, strides=2, padding="same")
        x = tf.cast(tf.random.stateless_normal([3, 28, 28, 1], [1, 2]), layer.compute_dtype)
        g = tf.cast(tf.ones_like(layer(x)), layer.compute_dtype)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert x.dtype != tf.float32
    assert "XlaCustomCallV2" in _rule_ops(layer, x, jit=True)  # traced with 16-bit x and g
    got = tf.function(lambda x, g: ghost_conv.conv_rule(layer, x, g)[0][1].grads,
                      jit_compile=True)(x, g)
    want = native.conv_kernel_grads_op(tf.cast(x, tf.float32), tf.cast(g, tf.float32), (8, 8),
                                       (2, 2), (1, 1), "SAME")
    np.testing.assert_array_equal(got.numpy().reshape(want.shape), want.numpy())


def test_the_xla_custom_call_with_no_output_position_gives_zeros():
    fn = tf.function(lambda x, g: native.conv_kernel_grads_xla(x, g, (5, 5), (1, 1), (1, 1),
                                                               "VALID"), jit_compile=True)
    got = fn(tf.ones([2, 4, 4, 2]), tf.zeros([2, 0, 0, 3]))
    assert got.shape == (2, 50, 3)
    np.testing.assert_array_equal(got.numpy(), np.zeros((2, 50, 3), np.float32))


def test_the_xla_custom_call_refuses_what_it_cannot_compute():
    def call(x_spec, g_spec, padding="SAME", sizes=(8, 8)):
        @tf.function(jit_compile=True, input_signature=[x_spec, g_spec])
        def fn(x, g):
            return native.conv_kernel_grads_xla(x, g, sizes, (2, 2), (1, 1), padding)

        return fn.get_concrete_function()

    x, g = tf.TensorSpec([2, 28, 28, 1]), tf.TensorSpec([2, 14, 14, 16])
    with pytest.raises(ValueError, match=r"g must be \[2, 14, 14, 'F'\]"):
        call(x, tf.TensorSpec([2, 13, 14, 16]))
    with pytest.raises(ValueError, match="static rank-4 shapes"):
        call(tf.TensorSpec([None, 28, 28, 1]), g)
    with pytest.raises(ValueError, match="padding must be 'SAME' or 'VALID'"):
        call(x, g, padding="FULL")
    with pytest.raises(ValueError, match="2 integers >= 1"):
        call(x, g, sizes=(0, 8))
    with pytest.raises(TypeError, match="float32"):
        call(tf.TensorSpec([2, 28, 28, 1], tf.float16), g)


@pytest.mark.parametrize("graph", [False, True, "xla"], ids=["eager", "tf.function", "xla"])
def test_ghost_clipper_with_native_kernel_grads_equals_the_per_example_loop(graph):
    """Norms and clipped sum of a model whose convolutions take the native route: 2-D with a
    stride, with a dilation and 1x1, 1-D causal with a dilation, and one convolution called twice
    (its per-example gradients summed over the calls), against a GradientTape loop."""
    r = rng(17)
    inp = keras.Input((10, 10, 2))
    shared = keras.layers.Conv2D(3, 3, padding="same", activation="tanh")
    h = keras.layers.Conv2D(4, 3, strides=(2, 1), padding="same", activation="tanh")(inp)
    h = keras.layers.Conv2D(2, 3, dilation_rate=(1, 2), padding="same")(h)  # [5, 10, 2]
    h = shared(h)
    h = shared(keras.layers.Conv2D(2, 1)(h))
    h = keras.layers.Reshape((5, 30))(h)
    h = keras.layers.Conv1D(4, 2, dilation_rate=2, padding="causal", activation="tanh")(h)
    out = keras.layers.Dense(3)(keras.layers.Flatten()(h))
    model = keras.Model(inp, out)
    x = (r.normal(size=(6, 10, 10, 2)) * r.uniform(0.2, 3.0, (6, 1, 1, 1))).astype("float32")
    calls = []
    real = ghost_conv._native_kernel_grads

    def counting(layer, x, g):
        out = real(layer, x, g)
        calls.append((layer.name, out is not None))
        return out

    ghost_conv._native_kernel_grads = counting
    try:
        check(model, x, r.integers(0, 3, 6), graph=graph, reference=LoopReference)
    finally:
        ghost_conv._native_kernel_grads = real
    # every convolution took the native route (the shared one once per call)
    assert len(calls) == 6 and all(native_route for _, native_route in calls), calls


def test_a_failing_xla_target_link_still_builds_the_ops(tmp_path):
    """The XLA custom-call target is an extra: where linking it fails (here: a library that does
    not exist), a fresh process builds the ops without it, the op route and the noise op work,
    and under XLA the rule keeps XLA's own route."""
    code = (
        "import numpy as np, tensorflow as tf, keras\n"
        "from tf_dp.dp_query import native\n"
        "native._xla_target_flags = lambda: ['-DTF_DP_XLA_CUSTOM_CALL', "
        "'-l:libtf_dp_no_such_library.so']\n"
        "assert native.available(), native.status()\n"
        "assert not native.xla_available()\n"
        "from tf_dp.gradients.ghost import conv\n"
        "layer = keras.layers.Conv2D(16, 8, strides=2, padding='same')\n"
        "x = tf.random.normal([2, 28, 28, 1])\n"
        "g = tf.ones_like(layer(x))\n"
        "f = tf.function(lambda x, g: [v.grads if hasattr(v, 'grads') else v.a "
        "for _, v in conv.conv_rule(layer, x, g)], jit_compile=True)\n"
        "ops = {op.type for op in f.get_concrete_function(x, g).graph.get_operations()}\n"
        "assert 'XlaCustomCallV2' not in ops, ops\n"
        "f(x, g)\n"
        "eager = conv.conv_rule(layer, x, g)[0][1].grads\n"
        "assert eager.shape == (2, 8, 8, 1, 16), eager.shape\n"
        "print('ok')\n"
    )
    env = dict(os.environ, TF_DP_NATIVE_CACHE=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_DP_NATIVE", None)
    out = warm_python.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          timeout=600, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
    assert "building them without it" in out.stderr
