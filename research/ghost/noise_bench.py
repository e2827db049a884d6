"""Times Gaussian noise samplers for the MLP's 670k parameters (one tf.function each).

    python -m research.ghost.noise_bench

Measured on a 2-core CPU without GPU (TF 2.21, Keras 3.15, other processes paused; median wall
ms per draw of all 670k, noise added to the leaves): a dense three-word Box-Muller (``bm96``, one
flat draw split per leaf) 5.4 ms; the library's sampler (``tf_dp_sampler``: the low word of ``u1``
drawn only for the 1/256 of pairs whose high word is below 2^24, two separate word draws, one
draw per large leaf, no split copy) 2.9 ms, with the same values bit for bit on the same words as
``bm96`` (``tests/test_noise.py``).
"""
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import math  # noqa: E402

import tensorflow as tf  # noqa: E402

SHAPES = [(784, 512), (512,), (512, 512), (512,), (512, 10), (10,)]
g = tf.random.Generator.from_seed(1, alg="philox")
vals = [tf.zeros(s) for s in SHAPES]


@tf.function
def gen_normal():
    return [v + g.normal(tf.shape(v), stddev=1.1) for v in vals]


@tf.function
def stateless_normal():
    seed = g.make_seeds(1)[:, 0]
    return [v + tf.random.stateless_normal(tf.shape(v), seed, stddev=1.1, alg="philox")
            for v in vals]


def bm(n, seed):
    half = (n + 1) // 2
    u1 = tf.random.stateless_uniform([half], seed, dtype=tf.float64, alg="philox")
    u2 = tf.random.stateless_uniform([half], seed + [0, 1], dtype=tf.float32, alg="philox")
    r = tf.cast(tf.sqrt(-2.0 * tf.math.log1p(-u1)), tf.float32)
    th = 2 * math.pi * u2
    return tf.concat([r * tf.cos(th), r * tf.sin(th)], 0)[:n]


@tf.function
def boxmuller_fused():
    seed = g.make_seeds(1)[:, 0]
    n = sum(math.prod(s) for s in SHAPES)
    z = bm(n, seed) * 1.1
    out, o = [], 0
    for v in vals:
        k = math.prod(v.shape)
        out.append(v + tf.reshape(z[o:o + k], v.shape))
        o += k
    return out


def bm_bits(n, seed):
    half = (n + 1) // 2
    bits = tf.random.stateless_uniform([3, half], seed, minval=None, maxval=None,
                                       dtype=tf.uint32, alg="philox")
    hi = tf.cast(tf.bitwise.right_shift(bits[0], 11), tf.float64)
    lo = tf.cast(bits[1], tf.float64)
    u1 = (hi * 4294967296.0 + lo) * (2.0 ** -53)  # [0, 1), 53 bits
    u2 = tf.cast(tf.bitwise.right_shift(bits[2], 8), tf.float32) * (2.0 ** -24)
    r = tf.cast(tf.sqrt(-2.0 * tf.math.log1p(-u1)), tf.float32)
    th = (2 * math.pi) * u2
    return tf.concat([r * tf.cos(th), r * tf.sin(th)], 0)[:n]


@tf.function
def boxmuller_bits():
    seed = g.make_seeds(1)[:, 0]
    n = sum(math.prod(s) for s in SHAPES)
    z = bm_bits(n, seed) * 1.1
    out, o = [], 0
    for v in vals:
        k = math.prod(v.shape)
        out.append(v + tf.reshape(z[o:o + k], v.shape))
        o += k
    return out


@tf.function
def gen_normal_fused():
    n = sum(math.prod(s) for s in SHAPES)
    z = g.normal([n], stddev=1.1)
    out, o = [], 0
    for v in vals:
        k = math.prod(v.shape)
        out.append(v + tf.reshape(z[o:o + k], v.shape))
        o += k
    return out


@tf.function
def uniform_only():
    n = sum(math.prod(s) for s in SHAPES)
    return g.uniform([n])


def bench(fn, n=40):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        tf.nest.map_structure(lambda t: t.numpy(), out)
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def bm32(n, seed):
    """Two 32-bit words per pair, all float32: u1 = (k + 0.5) 2^-32."""
    half = (n + 1) // 2
    bits = tf.random.stateless_uniform([2, half], seed, minval=None, maxval=None,
                                       dtype=tf.uint32, alg="philox")
    u1 = (tf.cast(bits[0], tf.float32) + 0.5) * (2.0 ** -32)
    u2 = tf.cast(tf.bitwise.right_shift(bits[1], 8), tf.float32) * (2.0 ** -24)
    r = tf.sqrt(-2.0 * tf.math.log(u1))
    th = (2 * math.pi) * u2
    return tf.concat([r * tf.cos(th), r * tf.sin(th)], 0)[:n]


def bm96(n, seed):
    """Three words per pair, float32: u1 = (hi + (lo + .5) 2^-32) 2^-32 (64-bit resolution)."""
    half = (n + 1) // 2
    bits = tf.random.stateless_uniform([3, half], seed, minval=None, maxval=None,
                                       dtype=tf.uint32, alg="philox")
    u1 = (tf.cast(bits[0], tf.float32) + (tf.cast(bits[1], tf.float32) + 0.5) * (2.0 ** -32)) * (2.0 ** -32)
    u2 = tf.cast(tf.bitwise.right_shift(bits[2], 8), tf.float32) * (2.0 ** -24)
    r = tf.sqrt(-2.0 * tf.math.log(u1))
    th = (2 * math.pi) * u2
    return tf.concat([r * tf.cos(th), r * tf.sin(th)], 0)[:n]


def _wrap(sampler):
    @tf.function
    def f():
        seed = g.make_seeds(1)[:, 0]
        n = sum(math.prod(s) for s in SHAPES)
        z = sampler(n, seed) * 1.1
        out, o = [], 0
        for v in vals:
            k = math.prod(v.shape)
            out.append(v + tf.reshape(z[o:o + k], v.shape))
            o += k
        return out
    f.python_function.__name__ = sampler.__name__
    return f


@tf.function
def tf_dp_sampler():
    """The library's sampler: lazy low words, one draw per large leaf (tf_dp.dp_query.noise)."""
    from tf_dp.dp_query.noise import add_gaussian_noise_structure

    return add_gaussian_noise_structure(g, vals, 1.1)


if __name__ == "__main__":
    for _ in range(3):
        for f in (gen_normal_fused, boxmuller_fused, _wrap(bm32), _wrap(bm96), tf_dp_sampler):
            print(f"{f.python_function.__name__:20s} {bench(f):7.2f} ms")
