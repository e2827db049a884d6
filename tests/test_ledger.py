"""PrivacyLedger + QueryWithLedger: events recorded as run, inside tf.function, over many steps."""

import math
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent, compress


def f32(x):
    return float(np.float32(x))


def run_step(query, template, records):
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    state = query.initial_sample_state(template)
    for r in records:
        state = query.accumulate_record(params, state, r)
    return query.get_noised_result(state, gs)


def test_200_step_tf_function_loop_with_changing_clip():
    steps = 200
    clips = (0.5 + 0.013 * np.arange(steps)).astype(np.float32)
    multiplier = 1.1
    clip = tf.Variable(1.0)
    stddev = tf.Variable(1.0)
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.GaussianSumQuery(clip, stddev, seed=1), ledger,
        population_size=60000, selection_probability=256 / 60000)
    gs = query.initial_global_state()

    @tf.function
    def step(c, record):
        clip.assign(c)
        stddev.assign(c * multiplier)
        params = query.derive_sample_params(gs)
        state = query.initial_sample_state(record)
        state = query.accumulate_record(params, state, record)
        return query.get_noised_result(state, gs)[0]

    for t in range(steps):
        step(tf.constant(clips[t]), tf.constant([3.0, 4.0]))
    assert step.experimental_get_tracing_count() == 1

    entries = ledger.samples()
    assert ledger.num_samples == steps and len(entries) == steps
    for t, e in enumerate(entries):
        assert e.sampling == SamplingEvent(60000, 256 / 60000, "poisson")
        assert len(e.queries) == 1
        (q,) = e.queries
        assert q.l2_sensitivity == f32(clips[t])  # the clip of *that* step, exactly
        assert q.noise_stddev == f32(np.float32(clips[t]) * np.float32(multiplier))
        assert q.mechanism == "gaussian" and q.jl_projections is None
        assert e.effective_noise_multiplier() == pytest.approx(multiplier, rel=1e-6)
    assert len(compress(entries)) == steps  # every step differs


def test_sampling_changes_between_steps_are_recorded():
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.0, 2.0, seed=1), ledger,
                                  population_size=100, selection_probability=0.5)
    fn = tf.function(lambda: run_step(query, tf.zeros([2]), [tf.ones([2])])[0])
    fn()
    query.set_sampling(200, 0.25, "shuffle")
    fn()
    query.set_mechanism(sensitivity_multiplier=2.0)  # microbatches of several examples: 2C
    fn()
    query.set_mechanism(sensitivity_multiplier=1.0, jl_projections=3)
    fn()
    e = ledger.samples()
    assert [x.sampling for x in e] == [SamplingEvent(100, 0.5, "poisson")] + \
        [SamplingEvent(200, 0.25, "shuffle")] * 3
    assert [x.queries[0].l2_sensitivity for x in e] == [1.0, 1.0, 2.0, 1.0]
    assert [x.queries[0].mechanism for x in e] == ["gaussian", "gaussian", "gaussian", "jl"]
    assert e[3].queries[0].jl_projections == 3 and e[3].jl_projections == 3
    assert [x.effective_noise_multiplier() for x in e] == [2.0, 2.0, 1.0, 2.0]


def test_nested_query_records_one_sum_event_per_group():
    clips = [1.0, 0.5, 2.0]
    sigmas = [1.5, 0.6, 4.0]
    ledger = tf_dp.PrivacyLedger()
    nested = tf_dp.NestedQuery({
        "a": tf_dp.GaussianSumQuery(clips[0], sigmas[0], seed=1),
        "b": [tf_dp.GaussianSumQuery(clips[1], sigmas[1], seed=2),
              tf_dp.JointClipGaussianSumQuery(clips[2], sigmas[2], scales=[1.0, 10.0], seed=3)],
    })
    query = tf_dp.QueryWithLedger(nested, ledger, population_size=500, selection_probability=0.02)
    template = {"a": tf.zeros([3]), "b": [tf.zeros([2]), [tf.zeros([1]), tf.zeros([4])]]}
    fn = tf.function(lambda: run_step(query, template, [tf.nest.map_structure(tf.ones_like, template)])[0])
    for _ in range(10):
        fn()
    entries = ledger.samples()
    assert len(entries) == 10
    want_z = sum((c / s) ** 2 for c, s in zip(clips, sigmas)) ** -0.5
    for e in entries:
        # tf.nest order: "a" then "b"[0] then "b"[1].
        assert [(q.l2_sensitivity, q.noise_stddev) for q in e.queries] == \
            [(f32(c), f32(s)) for c, s in zip(clips, sigmas)]
        assert e.effective_noise_multiplier() == pytest.approx(want_z, rel=1e-6)


