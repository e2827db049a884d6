"""The ledger journal: an append-only file that holds every step a ledger recorded, as it ran.

A ledger file is a snapshot, written at a checkpoint; the steps a process runs after its last
snapshot are lost when the process is killed, although their results may already have left it
(a ``ModelCheckpoint`` saved every few batches, a TensorBoard weight histogram). A journal closes
that gap: :meth:`PrivacyLedger.attach_journal <tf_dp.ledger.PrivacyLedger.attach_journal>`
makes the ledger append the steps it recorded since the last append at every
:meth:`~tf_dp.ledger.PrivacyLedger.flush`, which the Keras integration calls after every compiled
train call, before any callback sees the call's results. A resumed run that attaches the same
journal charges every step that ran, including those no checkpoint kept.

Format (version 1): UTF-8 text, one JSON object per line. The first line is
``{"format": "tf_dp.privacy_journal", "version": 1}``; each further line is a record::

    {"start": 120, "runs": [...], "sha256": "<hex SHA-256 of f'{start}:{canonical runs JSON}'>"}

``runs`` has the layout of a ledger file's runs (``tf_dp/ledger/ledger_file.py``) and holds the
steps ``start, start + 1, ...``; each record starts where the previous one ended. A record is
written with one ``write`` call, newline last. A kill can leave only a torn last record: one
with no newline (no record end). Readers ignore it and writers cut it off before appending. A
complete line (newline present) that is not a valid record (bad JSON, a bad checksum, nesting too
deep to parse) is damage, wherever it is, and raises :class:`~tf_dp.ledger.LedgerFileError`
naming the byte offset: its steps ran, so the journal is never cut back silently.

One writer at a time: a :class:`LedgerJournal` holds an exclusive ``fcntl.flock`` lock on the
file while it is open, so a second writer (another process, or another ledger in this process)
is refused with :class:`~tf_dp.ledger.LedgerFileError` before it reads or writes anything. The
lock goes with :meth:`LedgerJournal.close` (``detach_journal``) or the process's exit. Readers
(:func:`read_journal`) take no lock.

Pure Python (no TensorFlow), like the ledger file module.

Example::

    ledger.attach_journal("run/privacy_journal.jsonl")     # resumes: the ledger becomes the
    ...                                                   # longer of the two, then every flush
    entries = read_journal("run/privacy_journal.jsonl")  # appends the new steps
"""

from __future__ import annotations

import errno
import gc
import hashlib
import json
import os
import warnings
from typing import Optional, Sequence

from tf_dp.ledger.events import SampleEntry
from tf_dp.ledger.ledger_file import (
    LedgerFileError,
    _canonical,
    _check_listable,
    parse_runs,
    payload_from_runs,
    runs_payload,
)

try:  # POSIX; elsewhere a journal is not locked (reading still detects two writers)
    import fcntl
except ImportError:  # pragma: no cover (Windows)
    fcntl = None  # type: ignore[assignment]

JOURNAL_FORMAT = "tf_dp.privacy_journal"
JOURNAL_VERSION = 1
_HEADER = (
    json.dumps({"format": JOURNAL_FORMAT, "version": JOURNAL_VERSION}, separators=(",", ":"))
    + "\n"
).encode()


def encode_runs(entries: Sequence[SampleEntry]) -> str:
    """The canonical JSON text of ``entries``'s runs, as a journal record holds it."""
    return _canonical(runs_payload(entries)).decode()


def encode_run_counts(runs: Sequence[tuple[SampleEntry, int]]) -> str:
    """:func:`encode_runs` for runs ``[(entry, count), ...]`` (no step is listed)."""
    return _canonical(payload_from_runs(runs)).decode()


def _digest(start: int, runs_json: str) -> str:
    return hashlib.sha256(f"{start}:{runs_json}".encode()).hexdigest()


def _parse_record(line: bytes) -> Optional[tuple[int, list[tuple[SampleEntry, int]], int]]:
    """``(start, runs, steps)`` of one complete record, or None if the line is not a valid
    record (its steps are never listed one by one)."""
    try:
        record = json.loads(line.decode())
        start, runs = record["start"], record["runs"]
        if record.get("sha256") != _digest(start, _canonical(runs).decode()):
            return None
        return (start, *parse_runs(runs))
    except (ValueError, KeyError, TypeError, LedgerFileError, RecursionError):
        return None  # RecursionError: a line nested too deep for the JSON parser


