"""``PrivacyBudget``: ``fit`` stops before the step that would spend more than the budget (a thin
adaptor over :class:`tf_dp.engine.BudgetPlanner`, which custom loops use directly)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, Optional

import keras

from tf_dp.engine.budget import BudgetExhaustedError, BudgetPlanner
from tf_dp.keras.callback_common import dp_optimizer
from tf_dp.ledger.events import SampleEntry

__all__ = ["PrivacyBudget"]

_logger = logging.getLogger("tf_dp")


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
        return dp_optimizer(self.model, "PrivacyBudget")

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
