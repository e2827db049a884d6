"""The ledger's flush between compiled (XLA) calls: a few eager reads per call, every step kept.

The Keras integration and ``DPTrainStep`` flush the ledger after every compiled call, so the
flush's eager TensorFlow ops are a per-step cost (each one 15-60 us of dispatch on a CPU, about
as much as an XLA-compiled step of a small model). The flush reads four counters (rows staged and
rows dropped, in the sample and query tables) and, while the staging tables hold rows, their
capacity (two ops per table); it moves the staged rows into the ledger proper only when the next
call's reserved rows would not fit after them. A journal adds the prefix step count, the two
recorded-row counts and one gather per table. Correctness is checked against the steps as
written by the test (a Python list), for the ledger and for its journal file.
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.python import pywrap_tfe

import tf_dp
from tf_dp.ledger import LedgerOverflowError
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.journal import read_journal

STAGING = 64  # the staging tables' rows (_INITIAL_CAPACITY); reserve(1) leaves them so


def _stddev(step: int) -> float:
    return 1.0 + step // 3  # runs of three equal steps; exact in float32 and float64


def _expected(steps: int) -> list[SampleEntry]:
    return [
        SampleEntry(SamplingEvent(60000, 0.01, "poisson"), (SumQueryEvent(1.0, _stddev(t)),))
        for t in range(steps)
    ]


def _compiled_recorder(ledger: tf_dp.PrivacyLedger, steps_per_call: int = 1):
    @tf.function(jit_compile=True)
    def record(stddevs):
        # a few steps unrolled; more in a loop of the compiled step (quicker to compile)
        for i in range(steps_per_call) if steps_per_call <= 5 else tf.range(steps_per_call):
            ledger.record_sampling(60000, 0.01, "poisson")
            ledger.record_sum_query(1.0, stddevs[i])

    def call(first_step: int) -> None:
        record(tf.constant([_stddev(first_step + i) for i in range(steps_per_call)], tf.float64))

    return call


class _EagerOps:
    """Counts eager TensorFlow op executions: the generated op wrappers' fast path
    (``pywrap_tfe.TFE_Py_FastPathExecute``) and the general one (``TFE_Py_Execute``)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("TFE_Py_FastPathExecute", "TFE_Py_Execute"):
            real = getattr(pywrap_tfe, name)

            def counted(*args, _real=real):
                self.count += 1
                return _real(*args)

            monkeypatch.setattr(pywrap_tfe, name, counted)


@pytest.mark.parametrize("journal", [False, True], ids=["no_journal", "journal"])
def test_a_flush_after_a_compiled_call_costs_a_few_reads(tmp_path, monkeypatch, journal):
    ledger = tf_dp.PrivacyLedger()
    ledger.reserve(1)  # what fit (steps_per_execution=1) and DPTrainStep reserve
    path = os.fspath(tmp_path / "journal.jsonl")
    if journal:
        ledger.attach_journal(path)
    record = _compiled_recorder(ledger)
    record(0)
    ledger.flush()  # traced and compiled outside the count
    ops = _EagerOps(monkeypatch)
    calls = STAGING + 10  # the staging tables fill once
    per_flush = []
    for step in range(1, calls + 1):
        record(step)
        before = ops.count
        ledger.flush()
        per_flush.append(ops.count - before)
        assert ledger.num_samples == step + 1
    print("eager ops per flush:", per_flush)
    # 4 counter reads + 2 capacity reads (VariableShape, slice) per table; a journal adds the
    # prefix step count, the 2 recorded-row counts and 1 gather of staged rows per table
    bound = 8 + (5 if journal else 0)
    assert int(np.median(per_flush)) <= bound, per_flush
    # staged rows move once per STAGING - 1 calls (a move costs a few dozen ops)
    assert sum(n > bound for n in per_flush) <= calls // (STAGING - 1) + 1, per_flush
    assert ledger.samples() == _expected(calls + 1)
    if journal:
        assert read_journal(path) == _expected(calls + 1)


