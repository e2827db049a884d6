"""What tf_dp's Keras callbacks share: the DP optimizer of the model they serve, and the check
that an accountant can analyse the run before it starts."""

from __future__ import annotations

import keras

from tf_dp.engine.budget import check_can_analyse
from tf_dp.keras.optimizers import DPOptimizerMixin

__all__: list[str] = []


def dp_optimizer(model: keras.Model, who: str):
    """``model.optimizer`` if it is a tf_dp DP optimizer, else TypeError naming ``who``."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not isinstance(optimizer, DPOptimizerMixin):
        raise TypeError(
            f"{who} needs a model compiled with a tf_dp DP optimizer (e.g. "
            f"tf_dp.keras.DPKerasSGDOptimizer), got {type(optimizer).__name__}"
        )
    return optimizer


def check_can_analyse_fit(optimizer, delta: float, accountant: str, who: str) -> None:
    """Fails at the start of ``fit``, not after an epoch, when ``accountant`` cannot analyse the
    ledger as it will be after one more step (e.g. JL steps with ``accountant="rdp"``)."""
    check_can_analyse(optimizer.engine, int(optimizer.iterations.numpy()), delta, accountant, who)
