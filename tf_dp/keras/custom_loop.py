"""DP training in a custom loop: :class:`DPTrainStep`, the step ``fit`` runs, called by you.

A ``DPTrainStep`` runs the same DP step as ``model.fit`` of a private model (the optimizer's
:class:`~tf_dp.engine.DPEngine`: clip per example, noise and record in the optimizer's ledger,
divide by the public denominator, apply with the DP optimizer), on a batch your loop chose.
Call it inside your own ``tf.function`` (``jit_compile=True`` works), under a
``tf.distribute`` strategy's ``run``, or eagerly; mixed precision behaves as in ``fit``.

The ledger needs to know how your batches are drawn: pass ``sampling=`` (a
:class:`tf_dp.engine.Sampling`; a tf_dp sampler's ``.sampling``) or call
``optimizer.set_sampling(...)`` first. Call :meth:`DPTrainStep.start_pass` where your loop starts
a new pass over its data, and :meth:`DPTrainStep.flush` after every call of a compiled function
(it moves the steps recorded inside it into the ledger and reports withheld steps).

Your ``tf.function`` traces the step for the unit of privacy declared at that moment (examples,
or users of ``k`` records). After declaring another unit or ``k``, wrap the step in a new
``tf.function``: the old one records and applies nothing and fails (``InvalidArgumentError`` from
the call, or ``ValueError`` from the next :meth:`DPTrainStep.flush` under ``jit_compile=True``).

Example::

    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(2)])
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                          learning_rate=0.1)
    dp_step = tf_dp.keras.DPTrainStep(
        model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling=tf_dp.engine.Sampling(len(x), 32 / len(x), policy="shuffle"))

    @tf.function(jit_compile=True)
    def train(x, y):
        return dp_step(x, y)                  # the mean loss; the update is applied

    for epoch in range(3):
        dp_step.start_pass()
        for xb, yb in dataset:                # fixed-size batches of 32, shuffled each epoch
            loss = train(xb, yb)
            dp_step.flush()
    tf_dp.accounting.compute_epsilon(opt.ledger, delta=1e-5)
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf

from tf_dp.engine import Sampling
from tf_dp.keras.losses import PerExampleLoss
from tf_dp.keras.compatibility import check_model_is_dp_compatible
from tf_dp.keras.models import private_step
from tf_dp.keras.optimizers import DPOptimizerMixin

__all__ = ["DPTrainStep"]


class DPTrainStep:
    """One DP step of ``model`` with ``optimizer``, for custom training loops.

    Args:
      model: any Keras model (it need not be made private or compiled).
      optimizer: a tf_dp DP optimizer; its ledger records every step.
      loss: the loss (a name, a ``keras.losses.Loss`` or a function ``(y_true, y_pred) ->
        per-example values``); None: the model's compiled loss.
      sampling: how your loop draws its batches (a :class:`tf_dp.engine.Sampling`); None: the
        optimizer's declaration (``optimizer.set_sampling(...)``), required before the first call.

    Calling it with ``(x, y, sample_weight=None)`` runs one DP step, applies the update and
    returns the mean loss of the batch's records (rows of sample weight 0 left out).
    """

    def __init__(
        self,
        model: keras.Model,
        optimizer: DPOptimizerMixin,
        loss: Any = None,
        sampling: Optional[Sampling] = None,
    ) -> None:
        if not isinstance(model, keras.Model):
            raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
        if not isinstance(optimizer, DPOptimizerMixin):
            raise TypeError(
                "optimizer must be a tf_dp DP optimizer (e.g. tf_dp.keras.DPKerasSGDOptimizer), "
                f"got {type(optimizer).__name__}"
            )
        if sampling is not None and not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a tf_dp.engine.Sampling or None, got {sampling!r}")
        check_model_is_dp_compatible(model)
        self._loss_fn = PerExampleLoss(model, loss=loss)
        self.model, self.optimizer = model, optimizer
        optimizer.check_ledger_covers_steps()
        if sampling is not None:
            optimizer.set_sampling(sampling)
        optimizer.engine.reserve(1)  # room for one step between flushes (XLA, replicas)

    def __call__(self, x: Any, y: Any, sample_weight: Any = None) -> tf.Tensor:
        if not self.optimizer.sampling_configured:
            raise ValueError(
                "DPTrainStep needs to know how batches are drawn: pass sampling="
                "tf_dp.engine.Sampling(population_size, selection_probability, policy) or call "
                "optimizer.set_sampling(...) first"
            )
        mean_loss, _, _ = private_step(
            self.model, self.optimizer, self._loss_fn, x, y, sample_weight
        )
        return mean_loss

    def start_pass(self) -> None:
        """Marks the next step as the first of a new pass over the data (eager)."""
        self.optimizer.start_pass()

    def flush(self) -> None:
        """After each call of a compiled function: moves its recorded steps into the ledger,
        raises if a step met a non-finite clip or noise, logs withheld steps (eager). Under
        ``jit_compile=True`` it also draws the next step's noise outside XLA, faster than XLA
        draws it (:class:`tf_dp.dp_query.noise.PrefetchedNoise`)."""
        self.optimizer.after_compiled_call()
        self.optimizer.engine.prefetch_noise()
