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


# -- (b) the low bits of the noised sum ------------------------------------------------------------

import tf_dp  # noqa: E402

N = 1 << 17
Z = 5.0  # two-proportion bound in standard errors (module docstring)


def _event(y, bits=24):
    """|y| < 1/2 and y 2^bits not an integer (float64 arithmetic on float32 values: exact)."""
    y = np.asarray(y, np.float64)
    scaled = y * 2.0**bits
    return (np.abs(y) < 0.5) & (scaled != np.floor(scaled))


def _same_rate(k1, n1, k2, n2):
    """Two counts are binomial draws of one probability, within Z pooled standard errors."""
    p = (k1 + k2) / (n1 + n2)
    se = math.sqrt(max(p * (1 - p), 1.0 / (n1 + n2)) * (1.0 / n1 + 1.0 / n2))
    return abs(k1 / n1 - k2 / n2) <= Z * se


def _released(noise_mode, canary, seed):
    # N independent runs of the one-coordinate query in one call: the sum is -1 (the canary's
    # clipped record) or 0 in every coordinate, stddev 1.
    q = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.0, seed=seed, noise_mode=noise_mode)
    state = tf.fill([N], -1.0 if canary else 0.0)
    return q.get_noised_result(state, q.initial_global_state())[0].numpy()


def test_low_bits_reveal_the_canary_with_continuous_noise():
    # The attack is real: without the canary a quarter of the outputs are in the event, with it
    # none (-1 + eta, |y| < 1/2, is a multiple of 2^-24: Sterbenz).
    with_c, without = _released("continuous", True, 1), _released("continuous", False, 2)
    assert _event(with_c).sum() == 0
    assert _event(without).sum() > 0.2 * N


def test_grid_noise_defeats_the_low_bit_attack():
    with_c, without = _released("grid", True, 1), _released("grid", False, 2)
    k1, k2 = _event(with_c).sum(), _event(without).sum()
    assert _same_rate(k1, N, k2, N), (k1, k2)
    # every low bit, given |y| < 1/2: the same frequencies with and without the canary
    a, b = with_c[np.abs(with_c) < 0.5], without[np.abs(without) < 0.5]
    for bits in range(1, 31):
        ka, kb = _event(a, bits).sum(), _event(b, bits).sum()
        assert _same_rate(ka, a.size, kb, b.size), (bits, ka, a.size, kb, b.size)
    # the released values are multiples of the documented grid (d = N coordinates)
    g = 2.0 ** math.floor(math.log2(2.0**-10 / math.sqrt(N)))
    assert np.all(np.asarray(with_c, np.float64) / g == np.round(np.asarray(with_c, np.float64) / g))


def _bias_model(width):
    import keras

    inp = keras.Input([1])
    out = keras.layers.Dense(width, kernel_initializer="zeros", bias_initializer="zeros")(inp)
    return keras.Model(inp, out)


def _first_step_bias(noise_mode, canary, seed, jit_compile=False):
    """Bias after one DP-SGD step (q = 1, batch 2, learning rate 1): every bias coordinate is an
    independent trial. The canary's per-example gradient is -1 in each bias coordinate (norm
    sqrt(W) = the clip, so unclipped), the other example's 0; noise stddev 1 per coordinate."""
    import keras

    import tf_dp.keras as dpk

    width = 1 << 14
    model = dpk.make_private(_bias_model(width))
    opt = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=math.sqrt(width), noise_multiplier=1.0 / math.sqrt(width), learning_rate=1.0,
        noise_seed=seed, noise_mode=noise_mode, gradient_mode="vectorized",
    )
    model.compile(optimizer=opt, loss=lambda t, p: -keras.ops.sum(t * keras.ops.cast(p, "float32"), axis=-1),
                  jit_compile=jit_compile)
    x = np.zeros([2, 1], np.float32)
    y = np.zeros([2, width], np.float32)
    if canary:
        y[0] = 1.0
    model.fit(x, y, batch_size=2, epochs=1, shuffle=False, verbose=0)
    bias = model.layers[-1].bias.numpy()
    return -2.0 * bias.astype(np.float64), opt  # the noised sum y (division by 2 is exact)


