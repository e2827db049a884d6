"""The ledger's copy in Keras saved variables (``.keras`` files, ``.weights.h5``, checkpoints).

A private model and its DP optimizer each write the ledger's two tables and their SHA-256
(:func:`tf_dp.ledger.privacy_ledger.tables_checksum`) next to their own variables. Reading
checks the checksum before anything is used: a copy whose tables do not match it (corrupted or
edited), or that lacks it, raises :class:`tf_dp.ledger.LedgerFileError`. The checksum detects
corruption and accidental edits; it is not a signature (anyone who edits the tables on purpose
can recompute it).

Example::

    def save_own_variables(self, store):
        super().save_own_variables(store)
        write_ledger(store, *self.ledger.tables())

    def load_own_variables(self, store):
        tables = read_ledger(store)          # None when the store holds no ledger
        super().load_own_variables(without_ledger(store))
"""

from __future__ import annotations

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


def read_ledger(store: Any) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """The tables stored in ``store`` after checking their checksum, or None if it holds none."""
    keys = set(store.keys()) if store is not None else set()
    if not keys & set(KEYS):
        return None
    missing = [k for k in KEYS if k not in keys]
    if missing:
        raise LedgerFileError(
            f"the saved ledger is incomplete (missing {', '.join(missing)}): it cannot be checked, "
            "so it is not loaded"
        )
    samples = np.asarray(store[SAMPLES_KEY], np.float64)
    queries = np.asarray(store[QUERIES_KEY], np.float64)
    stored = np.asarray(store[CHECKSUM_KEY]).astype(np.uint8).tobytes().hex()
    try:
        expected = tables_checksum(samples, queries)
    except ValueError as e:
        raise LedgerFileError(f"the saved ledger's tables are malformed: {e}") from None
    if stored != expected:
        raise LedgerFileError(
            "ledger checksum mismatch in the saved variables: the ledger stored with these "
            "weights was corrupted or edited after it was written; nothing was loaded from it"
        )
    return samples, queries


def without_ledger(store: Any) -> dict[str, Any]:
    """The entries of ``store`` that are not the ledger's."""
    return {k: store[k] for k in store.keys() if k not in KEYS}
