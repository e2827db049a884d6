"""Clip and noise schedules for the DP optimizers.

``l2_norm_clip``, ``noise_multiplier`` and ``noise_stddev`` of every DP optimizer accept a number
or a *schedule*: any callable ``step -> float``, called like a Keras learning-rate schedule with
the optimizer's step count (``optimizer.iterations``, a scalar ``int64`` tensor) at the start of
every DP step, inside the compiled train step (so it must use TensorFlow ops, e.g. ``tf.where``
rather than a Python ``if`` on the step). Every ``keras.optimizers.schedules.LearningRateSchedule``
is such a callable. The ledger records the clip and noise each step actually used.

:class:`DecreasingClip` is the decreasing clip bound of "Improving gradient perturbation with
momentum and decreasing clip" (2019).

Example::

    clip = tf_dp.keras.schedules.DecreasingClip(initial_clip=4.0, decay_steps=2000)
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_stddev=6.0,
                                          learning_rate=0.1, momentum=0.6)
"""

from __future__ import annotations

import math
from typing import Any

import keras
import numpy as np
import tensorflow as tf

__all__ = ["DecreasingClip"]


def _positive_number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a finite number > 0, got {type(value).__name__}")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")
    return float(value)


@keras.saving.register_keras_serializable(package="tf_dp", name="DecreasingClip")
class DecreasingClip(keras.optimizers.schedules.LearningRateSchedule):
    """Clip bound that decreases linearly in its denominator down to a floor.

    ``C_t = C / min(1 / floor_fraction, 1 + t / T)`` at step ``t``, with ``C = initial_clip`` and
    ``T = decay_steps``: the clip falls from ``C`` to ``floor_fraction * C`` at step
    ``T * (1 / floor_fraction - 1)`` and stays there. With the default ``floor_fraction=0.5`` this
    is ``C_t = C / min(2, 1 + t / T)``, the schedule of "Improving gradient perturbation with
    momentum and decreasing clip" (2019, Sec. 3, "Adjusting the gradient norm clip bound"), where
    ``T`` is the total number of steps: the clip reaches ``C / 2`` at the last step.

    Gradients shrink as training converges, so a smaller clip loses little signal; used with a
    fixed noise standard deviation (``noise_stddev=`` of the DP optimizers, the paper's setting),
    the effective noise multiplier ``sigma / C_t`` grows and each later step costs less privacy,
    so more steps fit in a budget. (With ``noise_multiplier=`` the noise shrinks with the clip and
    every step costs the same.)

    Args:
      initial_clip: ``C``, the clip at step 0 (finite, > 0).
      decay_steps: ``T`` (finite, > 0).
      floor_fraction: the smallest clip as a fraction of ``C``, in (0, 1] (1: constant clip).

    Example::

        clip = DecreasingClip(initial_clip=4.0, decay_steps=1000)
        float(clip(0)), float(clip(500)), float(clip(1000)), float(clip(5000))  # 4, 2.667, 2, 2
    """

    def __init__(self, initial_clip: float, decay_steps: float, floor_fraction: float = 0.5):
        super().__init__()
        self.initial_clip = _positive_number("initial_clip", initial_clip)
        self.decay_steps = _positive_number("decay_steps", decay_steps)
        floor = _positive_number("floor_fraction", floor_fraction)
        if floor > 1:
            raise ValueError(f"floor_fraction must be in (0, 1], got {floor_fraction}")
        self.floor_fraction = floor

    def __call__(self, step: Any) -> tf.Tensor:
        t = tf.cast(step, tf.float32)
        denominator = tf.minimum(
            tf.constant(1.0 / self.floor_fraction, tf.float32), 1.0 + t / self.decay_steps
        )
        return tf.constant(self.initial_clip, tf.float32) / denominator

    def numpy_values(self, steps: Any) -> np.ndarray:
        """The clip at each of ``steps`` (an array of step numbers), in numpy: the float32
        values the TensorFlow call gives, without TensorFlow (``PrivacyBudget`` predicts the
        next steps' ledger entries with it).

        Example::

            DecreasingClip(4.0, 1000).numpy_values(np.arange(3))  # float32 [4.0, 3.996, 3.992]
        """
        t = np.asarray(steps).astype(np.float32)
        denominator = np.minimum(np.float32(1.0 / self.floor_fraction),
                                 np.float32(1.0) + t / np.float32(self.decay_steps))
        return np.float32(self.initial_clip) / denominator

    def get_config(self) -> dict[str, Any]:
        return {
            "initial_clip": self.initial_clip,
            "decay_steps": self.decay_steps,
            "floor_fraction": self.floor_fraction,
        }

    def __repr__(self) -> str:
        return (
            f"DecreasingClip(initial_clip={self.initial_clip:g}, decay_steps={self.decay_steps:g}, "
            f"floor_fraction={self.floor_fraction:g})"
        )
