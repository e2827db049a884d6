"""Keras callbacks for DP training: privacy per epoch, a privacy budget, ledger persistence.

All of them read the DP optimizer's :class:`~tf_dp.PrivacyLedger` (what actually ran) and ask an
accountant of :mod:`tf_dp.accounting` for the guarantee. Each lives in a small module of its own
(``privacy_report.py``, ``privacy_budget.py``, ``backup.py``, ``ledger_checkpoint.py``); this
module gathers them.

- :class:`PrivacyReport` puts ``epsilon`` (spent so far) into the epoch ``logs``, so it lands in
  ``History.history["epsilon"]`` and in every ``keras.callbacks.TensorBoard`` of the ``fit``, in
  either order.
- :class:`PrivacyBudget` is the ``DPTrain`` loop of Abadi et al. 2016: it stops training *before*
  the step that would take epsilon over the budget.
- :class:`BackupAndRestore` is ``keras.callbacks.BackupAndRestore`` that also backs up and restores
  the ledger, so an interrupted run resumes with the same ledger (and the same spent budget).
- :class:`LedgerCheckpoint` writes the ledger file next to your ``ModelCheckpoint`` files.

Example::

    from tf_dp.keras import callbacks as dp_callbacks

    callbacks = [
        dp_callbacks.BackupAndRestore("backup/"),        # weights + ledger
        dp_callbacks.PrivacyBudget(target_epsilon=3.0, delta=1e-5),
        dp_callbacks.PrivacyReport(delta=1e-5),
        keras.callbacks.ModelCheckpoint("ckpt/model-{epoch:02d}.keras"),
        dp_callbacks.LedgerCheckpoint("ckpt/ledger-{epoch:02d}.json"),
        keras.callbacks.TensorBoard("logs/"),
    ]
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.01), epochs=50,
              callbacks=callbacks)
"""

from __future__ import annotations

from tf_dp.engine.budget import (  # noqa: F401 -- the budget's names, also here
    BUDGET_ACCOUNTANTS,
    SCHEDULE_MARGIN,
    BudgetExhaustedError,
    BudgetPlanner,
    compute_epsilon,
)
from tf_dp.keras.backup import JOURNAL_NAME, LEDGER_BACKUP_NAME, BackupAndRestore
from tf_dp.keras.ledger_checkpoint import LedgerCheckpoint
from tf_dp.keras.privacy_budget import PrivacyBudget
from tf_dp.keras.privacy_report import PrivacyReport

__all__ = [
    "BUDGET_ACCOUNTANTS",
    "JOURNAL_NAME",
    "LEDGER_BACKUP_NAME",
    "SCHEDULE_MARGIN",
    "BackupAndRestore",
    "BudgetExhaustedError",
    "LedgerCheckpoint",
    "PrivacyBudget",
    "PrivacyReport",
    "compute_epsilon",
]