def _scan(path: str) -> tuple[list[tuple[SampleEntry, int]], int, int]:
    """``(runs, steps, valid_bytes)``: the journal's valid records as merged runs, their step
    count and the length of the valid prefix of the file (a torn tail after it is ignored).
    Memory grows with the runs, not the steps."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        return [], 0, 0
    newline = data.find(b"\n")
    if newline < 0:  # torn header
        return [], 0, 0
    try:
        header = json.loads(data[:newline].decode())
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict) or header.get("format") != JOURNAL_FORMAT:
        raise LedgerFileError(f"{path!r} is not a tf_dp privacy journal")
    if header.get("version") != JOURNAL_VERSION:
        raise LedgerFileError(
            f"unsupported journal version {header.get('version')!r}; this tf_dp reads version "
            f"{JOURNAL_VERSION}"
        )
    runs: list[tuple[SampleEntry, int]] = []
    steps = 0
    valid = pos = newline + 1
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # no newline: a torn last record
            break
        parsed = _parse_record(data[pos:end])
        if parsed is None:
            # A complete line (its newline was written, and a record is one write, newline
            # last) that is not a valid record: damage, not a torn write. Its steps ran.
            line_no, later = data.count(b"\n", 0, pos) + 1, data.count(b"\n", end + 1)
            raise LedgerFileError(
                f"journal {path!r} is corrupted at byte {pos}: a complete record (line "
                f"{line_no}) is invalid (bad JSON or checksum) after "
                f"{steps} valid steps, with {later} complete line(s) after it. The steps "
                "it held ran and cannot be charged from this file; it is not truncated. Restore "
                "the journal from a copy, or account from the ledger backup and the damaged "
                "record's steps by hand"
            )
        else:
            start, records, count = parsed
            if start != steps:
                raise LedgerFileError(
                    f"journal {path!r}: a record starts at step {start}, expected "
                    f"{steps}: the journal was written by two writers or edited"
                )
            for entry, n in records:
                if runs and runs[-1][0] == entry:
                    runs[-1] = (runs[-1][0], runs[-1][1] + n)
                else:
                    runs.append((entry, n))
            steps += count
            valid = end + 1
        pos = end + 1
    return runs, steps, valid


def read_journal_runs(path: str | os.PathLike) -> list[tuple[SampleEntry, int]]:
    """The steps a journal holds as runs ``[(entry, count), ...]`` (consecutive identical steps
    merged; a torn last record is ignored), in memory proportional to the runs, whatever the
    step count.

    Example::

        runs = read_journal_runs("backup/privacy_journal.jsonl")
        tf_dp.accounting.compute_epsilon(runs, delta=1e-5)
    """
    try:
        return _scan(os.fspath(path))[0]
    except OSError as e:
        raise LedgerFileError(f"cannot read journal {os.fspath(path)!r}: {e.strerror}") from None


def read_journal(path: str | os.PathLike) -> list[SampleEntry]:
    """The steps a journal holds, in order, one entry per step (a torn last record is ignored;
    at most ``MAX_LISTED_SAMPLES`` steps: :func:`read_journal_runs` reads any journal).

    Example::

        entries = read_journal("backup/privacy_journal.jsonl")
        tf_dp.accounting.compute_epsilon(entries, delta=1e-5)
    """
    runs = read_journal_runs(path)
    _check_listable(sum(count for _, count in runs))
    return [entry for entry, count in runs for _ in range(count)]


def _lock(fd: int, path: str) -> None:
    """Takes an exclusive, non-blocking ``flock`` on ``fd``: LedgerFileError if another open
    file (another process, or another LedgerJournal in this one) holds it."""
    if fcntl is None:  # pragma: no cover (Windows)
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # The holder may be an unreachable journal of this process (the ledger of a model
            # replaced after an interrupted fit, kept by a reference cycle): collect it, retry.
            gc.collect()
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            raise LedgerFileError(
                f"journal {path!r} is already open for writing (another run, or another ledger "
                "in this process, holds its lock): a journal has one writer at a time. Use "
                "another path (for BackupAndRestore: another backup_dir) or stop the other "
                "writer (PrivacyLedger.detach_journal) first; its journal is left unchanged"
            ) from None
        # A file system without flock (some network mounts): go on unlocked; reading the
        # journal still detects records of two writers.
        warnings.warn(
            f"tf_dp: cannot lock journal {path!r} ({e.strerror}); a second writer will not be "
            "refused",
            RuntimeWarning,
            stacklevel=3,
        )


def _write(fd: int, data: bytes, path: str, size: Optional[int] = None) -> None:
    """``os.write`` of all of ``data``; an OSError (a full disk: ENOSPC) names the file, and a
    partly written record is cut off again (a later append must not glue onto it) at ``size``,
    the file's size before the write (read here if not given)."""
    if size is None:
        size = os.fstat(fd).st_size
    try:
        written = os.write(fd, data)
    except OSError as e:
        _cut(fd, size)
        raise OSError(e.errno, f"cannot append to journal: {e.strerror}", path) from e
    if written != len(data):  # a full disk can also give a short write
        _cut(fd, size)
        raise OSError(
            errno.ENOSPC,
            f"cannot append to journal: wrote {written} of {len(data)} bytes (disk full?)",
            path,
        )


