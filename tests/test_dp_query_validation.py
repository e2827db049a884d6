"""Bad input fails early with ValueError/TypeError naming the argument and the accepted range,
before any state (in particular the ledger) changes; and section-4 noise allocation helpers."""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

BAD_NUMBERS = [
    (-1.0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    (-float("inf"), ValueError), (np.float32("nan"), ValueError), (tf.constant(-0.5), ValueError),
    (tf.Variable(float("nan")), ValueError), (tf.constant([1.0, 2.0]), ValueError),
    ("1.0", TypeError), (True, TypeError), (None, TypeError), ([1.0], (TypeError, ValueError)),
    (tf.constant("a"), TypeError),
]


@pytest.mark.parametrize("value,exc", BAD_NUMBERS)
@pytest.mark.parametrize("arg", ["l2_norm_clip", "stddev"])
def test_gaussian_rejects_bad_clip_and_stddev(arg, value, exc):
    kwargs = {"l2_norm_clip": 1.0, "stddev": 1.0, arg: value}
    with pytest.raises(exc, match=arg):
        tf_dp.GaussianSumQuery(**kwargs)
    with pytest.raises(exc, match=arg):
        tf_dp.JointClipGaussianSumQuery(scales=[1.0], **kwargs)


def test_error_message_states_accepted_range():
    with pytest.raises(ValueError, match=r"l2_norm_clip must be a finite number >= 0, got -1"):
        tf_dp.GaussianSumQuery(-1.0, 1.0)


def test_valid_numbers_accepted():
    for v in [0, 0.0, 3, np.float64(2.5), np.int32(4), tf.constant(1.0), tf.Variable(2.0),
              tf.constant(3, tf.int32)]:
        tf_dp.GaussianSumQuery(v, v)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), float("inf")])
def test_joint_clip_rejects_bad_scales(scale):
    with pytest.raises(ValueError, match=r"scales\[1\].*> 0"):
        tf_dp.JointClipGaussianSumQuery(1.0, 1.0, scales=[1.0, scale])
    with pytest.raises(ValueError, match="scales"):
        tf_dp.JointClipGaussianSumQuery(1.0, 1.0, scales=[])


@pytest.mark.parametrize("denominator", [0.0, -2.0, float("nan"), float("inf"), tf.constant(0.0), None])
def test_normalized_rejects_bad_denominator(denominator):
    with pytest.raises(ValueError, match="denominator"):
        tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 1.0), denominator)


def test_normalized_rejects_non_query():
    with pytest.raises(TypeError, match="numerator_query"):
        tf_dp.NormalizedQuery(lambda x: x, 2.0)


def test_nested_rejects_non_query_and_empty():
    with pytest.raises(TypeError, match=r"queries.*leaf 1 is str"):
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 1.0), "gaussian"])
    with pytest.raises(TypeError, match="queries"):
        tf_dp.NestedQuery({"a": None})
    with pytest.raises(ValueError, match="queries"):
        tf_dp.NestedQuery([])


def test_mismatched_structures_raise_value_error_naming_the_argument():
    g = tf_dp.GaussianSumQuery(1.0, 1.0, seed=1)
    params = g.derive_sample_params(g.initial_global_state())
    state = g.initial_sample_state([tf.zeros([2]), tf.zeros([3])])
    with pytest.raises(ValueError, match="record"):
        g.accumulate_record(params, state, [tf.zeros([2])])
    with pytest.raises(ValueError, match="sample_state_2"):
        g.merge_sample_states(state, [tf.zeros([2])])
    # Shapes that would silently broadcast are refused.
    with pytest.raises(ValueError, match="shape"):
        g.accumulate_record(params, state, [tf.zeros([1]), tf.zeros([3])])
    with pytest.raises(TypeError, match="dtype"):
        g.accumulate_record(params, state, [tf.zeros([2], tf.float64), tf.zeros([3])])

    nested = tf_dp.NestedQuery({"a": tf_dp.GaussianSumQuery(1.0, 1.0), "b": tf_dp.GaussianSumQuery(1.0, 1.0)})
    gs = nested.initial_global_state()
    with pytest.raises(ValueError, match="template"):
        nested.initial_sample_state({"a": tf.zeros([2])})
    state = nested.initial_sample_state({"a": tf.zeros([2]), "b": tf.zeros([2])})
    with pytest.raises(ValueError, match="record"):
        nested.accumulate_record(nested.derive_sample_params(gs), state, {"a": tf.zeros([2]), "c": tf.zeros([2])})
    with pytest.raises(ValueError, match="sample_state"):
        nested.get_noised_result([tf.zeros([2]), tf.zeros([2])], gs)
    with pytest.raises(ValueError, match="squared_norms"):
        nested.clip_weights(nested.derive_sample_params(gs), [tf.zeros([3])])

    joint = tf_dp.JointClipGaussianSumQuery(1.0, 1.0, scales={"k": 1.0, "b": 0.1})
    with pytest.raises(ValueError, match="record"):
        joint.preprocess_record(joint.derive_sample_params(joint.initial_global_state()), {"k": tf.zeros([2])})
    with pytest.raises(ValueError, match="template"):
        joint.initial_sample_state([tf.zeros([2]), tf.zeros([2])])


