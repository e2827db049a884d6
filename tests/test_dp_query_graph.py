"""Queries inside tf.function, under XLA (jit_compile=True) and in tf.distribute replica contexts."""

import os
import sys
import textwrap

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers import warm_python

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def np_clipped_sum(records, clip):
    total = np.zeros_like(records[0], dtype=np.float64)
    for r in records:
        norm = np.linalg.norm(r.astype(np.float64))
        total += r * min(1.0, clip / norm)
    return total


RECORDS = (np.random.default_rng(0).normal(size=(6, 5)) * [[0.1], [1.0], [4.0], [0.5], [9.0], [2.0]]
           ).astype(np.float32)


def make_queries():
    """Each query with the numpy reference of its clipped sum for RECORDS (as [r[:2], r[2:]])."""
    def ref_nested(clips):
        return [np_clipped_sum(RECORDS[:, :2], clips[0]), np_clipped_sum(RECORDS[:, 2:], clips[1])]

    def ref_joint(clip, alphas):
        scaled = RECORDS / np.array([alphas[0]] * 2 + [alphas[1]] * 3, np.float32)
        s = np_clipped_sum(scaled, clip) * np.array([alphas[0]] * 2 + [alphas[1]] * 3)
        return [s[:2], s[2:]]

    full = np_clipped_sum(RECORDS, 1.5)
    return {
        "gaussian": (tf_dp.GaussianSumQuery(1.5, 0.0, seed=1), [full[:2], full[2:]]),
        "nested": (tf_dp.NestedQuery([tf_dp.GaussianSumQuery(0.4, 0.0, seed=1),
                                      tf_dp.GaussianSumQuery(2.0, 0.0, seed=2)]), ref_nested([0.4, 2.0])),
        "joint": (tf_dp.JointClipGaussianSumQuery(1.0, 0.0, scales=[0.5, 3.0], seed=1),
                  ref_joint(1.0, [0.5, 3.0])),
        "normalized": (tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.5, 0.0, seed=1), 2.0),
                       [full[:2] / 2, full[2:] / 2]),
    }


def split(r):
    return [r[:2], r[2:]]


def accumulate_all(query, records):
    gs = query.initial_global_state()
    params = query.derive_sample_params(gs)
    state = query.initial_sample_state([tf.zeros([2]), tf.zeros([3])])
    for i in range(records.shape[0]):
        state = query.accumulate_record(params, state, split(records[i]))
    return query.get_noised_result(state, gs)[0]


@pytest.mark.parametrize("jit", [False, True], ids=["tf_function", "xla"])
@pytest.mark.parametrize("name", ["gaussian", "nested", "joint", "normalized"])
def test_accumulate_and_result_in_tf_function(name, jit):
    query, want = make_queries()[name]
    fn = tf.function(lambda recs: accumulate_all(query, recs), jit_compile=jit)
    got = fn(tf.constant(RECORDS))
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("jit", [False, True], ids=["tf_function", "xla"])
def test_clip_weights_and_while_loop_in_graph(jit):
    """clip_weights on a batch of norms and accumulation in a tf.while_loop (symbolic batch size)."""
    query = tf_dp.GaussianSumQuery(1.5, 0.0, seed=1)
    gs = query.initial_global_state()

    @tf.function(jit_compile=jit)
    def fn(recs):
        params = query.derive_sample_params(gs)
        w = query.clip_weights(params, [tf.reduce_sum(tf.square(recs), axis=1)])[0]
        weighted = tf.reduce_sum(recs * w[:, None], axis=0)
        state = query.initial_sample_state(tf.zeros([5]))
        n = tf.shape(recs)[0]
        _, state = tf.while_loop(
            lambda i, s: i < n,
            lambda i, s: (i + 1, query.accumulate_record(params, s, recs[i])),
            (tf.constant(0), state))
        return weighted, state

    weighted, state = fn(tf.constant(RECORDS))
    want = np_clipped_sum(RECORDS, 1.5)
    np.testing.assert_allclose(weighted.numpy(), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.numpy(), want, rtol=1e-5, atol=1e-6)


