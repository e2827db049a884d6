"""Privacy ledger: sampling and sum-query events as they actually ran (McMahan et al. 2018, §6).

``events``, ``ledger_file`` and ``journal`` are pure Python (readable without TensorFlow); the
TensorFlow side (``PrivacyLedger``, ``QueryWithLedger``) is imported lazily.
"""

from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.journal import LedgerJournal, read_journal
from tf_dp.ledger.ledger_file import (
    LedgerFileError,
    LedgerOverwriteError,
    read_ledger_file,
    read_ledger_runs,
    write_ledger_file,
)

def __getattr__(name):
    # The TensorFlow side, imported on first use (events, ledger files and journals stay
    # readable without TensorFlow).
    if name in ("PrivacyLedger", "LedgerOverflowError"):
        from tf_dp.ledger.privacy_ledger import LedgerOverflowError, PrivacyLedger

        globals().update(PrivacyLedger=PrivacyLedger, LedgerOverflowError=LedgerOverflowError)
        return globals()[name]
    if name == "QueryWithLedger":
        from tf_dp.ledger.query_with_ledger import QueryWithLedger

        globals()[name] = QueryWithLedger
        return QueryWithLedger
    raise AttributeError(f"module 'tf_dp.ledger' has no attribute {name!r}")


__all__ = [
    "SampleEntry",
    "SamplingEvent",
    "SumQueryEvent",
    "LedgerFileError",
    "LedgerOverwriteError",
    "LedgerJournal",
    "read_journal",
    "read_ledger_file",
    "read_ledger_runs",
    "write_ledger_file",
    "PrivacyLedger",
    "QueryWithLedger",
    "LedgerOverflowError",
]