def _cut(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:  # pragma: no cover (then the tail stays torn: readers ignore it)
        pass


class LedgerJournal:
    """Appends a ledger's steps to an append-only journal file (see the module docstring).

    Opening reads the existing journal (:attr:`num_samples`, :meth:`entries`) and cuts off a
    torn last record. :meth:`append` writes the steps from ``start`` with one ``write`` call
    at the end of the file; with ``fsync=True`` it also waits until the record is on disk
    (survives a machine crash, not only a killed process; slower on most disks). A journal file
    has one writer at a time: an open journal holds an exclusive lock on its file (released by
    :meth:`close` or the process's exit), and opening a locked journal raises
    :class:`~tf_dp.ledger.LedgerFileError` before anything is read or written. An error writing
    the file (``ENOSPC``: disk full) is an ``OSError`` that names it.

    Normally you do not use this class directly:
    :meth:`~tf_dp.ledger.PrivacyLedger.attach_journal` does.

    Example::

        journal = LedgerJournal("run/privacy_journal.jsonl")
        journal.append(new_entries, start=journal.num_samples)
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be True or False, got {type(fsync).__name__}")
        self._fd: Optional[int] = None
        self.path = os.fspath(path)
        self.fsync = fsync
        self._num_samples = 0
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666)
        except OSError as e:
            raise OSError(e.errno, f"cannot open journal: {e.strerror}", self.path) from None
        try:
            _lock(fd, self.path)  # before reading: a refused writer changes nothing
            _, steps, valid = _scan(self.path)
            if valid == 0:
                os.ftruncate(fd, 0)
                _write(fd, _HEADER, self.path)
                valid = len(_HEADER)
            elif os.fstat(fd).st_size > valid:
                os.ftruncate(fd, valid)  # cut off a torn last record
            if self.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)  # also releases the lock
            raise
        self._num_samples = steps
        self._size = valid  # the file's size (its one writer holds the lock): no fstat per append
        self._fd = fd

    @property
    def num_samples(self) -> int:
        """Steps the journal holds."""
        return self._num_samples

    def entries(self) -> list[SampleEntry]:
        """The steps the journal holds, read back from the file (one entry per step)."""
        return read_journal(self.path)

    def runs(self) -> list[tuple[SampleEntry, int]]:
        """The steps the journal holds as runs ``[(entry, count), ...]``, read back from the
        file in memory proportional to the runs."""
        return read_journal_runs(self.path)

    def append_runs(self, runs: Sequence[tuple[SampleEntry, int]], start: int) -> None:
        """:meth:`append` for runs ``[(entry, count), ...]`` (one record, no step listed)."""
        runs = list(runs)
        if runs:
            self.append_encoded(encode_run_counts(runs), sum(c for _, c in runs), start)

    def append(self, entries: Sequence[SampleEntry], start: int) -> None:
        """Appends ``entries`` as steps ``start, start + 1, ...``; ``start`` must be
        :attr:`num_samples` (a journal has no gaps)."""
        if entries:
            self.append_encoded(encode_runs(entries), len(entries), start)

    def append_encoded(self, runs_json: str, count: int, start: int) -> None:
        """:meth:`append` for ``count`` steps already encoded by :func:`encode_runs` (a writer
        that appends the same kind of step again and again encodes it once)."""
        if self._fd is None:
            raise ValueError(f"journal {self.path!r} is closed")
        if start != self._num_samples:
            raise ValueError(
                f"journal {self.path!r} holds {self._num_samples} steps; cannot append from "
                f"step {start}"
            )
        digest = _digest(start, runs_json)
        line = f'{{"start":{start},"runs":{runs_json},"sha256":"{digest}"}}\n'.encode()
        _write(self._fd, line, self.path, self._size)  # O_APPEND: at the end of the file
        self._size += len(line)
        if self.fsync:
            os.fsync(self._fd)
        self._num_samples += count

    def close(self) -> None:
        """Closes the file and releases its lock (appending afterwards raises)."""
        fd = getattr(self, "_fd", None)  # None if __init__ failed
        if fd is not None:
            self._fd = None
            os.close(fd)

    def __del__(self):
        self.close()

    def __repr__(self) -> str:
        return f"LedgerJournal({self.path!r}, num_samples={self._num_samples})"