def test_effective_noise_multiplier_eq1_hand_computed():
    s = SamplingEvent(10, 0.1)
    e = SampleEntry(s, (SumQueryEvent(1.0, 2.0), SumQueryEvent(3.0, 2.0)))
    # (1/4 + 9/4)^(-1/2) = (10/4)^(-1/2)
    assert e.effective_noise_multiplier() == pytest.approx(math.sqrt(0.4), rel=1e-12)
    assert SampleEntry(s, (SumQueryEvent(2.0, 2.2),)).effective_noise_multiplier() == pytest.approx(1.1)
    # A zero-noise query with positive sensitivity: no privacy.
    assert SampleEntry(s, (SumQueryEvent(1.0, 2.0), SumQueryEvent(1.0, 0.0))).effective_noise_multiplier() == 0.0
    # No query touched the data: nothing spent.
    assert SampleEntry(s, (SumQueryEvent(0.0, 1.0),)).effective_noise_multiplier() == math.inf


def test_no_privacy_queries_recorded_as_non_private():
    for inner in [tf_dp.NoPrivacySumQuery(), tf_dp.NoPrivacyAverageQuery()]:
        ledger = tf_dp.PrivacyLedger()
        query = tf_dp.QueryWithLedger(inner, ledger, population_size=10, selection_probability=0.5)
        query.set_mechanism(sensitivity_multiplier=2.0, jl_projections=2)  # must not make it "jl"
        run_step(query, tf.zeros([2]), [tf.ones([2])])
        (e,) = ledger.samples()
        assert [q.mechanism for q in e.queries] == ["none"]
        assert not e.private
        assert e.effective_noise_multiplier() == 0.0

    # A nested query mixing private and non-private groups is non-private as a whole.
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 1.0, seed=1), tf_dp.NoPrivacySumQuery()]), ledger)
    run_step(query, [tf.zeros([2]), tf.zeros([2])], [])
    (e,) = ledger.samples()
    assert [q.mechanism for q in e.queries] == ["gaussian", "none"]
    assert e.effective_noise_multiplier() == 0.0


def test_normalized_query_records_numerator_sum_query():
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(0.75, 1.5, seed=1), 32.0), ledger)
    run_step(query, tf.zeros([2]), [])
    (e,) = ledger.samples()
    assert [(q.l2_sensitivity, q.noise_stddev) for q in e.queries] == [(0.75, 1.5)]


def test_query_with_ledger_delegates_clipping():
    g = tf_dp.GaussianSumQuery(1.0, 0.0)
    query = tf_dp.QueryWithLedger(g)
    assert isinstance(query.ledger, tf_dp.PrivacyLedger)
    assert query.supports_norm_clipping
    params = query.derive_sample_params(query.initial_global_state())
    np.testing.assert_allclose(query.preprocess_record(params, tf.constant([3.0, 4.0])).numpy(), [0.6, 0.8])
    np.testing.assert_allclose(query.clip_weights(params, tf.constant([25.0, 0.25])).numpy(), [0.2, 1.0])
    assert query.ledger.num_samples == 0  # clipping alone records nothing


def test_bad_step_leaves_ledger_unchanged():
    ledger = tf_dp.PrivacyLedger()
    nested = tf_dp.NestedQuery([tf_dp.GaussianSumQuery(1.0, 1.0, seed=1)] * 2)
    query = tf_dp.QueryWithLedger(nested, ledger, population_size=10, selection_probability=0.1)
    gs = query.initial_global_state()
    run_step(query, [tf.zeros([2])] * 2, [])
    before = ledger.samples()
    assert len(before) == 1
    with pytest.raises(ValueError, match="sample_state"):
        query.get_noised_result([tf.zeros([2])], gs)
    with pytest.raises(ValueError, match="record"):
        query.accumulate_record(query.derive_sample_params(gs), [tf.zeros([2])] * 2, [tf.zeros([3])] * 2)
    assert ledger.samples() == before

    # Invalid sampling parameters: refused, old values kept.
    for args, match in [((0, 0.1), "population_size"), ((10, 0.0), "selection_probability"),
                        ((10, 1.5), "selection_probability"), ((10, float("nan")), "selection_probability"),
                        ((10, 0.1, "random"), "policy"), ((2.5, 0.1), "population_size")]:
        with pytest.raises(ValueError, match=match):
            query.set_sampling(*args)
    for kwargs, match in [({"sensitivity_multiplier": 0.0}, "sensitivity_multiplier"),
                          ({"jl_projections": -1}, "jl_projections")]:
        with pytest.raises(ValueError, match=match):
            query.set_mechanism(**kwargs)
    run_step(query, [tf.zeros([2])] * 2, [])
    assert ledger.samples() == before * 2


