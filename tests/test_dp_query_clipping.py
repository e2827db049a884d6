"""Clipping and accumulation of the sum queries against plain numpy references.

References are per-record numpy loops (global L2 norm, factor min(1, C / norm)) written
independently of the library, plus hand-computed small cases.
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_dp

RTOL = 1e-5  # float32 arithmetic on O(1) values


def np_clip(leaves, clip):
    """Clips a list of numpy arrays jointly to global L2 norm ``clip``."""
    norm = np.sqrt(sum(float(np.sum(np.asarray(x, np.float64) ** 2)) for x in leaves))
    factor = 1.0 if norm <= clip else (clip / norm if norm > 0 else 0.0)
    return [np.asarray(x, np.float64) * factor for x in leaves]


def np_clipped_sum(records, clip):
    total = None
    for rec in records:
        clipped = np_clip(rec, clip)
        total = clipped if total is None else [a + b for a, b in zip(total, clipped)]
    return total


def make_records(rng, n, shapes, scales):
    """Records with norms spread below and above typical clips (scales multiply each record)."""
    return [
        [(rng.normal(size=s) * sc).astype(np.float32) for s in shapes]
        for sc in np.resize(scales, n)
    ]


def accumulate(query, records, template):
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    state = query.initial_sample_state(template)
    for rec in records:
        state = query.accumulate_record(params, state, rec)
    return state


def test_gaussian_clipping_matches_numpy_per_record():
    rng = np.random.default_rng(0)
    shapes = [(3, 2), (4,)]
    records = make_records(rng, 12, shapes, [0.05, 0.3, 1.0, 3.0, 10.0])
    clip = 1.3
    query = tf_dp.GaussianSumQuery(l2_norm_clip=clip, stddev=0.0)
    params = query.derive_sample_params(query.initial_global_state())
    for rec in records:  # each record separately
        got = query.preprocess_record(params, [tf.constant(x) for x in rec])
        for g, r in zip(got, np_clip(rec, clip)):
            np.testing.assert_allclose(g.numpy(), r, rtol=RTOL, atol=1e-7)
    state = accumulate(query, [[tf.constant(x) for x in r] for r in records],
                       [tf.zeros(s) for s in shapes])
    for got, want in zip(state, np_clipped_sum(records, clip)):
        np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=1e-6)
    # Some records were clipped and some were not, so the test exercises both branches.
    norms = [np.sqrt(sum(np.sum(x.astype(np.float64) ** 2) for x in r)) for r in records]
    assert min(norms) < clip < max(norms)


def test_gaussian_hand_computed():
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0)
    state = accumulate(query, [tf.constant([3.0, 4.0]), tf.constant([0.1, 0.0])], tf.zeros([2]))
    np.testing.assert_allclose(state.numpy(), [0.7, 0.8], rtol=1e-6)


def test_zero_record_and_zero_clip():
    query = tf_dp.GaussianSumQuery(l2_norm_clip=0.0, stddev=0.0)
    state = accumulate(query, [tf.constant([3.0, 4.0]), tf.zeros([2])], tf.zeros([2]))
    np.testing.assert_array_equal(state.numpy(), [0.0, 0.0])
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0)
    state = accumulate(query, [tf.zeros([2])], tf.zeros([2]))
    assert np.all(np.isfinite(state.numpy()))
    np.testing.assert_array_equal(state.numpy(), [0.0, 0.0])


def test_gaussian_float64_records():
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0)
    rec = tf.constant([30.0, 40.0], tf.float64)
    state = accumulate(query, [rec], tf.zeros([2], tf.float64))
    assert state.dtype == tf.float64
    np.testing.assert_allclose(state.numpy(), [0.6, 0.8], rtol=1e-6)


def _weights_sum(query, records, shapes):
    """sum_i w_i * g_i with w from clip_weights on per-record squared norms."""
    params = query.derive_sample_params(query.initial_global_state())
    sq = [tf.constant([np.sum(r[k].astype(np.float64) ** 2) for r in records], tf.float32)
          for k in range(len(shapes))]
    weights = query.clip_weights(params, sq)
    out = []
    for k in range(len(shapes)):
        w = weights[k].numpy().astype(np.float64)
        assert w.shape == (len(records),)
        out.append(sum(w[i] * records[i][k].astype(np.float64) for i in range(len(records))))
    return out


@pytest.mark.parametrize("kind", ["gaussian", "nested", "joint", "normalized_numerator"])
def test_clip_weights_equal_accumulate_record(kind):
    rng = np.random.default_rng(1)
    shapes = [(5,), (2, 3)]
    records = make_records(rng, 10, shapes, [0.02, 0.5, 2.0, 8.0])
    if kind == "gaussian":
        query = tf_dp.GaussianSumQuery(1.0, 0.0)
    elif kind == "nested":
        query = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(0.7, 0.0), tf_dp.GaussianSumQuery(2.0, 0.0)])
    elif kind == "joint":
        query = tf_dp.JointClipGaussianSumQuery(1.0, 0.0, scales=[0.5, 4.0])
    else:
        query = tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.5, 0.0), denominator=10.0)
    assert query.supports_norm_clipping
    state = accumulate(query, [[tf.constant(x) for x in r] for r in records],
                       [tf.zeros(s) for s in shapes])
    for got, want in zip(state, _weights_sum(query, records, shapes)):
        np.testing.assert_allclose(got.numpy(), want, rtol=RTOL, atol=1e-6)


def test_nested_clipping_per_group_matches_numpy():
    rng = np.random.default_rng(2)
    clips = {"dense": 0.8, "emb": 2.5}
    query = tf_dp.NestedQuery({k: tf_dp.GaussianSumQuery(c, 0.0) for k, c in clips.items()})
    records = [
        {"dense": [(rng.normal(size=4) * s).astype(np.float32), rng.normal(size=2).astype(np.float32)],
         "emb": (rng.normal(size=(3, 2)) * s).astype(np.float32)}
        for s in [0.1, 1.0, 5.0, 0.3, 3.0]
    ]
    template = {"dense": [tf.zeros([4]), tf.zeros([2])], "emb": tf.zeros([3, 2])}
    state = accumulate(query, tf.nest.map_structure(tf.constant, records), template)
    want_dense = np_clipped_sum([r["dense"] for r in records], clips["dense"])
    want_emb = np_clipped_sum([[r["emb"]] for r in records], clips["emb"])
    for g, w in zip(state["dense"], want_dense):
        np.testing.assert_allclose(g.numpy(), w, rtol=RTOL, atol=1e-6)
    np.testing.assert_allclose(state["emb"].numpy(), want_emb[0], rtol=RTOL, atol=1e-6)


def test_nested_hand_computed():
    query = tf_dp.NestedQuery({"a": tf_dp.GaussianSumQuery(1.0, 0.0), "b": tf_dp.GaussianSumQuery(0.5, 0.0)})
    records = [
        {"a": tf.constant([3.0, 4.0]), "b": tf.constant([1.0, 0.0, 0.0])},
        {"a": tf.constant([0.0, 0.5]), "b": tf.constant([0.0, 0.0, 0.2])},
    ]
    state = accumulate(query, records, {"a": tf.zeros([2]), "b": tf.zeros([3])})
    np.testing.assert_allclose(state["a"].numpy(), [0.6, 1.3], rtol=1e-6)
    np.testing.assert_allclose(state["b"].numpy(), [0.5, 0.0, 0.2], rtol=1e-6)


def test_nested_of_nested():
    inner = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 0.0), tf_dp.GaussianSumQuery(1.0, 0.0)])
    query = tf_dp.NestedQuery({"x": inner, "y": tf_dp.GaussianSumQuery(0.1, 0.0)})
    rec = {"x": [tf.constant([0.0, 2.0]), tf.constant([0.5])], "y": tf.constant([1.0, 1.0])}
    state = accumulate(query, [rec], tf.nest.map_structure(tf.zeros_like, rec))
    np.testing.assert_allclose(state["x"][0].numpy(), [0.0, 1.0], rtol=1e-6)
    np.testing.assert_allclose(state["x"][1].numpy(), [0.5], rtol=1e-6)
    np.testing.assert_allclose(state["y"].numpy(), [0.1 / np.sqrt(2)] * 2, rtol=1e-6)
    assert len(query.sum_query_specs(query.initial_global_state())) == 3


def np_joint_clip(leaves, alphas, clip):
    """The paper's definition: rescale by 1/alpha_j, clip jointly to S, scale back by alpha_j."""
    scaled = [np.asarray(x, np.float64) / a for x, a in zip(leaves, alphas)]
    clipped = np_clip(scaled, clip)
    return [c * a for c, a in zip(clipped, alphas)]


