"""Ledgers of many short runs over few distinct values (a cyclic clip or noise schedule): every
reader builds one entry per distinct step, order-independent accountants compose distinct steps
with their total counts, order-dependent analyses (shuffle epochs, tree aggregation) keep the
order, and the ledger file of many runs lists each distinct step once."""

from __future__ import annotations

import json
import math

import dp_accounting
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.accounting import compute_epsilon, rdp
from tf_dp.accounting.dp_events import ledger_to_dp_event
from tf_dp.ledger import LedgerFileError, ledger_file, privacy_ledger, read_ledger_runs
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

N, Q = 60000, 256 / 60000


def _values(k, queries=1):
    """``k`` distinct Poisson steps (one or two Gaussian queries each)."""
    return [
        SampleEntry(SamplingEvent(N, Q), tuple(SumQueryEvent(1.0, 1.0 + i * 1e-3 + j)
                                              for j in range(queries)))
        for i in range(k)
    ]


def _cyclic(values, repeats):
    """Steps ``v0 .. v(k-1), v0 .. v(k-1), ...``: ``k * repeats`` runs of one step."""
    return [(values[j % len(values)], 1) for j in range(len(values) * repeats)]


def test_cyclic_runs_round_trip_in_pieces_and_share_one_entry_per_value(monkeypatch):
    # pieces of 64 steps: the cycle (5 + 3 values, one or two queries each) crosses every piece
    # boundary; runs() equals the run list given, and equal steps are one object throughout
    monkeypatch.setattr(privacy_ledger, "_CHUNK_ROWS", 64)
    values = _values(5) + _values(3, queries=2)
    runs = _cyclic(values, 40) + [(values[0], 7), (values[6], 3)]
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs(runs)
    samples, queries = ledger.tables()
    # a direct count: steps, and query rows (two for the last three values)
    assert len(samples) == 8 * 40 + 10 and len(queries) == 5 * 40 + 3 * 40 * 2 + 7 + 3 * 2
    read = ledger.runs()
    assert read == runs
    assert len({id(e) for e, _ in read}) == len(values)
    for start in (0, 1, 63, 64, 200, len(samples)):
        steps = [e for e, c in runs for _ in range(c)][start:]
        assert [e for e, c in ledger.runs_from(start) for _ in range(c)] == steps


def test_entries_are_built_once_per_distinct_row(monkeypatch):
    # a spy on the row-to-entry conversion: 2000 runs over 20 values convert 20 rows
    values = _values(20)
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs(_cyclic(values, 100))
    converted = []
    to_entries = privacy_ledger._to_entries

    def spy(samples, queries, *rest):
        converted.append(len(samples))
        return to_entries(samples, queries, *rest)

    monkeypatch.setattr(privacy_ledger, "_to_entries", spy)
    assert ledger.runs() == _cyclic(values, 100)
    assert sum(converted) == 20


@pytest.mark.parametrize("accountant", ["rdp", "moments", "gdp", "pld"])
def test_cyclic_ledger_epsilon_equals_grouped_steps(accountant):
    # the same steps in another order (each value's steps in one long run): Poisson steps
    # compose in any order, so every accountant gives the same epsilon
    values = _values(6)
    cyclic = tf_dp.PrivacyLedger()
    cyclic.restore_runs(_cyclic(values, 50))
    grouped = [(v, 50) for v in values]
    ours = compute_epsilon(cyclic, 1e-5, accountant).epsilon
    assert math.isfinite(ours)
    assert ours == pytest.approx(compute_epsilon(grouped, 1e-5, accountant).epsilon, rel=1e-12)


def test_cyclic_ledger_rdp_equals_dp_accounting():
    values = _values(6)
    cyclic = tf_dp.PrivacyLedger()
    cyclic.restore_runs(_cyclic(values, 50))
    direct = dp_accounting.rdp.RdpAccountant(orders=list(rdp.DEFAULT_ORDERS))
    for v in values:  # composed one step at a time, in the ledger's order
        z = v.queries[0].noise_stddev / v.queries[0].l2_sensitivity
        direct.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(z)),
                       50)
    converted = dp_accounting.rdp.RdpAccountant(orders=list(rdp.DEFAULT_ORDERS))
    converted.compose(ledger_to_dp_event(cyclic))
    ours = compute_epsilon(cyclic, 1e-5, "rdp").epsilon
    assert ours == pytest.approx(direct.get_epsilon(1e-5), rel=1e-6)
    assert ours == pytest.approx(converted.get_epsilon(1e-5), rel=1e-6)


