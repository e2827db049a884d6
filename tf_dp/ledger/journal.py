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
written with one ``write`` call, newline last. A kill can leave only a torn last record (no
newline, bad JSON or a bad checksum, with nothing valid after it): readers ignore it and writers
cut it off before appending. Anything invalid *before* a valid record is corruption and raises
:class:`~tf_dp.ledger.LedgerFileError`.

Pure Python (no TensorFlow), like the ledger file module.

Example::

    ledger.attach_journal("run/privacy_journal.jsonl")     # resumes: the ledger becomes the
    ...                                                   # longer of the two, then every flush
    entries = read_journal("run/privacy_journal.jsonl")  # appends the new steps
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Optional, Sequence

from tf_dp.ledger.events import SampleEntry
from tf_dp.ledger.ledger_file import LedgerFileError, _canonical, runs_payload, runs_to_entries

JOURNAL_FORMAT = "tf_dp.privacy_journal"
JOURNAL_VERSION = 1
_HEADER = (
    json.dumps({"format": JOURNAL_FORMAT, "version": JOURNAL_VERSION}, separators=(",", ":"))
    + "\n"
).encode()


def encode_runs(entries: Sequence[SampleEntry]) -> str:
    """The canonical JSON text of ``entries``'s runs, as a journal record holds it."""
    return _canonical(runs_payload(entries)).decode()


def _digest(start: int, runs_json: str) -> str:
    return hashlib.sha256(f"{start}:{runs_json}".encode()).hexdigest()


def _parse_record(line: bytes) -> Optional[tuple[int, list[SampleEntry]]]:
    """``(start, entries)`` of one complete record, or None if the line is not a valid record."""
    try:
        record = json.loads(line.decode())
        start, runs = record["start"], record["runs"]
        if record.get("sha256") != _digest(start, _canonical(runs).decode()):
            return None
        return start, runs_to_entries(runs)
    except (ValueError, KeyError, TypeError, LedgerFileError):
        return None


def _scan(path: str) -> tuple[list[SampleEntry], int]:
    """``(entries, valid_bytes)``: the journal's valid records and the length of the valid
    prefix of the file (a torn tail after it is ignored)."""
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        return [], 0
    newline = data.find(b"\n")
    if newline < 0:  # torn header
        return [], 0
    try:
        header = json.loads(data[:newline].decode())
    except (ValueError, UnicodeDecodeError):
        header = None
    if not isinstance(header, dict) or header.get("format") != JOURNAL_FORMAT:
        raise LedgerFileError(f"{path!r} is not a tf_dp privacy journal")
    if header.get("version") != JOURNAL_VERSION:
        raise LedgerFileError(
            f"unsupported journal version {header.get('version')!r}; this tf_dp reads version "
            f"{JOURNAL_VERSION}"
        )
    entries: list[SampleEntry] = []
    valid = pos = newline + 1
    bad_at: Optional[int] = None  # offset of the first invalid line after the last valid one
    while pos < len(data):
        end = data.find(b"\n", pos)
        if end < 0:  # no newline: a torn last record
            break
        parsed = _parse_record(data[pos:end])
        if parsed is None:
            bad_at = pos if bad_at is None else bad_at
        else:
            if bad_at is not None:
                raise LedgerFileError(
                    f"journal {path!r} is corrupted at byte {bad_at} (an invalid record before "
                    "valid ones)"
                )
            start, records = parsed
            if start != len(entries):
                raise LedgerFileError(
                    f"journal {path!r}: a record starts at step {start}, expected "
                    f"{len(entries)}: the journal was written by two writers or edited"
                )
            entries.extend(records)
            valid = end + 1
        pos = end + 1
    return entries, valid


def read_journal(path: str | os.PathLike) -> list[SampleEntry]:
    """The steps a journal holds, in order (a torn last record is ignored).

    Example::

        entries = read_journal("backup/privacy_journal.jsonl")
        tf_dp.accounting.compute_epsilon(entries, delta=1e-5)
    """
    try:
        return _scan(os.fspath(path))[0]
    except OSError as e:
        raise LedgerFileError(f"cannot read journal {os.fspath(path)!r}: {e.strerror}") from None


class LedgerJournal:
    """Appends a ledger's steps to an append-only journal file (see the module docstring).

    Opening reads the existing journal (:attr:`num_samples`, :meth:`entries`) and cuts off a
    torn last record. :meth:`append` writes the steps from ``start`` with one ``write`` call
    at the end of the file; with ``fsync=True`` it also waits until the record is on disk
    (survives a machine crash, not only a killed process; slower on most disks). A journal file
    has one writer at a time: records appended by a second writer break the sequence of
    ``start`` values, and reading the journal then raises.

    Normally you do not use this class directly:
    :meth:`~tf_dp.ledger.PrivacyLedger.attach_journal` does.

    Example::

        journal = LedgerJournal("run/privacy_journal.jsonl")
        journal.append(new_entries, start=journal.num_samples)
    """

    def __init__(self, path: str | os.PathLike, fsync: bool = False):
        if not isinstance(fsync, bool):
            raise TypeError(f"fsync must be True or False, got {type(fsync).__name__}")
        self.path = os.fspath(path)
        self.fsync = fsync
        exists = os.path.exists(self.path)
        entries, valid = _scan(self.path) if exists else ([], 0)
        self._num_samples = len(entries)
        self._fd: Optional[int] = os.open(
            self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o666
        )
        try:
            if valid == 0:
                os.ftruncate(self._fd, 0)
                os.write(self._fd, _HEADER)
                valid = len(_HEADER)
            elif os.fstat(self._fd).st_size > valid:
                os.ftruncate(self._fd, valid)  # cut off a torn last record
            if self.fsync:
                os.fsync(self._fd)
        except BaseException:
            os.close(self._fd)
            self._fd = None
            raise

    @property
    def num_samples(self) -> int:
        """Steps the journal holds."""
        return self._num_samples

    def entries(self) -> list[SampleEntry]:
        """The steps the journal holds, read back from the file."""
        return read_journal(self.path)

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
        written = os.write(self._fd, line)  # O_APPEND: at the end, whoever else appends
        if written != len(line):  # pragma: no cover (a full disk)
            raise OSError(f"journal {self.path!r}: wrote {written} of {len(line)} bytes")
        if self.fsync:
            os.fsync(self._fd)
        self._num_samples += count

    def close(self) -> None:
        """Closes the file (appending afterwards raises)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self):
        self.close()

    def __repr__(self) -> str:
        return f"LedgerJournal({self.path!r}, num_samples={self._num_samples})"
