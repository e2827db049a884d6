"""What a DP optimizer was configured with, read from its engine: the privacy parameters, the
speed knobs, the ledger, the clipper and the clip / noise schedules.

:class:`OptimizerSettings` is a base class of every DP optimizer
(:class:`tf_dp.keras.optimizers.DPOptimizerMixin`); the engine
(:class:`tf_dp.engine.DPEngine`) holds the values, these properties read them.

Example::

    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1)
    opt.l2_norm_clip, opt.noise_multiplier          # (1.0, 1.1)
    opt.dp_values_at(0)                             # (clip, noise stddev) of step 0
"""

from __future__ import annotations

import warnings
from typing import Any, Optional

from tf_dp.engine import DPEngine
from tf_dp.gradients import GradientClipper
from tf_dp.ledger.privacy_ledger import PrivacyLedger
from tf_dp.ledger.query_with_ledger import QueryWithLedger


__all__ = ["OptimizerSettings"]


class OptimizerSettings:
    """Read-only settings and schedules of a DP optimizer (a base of ``DPOptimizerMixin``; it
    reads the optimizer's engine)."""

    _engine: DPEngine

    @property
    def engine(self) -> DPEngine:
        """The :class:`~tf_dp.engine.DPEngine` that runs this optimizer's DP steps."""
        return self._engine

    @property
    def ledger(self) -> PrivacyLedger:
        """The :class:`~tf_dp.PrivacyLedger` this optimizer records every DP step in."""
        return self._engine.ledger

    @property
    def dp_query(self) -> QueryWithLedger:
        return self._engine.recorder

    @property
    def _dp_global_state(self) -> Any:
        return self._engine.global_state

    @property
    def gradient_mode(self) -> str:
        return self._engine.speed.gradient_mode

    @property
    def noise_multiplier(self) -> Any:
        """The ``noise_multiplier`` given (a number or a schedule), or None."""
        return self._engine.privacy.noise_multiplier

    @property
    def noise_stddev(self) -> Any:
        """The absolute ``noise_stddev`` given (a number or a schedule), or None."""
        return self._engine.privacy.noise_stddev

    @property
    def l2_norm_clip(self) -> Any:
        """The ``l2_norm_clip`` given (a number or a schedule), or None (explicit query)."""
        return self._engine.privacy.l2_norm_clip

    @property
    def max_physical_batch_size(self) -> Optional[int]:
        """Examples clipped at once (``None``: the whole sampled batch)."""
        return self._engine.speed.max_physical_batch_size

    @property
    def num_microbatches(self) -> Optional[int]:
        return self._engine.privacy.num_microbatches

    @property
    def noise_seed(self) -> Optional[int]:
        """The explicit noise seed (tests and debugging; it voids the guarantee), or None."""
        return self._engine.privacy.noise_seed

    @property
    def gradient_clipper(self) -> Optional[GradientClipper]:
        """The gradient clipper in use (resolved from ``gradient_mode`` on the first step)."""
        return self._engine.clipper

    @property
    def gradient_strategy(self) -> Optional[GradientClipper]:
        """Deprecated name of :attr:`gradient_clipper`."""
        warnings.warn(
            "DP optimizers' gradient_strategy is deprecated; use gradient_clipper",
            DeprecationWarning, stacklevel=2,
        )
        return self.gradient_clipper

    @property
    def has_dp_schedules(self) -> bool:
        """True when the clip or the noise is a schedule (values set at every step)."""
        return self._engine.has_schedules

    def dp_values_at(self, step: int) -> tuple[float, float]:
        """``(clip, noise stddev)`` of the step numbered ``step`` (``optimizer.iterations`` when
        it runs), computed eagerly; ValueError naming the argument when out of range."""
        return self._engine.values_at(step)

    def update_dp_schedules(self) -> None:
        """Sets the query's clip and noise to the schedules' values at ``self.iterations``."""
        self._engine.update_schedules(self.iterations)  # type: ignore[attr-defined]

    def check_dp_schedules(self, steps: int = 1) -> None:
        """Eagerly checks the schedules' values for the next ``steps`` steps (``fit`` calls it
        before every compiled call, so a bad value fails before anything runs, also under XLA)."""
        if not self._engine.has_schedules:
            return
        first = int(self.iterations.numpy())  # type: ignore[attr-defined]
        for step in range(first, first + max(1, int(steps))):
            self._engine.values_at(step)

    def clipper_for(self, model: Any) -> GradientClipper:
        """Resolves (once) the gradient clipper for ``model``."""
        return self._engine.clipper_for(model)
