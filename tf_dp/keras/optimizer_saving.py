"""How a DP optimizer is saved and rebuilt: its ledger travels with the model, and its Keras
config carries the privacy parameters.

:class:`OptimizerSaving` is a base class of every DP optimizer
(:class:`tf_dp.keras.optimizers.DPOptimizerMixin`): the ledger goes into the optimizer's saved
variables (``.keras`` files, ``save_weights``, ``BackupAndRestore``, ``ModelCheckpoint``) with a
checksum, and ``get_config`` / ``from_config`` carry the clip, the noise (numbers or schedules)
and an explicit query.

Example::

    model.save("model.keras")                       # weights, optimizer state and ledger
    restored = keras.saving.load_model("model.keras")
    restored.optimizer.ledger.num_steps             # the steps trained before saving
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from tf_dp.dp_query.serialization import deserialize_query, serialize_query
from tf_dp.engine.validation import is_schedule
from tf_dp.keras import ledger_store


__all__ = ["OptimizerSaving"]


class OptimizerSaving:
    """Saving, loading and Keras config of a DP optimizer (a base of ``DPOptimizerMixin``; it
    reads the optimizer's engine)."""

    # -- the ledger travels with the model ------------------------------------------------------

    def save_own_variables(self, store) -> None:
        """Saves the optimizer's variables and its ledger with its checksum (``.keras`` files,
        ``save_weights``, ``keras.callbacks.BackupAndRestore`` and ``ModelCheckpoint`` all go
        through here)."""
        super().save_own_variables(store)  # type: ignore[misc]
        ledger_store.write_ledger(store, *self._engine.ledger.run_tables())  # type: ignore

    def load_own_variables(self, store) -> None:
        """Restores the optimizer's variables and its ledger (see :meth:`restore_ledger_tables`).

        The ledger's checksum is checked first: a saved ledger that was corrupted or edited
        raises :class:`tf_dp.ledger.LedgerFileError` before anything is restored. Tables saved
        without a checksum (earlier versions) load with ``ledger.verified`` False. Trained
        variables (``iterations`` > 0) saved without any ledger leave the ledger's
        ``missing_steps`` positive: the privacy spent is unknown, never zero.
        """
        stored = ledger_store.read_ledger(store)
        if stored is not None:
            self.restore_ledger_tables(*stored)
        super().load_own_variables(ledger_store.without_ledger(store))  # type: ignore[misc]
        self._engine.ledger.expect_trained_steps(  # type: ignore[attr-defined]
            int(self.iterations.numpy())  # type: ignore[attr-defined]
        )

    def restore_ledger_tables(
        self, samples: np.ndarray, queries: np.ndarray, verified: bool = True
    ) -> None:
        """Restores a saved ledger (tables from ``ledger.tables()``), never losing steps."""
        self._engine.restore_ledger_tables(samples, queries, verified)  # type: ignore

    def inherit_ledger(self, previous: "OptimizerSaving") -> None:
        """Continues ``previous``'s ledger (a private model recompiled with a new DP optimizer)."""
        self._engine.continue_ledger(  # type: ignore[attr-defined]
            previous.engine, int(previous.iterations.numpy())  # type: ignore[attr-defined]
        )

    def check_ledger_covers_steps(self) -> None:
        """Raises if the optimizer applied more steps than its ledger records (e.g. a model
        reloaded from a file without its ledger): the budget would ignore steps taken."""
        self._engine.check_ledger_covers(int(self.iterations.numpy()))  # type: ignore

    # -- Keras config ----------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Keras config. With ``dp_sum_query``, the query's config (``serialize_query``: the
        Gaussian, automatic, adaptive, nested and normalized queries; an adaptive query's current
        clip included); NotImplementedError naming the query class for the others."""
        config = super().get_config()  # type: ignore[misc]
        engine = self._engine  # type: ignore[attr-defined]
        privacy, speed = engine.privacy, engine.speed
        if self._custom_query:  # type: ignore[attr-defined]
            config["dp_sum_query"] = serialize_query(engine.query)
        config.update(
            {
                "l2_norm_clip": _serialize_value(privacy.l2_norm_clip),
                "noise_multiplier": _serialize_value(privacy.noise_multiplier),
                "noise_stddev": _serialize_value(privacy.noise_stddev),
                "num_microbatches": privacy.num_microbatches,
                "gradient_mode": speed.gradient_mode,
                "jl_projections": speed.jl_projections,
                "jl_method": speed.jl_method,
                "max_physical_batch_size": speed.max_physical_batch_size,
                "noise_mode": privacy.noise_mode,
            }
        )
        if privacy.sparse_embeddings is not None:
            config["sparse_embeddings"] = privacy.sparse_embeddings.get_config()
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None):
        """Rebuilds the optimizer; clip and noise schedules are deserialised like Keras's
        learning-rate schedules."""
        config = dict(config)
        if isinstance(config.get("dp_sum_query"), dict):
            config["dp_sum_query"] = deserialize_query(config["dp_sum_query"])
        if isinstance(config.get("sparse_embeddings"), dict):
            from tf_dp.dp_query.partition_selection import SparseEmbeddingConfig

            config["sparse_embeddings"] = SparseEmbeddingConfig.from_config(
                config["sparse_embeddings"])
        for key in ("l2_norm_clip", "noise_multiplier", "noise_stddev"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        return super().from_config(config, custom_objects=custom_objects)  # type: ignore[misc]


def _serialize_value(value: Any) -> Any:
    """Numbers as they are; schedules as Keras serialises learning-rate schedules."""
    if value is None or not is_schedule(value):
        return value
    return keras.saving.serialize_keras_object(value)
