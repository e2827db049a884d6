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
from tests.helpers import warm_python

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


# A ledger file that claims 1e9 steps in three runs (checksum re-signed after the edit, as
# anyone can): loading it, resuming from it through a journal and analysing it must cost memory
# by runs. Run in a subprocess (a per-step expansion is 1e9 table rows: tens of GB, an OOM kill
# or TensorFlow's out-of-memory error), which prints its peak RSS and the results.
_CLAIMED_RUNS = ((60000, 1e-5, 1.0, 0.8, 400_000_000), (60000, 2e-5, 1.0, 1.6, 400_000_000),
                 (60000, 1e-5, 1.0, float(np.float32(1.3)), 200_000_000))
_EXTRA_STEPS = 5  # recorded after the resume, equal to the last claimed run's steps

_RESUME_SCRIPT = r"""
import json, os, resource, sys
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import tensorflow as tf
import tf_dp
from tf_dp.accounting import compute_epsilon
from tf_dp.ledger import read_ledger_runs

def peak_rss_mb():
    # VmHWM: this process image's own peak (ru_maxrss keeps the parent's across fork + exec on
    # Linux, so a subprocess of a 7 GB pytest process would report 7 GB)
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


path, journal, out, n, q, clip, std, extra = sys.argv[1:]
ledger = tf_dp.PrivacyLedger.load(path)
loaded_steps = ledger.num_samples
ledger.attach_journal(journal)  # a resume: the journal takes the loaded steps (as runs)
query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(float(clip), float(std)), ledger,
                              population_size=int(n), selection_probability=float(q))
gs = query.initial_global_state()
for _ in range(int(extra)):  # the resumed training's steps
    query.get_noised_result(query.initial_sample_state(tf.zeros([3])), gs)
ledger.flush()  # appends them to the journal
ledger.detach_journal()
resumed = tf_dp.PrivacyLedger()  # a process restarted after a kill: the journal is the record
resumed.attach_journal(journal)
ledger.save(out)
result = {
    "loaded_steps": loaded_steps,
    "steps": ledger.num_samples,
    "journal_steps": resumed.num_samples,
    "epsilon": compute_epsilon(ledger, 1e-5, "rdp").epsilon,
    "epsilon_journal": compute_epsilon(resumed, 1e-5, "rdp").epsilon,
    "epsilon_file": compute_epsilon(out, 1e-5, "rdp").epsilon,
    "runs": [[e.sampling.selection_probability, e.effective_noise_multiplier(), c]
             for e, c in resumed.runs()],
    "saved_runs": len(read_ledger_runs(out)),
    "peak_rss_mb": peak_rss_mb(),
}
print("RESULT " + json.dumps(result))
"""


def test_a_ledger_claiming_1e9_steps_loads_resumes_and_analyses_in_memory_by_runs(tmp_path):
    import sys

    small = tf_dp.PrivacyLedger()
    small.restore_runs([(SampleEntry(SamplingEvent(n, q), (SumQueryEvent(clip, std),)), 1)
                        for n, q, clip, std, _ in _CLAIMED_RUNS])
    path = tmp_path / "claims_1e9.json"
    small.save(path)
    payload = json.loads(path.read_text())
    for run, (*_, count) in zip(payload["runs"], _CLAIMED_RUNS):
        run["count"] = count
    payload["num_samples"] = sum(c for *_, c in _CLAIMED_RUNS)
    del payload["sha256"]
    payload["sha256"] = ledger_file.hashlib.sha256(ledger_file._canonical(payload)).hexdigest()
    path.write_text(json.dumps(payload))
    assert path.stat().st_size < 2000

    n, q, clip, std, _ = _CLAIMED_RUNS[-1]
    proc = warm_python.run(
        [sys.executable, "-c", _RESUME_SCRIPT, str(path), str(tmp_path / "journal.jsonl"),
         str(tmp_path / "saved.json"), str(n), repr(q), repr(clip), repr(std),
         str(_EXTRA_STEPS)],
        capture_output=True, text=True, timeout=600,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])

    claimed = sum(c for *_, c in _CLAIMED_RUNS)
    assert got["loaded_steps"] == claimed == 10**9
    assert got["steps"] == got["journal_steps"] == claimed + _EXTRA_STEPS
    # the extra steps continue the last run (equal events): still three runs, in every reader
    expected_runs = [[q, std / clip, c] for _, q, clip, std, c in _CLAIMED_RUNS]
    expected_runs[-1][2] += _EXTRA_STEPS
    assert got["runs"] == expected_runs and got["saved_runs"] == 3
    # the process's whole peak (TensorFlow's import included): a per-step table of 1e9 rows
    # would be 64 GB for the sample table alone
    assert got["peak_rss_mb"] < 1024, got["peak_rss_mb"]

    # epsilon from Google's dp_accounting, composing the same events by their counts
    direct = dp_accounting.rdp.RdpAccountant(orders=list(rdp.DEFAULT_ORDERS))
    for qq, z, count in expected_runs:
        direct.compose(dp_accounting.PoissonSampledDpEvent(qq, dp_accounting.GaussianDpEvent(z)),
                       count)
    want = direct.get_epsilon(1e-5)
    assert math.isfinite(want) and want > 0
    # float64 on both sides: the same RDP bound summed in a different order (log-space series),
    # then the same conversion; 1e-6 relative covers their roundings with a wide margin and is
    # far below any change of an event (a count off by one changes it by ~1e-9 relative, so
    # the step count is checked exactly above)
    for key in ("epsilon", "epsilon_journal", "epsilon_file"):
        assert got[key] == pytest.approx(want, rel=1e-6), key