def test_staged_rows_survive_other_writers_readers_and_checkpoints(tmp_path):
    # rows left staged by a flush are seen by every reader, moved before a direct (eager or
    # graph) append, journaled once each, and saved and restored by tf.train.Checkpoint
    ledger = tf_dp.PrivacyLedger()
    ledger.reserve(1)
    path = os.fspath(tmp_path / "journal.jsonl")
    ledger.attach_journal(path)
    compiled = _compiled_recorder(ledger)

    @tf.function
    def graph_record(stddev):
        ledger.record_sampling(60000, 0.01, "poisson")
        ledger.record_sum_query(1.0, stddev)

    step = 0
    for kind in ["xla"] * 5 + ["eager"] + ["xla"] * 4 + ["graph"] + ["xla"] * 3:
        if kind == "xla":
            compiled(step)
        elif kind == "eager":
            ledger.record_sampling(60000, 0.01, "poisson")
            ledger.record_sum_query(1.0, _stddev(step))
        else:
            graph_record(tf.constant(_stddev(step), tf.float64))
        step += 1
        ledger.flush()
        assert ledger.num_samples == step
    assert int(ledger._samples.staged_count.numpy()) == 3  # left staged by the flushes
    checkpoint = tf.train.Checkpoint(ledger=ledger)
    saved = checkpoint.write(os.fspath(tmp_path / "ckpt"))
    assert read_journal(path) == _expected(step)
    assert ledger.samples() == _expected(step)
    restored = tf_dp.PrivacyLedger()
    tf.train.Checkpoint(ledger=restored).read(saved).assert_consumed()
    assert restored.samples() == _expected(step)


def test_calls_of_several_steps_keep_room_for_the_largest_call(tmp_path):
    # a compiled function running 5 steps per call behind a reserve(1) (DPTrainStep reserves
    # one step; a loop may call it several times in one compiled function): the flush keeps
    # room for the most rows one call staged, so no step is dropped
    ledger = tf_dp.PrivacyLedger()
    ledger.reserve(1)
    path = os.fspath(tmp_path / "journal.jsonl")
    ledger.attach_journal(path)
    record = _compiled_recorder(ledger, steps_per_call=5)
    for call in range(20):  # 100 steps: the staging table fills once
        record(5 * call)
        ledger.flush()
    assert ledger.samples() == _expected(100)
    assert read_journal(path) == _expected(100)


def test_a_call_larger_than_the_staging_table_still_raises():
    ledger = tf_dp.PrivacyLedger()
    ledger.reserve(1)
    record = _compiled_recorder(ledger, steps_per_call=STAGING + 2)
    record(0)
    with pytest.raises(LedgerOverflowError, match="staging table"):
        ledger.flush()
    assert ledger.samples() == _expected(STAGING)  # the steps that fit; the others released nothing


def test_a_compiled_step_is_compiled_once_whatever_the_rows_staged():
    """A compiled step that stages a ledger row is compiled once, whatever the number of rows
    already staged (an index read from a variable would be a compile-time constant under XLA:
    one compile per staged count, up to 64 between two moves, each keeping its JIT code for the
    life of the process). Counted from TensorFlow's compile log over 70 steps, in a subprocess
    (a crash there is a failure here): the bare recorder and the Keras train step once each."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root, TF_CPP_MIN_LOG_LEVEL="0",
               TF_CPP_VMODULE="device_compiler=2")
    p = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "helpers", "xla_compile_count.py")],
        capture_output=True, text=True, timeout=600, env=env,
    )
    assert p.returncode == 0 and "DONE" in p.stderr, p.stderr[-3000:]
    compiled = collections.Counter(
        re.search(r"signature: (\w+)", line).group(1)
        for line in p.stderr.splitlines() if "Instantly compiling for signature" in line
    )
    names = sorted(compiled)
    assert len(names) == 2, compiled  # the log is on: each function was compiled at least once
    assert names[0].startswith("__inference_bare_recorder"), compiled
    assert names[1].startswith("__inference_one_step_on_data"), compiled
    assert set(compiled.values()) == {1}, compiled
