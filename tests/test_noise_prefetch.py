"""Noise drawn ahead for XLA-compiled steps (``tf_dp.dp_query.noise.PrefetchedNoise``).

The prefetched noise must be the documented sampler's (the values ``gaussian_noise`` gives on a
generator of the same seed, bit for bit), each buffer must serve at most one step, and a step
without a fresh buffer must still be noised (inline). Statistical checks use K = 5 standard
errors of the sample mean (sigma / sqrt(n)) and standard deviation (sigma / sqrt(2 n)) on fixed
seeds.
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
import tf_dp.keras as dpk
from tf_dp.dp_query import noise

K = 5.0


@pytest.fixture(autouse=True)
def _serve_from_the_buffer(monkeypatch):
    """These tests exercise the buffer, which the query uses under XLA only where tf_dp's
    native sampler cannot run inside XLA (or with ``over_native``); the default where it can is
    tested last."""
    monkeypatch.setattr(noise.PrefetchedNoise, "over_native", True)


SIZES = [(300,), (400, 500)]  # 200,300 normals: two chunks of the float32 sampler
N = sum(int(np.prod(s)) for s in SIZES)
SIGMA = 1.1


def _xla_noised(pre):
    @tf.function(jit_compile=True)
    def noised(a, b):
        return pre.add_to([a, b], SIGMA)

    return noised


def _zeros():
    return [tf.zeros(s, tf.float32) for s in SIZES]


def _split(flat):
    out, k = [], 0
    for s in SIZES:
        m = int(np.prod(s))
        out.append(flat[k : k + m].reshape(s))
        k += m
    return out


def _reference_draws(seed, count):
    """The prefetch generator's first ``count`` draws of N normals: gaussian_noise on
    ``make_generator(seed).split(1)[0]``, eagerly."""
    ahead = noise.make_generator(seed=seed).split(1)[0]
    return [noise.gaussian_noise(ahead, N).numpy() for _ in range(count)]


def _flat(ts):
    return np.concatenate([t.numpy().ravel() for t in ts])


@pytest.mark.parametrize("background", [False, True], ids=["between-steps", "background"])
def test_prefetched_noise_is_the_sampler_bit_for_bit(background):
    pre = noise.PrefetchedNoise(noise.make_generator(seed=5))
    pre.background = background
    noised = _xla_noised(pre)
    noised.get_concrete_function(*_zeros())  # traced: the buffers exist, nothing drawn yet
    # draws the first normals (background: then the second in a background thread)
    pre.refill()
    got = [t.numpy() for t in noised(*_zeros())]
    assert pre.served == 1
    z1, z2 = _reference_draws(5, 2)
    want = _split(np.float32(SIGMA) * z1)  # 0 + sigma z: one float32 product, exact either way
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    assert all(np.count_nonzero(g == 0.0) == 0 for g in got)  # no coordinate without noise
    pre.refill()  # the second draw (background: the one drawn in the thread) is the next step's
    np.testing.assert_array_equal(_flat(noised(*_zeros())), np.float32(SIGMA) * z2)
    assert pre.served == 2
    assert (pre._vars[3] is not None) == background  # the second buffer only where it is used


@pytest.mark.parametrize("background", [False, True], ids=["between-steps", "background"])
def test_each_draw_serves_one_step_and_a_step_without_one_draws_inline(background):
    gen = noise.make_generator(seed=8)
    pre = noise.PrefetchedNoise(gen)
    noised = _xla_noised(pre)
    noised.get_concrete_function(*_zeros())
    pre.refill(background)
    pre.wait()  # background: the following step's draw has finished
    ahead_state = pre._ahead.state.numpy().copy()
    pre.refill(background)  # the current draw was not used: nothing is drawn, nothing moves
    pre.wait()
    np.testing.assert_array_equal(pre._ahead.state.numpy(), ahead_state)
    z1, z2 = _reference_draws(8, 2)
    first = _flat(noised(*_zeros()))
    np.testing.assert_array_equal(first, np.float32(SIGMA) * z1)
    state_before = gen.state.numpy().copy()
    second = _flat(noised(*_zeros()))  # no refill: drawn inline from the query's generator
    assert pre.served == 1
    assert not np.array_equal(gen.state.numpy(), state_before)  # the inline draw's counters
    # the second step's noise is fresh: uncorrelated with the first and with the draw that
    # waits in the second buffer, and N(0, SIGMA^2)
    assert abs(np.corrcoef(first, second)[0, 1]) < K / np.sqrt(N)
    assert abs(np.corrcoef(z2, second)[0, 1]) < K / np.sqrt(N)
    assert abs(second.mean()) <= K * SIGMA / np.sqrt(N)
    assert abs(second.std() - SIGMA) <= K * SIGMA / np.sqrt(2 * N)
    assert np.count_nonzero(second == 0.0) == 0
    pre.refill(background)
    np.testing.assert_array_equal(_flat(noised(*_zeros())), np.float32(SIGMA) * z2)
    assert pre.served == 2


def test_outside_xla_and_under_a_strategy_the_query_draws_inline():
    assert not noise.PrefetchedNoise.applies_to([tf.zeros([4])])  # eager
    q = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=SIGMA, seed=3)
    gs = q.initial_global_state()

    @tf.function
    def graph_noised(v):
        return q.get_noised_result([v], gs)[0]

    graph_noised(tf.zeros([N]))
    q.prefetched_noise.refill()
    assert q.prefetched_noise.served == 0 and q.prefetched_noise._vars is None
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        seen = []

        @tf.function(jit_compile=True)
        def probe(v):
            seen.append(noise.PrefetchedNoise.applies_to([v]))
            return v

        probe(tf.zeros([4]))
    assert seen == [False]


def _private_model(seed, width=8):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(width), keras.layers.Dense(3)])
    optimizer = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, noise_seed=seed
    )
    model = dpk.make_private(model)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    optimizer.set_sampling(64, 16 / 64, "shuffle")
    return model, optimizer


def test_fit_under_xla_reads_noise_drawn_ahead_once_per_step(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 20)).astype("float32")
    y = rng.integers(0, 3, size=64)
    model, optimizer = _private_model(1)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    prefetched = optimizer.engine.query.prefetched_noise
    # 4 steps: the first call traced the step (no buffer yet, inline draw); the 3 others read
    # a buffer drawn before their call
    assert prefetched.served == 3
    assert optimizer.ledger.num_samples == 4  # every step recorded
    # the buffer is no model or optimizer variable (never saved with the weights)
    names = [v.path if hasattr(v, "path") else v.name for v in model.variables]
    names += [v.path if hasattr(v, "path") else v.name for v in optimizer.variables]
    assert not [n for n in names if "noise_ahead" in n]
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    path = checkpoint.write(str(tmp_path / "ckpt"))
    assert not [n for n, _ in tf.train.list_variables(path) if "noise_ahead" in n]


@pytest.mark.parametrize("background", [False, True], ids=["between-steps", "background"])
def test_a_process_that_exits_right_after_an_xla_fit_exits_cleanly(background):
    # the last refill's background draw may still run at exit: it is joined, not killed (in a
    # subprocess, so a crash at shutdown fails this test rather than the suite)
    code = (
        "import numpy as np, keras, tf_dp.keras as dpk\n"
        "from tf_dp.dp_query.noise import PrefetchedNoise\n"
        f"PrefetchedNoise.background = {background}\n"
        "PrefetchedNoise.over_native = True\n"
        "m = keras.Sequential([keras.Input((20,)), keras.layers.Dense(3)])\n"
        "o = dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1)\n"
        "m = dpk.make_private(m)\n"
        "m.compile(optimizer=o, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),"
        " jit_compile=True)\n"
        "o.set_sampling(64, 16 / 64, 'shuffle')\n"
        "x = np.zeros((64, 20), 'float32'); y = np.zeros(64, 'int64')\n"
        "m.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)\n"
        "assert o.engine.query.prefetched_noise.served == 3\n"
        "print('done')\n"
    )
    p = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.strip().endswith("done")


def _fit_and_train_on_batch(seed, fused, monkeypatch):
    from tf_dp.keras import fit_sampling

    with monkeypatch.context() as patch:
        if not fused:  # Keras's own train function, the noise and counters read between calls
            patch.setattr(fit_sampling, "_fused_train_function", lambda model, engine: None)
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 20)).astype("float32")
        y = rng.integers(0, 3, size=64)
        model, optimizer = _private_model(seed)
        model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
        optimizer.set_sampling(64, 16 / 64, "shuffle")
        model.train_on_batch(x[:16], y[:16])
        return model, optimizer


def test_fused_train_function_trains_as_the_unfused_one_bit_for_bit(monkeypatch):
    # fit and train_on_batch under XLA with one step per call run the step and then, in the
    # same function, draw the next step's noise and read the flush's counters: the same
    # weights, noise and ledger as drawing and reading between the calls
    fused, fused_opt = _fit_and_train_on_batch(3, True, monkeypatch)
    plain, plain_opt = _fit_and_train_on_batch(3, False, monkeypatch)
    for a, b in zip(fused.get_weights(), plain.get_weights()):
        np.testing.assert_array_equal(a, b)
    assert fused_opt.ledger.num_samples == plain_opt.ledger.num_samples == 9
    np.testing.assert_array_equal(fused_opt.ledger.tables()[0],
                                  plain_opt.ledger.tables()[0])
    np.testing.assert_array_equal(fused_opt.ledger.tables()[1],
                                  plain_opt.ledger.tables()[1])
    fused_pre = fused_opt.engine.query.prefetched_noise
    plain_pre = plain_opt.engine.query.prefetched_noise
    # 9 steps, each after the first read a buffer drawn for it: the fused path drew them in the
    # graph (no eager fill function was ever made), the other between calls
    assert fused_pre.served == plain_pre.served == 8
    assert fused_pre._fill_current is None and plain_pre._fill_current is not None


def test_flush_counters_read_in_the_graph_equal_the_eager_reads():
    from tf_dp.ledger.privacy_ledger import counter_key, known_counters, read_int

    model, optimizer = _private_model(4)
    x = np.zeros((64, 20), "float32")
    model.fit(x, np.zeros(64, "int64"), batch_size=16, epochs=1, verbose=0, shuffle=False)
    engine = optimizer.engine
    counters = engine.flush_counters()
    snapshot = tf.function(engine.after_step_in_graph)()
    assert snapshot.shape == (1, len(counters))  # no journal: no rows
    known = known_counters(counters, snapshot.numpy()[0])
    assert len(known) == len(counters)
    for c in counters:
        if c.shape.rank == 2:  # a staging table: its rows
            assert known[counter_key(c)] == c.numpy().shape[0]
        else:
            assert known[counter_key(c)] == read_int(c) == int(c.numpy())
    # the staged count is among them and non-zero here (the steps stay staged between calls)
    assert sum(known[counter_key(c)] for c in counters[:2]) > 0


@pytest.mark.parametrize("jit_compile", [True, False], ids=["xla", "graph"])
def test_fused_train_function_journals_the_steps_as_the_unfused_one(tmp_path, monkeypatch,
                                                                    jit_compile):
    # the journal's append after each step takes the step's rows from the function that ran
    # it: the journal file must hold what the ledger holds, as with the rows read between calls
    from tf_dp.keras import fit_sampling
    from tf_dp.ledger import privacy_ledger
    from tf_dp.ledger.journal import read_journal

    rng = np.random.default_rng(1)
    x = rng.normal(size=(64, 20)).astype("float32")
    y = rng.integers(0, 3, size=64)
    journals = []
    for fused in (True, False):
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(fit_sampling, "_fused_train_function", lambda model, engine: None)
            model, optimizer = _private_model(5)
            if not jit_compile:
                model.compile(optimizer=optimizer, jit_compile=False,
                              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
                optimizer.set_sampling(64, 16 / 64, "shuffle")
            path = tmp_path / f"journal_{fused}"
            optimizer.ledger.attach_journal(path)
            reads = []
            read_rows = privacy_ledger._read_rows
            patch.setattr(privacy_ledger, "_read_rows", lambda *a: reads.append(a) or read_rows(*a))
            model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False)
            # the fused function's steps gave the journal their rows: no table reads between steps
            assert (len(reads) == 0) if fused else (len(reads) >= 8)
            optimizer.set_sampling(64, 16 / 64, "shuffle")
            model.train_on_batch(x[:16], y[:16])
            entries = read_journal(path)
            assert entries == optimizer.ledger.samples()
            assert len(entries) == 9
            journals.append(entries)
    assert journals[0] == journals[1]


def test_where_the_native_sampler_runs_in_xla_the_step_draws_its_own_noise(monkeypatch):
    """The default where tf_dp's native ops are built: no buffer; each XLA step draws its noise
    with the native kernel as a custom call, from the query's generator with the same
    reservations as the eager step's native draws (the generator ends in the same state)."""
    from tf_dp.dp_query import native

    monkeypatch.setattr(noise.PrefetchedNoise, "over_native", False)
    assert native.xla_available(), native.status()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 20)).astype("float32")
    y = rng.integers(0, 3, size=64)
    states = []
    for jit in (True, False):
        # 49k parameters: one draw of at least noise.LAZY_MIN_SIZE (XLA's own sampler would
        # draw three words per pair from the generator instead of reserving two with a skip)
        model, optimizer = _private_model(5, width=2048)
        if not jit:
            model.compile(optimizer=optimizer, jit_compile=False,
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            optimizer.set_sampling(64, 16 / 64, "shuffle")
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
        query = optimizer.engine.query
        if jit:
            assert query.prefetched_noise.served == 0 and query.prefetched_noise._vars is None
        states.append(query._generator.state.numpy())
        assert optimizer.ledger.num_samples == 4
    np.testing.assert_array_equal(states[0], states[1])