def test_keras_first_step_low_bits_continuous_vs_grid():
    s_c, _ = _first_step_bias("continuous", True, 1)
    s_n, _ = _first_step_bias("continuous", False, 2)
    assert _event(s_c).sum() == 0 and _event(s_n).sum() > 0.2 * s_n.size  # the attack
    g_c, opt = _first_step_bias("grid", True, 1)
    g_n, _ = _first_step_bias("grid", False, 2)
    n = g_c.size
    assert _same_rate(_event(g_c).sum(), n, _event(g_n).sum(), n)
    a, b = g_c[np.abs(g_c) < 0.5], g_n[np.abs(g_n) < 0.5]
    for bits in range(1, 31):
        assert _same_rate(_event(a, bits).sum(), a.size, _event(b, bits).sum(), b.size), bits
    # the ledger: sensitivity C + g sqrt(d) by hand (d = kernel + bias), the grid recorded
    (entry,) = opt.ledger.samples()
    (event,) = entry.queries
    c, d = math.sqrt(n), 2 * n
    g = 2.0 ** math.floor(math.log2(c * 2.0**-10 / math.sqrt(d)))
    assert event.noise_grid == g
    assert event.l2_sensitivity == pytest.approx(c + g * math.sqrt(d), rel=1e-15)
    assert event.l2_sensitivity >= c + g * math.sqrt(d)
    assert np.all(g_c / g == np.round(g_c / g))


def test_grid_ledger_round_trips_and_the_statement_names_the_mode(tmp_path):
    _, opt = _first_step_bias("grid", True, 3)
    path = tmp_path / "ledger.json"
    opt.ledger.save(path)
    loaded = tf_dp.PrivacyLedger.load(path)
    assert loaded.samples() == opt.ledger.samples()
    (event,) = loaded.samples()[0].queries
    assert event.noise_grid is not None
    # the raw tables keep the grid in the last column; tables saved before it still load
    samples, queries = opt.ledger.tables()
    assert queries.shape[1] == 7 and queries[0, -1] == event.noise_grid
    old = tf_dp.PrivacyLedger()
    old.load_tables(samples, queries[:, :-1])
    assert old.samples()[0].queries[0].noise_grid is None
    text = str(tf_dp.compute_epsilon(path, 1e-5))
    assert f"grid of {event.noise_grid:.6g}" in text
    _, cont = _first_step_bias("continuous", True, 3)
    assert "Continuous floating-point noise" in str(tf_dp.compute_epsilon(cont.ledger, 1e-5))


def test_grid_mode_under_xla_and_mixed_precision():
    import keras

    s, opt = _first_step_bias("grid", True, 4, jit_compile=True)
    (event,) = opt.ledger.samples()[0].queries
    assert np.all(s / event.noise_grid == np.round(s / event.noise_grid))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        s16, opt16 = _first_step_bias("grid", True, 5)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    (event16,) = opt16.ledger.samples()[0].queries
    assert event16.noise_grid == event.noise_grid
    assert np.all(np.isfinite(s16))


def test_noise_mode_is_validated_and_serialised():
    import tf_dp.keras as dpk

    with pytest.raises(ValueError, match="noise_mode"):
        tf_dp.GaussianSumQuery(1.0, 1.0, noise_mode="snapped")
    with pytest.raises(ValueError, match="noise_mode"):
        dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, noise_mode="exact")
    with pytest.raises(ValueError, match="noise_mode"):
        dpk.DPKerasSGDOptimizer(dp_sum_query=tf_dp.GaussianSumQuery(1.0, 1.0), noise_mode="grid")
    opt = dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, noise_mode="grid")
    again = dpk.DPKerasSGDOptimizer.from_config(opt.get_config())
    assert again.dp_query.query.noise_mode == "grid"
    q = tf_dp.GaussianSumQuery(1.0, 1.0, noise_mode="grid")
    assert tf_dp.GaussianSumQuery.from_config(q.get_config()).noise_mode == "grid"
