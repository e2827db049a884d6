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
from tf_dp.dp_query import noise

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


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