def test_indexed_slices_in_tf_function():
    query = tf_dp.GaussianSumQuery(2.0, 0.0)
    gs = query.initial_global_state()

    @tf.function
    def fn(values, indices):
        rec = tf.IndexedSlices(values, indices, tf.constant([4, 2], tf.int64))
        params = query.derive_sample_params(gs)
        state = query.initial_sample_state(tf.zeros([4, 2]))
        return query.accumulate_record(params, state, rec)

    out = fn(tf.constant([[1.0, 2.0], [3.0, 4.0], [0.0, 1.0]]), tf.constant([0, 2, 0], tf.int64))
    dense = np.array([[1.0, 3.0], [0, 0], [3.0, 4.0], [0, 0]])
    np.testing.assert_allclose(out.numpy(), dense * 2.0 / np.sqrt(35.0), rtol=1e-6)


def test_noise_under_xla_has_the_configured_stddev():
    sigma, n = 1.7, 100_000
    query = tf_dp.JointClipGaussianSumQuery(1.0, sigma, scales=[1.0, 0.1], seed=3)
    gs = query.initial_global_state()
    fn = tf.function(lambda s: query.get_noised_result(s, gs)[0], jit_compile=True)
    a, b = fn([tf.zeros([n]), tf.zeros([n])])
    c, _ = fn([tf.zeros([n]), tf.zeros([n])])
    for draws, sd in [(a, sigma), (b, 0.1 * sigma)]:
        draws = draws.numpy().astype(np.float64)
        assert abs(draws.std() - sd) <= 5 * sd / np.sqrt(2 * n)
        assert abs(draws.mean()) <= 5 * sd / np.sqrt(n)
    assert not np.any(a.numpy() == c.numpy())  # the generator state advances under XLA too


def _ledger_step(query, gs, template):
    def step(recs):
        params = query.derive_sample_params(gs)
        state = query.initial_sample_state(template)
        for i in range(recs.shape[0]):
            state = query.accumulate_record(params, state, recs[i])
        return query.get_noised_result(state, gs)[0]
    return step


def test_one_device_strategy_replica_context():
    strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
    with strategy.scope():
        ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.5, 0.0, seed=1), ledger,
                                  population_size=100, selection_probability=0.06)
    gs = query.initial_global_state()
    step = _ledger_step(query, gs, tf.zeros([5]))

    @tf.function
    def run(recs):
        return strategy.run(step, args=(recs,))

    for _ in range(3):
        out = run(tf.constant(RECORDS))
    np.testing.assert_allclose(out.numpy(), np_clipped_sum(RECORDS, 1.5), rtol=1e-5, atol=1e-6)
    assert ledger.num_samples == 3


def test_mirrored_strategy_accumulate_in_replicas_merge_then_noise():
    strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(0.4, 0.0, seed=1), tf_dp.GaussianSumQuery(2.0, 0.0, seed=2)]),
        ledger, population_size=100, selection_probability=0.06)
    gs = query.initial_global_state()

    def replica_fn(recs):
        params = query.derive_sample_params(gs)
        a = query.initial_sample_state([tf.zeros([2]), tf.zeros([3])])
        b = query.initial_sample_state([tf.zeros([2]), tf.zeros([3])])
        for i in range(3):
            a = query.accumulate_record(params, a, split(recs[i]))
        for i in range(3, 6):
            b = query.accumulate_record(params, b, split(recs[i]))
        return query.merge_sample_states(a, b)

    @tf.function
    def run(recs):
        per_replica = strategy.run(replica_fn, args=(recs,))
        total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
        return query.get_noised_result(total, gs)[0]

    out = run(tf.constant(RECORDS))
    _, want = make_queries()["nested"]
    for g, w in zip(out, want):
        np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-6)
    assert ledger.num_samples == 1 and len(ledger.samples()[0].queries) == 2


