"""``LedgerCheckpoint``: the ledger file written beside ``keras.callbacks.ModelCheckpoint``'s."""

from __future__ import annotations

import json
import os
import string
from typing import Any, Optional

import keras

from tf_dp.keras.callback_common import dp_optimizer

__all__ = ["LedgerCheckpoint"]


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
        optimizer = dp_optimizer(self.model, "LedgerCheckpoint")
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
