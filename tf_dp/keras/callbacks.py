"""Keras callbacks for DP training: privacy per epoch, a privacy budget, ledger persistence.

All of them read the DP optimizer's :class:`~tf_dp.PrivacyLedger` (what actually ran) and ask an
accountant of :mod:`tf_dp.accounting` for the guarantee.

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

import json
import logging
import os
import string
from typing import Any, Optional, Sequence

import keras

from tf_dp.engine.budget import (  # noqa: F401 -- BUDGET_ACCOUNTANTS etc.: public names here too
    BUDGET_ACCOUNTANTS,
    SCHEDULE_MARGIN,
    BudgetExhaustedError,
    BudgetPlanner,
    _ComposedCurve,
    _covered,
    _pessimistic,
    check_can_analyse,
    compute_epsilon,
)
from tf_dp.engine.budget import check_accountant as _check_accountant
from tf_dp.engine.budget import check_delta as _check_delta
from tf_dp.keras.optimizers import DPOptimizerMixin
from tf_dp.ledger.events import SampleEntry, runs_are_prefix
from tf_dp.ledger.ledger_file import read_ledger_runs

_logger = logging.getLogger("tf_dp")

#: Ledger file name inside a BackupAndRestore backup directory.
LEDGER_BACKUP_NAME = "privacy_ledger.json"
#: Journal file name inside a BackupAndRestore backup directory.
JOURNAL_NAME = "privacy_journal.jsonl"


def _dp_optimizer(model: keras.Model, who: str):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not isinstance(optimizer, DPOptimizerMixin):
        raise TypeError(
            f"{who} needs a model compiled with a tf_dp DP optimizer (e.g. "
            f"tf_dp.keras.DPKerasSGDOptimizer), got {type(optimizer).__name__}"
        )
    return optimizer


def _check_can_analyse(optimizer, delta: float, accountant: str, who: str) -> None:
    """Fails at the start of ``fit``, not after an epoch, when ``accountant`` cannot analyse the
    ledger as it will be after one more step (e.g. JL steps with ``accountant="rdp"``)."""
    check_can_analyse(optimizer.engine, int(optimizer.iterations.numpy()), delta, accountant, who)


def _calling_callback_list(callback, max_depth: int = 8):
    """The ``keras.callbacks.CallbackList`` that is calling ``callback``'s hook right now (found on
    the call stack: ``fit`` dispatches every hook through one), or None (a custom loop calling the
    hook directly)."""
    import inspect

    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(
                c is callback for c in owner.callbacks
            ):
                return owner
        return None
    finally:
        del frame


class PrivacyReport(keras.callbacks.Callback):
    """Adds ``epsilon`` (privacy spent so far, from the ledger) to each epoch's ``logs``.

    Keras's ``History`` (``model.fit(...).history["epsilon"]``) records it, and so does every
    ``keras.callbacks.TensorBoard`` of the same ``fit``, in whichever order the callbacks are
    listed: a ``TensorBoard`` listed after this one reads it from the epoch's ``logs``; for one
    listed before (it has already written that epoch's logs), this callback writes the scalar
    ``epoch_<log_key>`` itself, at step ``epoch``, into that callback's ``<log_dir>/train``, as
    ``TensorBoard`` writes its own epoch scalars (this needs the ``tensorboard`` package:
    ``pip install tensorboard``, part of the ``tutorials`` extra). Epsilon is computed at ``delta``
    by ``accountant`` from the optimizer's ledger of everything recorded so far (earlier ``fit``
    calls and a restored ledger included). ``statements`` keeps the accountant's full statement
    per epoch.

    Args:
      delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
      accountant: an accountant name of :func:`tf_dp.accounting.compute_epsilon` ("rdp", "pld"...).
      log_key: the logs key (default ``"epsilon"``).
      verbose: print the statement at the end of each epoch.

    Example::

        history = model.fit(batches, epochs=5, callbacks=[
            keras.callbacks.TensorBoard("logs/"), dp_callbacks.PrivacyReport(1e-5)])
        history.history["epsilon"]     # [0.41, 0.58, ...]; also "epoch_epsilon" in logs/train
    """

    def __init__(
        self, delta: float, accountant: str = "rdp", log_key: str = "epsilon", verbose: bool = False
    ):
        super().__init__()
        self.delta = _check_delta(delta)
        self.accountant = _check_accountant(accountant)
        self.log_key = log_key
        self.verbose = verbose
        self.statements: list[str] = []
        # TensorBoard callbacks that run before this one at each epoch end, and our writers to them
        self._tensorboards_before: list[Any] = []
        self._writers: dict[str, Any] = {}

    def on_train_begin(self, logs=None):
        optimizer = _dp_optimizer(self.model, "PrivacyReport")
        _check_can_analyse(optimizer, self.delta, self.accountant, "PrivacyReport")
        self._close_writers()
        self._tensorboards_before = []
        callback_list = _calling_callback_list(self)
        if callback_list is not None:
            for callback in callback_list.callbacks:
                if callback is self:
                    break
                if isinstance(callback, keras.callbacks.TensorBoard):
                    self._tensorboards_before.append(callback)

    def on_epoch_end(self, epoch, logs=None):
        ledger = _dp_optimizer(self.model, "PrivacyReport").ledger
        epsilon, result = compute_epsilon(ledger.runs(), self.delta, self.accountant)
        if logs is not None:
            logs[self.log_key] = epsilon
        self._write_to_tensorboards_before(epoch, epsilon)
        statement = str(result) if result is not None else "no DP step recorded: epsilon = 0"
        self.statements.append(statement)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: {statement}")

    def on_train_end(self, logs=None):
        self._close_writers()

    def _write_to_tensorboards_before(self, epoch: int, epsilon: float) -> None:
        if not self._tensorboards_before:
            return
        import tensorflow as tf

        for callback in self._tensorboards_before:
            train_dir = os.path.join(callback.log_dir, "train")
            writer = self._writers.get(train_dir)
            if writer is None:
                writer = self._writers[train_dir] = tf.summary.create_file_writer(train_dir)
            with writer.as_default():
                tf.summary.scalar(f"epoch_{self.log_key}", epsilon, step=epoch)
            writer.flush()

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


class PrivacyBudget(keras.callbacks.Callback):
    """Stops training before the step that would spend more than ``target_epsilon``.

    The ``DPTrain`` loop of Abadi et al. 2016 (Algorithm 1 with the accountant's stopping rule),
    in ``fit``: before each compiled call the callback asks a :class:`tf_dp.engine.BudgetPlanner`
    whether the steps about to run (the optimizer's current sampling, clip and noise, schedules
    included) would take the ledger's epsilon at ``delta`` above ``target_epsilon``; if so, it
    sets ``model.stop_training`` so that they never run. Epsilon after training is therefore
    ``<= target_epsilon`` (also across ``fit`` calls and resumed runs: the ledger holds all
    previous steps). Custom loops use the planner directly (docs/keras.md, "A budget in a custom
    loop"); how it decides and what a check costs is documented there.

    The budget stops on a certified upper bound only (design invariant 3): ``accountant`` is
    ``"rdp"`` (default), ``"moments"`` or ``"pld"`` (the tightest). ``"gdp"`` is accepted only
    when no step is subsampled (shuffled fixed-size batches, tree aggregation, full batches),
    where the composition is exactly mu-GDP; for Poisson-subsampled steps (rate < 1) its epsilon
    is the privacy-CLT approximation, which can be below the true epsilon (q = 0.1, noise
    multiplier 1, delta 1e-5: 30 steps are 2.99 by GDP, 4.18 by PLD), so ``fit`` raises
    ``ValueError`` naming the accountants to use, before any such step runs.

    With ``steps_per_execution = s > 1`` Keras runs ``s`` steps between two checks, so training
    stops once fewer than ``s`` steps are left (the budget is never exceeded). At each epoch end
    the steps recorded during the epoch are checked against the plan, and the next epoch's
    first call is checked as the start of a new pass over the data. ``epsilon_spent`` is the
    epsilon of the whole ledger as it was when ``fit`` ended, computed the first time it is read.

    If ``fit`` starts with not even one step left, it raises :class:`BudgetExhaustedError` from
    ``on_train_batch_begin`` (no step runs) unless ``raise_if_exhausted=False``, in which case the
    first step is replaced by a no-op and training stops.

    Args:
      target_epsilon: the budget, a finite number > 0.
      delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
      accountant: ``"rdp"``, ``"moments"`` or ``"pld"``; ``"gdp"`` only for steps without
        subsampling (see above).
      raise_if_exhausted: raise :class:`BudgetExhaustedError` when ``fit`` starts with no step
        left (else run no step and stop).
      verbose: print the spent epsilon when the budget stops training.

    Attributes:
      planner: the :class:`tf_dp.engine.BudgetPlanner` that decides.
      stopped: True once the callback stopped training.
      epsilon_spent: epsilon of the ledger when training ended.

    Example::

        budget = dp_callbacks.PrivacyBudget(target_epsilon=3.0, delta=1e-5)
        model.fit(batches, epochs=1000, callbacks=[budget])   # stops when the budget is spent
    """

    LOOK_AHEAD = BudgetPlanner.LOOK_AHEAD
    VERIFY_AHEAD = BudgetPlanner.VERIFY_AHEAD

    def __init__(
        self,
        target_epsilon: float,
        delta: float,
        accountant: str = "rdp",
        raise_if_exhausted: bool = True,
        verbose: bool = True,
    ):
        super().__init__()
        self.planner = BudgetPlanner(target_epsilon, delta, accountant)
        self.target_epsilon = self.planner.target_epsilon
        self.delta, self.accountant = self.planner.delta, self.planner.accountant
        self.raise_if_exhausted = raise_if_exhausted
        self.verbose = verbose
        self.stopped = False
        self._spent: Optional[float] = None
        self._spent_steps: Optional[tuple[Any, int]] = None  # (ledger, steps) when fit ended
        self._original_train_function = None

    def _optimizer(self):
        return _dp_optimizer(self.model, "PrivacyBudget")

    def _steps_per_call(self) -> int:
        # Keras runs steps_per_execution steps per call between two callback hooks.
        return int(getattr(self.model, "steps_per_execution", 1) or 1)

    def headroom(self, entries: Sequence[Any], kind: SampleEntry, cap: int) -> int:
        """Largest ``k <= cap`` such that ``entries + [kind] * k`` stays within the budget."""
        return self.planner.headroom(entries, kind, cap)

    def steps_left(self) -> Optional[int]:
        """Further steps the budget allows (as last computed), or None before training."""
        return self.planner.steps_left(self._optimizer())

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer()
        self.stopped = False
        self._first_batch = True
        params = getattr(self, "params", None) or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        self.planner.cap = int(steps) * int(epochs) + 1 if steps and epochs else 1 << 20
        self.planner.start(optimizer)  # the ledger may have been restored since

    def on_train_batch_begin(self, batch, logs=None):
        if not self._first_batch:
            return
        self._first_batch = False
        if self.planner.next_steps_allowed(self._optimizer(), self._steps_per_call()):
            return
        self._stop()
        spent = self.planner.epsilon(self._optimizer().ledger.runs())
        message = (
            f"PrivacyBudget: the privacy budget epsilon={self.target_epsilon:g} at "
            f"delta={self.delta:g} is spent (ledger: {spent:.4g}); not even one more step can run"
        )
        if self.raise_if_exhausted:
            raise BudgetExhaustedError(message)
        _logger.warning("tf_dp %s", message)
        self._original_train_function = self.model.train_function
        self.model.train_function = lambda iterator: {}

    def on_train_batch_end(self, batch, logs=None):
        if not self.stopped and not self.planner.next_steps_allowed(
            self._optimizer(), self._steps_per_call()
        ):
            self._stop()

    def on_epoch_end(self, epoch, logs=None):
        optimizer = self._optimizer()
        if self.planner.steps_left(optimizer) is None:
            return  # no check yet
        self.planner.check_recorded(optimizer)
        needed = self._steps_per_call()
        if not self.stopped and not (
            self.planner.next_steps_allowed(optimizer, needed)
            and self.planner.next_pass_allowed(optimizer, needed)
        ):
            self._stop()

    def on_train_end(self, logs=None):
        if self._original_train_function is not None:
            self.model.train_function = self._original_train_function
            self._original_train_function = None
        ledger = self._optimizer().ledger
        self._spent, self._spent_steps = None, (ledger, ledger.num_samples)
        if self.stopped and self.verbose:
            from tf_dp.accounting import sampling_claims

            print(
                f"PrivacyBudget: stopped after {ledger.num_samples} DP steps "
                f"(epsilon {self.epsilon_spent:.4g} <= {self.target_epsilon:g} at "
                f"delta={self.delta:g}); one more step would exceed the budget. "
                f"{sampling_claims(ledger.runs())}"
            )

    def _stop(self) -> None:
        self.stopped = True
        self.model.stop_training = True

    @property
    def epsilon_spent(self) -> Optional[float]:
        """Epsilon of the ledger's first steps up to the end of the last ``fit`` (None before
        one ended), computed on first read."""
        if self._spent is None and self._spent_steps is not None:
            ledger, steps = self._spent_steps
            runs, left = [], steps
            for entry, count in ledger.runs():
                if left <= 0:
                    break
                runs.append((entry, min(count, left)))
                left -= count
            self._spent = self.planner.epsilon(runs)
        return self._spent

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
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
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
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        optimizer.ledger.save(
            self.ledger_path, metadata={"epoch": self._current_epoch, "backup": True}
        )
        super()._save_model()

    def _load_model(self):
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
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
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
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


class LedgerCheckpoint(keras.callbacks.Callback):
    """Saves the optimizer's ledger file alongside ``keras.callbacks.ModelCheckpoint``.

    ``filepath`` may hold ``{epoch}`` (and any ``logs`` key), formatted like ModelCheckpoint's
    (``epoch`` is 1-based). Written at each epoch end (or every ``save_freq`` batches) and at
    the end of training; the file is what ``tf_dp.accounting`` and ``compute_dp_sgd_privacy`` read.
    To resume from a ModelCheckpoint file, restore its ledger too:
    ``model.optimizer.ledger.restore_runs(tf_dp.ledger.read_ledger_runs(path))``.

    A file at ``filepath`` that records more steps than the ledger being written is not
    replaced: :class:`~tf_dp.ledger.ledger_file.LedgerOverwriteError` (naming the path and both
    step counts) stops training, e.g. a second run of a script whose earlier run wrote more
    steps there. ``overwrite=True`` replaces it anyway (only for files that do not belong to
    this data).

    The arguments are checked when the callback is made, not after an epoch of training: an
    empty ``filepath``, one that is not a format string of named fields (``{}``, ``{0}``,
    ``{epoch.x}``, an unclosed brace) or whose format specs do not apply (``{epoch:q}``), and
    ``metadata`` that is not a JSON object of finite values raise ``ValueError`` (``TypeError``
    for a wrong type). A field other than ``epoch`` must be a key of the training logs: it is
    checked at the first batch's end (``val_*`` keys at the first epoch's end).

    Example::

        callbacks = [keras.callbacks.ModelCheckpoint("ckpt/model-{epoch:02d}.keras"),
                     dp_callbacks.LedgerCheckpoint("ckpt/ledger-{epoch:02d}.json")]
    """

    def __init__(
        self,
        filepath: str,
        save_freq: Any = "epoch",
        metadata: Optional[dict] = None,
        overwrite: bool = False,
    ):
        super().__init__()
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        self.overwrite = overwrite
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(f"save_freq must be 'epoch' or an integer >= 1, got {save_freq!r}")
        self.filepath = _checked_filepath(filepath)
        self._log_keys = sorted(
            {name for _, name, _, _ in string.Formatter().parse(self.filepath) if name}
            - {"epoch"}
        )
        self.save_freq = save_freq
        self.metadata = _checked_metadata(metadata)
        self._epoch = 0
        self._batches = 0
        self._keys_checked = False
        self.last_path: Optional[str] = None

    def _check_log_keys(self, logs: Optional[dict], at_epoch_end: bool) -> None:
        missing = [
            k for k in self._log_keys
            if k not in (logs or {}) and (at_epoch_end or not k.startswith("val_"))
        ]
        if missing:
            raise ValueError(
                f"LedgerCheckpoint filepath {self.filepath!r} names {missing} but the training "
                f"logs hold {sorted(logs or {})} (and epoch): use those keys"
            )

    def _save(self, epoch: int, logs: Optional[dict]) -> None:
        optimizer = _dp_optimizer(self.model, "LedgerCheckpoint")
        self._check_log_keys(logs, at_epoch_end=True)
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        optimizer.ledger.save(
            path, metadata={**self.metadata, "epoch": epoch + 1}, overwrite=self.overwrite
        )
        self.last_path = path

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self._keys_checked:  # the first batch's logs: every key but val_*
            self._keys_checked = True
            self._check_log_keys(logs, at_epoch_end=False)
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches % self.save_freq == 0:
                self._save(self._epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, logs)

    def on_train_end(self, logs=None):
        self._save(self._epoch, logs)


def _checked_filepath(filepath: Any) -> str:
    """``filepath`` as a str, if it is a non-empty format string of named fields whose format
    specs apply to ``epoch`` (an int) and to log values (floats); else ValueError/TypeError."""
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(f"filepath must be a str or path, got {type(filepath).__name__}")
    path = os.fspath(filepath)
    if not isinstance(path, str):
        raise TypeError(f"filepath must be a str path, got {type(path).__name__}")
    if not path.strip():
        raise ValueError("filepath must be a non-empty path, e.g. 'ckpt/ledger-{epoch:02d}.json'")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(path) if f is not None]
    except ValueError as e:
        raise ValueError(
            f"filepath {path!r} is not a valid format string ({e}); write a literal brace as "
            "'{{' or '}}'"
        ) from None
    for field in fields:
        if not field.isidentifier():
            raise ValueError(
                f"filepath {path!r}: every {{field}} must be a name ('epoch' or a key of the "
                f"training logs, e.g. 'loss'), got {{{field}}}"
            )
    values = {f: (1 if f == "epoch" else 0.5) for f in fields}
    try:
        path.format(**values)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(
            f"filepath {path!r}: its format specs do not apply to epoch (an integer) and log "
            f"values (floats): {e}"
        ) from None
    return path


def _checked_metadata(metadata: Any) -> dict:
    """``metadata`` as a dict, if it is a JSON object with string keys and finite numbers."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (a JSON object), got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except ValueError as e:  # NaN or infinity
        raise ValueError(
            f"metadata must hold finite numbers only (JSON has no NaN/inf): {e}"
        ) from None
    except (TypeError, RecursionError) as e:
        raise ValueError(
            f"metadata must be JSON-serialisable (str keys; str, numbers, bools, None, lists, "
            f"dicts): {e}"
        ) from None
    if any(not isinstance(k, str) for k in metadata):
        raise ValueError(f"metadata keys must be strings, got {[k for k in metadata]!r}")
    return dict(metadata)
