"""Ledger persistence: JSON save/load, tf.train.Checkpoint, resume, corrupted files, atomic write."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest
import tensorflow as tf

import tf_dp
from tf_dp.ledger import ledger_file
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import (
    LedgerFileError,
    LedgerOverwriteError,
    read_ledger_file,
    write_ledger_file,
)


def make_entries():
    """Awkward values on purpose: not representable in float32, several runs, all field kinds."""
    a = SampleEntry(SamplingEvent(60000, 256 / 60000, "poisson"),
                    (SumQueryEvent(0.1, 1.1), SumQueryEvent(0.3, 0.7)))
    b = SampleEntry(SamplingEvent(60000, 0.1, "shuffle"), (SumQueryEvent(2.0, 1.3, "jl", 5),))
    c = SampleEntry(SamplingEvent(7, 1.0), (SumQueryEvent(0.0, 0.0, "none"),))
    return [a] * 3 + [b] + [a] * 2 + [c] * 4


def recording_setup(ledger):
    clip = tf.Variable(1.0)
    query = tf_dp.QueryWithLedger(
        tf_dp.NestedQuery([tf_dp.GaussianSumQuery(clip, 1.5, seed=1),
                           tf_dp.GaussianSumQuery(0.5, 0.8, seed=2)]),
        ledger, population_size=1000, selection_probability=0.032)
    gs = query.initial_global_state()
    template = [tf.zeros([2]), tf.zeros([3])]

    @tf.function
    def step(c):
        clip.assign(c)
        return query.get_noised_result(query.initial_sample_state(template), gs)[0]

    return step


def test_file_round_trip_is_exact(tmp_path):
    entries = make_entries()
    path = tmp_path / "ledger.json"
    write_ledger_file(path, entries, metadata={"model": "cnn"})
    assert read_ledger_file(path) == entries
    payload = json.loads(path.read_text())
    assert payload["format"] == "tf_dp.privacy_ledger" and payload["version"] == 1
    assert payload["num_samples"] == 10
    assert [r["count"] for r in payload["runs"]] == [3, 1, 2, 4]  # run-length encoded
    assert payload["metadata"] == {"model": "cnn"}
    # Through a PrivacyLedger: load -> samples -> save -> read gives the same entries, exactly.
    ledger = tf_dp.PrivacyLedger.load(path)
    assert ledger.samples() == entries
    ledger.save(tmp_path / "again.json")
    assert read_ledger_file(tmp_path / "again.json") == entries


def test_recorded_ledger_save_load_round_trip(tmp_path):
    ledger = tf_dp.PrivacyLedger()
    step = recording_setup(ledger)
    for t in range(70):  # past the initial buffer capacity
        step(tf.constant(0.5 + 0.01 * t))
    path = tmp_path / "run.json"
    ledger.save(path)
    loaded = tf_dp.PrivacyLedger.load(path)
    assert loaded.num_samples == 70
    assert loaded.samples() == ledger.samples()
    assert read_ledger_file(path) == ledger.samples()


def test_checkpoint_round_trip_and_resume(tmp_path):
    ledger = tf_dp.PrivacyLedger()
    step = recording_setup(ledger)
    for t in range(100):
        step(tf.constant(0.2 + 0.003 * t))
    saved = ledger.samples()
    ckpt_path = tf.train.Checkpoint(ledger=ledger).save(str(tmp_path / "ckpt"))
    for t in range(5):  # after the checkpoint: lost when we restore
        step(tf.constant(9.0))

    # Restore into a fresh ledger (a new process would do this): exact.
    fresh = tf_dp.PrivacyLedger()
    tf.train.Checkpoint(ledger=fresh).restore(ckpt_path).assert_consumed()
    assert fresh.samples() == saved

    # Restore into the same ledger that kept recording, then continue: appends after step 100.
    tf.train.Checkpoint(ledger=ledger).restore(ckpt_path).assert_consumed()
    assert ledger.samples() == saved
    for t in range(100, 130):
        step(tf.constant(0.2 + 0.003 * t))
    entries = ledger.samples()
    assert len(entries) == 130
    assert entries[:100] == saved
    assert all(e.queries[0].l2_sensitivity == pytest.approx(0.2 + 0.003 * t, rel=1e-6)
               for t, e in enumerate(entries))


def test_resume_from_file_then_continue_recording(tmp_path):
    first = tf_dp.PrivacyLedger()
    step = recording_setup(first)
    for t in range(10):
        step(tf.constant(1.0 + t))
    first.save(tmp_path / "l.json")

    resumed = tf_dp.PrivacyLedger.load(tmp_path / "l.json")
    step2 = recording_setup(resumed)
    for t in range(10, 75):
        step2(tf.constant(1.0 + t))
    entries = resumed.samples()
    assert len(entries) == 75
    assert entries[:10] == first.samples()
    assert [e.queries[0].l2_sensitivity for e in entries] == [1.0 + t for t in range(75)]
    assert all(e.queries[1] == SumQueryEvent(0.5, float(tf.constant(0.8).numpy()), noise_seed=2)
               for e in entries)

    # restore_entries on a live ledger replaces its content; recording continues after it.
    first.restore_entries(entries[:3])
    step(tf.constant(42.0))
    assert first.num_samples == 4 and first.samples()[3].queries[0].l2_sensitivity == 42.0


def _write_payload(path, payload):
    path.write_text(json.dumps(payload))


def _assert_rejected(path, match):
    with pytest.raises(LedgerFileError, match=match):
        read_ledger_file(path)
    with pytest.raises(LedgerFileError, match=match):
        tf_dp.PrivacyLedger.load(path)


def test_corrupted_files_are_rejected(tmp_path):
    good = tmp_path / "good.json"
    write_ledger_file(good, make_entries())
    text = good.read_text()
    payload = json.loads(text)

    truncated = tmp_path / "truncated.json"
    truncated.write_text(text[: len(text) // 2])
    _assert_rejected(truncated, "not valid JSON")

    edited = tmp_path / "edited.json"
    p = json.loads(text)
    p["runs"][0]["queries"][0]["noise_stddev"] = 11.0  # more noise = smaller epsilon: must be caught
    _write_payload(edited, p)
    _assert_rejected(edited, "checksum mismatch")

    recounted = tmp_path / "recount.json"
    p = json.loads(text)
    p["runs"][0]["count"] = 1
    _write_payload(recounted, p)
    _assert_rejected(recounted, "checksum")

    version = tmp_path / "version.json"
    p = dict(payload, version=5)
    _write_payload(version, p)
    _assert_rejected(version, "unsupported ledger version 5")

    other = tmp_path / "other.json"
    _write_payload(other, dict(payload, format="something_else"))
    _assert_rejected(other, "not a tf_dp ledger file")

    not_json = tmp_path / "not.json"
    not_json.write_text("population_size=3\n")
    _assert_rejected(not_json, "not valid JSON")

    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    _assert_rejected(array, "JSON object")

    empty = tmp_path / "empty.json"
    empty.write_text("")
    _assert_rejected(empty, "not valid JSON")

    _assert_rejected(tmp_path / "missing.json", "cannot read ledger file .*missing.json")
    _assert_rejected(tmp_path, "cannot read ledger file")  # a directory

    # Checksum recomputed after an edit that makes an event invalid: still rejected, and named.
    invalid = tmp_path / "invalid.json"
    p = json.loads(text)
    del p["sha256"]
    p["runs"][0]["sampling"]["selection_probability"] = 1.5
    p["sha256"] = ledger_file.hashlib.sha256(ledger_file._canonical(p)).hexdigest()
    _write_payload(invalid, p)
    _assert_rejected(invalid, "selection_probability")

    missing_key = tmp_path / "missing_key.json"
    p = json.loads(text)
    del p["sha256"]
    del p["runs"][1]["queries"][0]["mechanism"]
    p["sha256"] = ledger_file.hashlib.sha256(ledger_file._canonical(p)).hexdigest()
    _write_payload(missing_key, p)
    _assert_rejected(missing_key, "malformed ledger event")


def test_binary_garbage_rejected_by_privacy_ledger_load(tmp_path):
    garbage = tmp_path / "garbage.json"
    garbage.write_bytes(b"\xff\xfe\x00\x81 not a ledger")
    with pytest.raises(LedgerFileError, match="garbage.json"):
        tf_dp.PrivacyLedger.load(garbage)


def test_failed_load_leaves_nothing_half_read(tmp_path):
    good = tmp_path / "good.json"
    write_ledger_file(good, make_entries())
    text = good.read_text()
    bad = tmp_path / "bad.json"
    bad.write_text(text.replace('"count": 4', '"count": 40'))
    ledger = tf_dp.PrivacyLedger.load(good)
    with pytest.raises(LedgerFileError):
        ledger.restore_entries(read_ledger_file(bad))
    assert ledger.samples() == make_entries()


def test_atomic_write_leaves_no_temp_files(tmp_path):
    path = tmp_path / "ledger.json"
    write_ledger_file(path, make_entries())
    write_ledger_file(path, make_entries()[:2], overwrite=True)  # a shorter ledger: opt in
    assert sorted(os.listdir(tmp_path)) == ["ledger.json"]
    assert read_ledger_file(path) == make_entries()[:2]
    # A write that fails (a value JSON cannot hold) leaves the old file intact and no temp file.
    event = SumQueryEvent(1.0, 1.0)
    object.__setattr__(event, "noise_stddev", float("inf"))  # bypass validation to force a failure
    with pytest.raises(ValueError):
        SumQueryEvent(1.0, float("inf"))  # events themselves refuse it
    bad = [SampleEntry(SamplingEvent(10, 0.5), (event,))]
    with pytest.raises(ValueError):
        write_ledger_file(path, bad, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["ledger.json"]
    assert read_ledger_file(path) == make_entries()[:2]
    # Saving through the ledger: same.
    tf_dp.PrivacyLedger.load(path).save(tmp_path / "second.json")
    assert sorted(os.listdir(tmp_path)) == ["ledger.json", "second.json"]


def test_empty_ledger_round_trip(tmp_path):
    ledger = tf_dp.PrivacyLedger()
    ledger.save(tmp_path / "empty.json")
    assert read_ledger_file(tmp_path / "empty.json") == []
    assert tf_dp.PrivacyLedger.load(tmp_path / "empty.json").num_samples == 0


@pytest.mark.skipif(os.name != "posix", reason="POSIX permission bits")
def test_file_mode_follows_the_replaced_file_or_the_umask(tmp_path):
    """The atomic write goes through a temporary file that mkstemp creates 0600; the ledger must
    not end up 0600 (it used to, even over a 0644 file)."""
    entries = make_entries()
    mode = lambda p: os.stat(p).st_mode & 0o777  # noqa: E731
    for existing in (0o644, 0o640, 0o664):
        path = tmp_path / f"l{existing:o}.json"
        path.write_text("{}")
        os.chmod(path, existing)
        write_ledger_file(path, entries)
        assert mode(path) == existing
        assert read_ledger_file(path) == entries
    old = os.umask(0o022)
    try:
        write_ledger_file(tmp_path / "new022.json", entries)
        os.umask(0o077)
        write_ledger_file(tmp_path / "new077.json", entries)
    finally:
        os.umask(old)
    assert mode(tmp_path / "new022.json") == 0o644
    assert mode(tmp_path / "new077.json") == 0o600
    assert ledger_file._current_umask() == old


if __name__ == "__main__":  # Bazel py_test entry point (see BUILD)
    sys.exit(pytest.main([__file__, *sys.argv[1:]]))


def test_a_ledger_file_is_not_replaced_by_a_shorter_ledger(tmp_path):
    path = tmp_path / "ledger.json"
    entries = make_entries()
    write_ledger_file(path, entries[:3])
    write_ledger_file(path, entries)  # more steps (an extension): replaced
    assert read_ledger_file(path) == entries
    with pytest.raises(LedgerOverwriteError) as e:
        write_ledger_file(path, entries[:2])
    message = str(e.value)
    assert str(path) in message and f"{len(entries)} steps" in message and "only 2" in message
    assert read_ledger_file(path) == entries  # untouched
    write_ledger_file(path, entries, metadata={"again": True})  # as many steps: replaced
    write_ledger_file(path, entries[:2], overwrite=True)
    assert read_ledger_file(path) == entries[:2]


def test_a_full_disk_names_the_ledger_file_and_keeps_the_old_one(tmp_path, monkeypatch):
    import errno

    path = str(tmp_path / "ledger.json")
    entries = make_entries()
    write_ledger_file(path, entries[:1])
    with open(path, "rb") as f:
        before = f.read()

    def no_space(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ledger_file.os, "fsync", no_space)
    with pytest.raises(OSError) as info:
        write_ledger_file(path, entries)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC
    assert info.value.filename == path and path in str(info.value)
    with open(path, "rb") as f:
        assert f.read() == before  # the old file is intact
    assert sorted(os.listdir(tmp_path)) == ["ledger.json"]  # no temporary file left
