"""The ledger's copy in Keras saved variables (``.keras`` files, ``.weights.h5``, checkpoints).

A private model and its DP optimizer each write the ledger's two tables and their SHA-256
(:func:`tf_dp.ledger.privacy_ledger.tables_checksum`) next to their own variables. Reading
checks the checksum before anything is used: a copy whose tables do not match it (corrupted or
edited), or that lacks one of its tables, raises :class:`tf_dp.ledger.LedgerFileError`. The
checksum detects corruption and accidental edits; it is not a signature (anyone who edits the
tables on purpose can recompute it).

The tables are :meth:`~tf_dp.ledger.PrivacyLedger.run_tables`: one sample row per run of
identical consecutive steps with its step count, so a ledger of a million steps of one
configuration stores a few rows. Tables of one row per step (:meth:`~tf_dp.ledger.PrivacyLedger.tables`,
what earlier versions wrote) load too.

Formats written by earlier versions: files saved between the ledger's first copy in the
optimizer's variables (commit c2fb504) and the checksum (commit 3b9dd89) hold both tables but no
checksum. Their ledger loads *unverified* (:func:`read_ledger` returns ``verified=False`` and
warns); the statements computed from it say so. Files older than that hold no ledger at all.

Example::

    def save_own_variables(self, store):
        super().save_own_variables(store)
        write_ledger(store, *self.ledger.run_tables())

    def load_own_variables(self, store):
        stored = read_ledger(store)          # None when the store holds no ledger
        super().load_own_variables(without_ledger(store))
        if stored is not None:
            samples, queries, verified = stored
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import numpy as np

from tf_dp.ledger.ledger_file import LedgerFileError
from tf_dp.ledger.privacy_ledger import tables_checksum

SAMPLES_KEY = "tf_dp_ledger_samples"
QUERIES_KEY = "tf_dp_ledger_queries"
CHECKSUM_KEY = "tf_dp_ledger_sha256"
KEYS = (SAMPLES_KEY, QUERIES_KEY, CHECKSUM_KEY)


def write_ledger(store: Any, samples: np.ndarray, queries: np.ndarray) -> None:
    """Writes the tables and their checksum (32 bytes, as uint8) into ``store``."""
    store[SAMPLES_KEY] = samples
    store[QUERIES_KEY] = queries
    digest = bytes.fromhex(tables_checksum(samples, queries))
    store[CHECKSUM_KEY] = np.frombuffer(digest, np.uint8)


_last_error = threading.local()


def _refuse(message: str) -> LedgerFileError:
    """The error to raise, remembered so that a caller whose load Keras wraps can re-raise it."""
    error = LedgerFileError(message)
    _last_error.value = error
    return error


def take_last_error() -> Optional[LedgerFileError]:
    """The last ledger error :func:`read_ledger` raised in this thread (then forgotten): Keras
    turns errors raised while loading into its own ``ValueError``; a private model's
    ``load_weights`` re-raises tf_dp's."""
    error = getattr(_last_error, "value", None)
    _last_error.value = None
    return error


UNVERIFIED_WARNING = (
    "tf_dp: this file was saved by a tf_dp version before ledger checksums (its ledger tables "
    "have no tf_dp_ledger_sha256); the ledger could not be verified. It is loaded and marked "
    "unverified (ledger.verified is False; privacy statements say so): re-save the model to "
    "store it with a checksum, once you trust it"
)


def read_ledger(store: Any) -> Optional[tuple[np.ndarray, np.ndarray, bool]]:
    """``(samples, queries, verified)`` stored in ``store``, or None if it holds no ledger.

    ``verified`` is True when the tables match their stored checksum; False for tables saved
    before checksums existed (no checksum key: a warning says so). A checksum mismatch, or a
    missing table, raises :class:`tf_dp.ledger.LedgerFileError`.
    """
    keys = set(store.keys()) if store is not None else set()
    if not keys & set(KEYS):
        return None
    missing = [k for k in (SAMPLES_KEY, QUERIES_KEY) if k not in keys]
    if missing:
        raise _refuse(
            f"tf_dp: the saved ledger is incomplete (missing {', '.join(missing)}): the privacy "
            "spent by these weights is unknown, so nothing was loaded from it. Load an intact "
            "copy of the file, or restore the run's ledger from its ledger file "
            "(ledger.restore_entries(tf_dp.ledger.read_ledger_file(path)))"
        )
    samples = np.asarray(store[SAMPLES_KEY], np.float64)
    queries = np.asarray(store[QUERIES_KEY], np.float64)
    if CHECKSUM_KEY not in keys:  # the format before checksums (commits c2fb504..3b9dd89)
        warnings.warn(UNVERIFIED_WARNING, UserWarning, stacklevel=2)
        return samples, queries, False
    stored = np.asarray(store[CHECKSUM_KEY]).astype(np.uint8).tobytes().hex()
    try:
        expected = tables_checksum(samples, queries)
    except ValueError as e:
        raise _refuse(f"tf_dp: the saved ledger's tables are malformed: {e}") from None
    if stored != expected:
        raise _refuse(
            "tf_dp: ledger checksum mismatch in the saved variables: the ledger stored with "
            "these weights was corrupted or edited after it was written; nothing was loaded "
            "from it. Load an intact copy of the file, or restore the run's ledger from its "
            "ledger file (ledger.restore_entries(tf_dp.ledger.read_ledger_file(path)))"
        )
    return samples, queries, True


def without_ledger(store: Any) -> dict[str, Any]:
    """The entries of ``store`` that are not the ledger's."""
    return {k: store[k] for k in store.keys() if k not in KEYS}