def test_joint_clip_matches_paper_definition():
    rng = np.random.default_rng(3)
    alphas = [1.0, 100.0, 0.25]
    shapes = [(3,), (2, 2), (5,)]
    clip = 1.2
    query = tf_dp.JointClipGaussianSumQuery(clip, 0.0, scales=alphas)
    records = [[(rng.normal(size=s) * a * m).astype(np.float32) for s, a in zip(shapes, alphas)]
               for m in [0.1, 0.5, 1.0, 2.0, 0.05]]
    params = query.derive_sample_params(query.initial_global_state())
    for rec in records:
        got = query.preprocess_record(params, [tf.constant(x) for x in rec])
        for g, w in zip(got, np_joint_clip(rec, alphas, clip)):
            np.testing.assert_allclose(g.numpy(), w, rtol=RTOL, atol=1e-6)
    state = accumulate(query, [[tf.constant(x) for x in r] for r in records],
                       [tf.zeros(s) for s in shapes])
    want = [sum(parts) for parts in zip(*[np_joint_clip(r, alphas, clip) for r in records])]
    for g, w in zip(state, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=RTOL, atol=1e-5)


def test_joint_clip_hand_computed_paper_example():
    # Paper section 2: alpha = (1, 100), S = 1. ||v1|| = 1, ||v2|| = 100 -> rescaled norm sqrt(2).
    query = tf_dp.JointClipGaussianSumQuery(1.0, 0.0, scales={"v1": 1.0, "v2": 100.0})
    params = query.derive_sample_params(query.initial_global_state())
    out = query.preprocess_record(params, {"v1": tf.constant([0.6, 0.8]), "v2": tf.constant([0.0, 100.0])})
    r = 1 / np.sqrt(2)
    np.testing.assert_allclose(out["v1"].numpy(), [0.6 * r, 0.8 * r], rtol=1e-6)
    np.testing.assert_allclose(out["v2"].numpy(), [0.0, 100.0 * r], rtol=1e-6)
    # Within the bound: unchanged ("if no clipping happens then alpha_j pi(s(v))_j = v_j").
    out = query.preprocess_record(params, {"v1": tf.constant([0.6, 0.0]), "v2": tf.constant([0.0, 50.0])})
    np.testing.assert_allclose(out["v1"].numpy(), [0.6, 0.0], rtol=1e-6)
    np.testing.assert_allclose(out["v2"].numpy(), [0.0, 50.0], rtol=1e-6)