def _tree_step(t, z, pass_start):
    return SampleEntry(SamplingEvent(100, 0.1, "shuffle", pass_start=pass_start),
                       (SumQueryEvent(1.0, z, "tree", tree_step=t),))


def test_cyclic_tree_ledger_keeps_its_order():
    # tree aggregation restarted every epoch (10 steps), 4 epochs, cycling over the same 10
    # leaf indices: epsilon equals dp_accounting's single-epoch tree event composed 4 times
    # (noise z / 2: replace-one, leaf sensitivity 2C), and runs() round-trips
    z = 4.0
    runs = [(_tree_step(t % 10, z, t % 10 == 0), 1) for t in range(40)]
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs(runs)
    assert ledger.runs() == runs
    acc = dp_accounting.rdp.RdpAccountant(
        orders=list(rdp.DEFAULT_ORDERS),
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_SPECIAL)
    acc.compose(dp_accounting.SingleEpochTreeAggregationDpEvent(z / 2, 10), 4)
    assert compute_epsilon(ledger, 1e-5, "rdp").epsilon == pytest.approx(
        acc.get_epsilon(1e-5), rel=1e-6)


def test_cyclic_shuffle_ledger_counts_each_epoch_with_each_of_its_values():
    # shuffled batches, 10 steps per epoch, clip alternating between two values (noise 2.0 and
    # 3.0 per unit clip): every epoch window holds both, so each of the 3 epochs counts once
    # with each (RDP a / (2 (z/2)^2) each): the closed form, not the grouped steps
    a, b = (SampleEntry(SamplingEvent(100, 0.1, "shuffle"), (SumQueryEvent(1.0, z),))
            for z in (2.0, 3.0))
    first = SampleEntry(SamplingEvent(100, 0.1, "shuffle", pass_start=True),
                        (SumQueryEvent(1.0, 2.0),))
    runs = [(first, 1)] + [((b if j % 2 else a), 1) for j in range(1, 30)]
    orders = np.asarray(rdp.DEFAULT_ORDERS, float)
    curve = 3 * (orders / (2 * 1.0**2) + orders / (2 * 1.5**2))
    expected, _ = rdp.epsilon_from_rdp(orders, curve, 1e-5)
    assert compute_epsilon(runs, 1e-5, "rdp").epsilon == pytest.approx(expected, rel=1e-9)


def test_long_ledger_file_lists_each_distinct_step_once(tmp_path, monkeypatch):
    monkeypatch.setattr(ledger_file, "INDEXED_MIN_RUNS", 50)
    values = _values(4) + _values(2, queries=2)
    runs = _cyclic(values, 20)
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs(runs)
    path = tmp_path / "cyclic.json"
    ledger.save(path, metadata={"run": "cyclic"})
    payload = json.loads(path.read_text())
    assert payload["version"] == 4 and len(payload["entries"]) == 6
    assert payload["codes"] == [j % 6 for j in range(120)] and payload["counts"] == [1] * 120
    assert read_ledger_runs(path) == runs
    assert tf_dp.PrivacyLedger.load(path).runs() == runs
    # shorter ledgers keep the per-run form
    short = tmp_path / "short.json"
    tf_dp.PrivacyLedger.load(path).save(short)  # same runs: indexed
    few = tf_dp.PrivacyLedger()
    few.restore_runs(runs[:10])
    few.save(tmp_path / "few.json")
    assert "runs" in json.loads((tmp_path / "few.json").read_text())


@pytest.mark.parametrize("edit, message", [
    (lambda p: p["codes"].__setitem__(3, 6), "codes must be integers in"),
    (lambda p: p["codes"].__setitem__(3, True), "codes must be integers in"),
    (lambda p: p["counts"].__setitem__(0, 0), "run count must be an integer"),
    (lambda p: p["counts"].pop(), "of equal length"),
    (lambda p: p["entries"][0]["queries"][0].__setitem__("noise_stddev", -1.0),
     "noise_stddev must be >= 0"),
])
def test_indexed_file_rejects_bad_arrays_and_events(tmp_path, monkeypatch, edit, message):
    monkeypatch.setattr(ledger_file, "INDEXED_MIN_RUNS", 10)
    path = tmp_path / "l.json"
    ledger_file.write_ledger_runs(path, _cyclic(_values(6), 3))
    payload = json.loads(path.read_text())
    edit(payload)
    body = {k: v for k, v in payload.items() if k != "sha256"}
    payload["sha256"] = __import__("hashlib").sha256(ledger_file._canonical(body)).hexdigest()
    path.write_text(json.dumps(payload))
    with pytest.raises(LedgerFileError, match=message):
        read_ledger_runs(path)


