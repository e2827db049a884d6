"""Noise: standard deviation, per-vector joint-clip noise, seeding (McMahan et al. 2018, section 8).

Tolerances: for N i.i.d. draws of N(0, sigma^2), the sample standard deviation has standard error
about sigma / sqrt(2N) and the sample mean sigma / sqrt(N). We allow K = 5 standard errors; the
seeds are fixed, so the tests are deterministic (and a wrong stddev by more than ~1% fails).
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.dp_query import native, noise

K = 5.0
N = 200_000


def assert_gaussian(draws, sigma):
    draws = np.asarray(draws, np.float64).ravel()
    n = draws.size
    assert abs(draws.mean()) <= K * sigma / np.sqrt(n), (draws.mean(), sigma)
    assert abs(draws.std() - sigma) <= K * sigma / np.sqrt(2 * n), (draws.std(), sigma)


def noised_zeros(query, template):
    gs = query.initial_global_state()
    result, _ = query.get_noised_result(query.initial_sample_state(template), gs)
    return result


@pytest.mark.parametrize("sigma", [0.3, 1.1, 7.0])
def test_gaussian_noise_stddev(sigma):
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=sigma, seed=11)
    assert_gaussian(noised_zeros(query, tf.zeros([N])).numpy(), sigma)


def test_noise_is_added_to_the_sum_and_independent_per_leaf():
    query = tf_dp.GaussianSumQuery(l2_norm_clip=100.0, stddev=0.5, seed=3)
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    state = query.initial_sample_state([tf.zeros([N // 2]), tf.zeros([N // 2])])
    state = query.accumulate_record(params, state, [tf.fill([N // 2], 0.01), tf.fill([N // 2], -0.02)])
    a, b = query.get_noised_result(state, gs)[0]
    assert_gaussian(a.numpy() - 0.01, 0.5)
    assert_gaussian(b.numpy() + 0.02, 0.5)
    # The two leaves get different draws (correlation ~ N(0, 1/n)).
    corr = np.corrcoef(a.numpy(), b.numpy())[0, 1]
    assert abs(corr) < K / np.sqrt(N // 2)


def test_zero_stddev_adds_nothing():
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0, seed=1)
    np.testing.assert_array_equal(noised_zeros(query, tf.zeros([100])).numpy(), np.zeros(100))


def test_variable_stddev_read_at_run_time():
    sigma = tf.Variable(1.0)
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=sigma, seed=5)
    gs = query.initial_global_state()
    sigma.assign(3.0)
    out = query.get_noised_result(query.initial_sample_state(tf.zeros([N])), gs)[0]
    assert_gaussian(out.numpy(), 3.0)


def test_joint_clip_noise_per_vector_is_alpha_times_sigma():
    sigma = 0.8
    alphas = {"small": 0.01, "mid": 1.0, "big": 100.0}
    query = tf_dp.JointClipGaussianSumQuery(1.0, sigma, scales=alphas, seed=7)
    out = noised_zeros(query, {k: tf.zeros([N // 4]) for k in alphas})
    for k, a in alphas.items():
        assert_gaussian(out[k].numpy(), a * sigma)


def test_nested_noise_per_group():
    query = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 0.2, seed=1),
                               tf_dp.GaussianSumQuery(1.0, 5.0, seed=2)])
    a, b = noised_zeros(query, [tf.zeros([N // 2]), tf.zeros([N // 2])])
    assert_gaussian(a.numpy(), 0.2)
    assert_gaussian(b.numpy(), 5.0)


def test_normalized_noise_is_divided():
    query = tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 4.0, seed=9), denominator=8.0)
    assert_gaussian(noised_zeros(query, tf.zeros([N])).numpy(), 0.5)


def test_float16_and_float64_states():
    for dtype in (tf.float16, tf.float64):
        query = tf_dp.GaussianSumQuery(1.0, 2.0, seed=4)
        out = noised_zeros(query, tf.zeros([N], dtype))
        assert out.dtype == dtype
        assert_gaussian(out.numpy(), 2.0)


def test_unseeded_noise_differs_between_fresh_queries():
    a = noised_zeros(tf_dp.GaussianSumQuery(1.0, 1.0), tf.zeros([1000])).numpy()
    b = noised_zeros(tf_dp.GaussianSumQuery(1.0, 1.0), tf.zeros([1000])).numpy()
    assert not np.any(a == b)  # continuous draws from independent streams never coincide
    # And consecutive calls on one query differ (the counter advances).
    q = tf_dp.GaussianSumQuery(1.0, 1.0)
    c, d = noised_zeros(q, tf.zeros([1000])).numpy(), noised_zeros(q, tf.zeros([1000])).numpy()
    assert not np.any(c == d)


def test_unseeded_generator_state_comes_from_os_entropy():
    states = [noise.make_generator().state.numpy() for _ in range(4)]
    # Philox state: 128-bit counter and 64-bit key, all random (no two equal, none the default 0).
    for i, s in enumerate(states):
        assert s.shape == (3,)
        assert np.all(s != 0)
        for t in states[i + 1:]:
            assert not np.any(s == t)
    assert noise.make_generator().algorithm == tf.random.Algorithm.PHILOX.value


def test_seeded_noise_is_reproducible():
    a = noised_zeros(tf_dp.GaussianSumQuery(1.0, 1.0, seed=42), tf.zeros([1000])).numpy()
    b = noised_zeros(tf_dp.GaussianSumQuery(1.0, 1.0, seed=42), tf.zeros([1000])).numpy()
    c = noised_zeros(tf_dp.GaussianSumQuery(1.0, 1.0, seed=43), tf.zeros([1000])).numpy()
    np.testing.assert_array_equal(a, b)
    assert not np.any(a == c)
    j1 = noised_zeros(tf_dp.JointClipGaussianSumQuery(1.0, 1.0, [2.0], seed=5), [tf.zeros([50])])
    j2 = noised_zeros(tf_dp.JointClipGaussianSumQuery(1.0, 1.0, [2.0], seed=5), [tf.zeros([50])])
    np.testing.assert_array_equal(j1[0].numpy(), j2[0].numpy())


def test_seeded_noise_same_in_tf_function_and_eager():
    eager_q = tf_dp.GaussianSumQuery(1.0, 1.0, seed=8)
    graph_q = tf_dp.GaussianSumQuery(1.0, 1.0, seed=8)
    gs = graph_q.initial_global_state()
    fn = tf.function(lambda s: graph_q.get_noised_result(s, gs)[0])
    for _ in range(2):
        np.testing.assert_array_equal(noised_zeros(eager_q, tf.zeros([64])).numpy(),
                                      fn(tf.zeros([64])).numpy())


def test_seed_type_is_checked():
    with pytest.raises(TypeError, match="seed"):
        tf_dp.GaussianSumQuery(1.0, 1.0, seed=1.5)
    with pytest.raises(TypeError, match="seed"):
        tf_dp.GaussianSumQuery(1.0, 1.0, seed=True)


# -- the batched Box-Muller sampler (noise.gaussian_noise) -------------------------------------------
#
# Tolerances from theory at fixed seeds (deterministic): the KS statistic of n exact draws exceeds
# c / sqrt(n) with probability about 2 exp(-2 c^2) (c = 2.5: 7e-6); a binomial count of expected
# value m is within 5 sqrt(m) + 1 of m except with probability < 1e-6.

KS_C = 2.5


@pytest.mark.parametrize("dtype", [tf.float32, tf.float64])
def test_sampler_matches_standard_normal(dtype):
    from scipy import stats

    n = 400_001  # odd: the last Box-Muller pair is cut
    z = noise.gaussian_noise(noise.make_generator(seed=123), n, dtype)
    assert z.shape == (n,) and z.dtype == dtype
    z = z.numpy().astype(np.float64)
    assert abs(z.mean()) <= K / np.sqrt(n)
    assert abs(z.var() - 1.0) <= K * np.sqrt(2.0 / n)
    assert stats.kstest(z, "norm").statistic <= KS_C / np.sqrt(n)
    # Both halves of the Box-Muller pairs (cos and sin) are standard normal and uncorrelated.
    h = n // 2
    for part in (z[:h], z[h:2 * h]):
        assert stats.kstest(part, "norm").statistic <= KS_C / np.sqrt(h)
    assert abs(np.corrcoef(z[:h], z[h:2 * h])[0, 1]) <= K / np.sqrt(h)


def test_sampler_tails():
    from scipy import stats

    gen = noise.make_generator(seed=7)
    z = np.concatenate([noise.gaussian_noise(gen, 2_000_000).numpy() for _ in range(2)])
    n = z.size
    for t in (2.0, 3.0, 4.0, 4.5, 5.0):
        m = n * 2 * stats.norm.sf(t)
        count = np.sum(np.abs(z) > t)
        assert abs(count - m) <= 5 * np.sqrt(m) + 1, (t, count, m)
    assert np.abs(z).max() <= noise.TAIL_BOUND * (1 + 1e-6)


def test_sampler_reaches_the_documented_tail_bound():
    # The smallest u1 (all-zero words) gives r = sqrt(2 * 65 * ln 2), at angle 0.
    assert noise.TAIL_BOUND == pytest.approx(9.4926, abs=1e-4)
    for dtype in (tf.float32, tf.float64):
        z = noise.box_muller(tf.zeros([3, 1], tf.uint32), dtype).numpy()
        assert z[0] == pytest.approx(noise.TAIL_BOUND, rel=1e-6)
        assert abs(z[1]) <= 1e-5
    # u1 = 2^-33 (hi = 0, lo = 0 .. then hi = 1): about 6.8 sigma, still representable.
    words = tf.constant([[0, 1], [2**31, 0], [0, 0]], tf.uint32)
    r = noise.box_muller(words).numpy()[:2]
    expect = np.sqrt(-2 * np.log((np.array([0, 1]) + (np.array([2**31, 0]) + 0.5) * 2.0**-32)
                                 * 2.0**-32))
    np.testing.assert_allclose(r, expect, rtol=1e-6)


def test_lazy_low_words_give_the_dense_values_bit_for_bit():
    # The float32 sampler draws the low word of u1 only for pairs with hi < 2^24; on the same
    # words it must return exactly what the dense three-word formula returns.
    rng = np.random.default_rng(5)
    h = 200_000
    hi = rng.integers(0, 2**32, h, dtype=np.uint64)
    hi[:5000] = rng.integers(0, 2**24, 5000)  # many tail pairs, including the extremes
    hi[:4] = [0, 1, 2**24 - 1, 2**24]
    words = tf.constant(np.stack([hi, rng.integers(0, 2**32, (2, h), dtype=np.uint64)[0],
                                  rng.integers(0, 2**32, h, dtype=np.uint64)]).astype(np.uint32))
    asked = []

    def draw_low(idx):
        asked.append(idx.numpy()[:, 0])
        return tf.gather_nd(words[1], idx)

    for sd in (None, 1.7):
        dense = noise.box_muller(words, tf.float32, sd).numpy()
        lazy = noise.box_muller_lazy(words[0], words[2], draw_low, sd).numpy()
        np.testing.assert_array_equal(lazy, dense)
    # exactly the pairs with hi < 2^24 asked for a low word
    np.testing.assert_array_equal(asked[0], np.flatnonzero(hi < 2**24))
    assert noise.box_muller_lazy(tf.zeros([1], tf.uint32), tf.zeros([1], tf.uint32),
                                 lambda idx: tf.zeros(tf.shape(idx)[:1], tf.uint32)).numpy()[0] \
        == pytest.approx(noise.TAIL_BOUND, rel=1e-6)


def test_float32_sampler_reserves_two_words_per_pair_with_one_skip():
    gen = noise.make_generator(seed=9)

    def counter_step(fn):
        before = int(gen.state.numpy()[0])
        fn()
        return int(gen.state.numpy()[0]) - before

    per_word = counter_step(lambda: gen.uniform_full_int([4096], tf.uint32)) / 4096
    for n in (2 * 65536, 3 * noise.CHUNK + 11):
        # one skip for the whole call (every chunk, the tail words included): 2 words per pair
        assert counter_step(lambda: noise.gaussian_noise(gen, n)) / per_word == 2 * ((n + 1) // 2)


def _stateless_words(key, counter, plane, count):
    c = tf.constant([counter[0], (counter[1] + plane) % 2**64], tf.uint64)
    return tf.raw_ops.StatelessRandomUniformFullIntV2(
        shape=[count], key=tf.constant([key], tf.uint64), counter=c, alg=1, dtype=tf.uint32)


@pytest.mark.parametrize("sampler", ["tf_ops", "native"])
def test_float32_sampler_uses_the_documented_counter_planes(sampler):
    # Recompute one multi-chunk call from Philox words read at the documented counters (chunk j:
    # high words on plane j, angles on plane J + j, low words on plane 2J + j, from the counter
    # the generator had before the call) with the transform of the sampler in use (the TF ops'
    # dense one, or the native op's on the given words): the values must match bit for bit
    # (for the native op, whose fused kernel computes its own Philox words, this checks them
    # against TensorFlow's), and the generator's next draw must start past every block the call
    # used.
    native.set_enabled(sampler == "native")
    try:
        _check_documented_counter_planes(sampler)
    finally:
        native.set_enabled(None)


def _check_documented_counter_planes(sampler):
    gen = noise.make_generator(seed=17)
    state = gen.state.numpy().view(np.uint64)
    counter, key = [int(state[0]), int(state[1])], int(state[2])
    n = 2 * noise.CHUNK + 2 * 4099
    z = noise.gaussian_noise(gen, n, stddev=1.3).numpy()
    sizes = [noise.CHUNK, noise.CHUNK, 2 * 4099]
    chunks = len(sizes)
    expect = []
    for j, m in enumerate(sizes):
        h = m // 2
        hi = _stateless_words(key, counter, j, h).numpy()
        angle = _stateless_words(key, counter, chunks + j, h)
        tail = np.flatnonzero(hi < 2**24)
        low = np.zeros(h, np.uint32)
        low[tail] = _stateless_words(key, counter, 2 * chunks + j, len(tail)).numpy()
        if sampler == "native":
            scale = noise._radius_scale(tf.float32, 1.3)
            expect.append(native.box_muller_op(hi, low, angle, scale).numpy())
        else:
            words = tf.constant(np.stack([hi, low, angle.numpy()]))
            expect.append(noise.box_muller(words, tf.float32, 1.3).numpy())
    np.testing.assert_array_equal(z, np.concatenate(expect))
    # the call reserved 256 blocks per word (2 words per pair) on plane 0, where only chunk 0's
    # high words are read (h / 4 blocks); the next call starts past them
    after = gen.state.numpy().view(np.uint64)
    assert int(after[1]) == counter[1] and int(after[0]) - counter[0] == 256 * n


def test_successive_calls_with_unknown_sizes_never_repeat_noise():
    # Counts only known at run time take the same reserved-counter path: every call must move
    # the generator past the words it read, or the next call would repeat its noise.
    gen = noise.make_generator(seed=23)
    fn = tf.function(lambda k: noise.gaussian_noise(gen, k),
                     input_signature=[tf.TensorSpec([], tf.int32)])
    n = 40_001
    before = int(gen.state.numpy()[0])
    a = fn(tf.constant(n)).numpy()
    b = fn(tf.constant(n)).numpy()
    assert int(gen.state.numpy()[0]) - before == 2 * 256 * 2 * ((n + 1) // 2)
    assert a.shape == b.shape == (n,)
    assert np.sum(a == b) <= 2  # equal float32 normals at the same position: chance only
    assert abs(np.corrcoef(a, b)[0, 1]) <= K / np.sqrt(n)
    # and a dense (float64) draw after them reads other blocks than the float32 calls did
    c = noise.gaussian_noise(gen, n, tf.float64).numpy()
    assert abs(np.corrcoef(b, c)[0, 1]) <= K / np.sqrt(n)


def test_structure_noise_per_leaf_stddev_and_dtypes():
    gen = noise.make_generator(seed=21)
    values = {"a": tf.zeros([300, 301]), "b": tf.zeros([7], tf.float16),
              "c": tf.zeros([50_000], tf.float64), "d": tf.zeros([0])}
    sds = {"a": 2.0, "b": 3.0, "c": 0.5, "d": 1.0}
    out = noise.add_gaussian_noise_structure(gen, values, sds)
    for k in values:
        assert out[k].dtype == values[k].dtype and out[k].shape == values[k].shape
    assert_gaussian(out["a"].numpy(), 2.0)
    assert_gaussian(out["c"].numpy(), 0.5)
    # one scalar for every leaf
    same = noise.add_gaussian_noise_structure(gen, [tf.zeros([N // 2]), tf.zeros([N // 2])], 4.0)
    assert_gaussian(same[0].numpy(), 4.0)
    assert_gaussian(same[1].numpy(), 4.0)


def test_small_leaves_share_one_draw_with_their_own_shapes_and_stddevs():
    # Leaves below OWN_DRAW_SIZE with the same stddev object share one draw (split per leaf);
    # a different stddev gets its own draw. Each leaf must still get its own law and shape.
    gen = noise.make_generator(seed=31)
    small = noise.OWN_DRAW_SIZE // 4
    values = [tf.zeros([small]), tf.zeros([small // 64, 64]), tf.zeros([small]), tf.zeros([3])]
    sds = [2.0, None, 0.5, None]
    sds[1] = sds[3] = sds[0]  # the same object as leaf 0: shared draw
    out = noise.add_gaussian_noise_structure(gen, values, sds)
    for v, o in zip(values, out):
        assert o.shape == v.shape
    assert_gaussian(out[0].numpy(), 2.0)
    assert_gaussian(out[1].numpy(), 2.0)
    assert_gaussian(out[2].numpy(), 0.5)
    # the shared draw is one vector cut in order: leaves 0 and 1 are not copies of each other
    assert abs(np.corrcoef(out[0].numpy(), out[1].numpy().ravel())[0, 1]) <= K / np.sqrt(small)


def test_sampler_in_tf_function_with_unknown_shape():
    gen = noise.make_generator(seed=2)
    fn = tf.function(lambda v: noise.add_gaussian_noise(gen, v, 1.5),
                     input_signature=[tf.TensorSpec([None, 3])])
    out = fn(tf.zeros([N // 3, 3])).numpy()
    assert out.shape == (N // 3, 3)
    assert_gaussian(out, 1.5)



def test_large_draw_is_chunked_and_traces_like_eager():
    # float64 (and XLA) draws above CHUNK are consecutive ordinary draws of CHUNK normals (to
    # bound the transform's temporaries); float32 draws are chunked over reserved counter planes
    # (test above). Either way a traced call with a constant count gives the eager values.
    n = 2 * noise.CHUNK + 7
    whole = noise.gaussian_noise(noise.make_generator(seed=5), n, tf.float64).numpy()
    gen = noise.make_generator(seed=5)
    parts = [noise.gaussian_noise(gen, m, tf.float64).numpy() for m in (noise.CHUNK, noise.CHUNK, 7)]
    np.testing.assert_array_equal(whole, np.concatenate(parts))
    for dtype in (tf.float32, tf.float64):
        eager = noise.gaussian_noise(noise.make_generator(seed=6), n, dtype).numpy()
        noise_gen = noise.make_generator(seed=6)
        traced = tf.function(lambda: noise.gaussian_noise(noise_gen, tf.constant(n), dtype))
        np.testing.assert_array_equal(traced().numpy(), eager)
        assert eager.shape == (n,)


def test_sampler_under_xla():
    gen = noise.make_generator(seed=4)
    fn = tf.function(lambda v: noise.add_gaussian_noise_structure(gen, v, 2.0), jit_compile=True)
    a, b = fn([tf.zeros([N // 2 + 1]), tf.zeros([7, 3])])
    assert b.shape == (7, 3)
    assert_gaussian(a.numpy(), 2.0)


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
