"""Floating-point artefacts of the noise: exact zeros of the sampler, and the low bits of the
noised sum (Mironov 2012; Jin et al. 2022).

Tolerances. Two-proportion comparisons use the pooled z statistic: for two binomial counts of the
same probability ``p`` over ``n`` trials each, ``|k1 - k2| / sqrt(2 n p (1 - p))`` exceeds 5 with
probability below 6e-7; seeds are fixed, so the tests are deterministic.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

from tf_dp.dp_query import noise

# -- (a) exact zeros of the Box-Muller transform ---------------------------------------------------


def _words(hi, lo, angle):
    return tf.constant(np.stack([hi, lo, angle]).astype(np.uint32))


def test_top_high_words_never_give_a_zero_pair():
    # In float32 every hi >= 2^32 - 128 rounds to 2^32, i.e. u1 = 1.0 and r = 0: the pair was
    # (0, 0). The radius of those words must be the one of the largest float below 1.
    rng = np.random.default_rng(0)
    hi = np.concatenate([np.arange(2**32 - 256, 2**32, dtype=np.uint64),
                         rng.integers(0, 2**32, 4096, dtype=np.uint64)])
    h = hi.size
    lo = rng.integers(0, 2**32, h, dtype=np.uint64)
    lo[:256] = 2**32 - 1
    angle = rng.integers(0, 2**32, h, dtype=np.uint64)
    r_min = math.sqrt(-2.0 * math.log1p(-(2.0**-24)))  # closed form: u1 = 1 - 2^-24
    words = _words(hi, lo, angle)
    for z in (noise.box_muller(words, tf.float32).numpy(),
              noise.box_muller_lazy(words[0], words[2], lambda idx: tf.gather_nd(words[1], idx))
              .numpy()):
        assert np.all(z != 0.0)
        r = np.hypot(z[:h].astype(np.float64), z[h:].astype(np.float64))
        top = hi >= 2**32 - 128
        np.testing.assert_allclose(r[top], r_min, rtol=1e-5)
        assert np.all(r >= r_min * (1 - 1e-5))
    # float64: hi = lo = 2^32 - 1 rounds (hi + (lo + 1/2) 2^-32) to 2^32 as well
    z64 = noise.box_muller(_words([2**32 - 1] * 2, [2**32 - 1] * 2, [5, 2**31]), tf.float64)
    z64 = z64.numpy()
    assert np.all(z64 != 0.0)
    np.testing.assert_allclose(np.hypot(z64[:2], z64[2:]), math.sqrt(-2.0 * math.log1p(-(2.0**-53))),
                               rtol=1e-6)


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_no_angle_gives_an_exact_zero(dtype):
    # Angle words of the first cell gave theta = 0 and sin(theta) = 0 exactly; the quarter-turn
    # words must not give cos(theta) = 0 either.
    angle = np.array([0, 1, 255, 256, 511, 512, 2**30, 2**31, 3 * 2**30, 2**32 - 1], np.uint64)
    angle = np.concatenate([angle, np.arange(2**30 - 1024, 2**30 + 1024, dtype=np.uint64)])
    h = angle.size
    z = noise.box_muller(_words(np.full(h, 2**31), np.zeros(h), angle), dtype).numpy()
    assert np.all(z != 0.0)


# -- the same pattern in Poisson sampling: a uniform on a grid compared with q ----------------------


def test_poisson_inclusion_probability_never_exceeds_q(monkeypatch):
    # tf.random.stateless_uniform(float64) returns k 2^-52 (k < 2^52 uniform). Feed the sampler
    # the grid values around q 2^52: exactly the floor(q 2^52) lowest values may join, a rate
    # <= q (with `u < q` the value floor(q 2^52) 2^-52 < q joined too: rate above q).
    from fractions import Fraction

    from tf_dp.data import poisson as poisson_module

    q = 0.3  # not a multiple of 2^-52
    k0 = math.floor(Fraction(q) * 2**52)  # exact, independent of floating point
    ks = np.array([0, k0 - 2, k0 - 1, k0, k0 + 1, 2**52 - 1], np.float64)
    fake = lambda shape, seed, dtype: tf.constant(ks * 2.0**-52, tf.float64)
    monkeypatch.setattr(poisson_module.tf.random, "stateless_uniform", fake)
    x = np.arange(ks.size, dtype=np.float32)[:, None]
    pb = poisson_module.poisson_batches(x, x[:, 0], sampling_probability=q, seed=1,
                                        max_batch_size=ks.size)
    bx, _, bw = next(iter(pb.dataset))
    joined = bx.numpy()[bw.numpy() > 0, 0].astype(int)
    np.testing.assert_array_equal(joined, np.flatnonzero(ks < k0))