def test_mirrored_strategy_two_replicas_in_subprocess():
    """Two logical CPU devices must be configured before TensorFlow initialises: own process."""
    script = textwrap.dedent("""
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
        import numpy as np
        import tensorflow as tf
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        import tf_dp

        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
        assert strategy.num_replicas_in_sync == 2
        ledger = tf_dp.PrivacyLedger()
        query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.0, 0.0), ledger,
                                      population_size=50, selection_probability=0.04)
        noisy = tf_dp.GaussianSumQuery(1.0, 1.0)  # unseeded: replicas must not share noise
        gs = query.initial_global_state()

        def replica_fn(rec):
            params = query.derive_sample_params(gs)
            s = query.initial_sample_state(tf.zeros([2]))
            s = query.accumulate_record(params, s, rec)
            s = query.merge_sample_states(s, query.accumulate_record(params, query.initial_sample_state(tf.zeros([2])), rec))
            return s, noisy.get_noised_result(tf.zeros([256]), noisy.initial_global_state())[0]

        @tf.function
        def run(recs):
            per_replica, noise = strategy.run(replica_fn, args=(recs,))
            total = strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)
            return query.get_noised_result(total, gs)[0], strategy.experimental_local_results(noise)

        recs = strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant([3.0, 4.0]) * float(ctx.replica_id_in_sync_group + 1) * 0.1)
        for _ in range(2):
            out, noise = run(recs)
        # replica 0: [.3,.4] (norm .5, unclipped) twice; replica 1: [.6,.8] (norm 1) twice.
        np.testing.assert_allclose(out.numpy(), [1.8, 2.4], rtol=1e-6)
        assert ledger.num_samples == 2
        assert not np.any(noise[0].numpy() == noise[1].numpy())
        print("OK")
    """)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = warm_python.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stderr[-3000:]


def test_ledger_records_exactly_under_xla_across_flushes():
    """Under jit_compile=True rows go to the fixed-size staging table and are flushed between
    compiled calls: the ledger equals the one recorded without XLA, step for step."""
    clip = tf.Variable(1.0)
    ledgers, fns = [], []
    for jit in (True, False):
        ledger = tf_dp.PrivacyLedger()
        query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(clip, 1.0, seed=1), ledger,
                                      population_size=500, selection_probability=0.05)
        gs = query.initial_global_state()
        ledgers.append(ledger)
        fns.append(tf.function(_ledger_step(query, gs, tf.zeros([5])), jit_compile=jit))
    ledgers[0].reserve(3)
    for t in range(150):  # more than twice the initial capacity of both tables
        clip.assign(0.5 + 0.01 * t)
        for fn in fns:
            fn(tf.constant(RECORDS))
        if t % 3 == 2:
            ledgers[0].flush()
    assert ledgers[0].num_samples == ledgers[1].num_samples == 150
    assert ledgers[0].samples() == ledgers[1].samples()
    assert ledgers[0].samples()[149].queries[0].l2_sensitivity == pytest.approx(1.99, rel=1e-6)


def test_xla_step_without_room_releases_nothing_and_flush_raises():
    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.0, 1.0, seed=1), ledger)
    gs = query.initial_global_state()
    fn = tf.function(_ledger_step(query, gs, tf.zeros([5])), jit_compile=True)
    capacity = ledger._samples.staging_capacity
    outputs = [fn(tf.constant(RECORDS)).numpy() for _ in range(capacity + 2)]
    assert all(np.any(o != 0) for o in outputs[:capacity])
    assert all(np.all(o == 0) for o in outputs[capacity:])  # withheld: nothing released
    with pytest.raises(tf_dp.ledger.LedgerOverflowError, match="2 ledger row"):
        ledger.flush()
    assert ledger.num_samples == capacity  # the withheld steps are not counted: they released nothing


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))
