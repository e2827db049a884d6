"""``BackupAndRestore``: Keras's backup and restore of an interrupted ``fit``, with the ledger
backed up, journaled at every step and restored (so a resumed run keeps the privacy spent)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import keras

from tf_dp.keras.callback_common import dp_optimizer
from tf_dp.ledger.events import runs_are_prefix
from tf_dp.ledger.ledger_file import read_ledger_runs

__all__ = ["BackupAndRestore", "JOURNAL_NAME", "LEDGER_BACKUP_NAME"]

_logger = logging.getLogger("tf_dp")

#: Ledger file name inside a BackupAndRestore backup directory.
LEDGER_BACKUP_NAME = "privacy_ledger.json"
#: Journal file name inside a BackupAndRestore backup directory.
JOURNAL_NAME = "privacy_journal.jsonl"


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also backs up, journals and keeps the ledger.

    Same arguments as the Keras callback (use it instead), and the same backups: the weights and
    the epoch at each epoch end (or every ``save_freq`` batches). What it adds, for the privacy
    ledger:

    - **Backups.** Each backup writes the optimizer's ledger to ``backup_dir/privacy_ledger.json``
      *before* the weights, so a crash in between leaves a ledger that over-counts (a valid
      bound), never one that under-counts.
    - **Journal.** During ``fit`` the ledger is journaled to ``backup_dir/privacy_journal.jsonl``
      (:meth:`tf_dp.PrivacyLedger.attach_journal`): every step is appended after the compiled
      call that ran it, before any callback sees its results. ``journal_fsync=True`` also waits
      for the disk at each append (a machine crash, not only a killed process).
    - **Resume.** ``fit`` restores the weights and the epoch (Keras), and the ledger: the longest
      of the backed-up ledger and the journal, so steps that ran after the last backup and were
      discarded by a kill are still charged (the resumed ledger may exceed
      ``optimizer.iterations``). A :class:`PrivacyBudget` sees the budget already spent.
    - **A finished run keeps its ledger.** When training ends, the weights and epoch are deleted
      as in Keras (``delete_checkpoint=True``), but ``privacy_ledger.json`` stays, marked
      ``"finished"``. Running the same ``fit`` again with the same ``backup_dir`` trains from
      epoch 0 with new weights and *continues* that ledger: the second run's steps are counted
      on top of the first's, and a :class:`PrivacyBudget` stops it when the budget is spent
      (at once, with :class:`BudgetExhaustedError`, if nothing is left). A genuinely new run on
      other data needs a new ``backup_dir``. With ``delete_checkpoint=False`` the weights and
      epoch stay as well, and a rerun resumes after the last epoch (no step runs).
    - The ledger restored from ``backup_dir`` and the optimizer's own must record the same run
      (one a prefix of the other): otherwise ``fit`` raises before any step runs.

    Example::

        model.fit(batches, epochs=30, callbacks=[
            dp_callbacks.BackupAndRestore("/tmp/backup"),
            dp_callbacks.PrivacyBudget(3.0, 1e-5)])
        # killed at epoch 12 (or mid-epoch); run the same script again: it resumes at epoch 12
        # with every step that ran in its ledger
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: Any = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        journal_fsync: bool = False,
    ):
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        if not isinstance(journal_fsync, bool):
            raise TypeError(f"journal_fsync must be True or False, got {journal_fsync!r}")
        self.journal_fsync = journal_fsync

    @property
    def ledger_path(self) -> str:
        return os.path.join(self.backup_dir, LEDGER_BACKUP_NAME)

    @property
    def journal_path(self) -> str:
        return os.path.join(self.backup_dir, JOURNAL_NAME)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # weights, epoch and the backed-up ledger (_load_model)
        optimizer = dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        before = optimizer.ledger.num_samples
        optimizer.ledger.attach_journal(self.journal_path, fsync=self.journal_fsync)
        if optimizer.ledger.num_samples > before:
            _logger.warning(
                "tf_dp: the journal %s records %d steps that ran after the last backup; the "
                "resumed ledger charges them (%d steps)",
                self.journal_path, optimizer.ledger.num_samples - before,
                optimizer.ledger.num_samples,
            )

    def _save_model(self):
        optimizer = dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        optimizer.ledger.save(
            self.ledger_path, metadata={"epoch": self._current_epoch, "backup": True}
        )
        super()._save_model()

    def _load_model(self):
        optimizer = dp_optimizer(self.model, "tf_dp BackupAndRestore")
        has_ledger = os.path.exists(self.ledger_path)
        if not has_ledger and os.path.exists(self._weights_path):
            raise FileNotFoundError(
                f"backup {self.backup_dir!r} holds weights but no {LEDGER_BACKUP_NAME}: resuming "
                "would forget the privacy already spent (was it written by "
                "keras.callbacks.BackupAndRestore?)"
            )
        backed_up = read_ledger_runs(self.ledger_path) if has_ledger else []
        super()._load_model()  # the weights (their own copy of the ledger) and the epoch
        ledger = optimizer.ledger
        current = ledger.runs()
        n_backed_up = sum(count for _, count in backed_up)
        n_current = sum(count for _, count in current)
        if runs_are_prefix(current, backed_up):
            if n_backed_up > n_current:
                ledger.restore_runs(backed_up)
        elif not runs_are_prefix(backed_up, current):
            raise ValueError(
                f"the ledger in {self.ledger_path!r} ({n_backed_up} steps) and the "
                f"optimizer's ledger ({n_current} steps) record different runs; use a new "
                "backup_dir for a new run"
            )
        if has_ledger:
            _logger.info(
                "tf_dp: restored %d ledger entries from %s", n_backed_up, self.ledger_path
            )
            with open(self.ledger_path) as f:
                finished = json.load(f)["metadata"].get("finished", False)
            if finished and not os.path.exists(self._training_metadata_path):
                _logger.warning(
                    "tf_dp: %s holds the ledger of a finished run (%d steps); this fit starts "
                    "again from epoch 0 and continues that ledger, so both runs are charged. "
                    "Use a new backup_dir for a new run on other data",
                    self.backup_dir, n_backed_up,
                )

    def on_train_end(self, logs=None):
        optimizer = dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        optimizer.ledger.save(
            self.ledger_path,
            metadata={"epoch": self._current_epoch, "backup": True, "finished": True},
        )
        optimizer.ledger.detach_journal()
        if not self.delete_checkpoint:
            return
        # The finished ledger holds every step: the journal and Keras's files can go.
        for path in (
            self.journal_path,
            self._weights_path,
            self._prev_weights_path,
            self._training_metadata_path,
            self._prev_training_metadata_path,
        ):
            if os.path.exists(path):
                os.remove(path)
