"""The native noise op (tf_dp/dp_query/native): built here, the same Philox words as TensorFlow,
its transform against a float64 computation on every angle cell and on the extreme words, and
the fallback to TensorFlow ops without a compiler.

Error bounds (in units of 2^-24, float32's relative rounding): the radius ``r = sqrt(scale ln u1)``
has a relative error of at most about 3 units (the logarithm's series and its sums about 2, the
square root and the product 1); ``cos`` and ``sin`` of the reduced angle ``a`` have an absolute
error of at most about 2.5 units (``a`` itself 1 unit relative, so at most 0.8 absolute on
``(0, pi/4)``; the series' evaluation about 1.5); the final product 0.5 units. So
``|z - z64| <= 6 * 2^-24 * max(r, 1)`` with ``z64`` computed in float64 from the same float32 ``u1``
(the formula of the TensorFlow ops, which round ``u1`` to float32 first).
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.dp_query import native, noise
from tests.helpers import warm_python

ULP = 2.0**-24


def _reference(hi, lo, angle, stddev=1.0):
    """float64 ``z`` from float32 ``u1`` (as both samplers round it) and the exact angle."""
    f32 = np.float32
    small = hi < 2**24
    u1_small = (hi.astype(f32) + (lo.astype(f32) + f32(0.5)) * f32(2**-32)) * f32(2**-32)
    u1 = np.where(small, u1_small, hi.astype(f32) * f32(2**-32))
    u1 = np.minimum(u1, f32(1 - 2**-24)).astype(np.float64)
    r = stddev * np.sqrt(-2.0 * np.log(u1))
    theta = (2.0 * (angle >> 9).astype(np.float64) + 1.0) * math.pi * 2.0**-23
    return np.concatenate([r * np.cos(theta), r * np.sin(theta)]), np.concatenate([r, r])


def test_native_op_is_built_on_this_machine():
    # README's test command installs g++: the native path is the one under test here.
    assert native.available(), native.status()
    assert native.status().startswith("loaded ")


def test_transform_on_random_and_tail_words_is_within_the_derived_bound():
    rng = np.random.default_rng(0)
    h = 1 << 20
    hi = rng.integers(0, 2**32, h, dtype=np.uint64).astype(np.uint32)
    hi[: h // 8] = rng.integers(0, 2**24, h // 8).astype(np.uint32)  # the tail: low words count
    lo = rng.integers(0, 2**32, h, dtype=np.uint64).astype(np.uint32)
    angle = rng.integers(0, 2**32, h, dtype=np.uint64).astype(np.uint32)
    for stddev in (1.0, 0.37):
        scale = noise._radius_scale(tf.float32, stddev)
        z = native.box_muller_op(hi, lo, angle, scale).numpy().astype(np.float64)
        ref, r = _reference(hi, lo, angle, float(np.float32(stddev)))
        err = np.abs(z - ref) / np.maximum(r, 1.0)
        assert err.max() <= 6 * ULP, err.max() / ULP
        assert np.all(z != 0)


def test_every_angle_cell_gives_cos_and_sin_within_the_bound_and_never_zero():
    # All 2^23 angle cells, with u1 = e^-1/2 (r = 1): z = (cos theta, sin theta).
    k = np.arange(1 << 23, dtype=np.uint32)
    angle = (k << 9) | (k & 0x1FF)  # the low 9 bits are ignored; vary them anyway
    hi = np.full(k.shape, int(round(math.exp(-0.5) * 2**32)), np.uint32)
    lo = np.zeros_like(hi)
    z = native.box_muller_op(hi, lo, angle).numpy().astype(np.float64)
    ref, r = _reference(hi, lo, angle)
    assert np.abs(z - ref).max() <= 6 * ULP * r.max()
    assert np.all(z != 0), "an exact zero: that coordinate would be released without noise"
    # signs by quadrant: cos > 0 on (-pi/2, pi/2), sin > 0 on (0, pi)
    theta = (2.0 * k + 1.0) * math.pi * 2.0**-23
    n = len(k)
    np.testing.assert_array_equal(np.sign(z[:n]), np.sign(np.cos(theta)))
    np.testing.assert_array_equal(np.sign(z[n:]), np.sign(np.sin(theta)))


def test_extreme_words_keep_the_tail_bound_and_no_exact_zero():
    top = 2**32 - 1
    cells = [0, (1 << 20) - 1, 1 << 20, (1 << 21) - 1, 1 << 21, (1 << 22) - 1, 1 << 22,
             (1 << 23) - 1]
    hi = np.array([0] * len(cells) + [top] * len(cells) + [(1 << 24) - 1, 1 << 24], np.uint32)
    lo = np.array([0] * len(cells) + [top] * len(cells) + [top, 0], np.uint32)
    k = np.array(cells * 2 + [0, 0], np.uint32)
    angle = k << 9
    z = native.box_muller_op(hi, lo, angle).numpy().astype(np.float64)
    ref, r = _reference(hi, lo, angle)
    assert np.all(np.abs(z - ref) <= 6 * ULP * np.maximum(r, 1.0))
    assert np.all(z != 0)
    # hi = lo = 0: u1 = 2^-65, the largest radius, TAIL_BOUND (cell 0: cos ~ 1)
    assert abs(z[0] - noise.TAIL_BOUND) <= 6 * ULP * noise.TAIL_BOUND
    assert np.abs(z).max() <= noise.TAIL_BOUND * (1 + 6 * ULP)
    # top words: u1 capped below 1, r = sqrt(-2 ln(1 - 2^-24)) = 3.45e-4, not 0
    h = len(hi)
    top_r = np.hypot(z[len(cells):2 * len(cells)], z[h + len(cells):h + 2 * len(cells)])
    np.testing.assert_allclose(top_r, math.sqrt(-2 * math.log1p(-(2.0**-24))), rtol=8 * ULP)


def test_fused_op_reads_tensorflows_philox_words_across_a_counter_carry():
    # A generator whose 128-bit counter is 3 blocks below a carry into its high word: the fused
    # op's counter arithmetic must match TensorFlow's (words checked bit for bit through the
    # native transform on TF's words).
    low = np.array([2**64 - 3], np.uint64).view(np.int64)[0]
    state = tf.constant([low, 5, 1234567], tf.int64)
    n = 100_002  # one chunk (planes 0, 1, 2), above the lazy sampler's minimum
    assert noise.LAZY_MIN_SIZE <= n <= noise.CHUNK
    gen = tf.random.Generator.from_state(state, alg="philox")
    z = noise.gaussian_noise(gen, n).numpy()
    counter, key = [2**64 - 3, 5], 1234567
    h = n // 2

    def words(plane, count):
        c = tf.constant([counter[0], counter[1] + plane], tf.uint64)
        return tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=[count], key=tf.constant([key], tf.uint64), counter=c, alg=1,
            dtype=tf.uint32).numpy()

    hi, angle = words(0, h), words(1, h)
    tail = np.flatnonzero(hi < 2**24)
    lo = np.zeros(h, np.uint32)
    lo[tail] = words(2, len(tail))
    np.testing.assert_array_equal(z, native.box_muller_op(hi, lo, angle).numpy())


def _planes_reference(state, n, stddev):
    """``n`` normals recomputed from the documented layout (noise.py): one skip reserves the
    call's words, chunk ``j`` of ``C`` reads its high words, angles and low words from counter
    planes ``j``, ``C + j`` and ``2C + j`` (the counter's high word plus the plane), the k-th pair
    with a high word below 2^24 reading low word k; per chunk ``[r cos, r sin]``, the last value
    dropped when the chunk is odd. Words from TensorFlow's Philox kernel, the transform from the
    per-chunk native op (checked against float64 above)."""
    counter = [int(v) for v in np.array(state[:2], np.int64).view(np.uint64)]
    key = int(np.array(state[2:3], np.int64).view(np.uint64)[0])
    sizes = [min(noise.CHUNK, n - k) for k in range(0, n, noise.CHUNK)]
    scale = np.float32(-2.0) * np.float32(stddev) ** 2

    def words(plane, count):
        c = tf.constant([counter[0], (counter[1] + plane) % 2**64], tf.uint64)
        return tf.raw_ops.StatelessRandomUniformFullIntV2(
            shape=[count], key=tf.constant([key], tf.uint64), counter=c, alg=1,
            dtype=tf.uint32).numpy()

    out = []
    for j, m in enumerate(sizes):
        h = (m + 1) // 2
        hi, angle = words(j, h), words(len(sizes) + j, h)
        tail = np.flatnonzero(hi < 2**24)
        lo = np.zeros(h, np.uint32)
        lo[tail] = words(2 * len(sizes) + j, len(tail))
        out.append(native.box_muller_op(hi, lo, angle, scale).numpy()[:m])
    return np.concatenate(out)


@pytest.mark.parametrize("shape", [(100_001,), (784, 512), (2 * 131_072 + 16_385,), (3, 100_001)],
                         ids=["one-chunk", "mlp-kernel", "three-chunks-odd", "2d-odd-chunks"])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "tf.function"])
def test_noise_added_in_one_op_is_the_documented_draw_added(shape, graph):
    """A large float32 leaf (at least noise.OWN_DRAW_SIZE) gets ``x + noise`` from one op (TfDpAddGaussianNoise: every chunk,
    no concatenation, no separate addition): bit for bit the documented planes' normals added to
    ``x`` in float32, and the generator moved by one skip of the same size."""
    n = int(np.prod(shape))
    assert n >= noise.OWN_DRAW_SIZE
    x = np.random.default_rng(1).normal(size=shape).astype(np.float32)
    low = np.array([2**64 - 5], np.uint64).view(np.int64)[0]  # a counter carry inside the call
    gen = tf.random.Generator.from_state(tf.constant([low, 9, 4242], tf.int64), alg="philox")
    state = gen.state.numpy()
    stddev = tf.constant(1.7, tf.float32)

    def noised():
        return noise.add_gaussian_noise_structure(gen, [tf.constant(x)], stddev)[0]

    fn = tf.function(noised) if graph else noised
    y = fn().numpy()
    assert y.shape == shape
    want = x + _planes_reference(state, n, 1.7).reshape(shape)
    np.testing.assert_array_equal(y, want)
    twin = tf.random.Generator.from_state(tf.constant(state), alg="philox")
    twin.skip(2 * ((n + 1) // 2))
    np.testing.assert_array_equal(gen.state.numpy(), twin.state.numpy())
    if graph:
        ops = {op.type for op in fn.get_concrete_function().graph.get_operations()}
        assert "TfDpAddGaussianNoise" in ops and "ConcatV2" not in ops


@pytest.mark.parametrize("n", [noise.CHUNK + 1, 3 * noise.CHUNK + 5])
def test_draws_of_several_chunks_come_from_one_op_on_the_documented_planes(n):
    state = tf.constant([np.array([2**64 - 2], np.uint64).view(np.int64)[0], 3, 99], tf.int64)
    gen = tf.random.Generator.from_state(state, alg="philox")
    fn = tf.function(lambda: noise.gaussian_noise(gen, n, stddev=2.0))
    z = fn().numpy()
    np.testing.assert_array_equal(z, _planes_reference(state.numpy(), n, 2.0))
    ops = [op.type for op in fn.get_concrete_function().graph.get_operations()]
    assert ops.count("TfDpChunkedGaussianNoise") == 1 and "ConcatV2" not in ops


@pytest.mark.parametrize("n", [1, 7, noise.LAZY_MIN_SIZE - 1, noise.LAZY_MIN_SIZE, 100_001,
                               noise.CHUNK, 3 * noise.CHUNK + 5, 669_706])
def test_under_xla_the_draw_is_the_native_kernel_as_a_custom_call(n):
    """Under XLA a float32 draw is the native chunked kernel as an XLA custom call: the
    documented planes' normals bit for bit (as the native op outside XLA, small draws included),
    the generator moved by one skip, across a counter carry, and no XLA sampler traced."""
    state = tf.constant([np.array([2**64 - 2], np.uint64).view(np.int64)[0], 3, 99], tf.int64)
    gen = tf.random.Generator.from_state(state, alg="philox")
    fn = tf.function(lambda: noise.gaussian_noise(gen, n, stddev=2.0), jit_compile=True)
    z = fn().numpy()
    np.testing.assert_array_equal(z, _planes_reference(state.numpy(), n, 2.0))
    twin = tf.random.Generator.from_state(state, alg="philox")
    twin.skip(2 * ((n + 1) // 2))
    np.testing.assert_array_equal(gen.state.numpy(), twin.state.numpy())
    ops = [op.type for op in fn.get_concrete_function().graph.get_operations()]
    assert ops.count("XlaCustomCallV2") == 1 and "StatefulUniformFullInt" not in ops


@pytest.mark.parametrize("n", [1, 26_010, noise.LAZY_MIN_SIZE - 1])
def test_small_draws_come_from_the_native_op_on_the_documented_planes(n):
    """Draws under noise.LAZY_MIN_SIZE (the reference CNN's 26,010 parameters) come from the
    native op too: the documented planes' normals bit for bit, no TensorFlow-ops sampler."""
    state = tf.constant([np.array([2**64 - 2], np.uint64).view(np.int64)[0], 3, 99], tf.int64)
    gen = tf.random.Generator.from_state(state, alg="philox")
    fn = tf.function(lambda: noise.gaussian_noise(gen, n, stddev=2.0))
    np.testing.assert_array_equal(fn().numpy(), _planes_reference(state.numpy(), n, 2.0))
    ops = [op.type for op in fn.get_concrete_function().graph.get_operations()]
    assert "TfDpGaussianNoise" in ops and "StatelessRandomUniformFullIntV2" not in ops


def test_the_xla_noise_call_refuses_what_it_cannot_draw():
    key, counter = tf.constant([1], tf.uint64), tf.constant([0, 0], tf.uint64)
    with pytest.raises(ValueError, match="chunk must be a positive multiple of 16384"):
        native.chunked_gaussian_noise_xla(10, key, counter, 1000, -2.0)
    with pytest.raises(ValueError, match=r"n must be in \[0, 2\^41\]"):
        native.chunked_gaussian_noise_xla(-1, key, counter, noise.CHUNK, -2.0)
    assert native.chunked_gaussian_noise_xla(0, key, counter, noise.CHUNK, -2.0).shape == (0,)


def test_the_added_noise_op_rejects_a_chunk_it_cannot_shard():
    with pytest.raises(tf.errors.InvalidArgumentError, match="chunk must be a positive multiple"):
        native.add_gaussian_noise_op(tf.zeros([10]), tf.constant([1], tf.uint64),
                                     tf.constant([0, 0], tf.uint64),
                                     tf.constant(1000, tf.int64), tf.constant(-2.0))


def test_native_and_tensorflow_samplers_read_the_same_words_and_agree_to_the_bound():
    out = {}
    for use_native in (True, False):
        native.set_enabled(use_native)
        try:
            gen = noise.make_generator(seed=5)
            z = tf.function(lambda: noise.gaussian_noise(gen, 669_706, stddev=1.7))().numpy()
            out[use_native] = (z.astype(np.float64), gen.state.numpy().tolist())
        finally:
            native.set_enabled(None)
    (a, state_a), (b, state_b) = out[True], out[False]
    assert state_a == state_b  # the same words reserved: the counter discipline is unchanged
    _assert_samplers_agree(a, b)


def _assert_samplers_agree(native_z, tf_ops_z):
    """The native sampler is within 6 units of float64 (above); TensorFlow's ops compute
    ``theta = (2k + 1) (pi 2^-23)`` in float32 (up to 2 pi: the constant's rounding and the
    product's, about 10 units absolute) before their cos and sin (about 2 units) and have the
    radius's 3 units: together at most 24 units of ``max(r, 1)`` apart, ``r`` the pair's radius."""
    r = np.empty_like(tf_ops_z)
    for start in range(0, len(tf_ops_z), noise.CHUNK):  # each chunk: [r cos, r sin]
        z = tf_ops_z[start:start + noise.CHUNK]
        h = (len(z) + 1) // 2
        pair = np.hypot(z[:h], np.append(z[h:], 0.0)[:h])
        r[start:start + len(z)] = np.concatenate([pair, pair])[: len(z)]
    assert np.max(np.abs(native_z - tf_ops_z) / np.maximum(r, 1.0)) <= 24 * ULP


def test_gradient_through_noised_values_is_the_identity():
    gen = noise.make_generator(seed=3)
    x = tf.Variable(tf.ones([70_000]))
    with tf.GradientTape() as tape:
        y = tf.reduce_sum(noise.add_gaussian_noise(gen, x, 2.0))
    np.testing.assert_array_equal(tape.gradient(y, x).numpy(), np.ones(70_000, np.float32))


def test_without_a_compiler_the_tensorflow_ops_are_used(tmp_path):
    # A fresh process with no compiler and an empty cache: status says why, noise still comes
    # (from the same words, so it agrees with this process's native draw to the bound above).
    code = (
        "import numpy as np\n"
        "from tf_dp.dp_query import native, noise\n"
        "assert not native.available(), native.status()\n"
        "print(native.status())\n"
        "gen = noise.make_generator(seed=5)\n"
        f"np.save({str(tmp_path / 'z.npy')!r}, noise.gaussian_noise(gen, 100_000).numpy())\n"
    )
    env = dict(os.environ, CXX=str(tmp_path / "no-such-compiler"),
               TF_DP_NATIVE_CACHE=str(tmp_path / "cache"), TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TF_DP_NATIVE", None)
    out = warm_python.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "unavailable: no C++ compiler" in out.stdout
    fallback = np.load(tmp_path / "z.npy").astype(np.float64)
    here = noise.gaussian_noise(noise.make_generator(seed=5), 100_000).numpy()
    _assert_samplers_agree(here.astype(np.float64), fallback)


def test_set_enabled_rejects_non_bool():
    with pytest.raises(TypeError, match="enabled must be"):
        native.set_enabled(1)


def test_not_used_where_a_gpu_is_present(monkeypatch):
    # the op is a CPU kernel: with a GPU the noise is drawn there by TensorFlow's kernels
    monkeypatch.setattr(native, "_accelerators", [])
    real = tf.config.list_logical_devices
    monkeypatch.setattr(tf.config, "list_logical_devices",
                        lambda kind=None: ["/GPU:0"] if kind == "GPU" else real(kind))
    assert not native.available()
    assert "a GPU is present" in native.status()
    monkeypatch.setattr(native, "_accelerators", [])
    monkeypatch.setattr(tf.config, "list_logical_devices", real)
    assert native.available()
