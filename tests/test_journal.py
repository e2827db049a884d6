"""The ledger journal: every step that ran is charged, also those a kill discarded."""

import errno
import gc
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.keras import callbacks as dpcb
from tf_dp.ledger import journal as journal_module
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.journal import LedgerJournal, read_journal
from tf_dp.ledger.ledger_file import LedgerFileError
from tests.helpers import warm_python

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
    # Writers that the lock cannot stop (a file system without flock, a hand edit): reading
    # still detects the broken sequence of starts.
    path = str(tmp_path / "j.jsonl")
    first = LedgerJournal(path)
    first.append([_entry(0)], start=0)
    first.close()
    with open(path, "ab") as f:  # a second writer that also thought it held step 0
        start, runs = 0, journal_module.encode_runs([_entry(1)])
        digest = journal_module._digest(start, runs)
        f.write(f'{{"start":0,"runs":{runs},"sha256":"{digest}"}}\n'.encode())
    with pytest.raises(LedgerFileError, match="two writers"):
        read_journal(path)


def test_a_second_writer_in_this_process_is_refused_and_the_lock_goes_with_close(tmp_path):
    path = str(tmp_path / "j.jsonl")
    first = LedgerJournal(path)
    first.append([_entry(0), _entry(1)], start=0)
    with open(path, "rb") as f:
        before = f.read()
    with pytest.raises(LedgerFileError, match="already open for writing"):
        LedgerJournal(path)
    other = tf_dp.PrivacyLedger()  # a second ledger of this process: refused as well
    with pytest.raises(LedgerFileError, match="already open for writing"):
        other.attach_journal(path)
    assert other.journal is None and other.num_samples == 0
    with open(path, "rb") as f:
        assert f.read() == before  # nothing written, nothing cut
    first.append([_entry(2)], start=2)  # the first writer goes on
    first.close()
    again = LedgerJournal(path)  # close released the lock
    assert again.num_samples == 3
    again.close()
    assert read_journal(path) == [_entry(i) for i in range(3)]


# A writer in another process: attaches the journal, records 3 steps, says so, waits.
WRITER = textwrap.dedent(
    """
    import sys
    import tf_dp
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    def record(ledger, i):
        e = SampleEntry(SamplingEvent(100, 0.1), (SumQueryEvent(1.0, 1.0 + i / 8),))
        ledger.record_sampling(100, 0.1, e.sampling.policy)
        ledger.record_sum_query(1.0, 1.0 + i / 8)
        ledger.flush()

    ledger = tf_dp.PrivacyLedger()
    ledger.attach_journal(sys.argv[1])
    for i in range(3):
        record(ledger, i)
    print("ready", flush=True)
    sys.stdin.readline()
    record(ledger, 3)
    print("done", flush=True)
    """
)


