"""The ledger journal: every step that ran is charged, also those a kill discarded."""

import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.keras import callbacks as dpcb
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.journal import LedgerJournal, read_journal
from tf_dp.ledger.ledger_file import LedgerFileError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _entry(i: int) -> SampleEntry:
    # a different noise per step, so that a lost or repeated step changes the entries
    return SampleEntry(SamplingEvent(100, 0.1), (SumQueryEvent(1.0, 1.0 + i / 8),))


def _record(ledger, entries) -> None:
    for e in entries:
        ledger.record_sampling(e.sampling.population_size, e.sampling.selection_probability,
                               e.sampling.policy)
        for q in e.queries:
            ledger.record_sum_query(q.l2_sensitivity, q.noise_stddev)
        ledger.flush()


def test_journal_holds_every_flushed_step_and_ignores_a_torn_last_record(tmp_path):
    path = str(tmp_path / "j.jsonl")
    steps = [_entry(i) for i in range(6)]
    ledger = tf_dp.PrivacyLedger()
    ledger.attach_journal(path)
    _record(ledger, steps[:5])
    assert read_journal(path) == steps[:5]
    # A kill in the middle of the last write: the torn record is ignored...
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.truncate(size - 7)
    assert read_journal(path) == steps[:4]
    # ...and a writer that resumes cuts it off, charges the 4 steps and appends after them.
    ledger.detach_journal()
    resumed = tf_dp.PrivacyLedger()
    resumed.attach_journal(path)
    assert resumed.samples() == steps[:4]
    _record(resumed, steps[4:6])
    assert read_journal(path) == steps[:4] + steps[4:6]
    resumed.detach_journal()


def test_journal_corrupted_before_a_valid_record_is_refused(tmp_path):
    path = str(tmp_path / "j.jsonl")
    journal = LedgerJournal(path)
    for i in range(3):
        journal.append([_entry(i)], start=i)
    journal.close()
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    assert b'"noise_stddev":1.0' in lines[1]
    lines[1] = lines[1].replace(b'"noise_stddev":1.0', b'"noise_stddev":2.0')  # bad checksum
    with open(path, "wb") as f:
        f.write(b"\n".join(lines))
    with pytest.raises(LedgerFileError, match="corrupted"):
        read_journal(path)


def test_two_writers_on_one_journal_are_detected(tmp_path):
    path = str(tmp_path / "j.jsonl")
    first, second = LedgerJournal(path), LedgerJournal(path)
    first.append([_entry(0)], start=0)
    second.append([_entry(1)], start=0)  # each thinks it holds step 0
    with pytest.raises(LedgerFileError, match="two writers"):
        read_journal(path)
    first.close()
    second.close()


def test_a_journaled_ledger_never_forgets_a_step(tmp_path):
    path = str(tmp_path / "j.jsonl")
    steps = [_entry(i) for i in range(4)]
    ledger = tf_dp.PrivacyLedger()
    ledger.attach_journal(path)
    _record(ledger, steps[:3])
    with pytest.raises(ValueError, match="3 steps"):
        ledger.reset()
    with pytest.raises(ValueError, match="do not extend"):
        ledger.restore_entries([steps[0], steps[3]])
    assert ledger.samples() == steps[:3]
    ledger.restore_entries(steps)  # an extension is fine, and journaled
    assert read_journal(path) == steps
    # A ledger of another run cannot adopt this journal.
    other = tf_dp.PrivacyLedger()
    _record(other, [_entry(7)])
    with pytest.raises(ValueError, match="different steps"):
        other.attach_journal(path)
    ledger.detach_journal()


# A training process that is killed (SIGKILL) in the middle of its second epoch, after a
# BackupAndRestore backup at the end of the first. It appends every step it ran to a plain file
# (the direct count), after the step and before the kill.
CHILD = textwrap.dedent(
    """
    import os, signal, sys
    import keras, numpy as np
    import tf_dp
    from tf_dp.keras import callbacks as dpcb

    backup, ran, kill_at = sys.argv[1], sys.argv[2], int(sys.argv[3])
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from journal_child_model import data, model

    class CountAndKill(keras.callbacks.Callback):
        count = 0
        def on_train_batch_end(self, batch, logs=None):
            with open(ran, "a") as f:
                f.write(f"{batch}\\n")
                f.flush()
            CountAndKill.count += 1
            if CountAndKill.count == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)

    x, y = data()
    m = model()
    m.fit(x, y, batch_size=20, epochs=3, verbose=0,
          callbacks=[dpcb.BackupAndRestore(backup), CountAndKill()])
    """
)

MODEL = textwrap.dedent(
    """
    import keras, numpy as np
    import tf_dp

    def data():
        rng = np.random.default_rng(0)
        x = rng.normal(size=(200, 8)).astype("float32")
        return x, (x[:, 0] > 0).astype("int64")

    def model():
        m = tf_dp.keras.make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
        m.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                      l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return m
    """
)


class _Count(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.steps = 0

    def on_train_batch_end(self, batch, logs=None):
        self.steps += 1


def test_steps_discarded_by_a_kill_are_charged_on_resume(tmp_path):
    (tmp_path / "journal_child.py").write_text(CHILD)
    (tmp_path / "journal_child_model.py").write_text(MODEL)
    backup, ran = str(tmp_path / "backup"), str(tmp_path / "ran.txt")
    env = dict(os.environ, PYTHONPATH=ROOT, TF_CPP_MIN_LOG_LEVEL="2")
    # 10 steps per epoch; killed after step 15 (5 steps into epoch 2; backup after step 10)
    proc = subprocess.run(
        [sys.executable, str(tmp_path / "journal_child.py"), backup, ran, "15"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    with open(ran) as f:
        ran_before = len(f.read().split())
    assert ran_before == 15
    assert len(tf_dp.ledger.read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME))) == 10

    # Resume in this process: a fresh model and optimizer, the same backup dir.
    sys.path.insert(0, str(tmp_path))
    try:
        from journal_child_model import data, model
    finally:
        sys.path.remove(str(tmp_path))
    x, y = data()
    resumed = model()
    resumed.build((None, 8))
    count = _Count()
    resumed.fit(x, y, batch_size=20, epochs=3, verbose=0,
                callbacks=[dpcb.BackupAndRestore(backup), count])
    assert count.steps == 20  # epochs 2 and 3 again, from the backup
    ledger = resumed.optimizer.ledger
    # every step that ran is charged: 15 in the killed process, 20 here
    assert ledger.num_samples == ran_before + count.steps == 35
    assert int(resumed.optimizer.iterations.numpy()) == 30  # weights: 10 backed up + 20
    assert tf_dp.ledger.read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME)) == (
        ledger.samples()
    )
    keras.backend.clear_session()


def test_compiled_calls_are_journaled_one_record_per_call(tmp_path):
    # XLA with 4 steps per compiled call: the staging table is flushed and journaled per call
    path = str(tmp_path / "j.jsonl")
    x = np.random.default_rng(0).normal(size=(200, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int64")
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                      l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=True, steps_per_execution=4)
    model.optimizer.ledger.attach_journal(path)
    model.fit(x, y, batch_size=20, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 10
    assert read_journal(path) == model.optimizer.ledger.samples()
    assert len(read_journal(path)) == 10
    with open(path) as f:
        assert len(f.read().splitlines()) == 1 + 3  # header, then calls of 4, 4 and 2 steps
    model.optimizer.ledger.detach_journal()