def test_no_privacy_average_has_no_norm_clipping_rule():
    q = tf_dp.NoPrivacyAverageQuery()
    assert not q.supports_norm_clipping
    with pytest.raises(NotImplementedError, match="NoPrivacyAverageQuery"):
        q.clip_weights((), [tf.zeros([2])])


# -- noise allocation (section 4) ------------------------------------------------------------


def eq1(clips, stddevs):
    """Effective noise multiplier by Eq. (1), via the ledger's SampleEntry (independent path)."""
    entry = SampleEntry(
        SamplingEvent(100, 0.1),
        tuple(SumQueryEvent(float(c), float(s)) for c, s in zip(clips, stddevs)),
    )
    return entry.effective_noise_multiplier()


def test_proportional_allocation_hand_computed_and_eq1():
    stddevs = tf_dp.proportional_noise_allocation(1.1, [1.0, 0.5])
    np.testing.assert_allclose(stddevs, [1.1 * math.sqrt(2), 1.1 * math.sqrt(2) * 0.5], rtol=1e-12)
    for z in [0.5, 1.0, 3.7]:
        clips = [0.1, 1.0, 4.0, 0.02]
        s = tf_dp.proportional_noise_allocation(z, clips)
        assert eq1(clips, s) == pytest.approx(z, rel=1e-12)
        ratios = [si / ci for si, ci in zip(s, clips)]  # sigma_g proportional to S_g
        np.testing.assert_allclose(ratios, [z * 2.0] * 4, rtol=1e-12)


def test_dimension_adjusted_allocation_hand_computed_and_eq1():
    clips = {"kernel": 1.0, "bias": 0.5}
    dims = {"kernel": 30, "bias": 10}
    s = tf_dp.dimension_adjusted_noise_allocation(2.0, clips, dims)
    assert set(s) == {"kernel", "bias"}
    assert s["kernel"] == pytest.approx(2.0 * math.sqrt(40 / 30) * 1.0, rel=1e-12)
    assert s["bias"] == pytest.approx(2.0 * math.sqrt(40 / 10) * 0.5, rel=1e-12)
    assert eq1([1.0, 0.5], [s["kernel"], s["bias"]]) == pytest.approx(2.0, rel=1e-12)
    # Dimensions from variables / tensors: their number of elements.
    variables = [tf.Variable(tf.zeros([5, 6])), tf.zeros([10])]
    s2 = tf_dp.dimension_adjusted_noise_allocation(2.0, [1.0, 0.5], variables)
    np.testing.assert_allclose(s2, [s["kernel"], s["bias"]], rtol=1e-12)
    clips = [0.3, 1.0, 2.0]
    for z in [0.7, 1.3]:
        assert eq1(clips, tf_dp.dimension_adjusted_noise_allocation(z, clips, [7, 100, 3])) == \
            pytest.approx(z, rel=1e-12)


def test_allocation_feeds_a_nested_query_whose_ledger_gives_z():
    clips = [1.0, 0.25, 3.0]
    stddevs = tf_dp.proportional_noise_allocation(1.3, clips)
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(c, s, seed=1) for c, s in zip(clips, stddevs)]),
        ledger, population_size=1000, selection_probability=0.01)
    gs = query.initial_global_state()
    query.get_noised_result(query.initial_sample_state([tf.zeros([2])] * 3), gs)
    (entry,) = ledger.samples()
    assert len(entry.queries) == 3
    assert entry.effective_noise_multiplier() == pytest.approx(1.3, rel=1e-6)  # float32 recording


@pytest.mark.parametrize("call,match", [
    (lambda: tf_dp.proportional_noise_allocation(-1.0, [1.0]), "noise_multiplier"),
    (lambda: tf_dp.proportional_noise_allocation(float("nan"), [1.0]), "noise_multiplier"),
    (lambda: tf_dp.proportional_noise_allocation(1.0, [1.0, 0.0]), r"l2_norm_clips\[1\]"),
    (lambda: tf_dp.proportional_noise_allocation(1.0, []), "l2_norm_clips"),
    (lambda: tf_dp.dimension_adjusted_noise_allocation(1.0, [1.0, 2.0], [3]), "dimensions"),
    (lambda: tf_dp.dimension_adjusted_noise_allocation(1.0, [1.0], [0]), r"dimensions\[0\]"),
    (lambda: tf_dp.dimension_adjusted_noise_allocation(1.0, [1.0], [2.5]), r"dimensions\[0\]"),
])
def test_allocation_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


@pytest.mark.parametrize("record", [2.5, -1])
def test_python_number_records_accumulate(record):
    """A record that is a Python number (no ``.shape``) is checked against the sample state like a
    tensor (dp_query.py used ``np`` without importing it: NameError)."""
    query = tf_dp.NoPrivacySumQuery()
    gs = query.initial_global_state()
    state = query.initial_sample_state(tf.constant(0.0))
    for _ in range(2):
        state = query.accumulate_record(query.derive_sample_params(gs), state, record)
    result, _ = query.get_noised_result(state, gs)
    assert float(result) == 2 * record
    wide = query.initial_sample_state(tf.zeros([3]))
    with pytest.raises(ValueError, match="does not match"):
        query.accumulate_record(query.derive_sample_params(gs), wide, record)


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