def test_a_second_run_on_one_journal_is_refused_before_it_writes(tmp_path):
    path = str(tmp_path / "privacy_journal.jsonl")
    env = dict(os.environ, PYTHONPATH=ROOT)
    child = subprocess.Popen(
        [sys.executable, "-c", WRITER, path], env=env, text=True,
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        with open(path, "rb") as f:
            before = f.read()
        second = tf_dp.PrivacyLedger()
        _record(second, [_entry(9)])
        with pytest.raises(LedgerFileError, match="already open for writing"):
            second.attach_journal(path)
        with pytest.raises(LedgerFileError, match="already open for writing"):
            LedgerJournal(path)
        with open(path, "rb") as f:
            assert f.read() == before
        child.stdin.write("\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "done"
        assert child.wait(timeout=60) == 0, child.stderr.read()
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    # The first run's journal is intact (4 steps, one record each), and the lock went with
    # its process: a later run may resume it.
    assert read_journal(path) == [_entry(i) for i in range(4)]
    resumed = tf_dp.PrivacyLedger()
    resumed.attach_journal(path)
    assert resumed.samples() == [_entry(i) for i in range(4)]
    resumed.detach_journal()


def _three_records(path):
    journal = LedgerJournal(path)
    for i in range(3):
        journal.append([_entry(i)], start=i)
    journal.close()
    with open(path, "rb") as f:
        return f.read()


def test_a_damaged_last_complete_record_is_not_taken_for_a_torn_write(tmp_path):
    path = str(tmp_path / "j.jsonl")
    data = _three_records(path)
    lines = data.split(b"\n")
    assert lines[-1] == b"" and b'"noise_stddev":1.25' in lines[-2]
    # The last record is complete (its newline is there) but its checksum fails: damage.
    lines[-2] = lines[-2].replace(b'"noise_stddev":1.25', b'"noise_stddev":1.5')
    damaged = b"\n".join(lines)
    with open(path, "wb") as f:
        f.write(damaged)
    offset = len(b"\n".join(lines[:-2])) + 1
    with pytest.raises(LedgerFileError, match=f"corrupted at byte {offset}"):
        read_journal(path)
    with pytest.raises(LedgerFileError, match="corrupted"):
        tf_dp.PrivacyLedger().attach_journal(path)
    with open(path, "rb") as f:
        assert f.read() == damaged  # not truncated
    # A torn tail (no record end) is still a torn write: ignored, then cut off by a writer.
    with open(path, "wb") as f:
        f.write(data[:-9])
    assert read_journal(path) == [_entry(0), _entry(1)]


def test_a_deeply_nested_journal_line_is_a_ledger_file_error(tmp_path):
    path = str(tmp_path / "j.jsonl")
    data = _three_records(path)
    deep = b"[" * 200_000 + b"]" * 200_000
    with open(path, "wb") as f:
        f.write(data + b'{"start":3,"runs":' + deep + b',"sha256":"00"}\n')
    with pytest.raises(LedgerFileError, match="corrupted"):
        read_journal(path)
    with pytest.raises(LedgerFileError, match="corrupted"):
        tf_dp.PrivacyLedger().attach_journal(path)
    with open(path, "wb") as f:  # the same in the header
        f.write(b'{"format":' + deep + b"}\n")
    with pytest.raises(LedgerFileError, match="not a tf_dp privacy journal"):
        read_journal(path)
    with open(path, "wb") as f:  # and as a torn tail: ignored
        f.write(data + deep)
    assert read_journal(path) == [_entry(i) for i in range(3)]


def test_a_failed_open_leaves_no_error_for_del(tmp_path, monkeypatch):
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(TypeError, match="fsync"):
        LedgerJournal(str(tmp_path / "j.jsonl"), fsync="yes")
    (tmp_path / "bad.jsonl").write_text("not a journal\n")
    with pytest.raises(LedgerFileError):
        LedgerJournal(str(tmp_path / "bad.jsonl"))
    gc.collect()
    assert [u.exc_value for u in unraisable] == []


def test_a_full_disk_names_the_journal_and_loses_no_record(tmp_path, monkeypatch):
    path = str(tmp_path / "j.jsonl")
    journal = LedgerJournal(path)
    journal.append([_entry(0)], start=0)
    real_write = os.write

    def no_space(fd, data):
        if fd == journal._fd:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    def half(fd, data):  # a full disk may also take part of a record
        if fd == journal._fd:
            return real_write(fd, data[: len(data) // 2])
        return real_write(fd, data)

    for fake in (no_space, half):
        monkeypatch.setattr(journal_module.os, "write", fake)
        with pytest.raises(OSError) as info:
            journal.append([_entry(1)], start=1)
        monkeypatch.setattr(journal_module.os, "write", real_write)
        assert info.value.errno == errno.ENOSPC
        assert info.value.filename == path and path in str(info.value)
        assert journal.num_samples == 1
        assert read_journal(path) == [_entry(0)]  # no part of the failed record is left
    journal.append([_entry(1)], start=1)  # space again: the next append reads back
    journal.close()
    assert read_journal(path) == [_entry(0), _entry(1)]


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
    ledger.detach_journal()  # (while it is attached, any other writer is refused)
    # A ledger of another run cannot adopt this journal.
    other = tf_dp.PrivacyLedger()
    _record(other, [_entry(7)])
    with pytest.raises(ValueError, match="different steps"):
        other.attach_journal(path)


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
    proc = warm_python.run(
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