def _dense_from_slices(values, indices, dense_shape):
    dense = np.zeros(dense_shape, np.float64)
    for v, i in zip(values, indices):
        dense[i] += v
    return dense


def test_indexed_slices_with_repeated_indices():
    # Row 0 appears twice: the dense gradient row is the sum, and the norm is taken of that.
    values = np.array([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]], np.float32)
    indices = np.array([0, 2, 0], np.int64)
    dense = _dense_from_slices(values, indices, (4, 2))
    assert np.isclose(np.sum(dense ** 2), 35.0)  # not 31, the norm of the raw values
    record = tf.IndexedSlices(tf.constant(values), tf.constant(indices), tf.constant([4, 2], tf.int64))
    other = np.array([[0.3, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.4]], np.float32)
    clip = 2.0
    for query in [tf_dp.GaussianSumQuery(clip, 0.0),
                  tf_dp.JointClipGaussianSumQuery(clip, 0.0, scales=[1.0, 1.0])]:
        params = query.derive_sample_params(query.initial_global_state())
        state = query.initial_sample_state([tf.zeros([4, 2]), tf.zeros([4, 2])])
        state = query.accumulate_record(params, state, [record, tf.constant(other)])
        state = query.accumulate_record(params, state, [record, tf.constant(other)])
        want = np_clipped_sum([[dense, other], [dense, other]], clip)
        for g, w in zip(state, want):
            np.testing.assert_allclose(tf.convert_to_tensor(g).numpy(), w, rtol=RTOL, atol=1e-6)
    # clip_weights from the squared norm of the deduplicated rows gives the same weights.
    query = tf_dp.GaussianSumQuery(clip, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    w = query.clip_weights(params, [tf.constant([35.0]), tf.constant([0.25])])
    np.testing.assert_allclose(w[0].numpy(), [clip / np.sqrt(35.25)], rtol=1e-6)


def test_indexed_slices_template_and_dense_result():
    values = tf.constant([[1.0, 0.0]])
    record = tf.IndexedSlices(values, tf.constant([1], tf.int64), tf.constant([3, 2], tf.int64))
    query = tf_dp.GaussianSumQuery(10.0, 0.0)
    state = query.initial_sample_state(record)
    assert state.shape == (3, 2)
    state = accumulate(query, [record, record], record)
    np.testing.assert_allclose(state.numpy(), [[0, 0], [2, 0], [0, 0]])


def test_merge_equals_sequential_accumulation():
    rng = np.random.default_rng(4)
    shapes = [(3,), (2, 2)]
    records = [[tf.constant(x) for x in r] for r in make_records(rng, 9, shapes, [0.1, 1.0, 5.0])]
    template = [tf.zeros(s) for s in shapes]
    queries = [
        tf_dp.GaussianSumQuery(1.0, 0.0),
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(0.5, 0.0), tf_dp.GaussianSumQuery(2.0, 0.0)]),
        tf_dp.JointClipGaussianSumQuery(1.0, 0.0, scales=[1.0, 3.0]),
        tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 0.0), 4.0),
        tf_dp.NoPrivacySumQuery(),
        tf_dp.NoPrivacyAverageQuery(),
    ]
    for query in queries:
        seq = accumulate(query, records, template)
        parts = [accumulate(query, records[:4], template), accumulate(query, records[4:7], template),
                 accumulate(query, records[7:], template)]
        merged = query.merge_sample_states(query.merge_sample_states(parts[0], parts[1]), parts[2])
        for a, b in zip(tf.nest.flatten(seq), tf.nest.flatten(merged)):
            np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-6, err_msg=repr(query))


