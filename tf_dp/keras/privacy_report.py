"""``PrivacyReport``: epsilon spent so far in each epoch's ``logs`` (``History``, TensorBoard)."""

from __future__ import annotations

import os
from typing import Any

import keras

from tf_dp.engine.budget import check_accountant, check_delta, compute_epsilon
from tf_dp.keras.callback_common import check_can_analyse_fit, dp_optimizer

__all__ = ["PrivacyReport"]


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
        self.delta = check_delta(delta)
        self.accountant = check_accountant(accountant)
        self.log_key = log_key
        self.verbose = verbose
        self.statements: list[str] = []
        # TensorBoard callbacks that run before this one at each epoch end, and our writers to them
        self._tensorboards_before: list[Any] = []
        self._writers: dict[str, Any] = {}

    def on_train_begin(self, logs=None):
        optimizer = dp_optimizer(self.model, "PrivacyReport")
        check_can_analyse_fit(optimizer, self.delta, self.accountant, "PrivacyReport")
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
        ledger = dp_optimizer(self.model, "PrivacyReport").ledger
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