def test_runs_from_a_reader_that_keeps_up_reads_only_the_new_rows(monkeypatch):
    # steps recorded one at a time (eagerly, and inside an XLA-compiled function, whose rows
    # are staged); a reader following the ledger gets every step once, and in the common case
    # (one new eager step) reads the new rows without flushing
    ledger = tf_dp.PrivacyLedger()
    values = [(1.0, 1.1), (1.0, 1.2), (0.5, 1.1)]

    def record(clip, noise):
        ledger.record_sampling(N, Q, "poisson")
        ledger.record_sum_query(clip, noise)

    compiled = __import__("tensorflow").function(record, jit_compile=True)
    got, seen, expected = [], 0, []
    flushes = []
    original_flush = privacy_ledger._Buffer.flush
    monkeypatch.setattr(privacy_ledger._Buffer, "flush",
                        lambda self: (flushes.append(1), original_flush(self))[1])
    for step in range(30):
        clip, noise = values[step % 3]
        (compiled if step % 7 == 3 else record)(clip, noise)
        expected.append(SampleEntry(SamplingEvent(N, Q), (SumQueryEvent(clip, noise),)))
        flushes.clear()
        new = ledger.runs_from(seen)
        if step % 7 != 3 and step > 0 and (step - 1) % 7 != 3:
            assert not flushes  # one new eager step: no flush needed
        got += [e for e, c in new for _ in range(c)]
        seen += sum(c for _, c in new)
    assert got == expected and seen == ledger.num_samples == 30


def _reads_of(graph, variable) -> list:
    """The ops of ``graph`` that read ``variable``'s value (not just its shape)."""
    captured = {id(t) for v, t in graph.captures if v is variable.handle}
    return [op for op in graph.get_operations()
            if op.type == "ReadVariableOp" and any(id(i) in captured for i in op.inputs)]


def test_recording_a_step_never_reads_the_table_it_appends_to():
    # In a graph, a read of the table that is alive while the row is scattered in makes
    # TensorFlow copy the whole table: every step would cost O(rows recorded so far).
    ledger = tf_dp.PrivacyLedger()

    @tf.function
    def record():
        ledger.record_sampling(100, 0.1, "poisson")
        ledger.record_sum_query(1.0, 1.0)

    graph = record.get_concrete_function().graph
    for table in (ledger._samples.data, ledger._queries.data):
        assert _reads_of(graph, table) == []
    record()
    assert ledger.num_samples == 1


def test_a_flush_writes_the_staged_rows_in_place(monkeypatch):
    # After a compiled (XLA) call the staged rows are written after the recorded ones: the
    # recorded rows are neither read back nor rewritten (a flush costs O(staged rows)).
    ledger = tf_dp.PrivacyLedger()
    ledger.restore_runs([(SampleEntry(SamplingEvent(100, 0.1), (SumQueryEvent(1.0, 2.0),)), 5000)])

    @tf.function(jit_compile=True)
    def record(i):
        ledger.record_sampling(100, 0.1, "poisson")
        ledger.record_sum_query(1.0, 1.0 + tf.cast(i, tf.float64))

    written = []
    real_write = type(ledger._samples).write
    monkeypatch.setattr(type(ledger._samples), "write",
                        lambda self, start, rows: written.append(rows.shape[0])
                        or real_write(self, start, rows))
    monkeypatch.setattr(type(ledger._samples), "load",
                        lambda self, table: pytest.fail("a flush rewrote the whole table"))
    for i in range(3):
        record(i)
        ledger.flush()
    assert written == [1, 1] * 3
    runs = ledger.runs()
    assert runs[0][1] == 5000 and [e.queries[0].noise_stddev for e, _ in runs[1:]] == [1.0, 2.0, 3.0]