def test_clip_variable_set_to_bad_value_fails_before_recording():
    clip = tf.Variable(1.0)
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(clip, 1.0, seed=1), ledger)
    fn = tf.function(lambda: run_step(query, tf.zeros([2]), [tf.ones([2])])[0])
    fn()
    for bad in [float("nan"), -1.0, float("inf")]:
        clip.assign(bad)
        with pytest.raises(ValueError, match="l2_sensitivity"):  # eager
            run_step(query, tf.zeros([2]), [tf.ones([2])])
        with pytest.raises(tf.errors.InvalidArgumentError, match="l2_sensitivity"):  # in a graph
            fn()
        assert ledger.num_samples == 1
    clip.assign(0.5)
    fn()
    assert [e.queries[0].l2_sensitivity for e in ledger.samples()] == [1.0, 0.5]


def test_a_graph_step_names_the_first_bad_value_among_several_sum_queries():
    clip, noise = tf.Variable(1.0), tf.Variable(1.0)
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(tf_dp.NestedQuery([
        tf_dp.GaussianSumQuery(1.0, 1.0, seed=1), tf_dp.GaussianSumQuery(clip, noise, seed=2)]),
        ledger)
    fn = tf.function(lambda: run_step(query, [tf.zeros([2])] * 2, [[tf.ones([2])] * 2])[0])
    fn()
    for variable, bad, match in [
        (noise, float("nan"), r"sum query 1: noise_stddev must be a finite number >= 0, got nan"),
        (noise, -2.0, r"sum query 1: noise_stddev must be a finite number >= 0, got -2"),
        (clip, float("inf"), r"sum query 1: l2_sensitivity \(the clip\) must be .*, got inf"),
    ]:
        variable.assign(bad)
        with pytest.raises(tf.errors.InvalidArgumentError, match=match):
            fn()
        variable.assign(1.0)
    fn()
    assert ledger.num_samples == 2  # the failed steps recorded nothing


def test_constructor_type_checks():
    with pytest.raises(TypeError, match="query"):
        tf_dp.QueryWithLedger("gaussian")
    with pytest.raises(TypeError, match="ledger"):
        tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.0, 1.0), ledger=[])


def test_ledger_grows_past_initial_capacity_eagerly_and_in_graph():
    ledger = tf_dp.PrivacyLedger()
    # 5 groups -> 5 query rows per sample; 150 samples -> 750 rows (several doublings).
    query = tf_dp.QueryWithLedger(
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(float(i + 1), 2.0, seed=i) for i in range(5)]),
        ledger, population_size=7, selection_probability=1.0)
    template = [tf.zeros([1])] * 5
    gs = query.initial_global_state()
    fn = tf.function(lambda s: query.get_noised_result(s, gs)[0])
    for i in range(150):
        if i % 50 == 0:
            query.get_noised_result(query.initial_sample_state(template), gs)  # eager
        else:
            fn(query.initial_sample_state(template))
    entries = ledger.samples()
    assert len(entries) == 150
    assert all([q.l2_sensitivity for q in e.queries] == [1.0, 2.0, 3.0, 4.0, 5.0] for e in entries)


def test_record_methods_directly():
    ledger = tf_dp.PrivacyLedger()
    ledger.record_sampling(1000, 0.01, "shuffle")
    ledger.record_sum_query(1.0, 1.1)
    ledger.record_sum_query(2.0, 3.0, "jl", 4)
    (e,) = ledger.samples()
    assert e == SampleEntry(SamplingEvent(1000, 0.01, "shuffle"),
                            (SumQueryEvent(1.0, 1.1), SumQueryEvent(2.0, 3.0, "jl", 4)))
    with pytest.raises(ValueError, match="policy"):
        ledger.record_sampling(10, 0.1, "iid")
    with pytest.raises(ValueError, match="mechanism"):
        ledger.record_sum_query(1.0, 1.0, "laplace")
    ledger.reset()
    assert ledger.num_samples == 0 and ledger.samples() == []


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_resume_takes_the_longer_of_ledger_and_journal(tmp_path):
    """docs/keras.md (multi-worker): after a kill the copies may differ by one step (70 vs
    69); attaching the journal keeps the longer, whichever side it is on."""

    entry = SampleEntry(SamplingEvent(1000, 0.01, "poisson"), (SumQueryEvent(1.0, 1.1),))
    for ledger_steps, journal_steps in [(69, 70), (70, 69)]:
        path = tmp_path / f"j{ledger_steps}.jsonl"
        writer = tf_dp.PrivacyLedger()
        writer.restore_runs([(entry, journal_steps)])
        writer.attach_journal(path)
        writer.detach_journal()
        ledger = tf_dp.PrivacyLedger()
        ledger.restore_runs([(entry, ledger_steps)])
        ledger.attach_journal(path)
        ledger.detach_journal()
        assert ledger.num_samples == 70
        reread = tf_dp.PrivacyLedger()
        reread.attach_journal(path)
        assert reread.num_samples == 70
        reread.detach_journal()