def test_normalized_query_fixed_and_tensor_denominator():
    rec = tf.constant([3.0, 4.0])
    for denom, want in [(4.0, [0.15, 0.2]), (tf.constant(2.0), [0.3, 0.4]), (tf.Variable(8.0), [0.075, 0.1])]:
        query = tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 0.0), denominator=denom)
        gs = query.initial_global_state()
        state = accumulate(query, [rec], tf.zeros([2]))
        result, _ = query.get_noised_result(state, gs)
        np.testing.assert_allclose(result.numpy(), want, rtol=1e-6)
    # A variable denominator is read at run time.
    denom = tf.Variable(1.0)
    query = tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 0.0), denominator=denom)
    gs = query.initial_global_state()
    denom.assign(5.0)
    result, _ = query.get_noised_result(accumulate(query, [rec], tf.zeros([2])), gs)
    np.testing.assert_allclose(result.numpy(), [0.12, 0.16], rtol=1e-6)
    specs = query.sum_query_specs(gs)
    assert len(specs) == 1 and float(specs[0].l2_sensitivity) == 1.0


def test_no_privacy_queries():
    recs = [tf.constant([3.0, 4.0]), tf.constant([1.0, -2.0]), tf.constant([0.5, 0.0])]
    query = tf_dp.NoPrivacySumQuery()
    gs = query.initial_global_state()
    result, _ = query.get_noised_result(accumulate(query, recs, tf.zeros([2])), gs)
    np.testing.assert_allclose(result.numpy(), [4.5, 2.0], rtol=1e-6)  # no clipping, no noise
    assert [s.private for s in query.sum_query_specs(gs)] == [False]

    query = tf_dp.NoPrivacyAverageQuery()
    gs = query.initial_global_state()
    result, _ = query.get_noised_result(accumulate(query, recs, tf.zeros([2])), gs)
    np.testing.assert_allclose(result.numpy(), [1.5, 2.0 / 3], rtol=1e-6)
    assert [s.private for s in query.sum_query_specs(gs)] == [False]
    # Weighted: (2*[3,4] + 1*[1,-2]) / 3
    state = query.initial_sample_state(tf.zeros([2]))
    state = query.accumulate_weighted_record(state, recs[0], 2.0)
    state = query.accumulate_weighted_record(state, recs[1], 1.0)
    result, _ = query.get_noised_result(state, gs)
    np.testing.assert_allclose(result.numpy(), [7 / 3, 2.0], rtol=1e-6)
    # Empty sample: 0, not NaN.
    result, _ = query.get_noised_result(query.initial_sample_state(tf.zeros([2])), gs)
    np.testing.assert_array_equal(result.numpy(), [0.0, 0.0])


def test_tensor_and_variable_clip_read_at_run_time():
    clip = tf.Variable(1.0)
    query = tf_dp.GaussianSumQuery(clip, 0.0)
    gs = query.initial_global_state()
    rec = tf.constant([3.0, 4.0])
    for c in [1.0, 2.5, 10.0]:
        clip.assign(c)
        params = query.derive_sample_params(gs)
        out = query.preprocess_record(params, rec)
        np.testing.assert_allclose(out.numpy(), np_clip([rec.numpy()], c)[0], rtol=1e-6)


def test_keras_variable_clip():
    import keras

    clip = keras.Variable(1.0, trainable=False)
    query = tf_dp.GaussianSumQuery(clip, 0.5)
    gs = query.initial_global_state()
    out = query.preprocess_record(query.derive_sample_params(gs), tf.constant([3.0, 4.0]))
    np.testing.assert_allclose(out.numpy(), [0.6, 0.8], rtol=1e-6)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        tf_dp.GaussianSumQuery(keras.Variable(-1.0), 0.5)


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
