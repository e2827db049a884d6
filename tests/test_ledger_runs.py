"""PrivacyLedger.runs(), restore_runs(), save/load through runs: checked against the steps as they
were recorded (a direct list kept by the test) and on a 1e6-step ledger."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import pytest

import tf_dp
from tf_dp.ledger import read_ledger_runs
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent


def _expand(runs):
    return [entry for entry, count in runs for _ in range(count)]


def _direct_runs(steps):
    """Run-length encoding by a direct count, independent of the ledger."""
    out = []
    for e in steps:
        if out and out[-1][0] == e:
            out[-1][1] += 1
        else:
            out.append([e, 1])
    return [tuple(r) for r in out]


def _random_steps(rng, n):
    """Steps drawn from a small pool so that runs of repeats occur, with pass starts, several
    queries per sample, tree/jl mechanisms, seeds and grids."""
    pool = []
    for _ in range(6):
        policy = ["poisson", "shuffle"][rng.integers(2)]
        k = int(rng.integers(1, 4))
        queries = []
        for _ in range(k):
            mech = ["gaussian", "gaussian", "jl", "tree"][rng.integers(4)]
            queries.append(SumQueryEvent(
                l2_sensitivity=float(rng.choice([0.5, 1.0, 2.0])),
                noise_stddev=float(rng.choice([0.75, 1.5])),
                mechanism=mech,
                jl_projections=int(rng.integers(1, 5)) if mech == "jl" else None,
                tree_step=int(rng.integers(0, 3)) if mech == "tree" else None,
                noise_seed=int(rng.integers(0, 9)) if rng.random() < 0.2 else None,
                noise_grid=float(rng.choice([0.25, 0.5])) if rng.random() < 0.3 else None,
            ))
        sampling = SamplingEvent(int(rng.choice([100, 1000])), float(rng.choice([0.01, 0.25])),
                                 policy, pass_start=policy == "shuffle" and rng.random() < 0.3)
        pool.append(SampleEntry(sampling, tuple(queries)))
    steps = []
    while len(steps) < n:
        steps += [pool[rng.integers(len(pool))]] * int(rng.integers(1, 6))
    return steps[:n]


def _record(ledger, steps):
    for e in steps:
        s = e.sampling
        ledger.record_sampling(s.population_size, s.selection_probability, s.policy,
                               pass_start=s.pass_start)
        for q in e.queries:
            ledger.record_sum_query(q.l2_sensitivity, q.noise_stddev, q.mechanism,
                                    q.jl_projections or q.tree_step or 0, noise_seed=q.noise_seed,
                                    noise_grid=q.noise_grid)


def test_runs_of_recorded_random_ledgers_match_the_recorded_steps(tmp_path):
    for seed in range(3):
        rng = np.random.default_rng(seed)
        steps = _random_steps(rng, 60)
        ledger = tf_dp.PrivacyLedger()
        _record(ledger, steps)
        runs = ledger.runs()
        assert runs == _direct_runs(steps)
        assert all(a[0] != b[0] for a, b in zip(runs, runs[1:]))  # maximal runs
        assert ledger.samples() == steps
        path = tmp_path / f"l{seed}.json"
        ledger.save(path)
        assert read_ledger_runs(path) == runs
        loaded = tf_dp.PrivacyLedger.load(path)
        assert loaded.samples() == steps
        # tables rebuilt from runs equal the recorded tables, row for row
        for a, b in zip(loaded.tables(), ledger.tables()):
            np.testing.assert_array_equal(a, b)
        restored = tf_dp.PrivacyLedger()
        restored.load_tables(*ledger.tables())
        assert restored.runs() == runs


def test_runs_restore_save_load_on_a_million_steps(tmp_path):
    base = SamplingEvent(60000, 256 / 60000)
    distinct = [
        SampleEntry(base, (SumQueryEvent(1.0, 1.0 + i / 1000), SumQueryEvent(0.5, 2.0)))
        for i in range(10_000)
    ]
    runs = [(e, 100) for e in distinct]
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs(runs)
    assert ledger.num_samples == 10**6
    samples, queries = ledger.tables()
    # each step's two query rows point to it, in order (a direct count)
    np.testing.assert_array_equal(queries[:, 0], np.repeat(np.arange(10**6), 2))
    np.testing.assert_array_equal(queries[::2, 2], np.repeat(1.0 + np.arange(10_000) / 1000, 100))
    assert ledger.runs() == runs
    ledger.save(tmp_path / "big.json")
    assert tf_dp.PrivacyLedger.load(tmp_path / "big.json").runs() == runs
    identical = tf_dp.PrivacyLedger()
    identical.restore_runs([(distinct[0], 10**6)])
    assert identical.runs() == [(distinct[0], 10**6)]


def test_restore_and_runs_in_pieces_match_the_recorded_steps(monkeypatch):
    # Pieces of 7 steps: runs cross piece boundaries everywhere. The tables built piece by piece
    # from runs equal the tables recorded step by step; runs() read piece by piece equals a
    # direct run-length count of the steps.
    from tf_dp.ledger import privacy_ledger

    monkeypatch.setattr(privacy_ledger, "_CHUNK_ROWS", 7)
    for seed in range(3):
        steps = _random_steps(np.random.default_rng(10 + seed), 80)
        recorded = tf_dp.PrivacyLedger()
        _record(recorded, steps)
        assert recorded.runs() == _direct_runs(steps)
        restored = tf_dp.PrivacyLedger()
        restored.restore_runs(_direct_runs(steps))
        for a, b in zip(restored.tables(), recorded.tables()):
            np.testing.assert_array_equal(a, b)
        assert restored.runs() == _direct_runs(steps)
        assert restored.samples() == steps


def test_restore_and_runs_hold_no_full_length_host_copy(monkeypatch):
    # numpy buffers are traced by tracemalloc (TensorFlow's own tensors are not): restoring and
    # reading 3e5 steps (26 MB of tables) works on pieces of a fixed number of steps, so the
    # host memory they take is bounded by the piece, not by the ledger's length.
    import tracemalloc

    from tf_dp.ledger import privacy_ledger

    monkeypatch.setattr(privacy_ledger, "_CHUNK_ROWS", 8192, raising=False)
    n = 300_000
    entry = SampleEntry(SamplingEvent(60000, 0.01), (SumQueryEvent(1.0, 1.1),))
    table_bytes = n * (4 + 7) * 8
    piece_bytes = 8192 * (4 + 7) * 8
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs([(entry, 1)])  # first ops outside the measurement
    ledger.runs()
    tracemalloc.start()
    try:
        ledger.restore_runs([(entry, n)])
        restore_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        runs = ledger.runs()
        runs_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(c for _, c in runs) == n
    # a piece's rows, its index arrays and the query index column: a few piece sizes
    assert restore_peak < 4 * piece_bytes < table_bytes / 8
    assert runs_peak < n * 8 + 4 * piece_bytes < table_bytes / 2


def _steps_from(steps, start):
    return _direct_runs(steps[start:])


def test_runs_from_gives_the_runs_of_the_later_steps(monkeypatch):
    # runs_from(start) equals a direct count of the steps from `start` on: from scratch, when
    # following a growing ledger (each call from where the previous one ended), and after the
    # tables were replaced by other steps.
    from tf_dp.ledger import privacy_ledger

    monkeypatch.setattr(privacy_ledger, "_CHUNK_ROWS", 7)
    steps = _random_steps(np.random.default_rng(7), 90)
    ledger = tf_dp.PrivacyLedger()
    seen = 0
    for stop in (13, 14, 40, 41, 90):
        _record(ledger, steps[seen:stop])
        assert ledger.runs_from(seen) == _steps_from(steps[:stop], seen)
        seen = stop
    for start in (90, 89, 0, 31, 5):
        assert ledger.runs_from(start) == _steps_from(steps, start)
    other = _random_steps(np.random.default_rng(8), 60)
    ledger.restore_runs(_direct_runs(other))
    for start in (31, 59, 60, 2):
        assert ledger.runs_from(start) == _steps_from(other, start)
    for bad in (-1, 61):
        with pytest.raises(ValueError, match="start must be in"):
            ledger.runs_from(bad)


def test_run_tables_list_runs_and_load_back_as_the_recorded_steps():
    """run_tables() (what .keras and weights files store): one sample row per run of a direct
    run-length count of the recorded steps, its last column the count, the query rows of each
    run pointing to the run; load_tables() of it, and of the per-step tables() earlier versions
    stored, gives back the recorded steps."""
    from tf_dp.ledger.privacy_ledger import RUN_SAMPLE_COLS, table_steps

    for seed in range(2):
        steps = _random_steps(np.random.default_rng(20 + seed), 40)
        ledger = tf_dp.PrivacyLedger()
        _record(ledger, steps)
        direct = _direct_runs(steps)
        samples, queries = ledger.run_tables()
        assert samples.shape == (len(direct), RUN_SAMPLE_COLS)
        np.testing.assert_array_equal(samples[:, -1], [c for _, c in direct])
        np.testing.assert_array_equal(
            queries[:, 0], np.repeat(np.arange(len(direct)), [len(e.queries) for e, _ in direct]))
        assert table_steps(samples) == len(steps) == table_steps(ledger.tables()[0])
        for tables in (ledger.run_tables(), ledger.tables()):
            restored = tf_dp.PrivacyLedger()
            restored.load_tables(*tables)
            assert restored.samples() == steps
    bad = samples.copy()
    bad[0, -1] = 0.5
    with pytest.raises(ValueError, match="step count .* must be an integer >= 1"):
        tf_dp.PrivacyLedger().load_tables(bad, queries)


def test_keras_file_stores_a_million_step_ledger_by_runs(tmp_path):
    """A private model whose optimizer's ledger holds 10**6 + 3 steps in 2 runs: its .keras
    file holds tables of 2 rows (the model's and the optimizer's copy; a per-step copy would be
    10**6 rows, 120 MB), the file stays under 1 MB, and loading it restores the same runs (steps
    counted directly)."""
    import zipfile

    import h5py
    import keras

    a = SampleEntry(SamplingEvent(60000, 256 / 60000), (SumQueryEvent(1.0, 1.1),))
    b = SampleEntry(SamplingEvent(60000, 256 / 60000), (SumQueryEvent(1.0, 2.0),))
    runs = [(a, 10**6), (b, 3)]
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1), loss="mse")
    model.optimizer.build(model.trainable_variables)
    model.optimizer.ledger.restore_runs(runs)
    path = tmp_path / "big.keras"
    model.save(path)
    assert os.path.getsize(path) < 2**20
    with zipfile.ZipFile(path) as z, z.open("model.weights.h5") as f, h5py.File(f) as h5:
        tables = []
        h5.visititems(lambda name, obj: tables.append(obj.shape) if name.endswith(
            "tf_dp_ledger_samples") else None)
    assert tables and all(shape[0] == 2 for shape in tables)
    loaded = keras.models.load_model(path)
    assert loaded.optimizer.ledger.runs() == runs
    assert loaded.optimizer.ledger.num_samples == 10**6 + 3 == sum(c for _, c in runs)
