"""Checks of the DP step's arguments, in one place: each names the argument and its range.

Every check runs before anything is built, run or recorded (invariant 6). The engine's
configuration (:mod:`tf_dp.engine.config`) calls them once, when it is built; the schedule
helpers also serve the step, which evaluates clip and noise schedules at every step.

Example:

>>> from tf_dp.engine import validation
>>> validation.check_number("l2_norm_clip", 1.0, positive=True)
>>> validation.check_number("l2_norm_clip", 0.0, positive=True)
Traceback (most recent call last):
...
ValueError: l2_norm_clip must be a finite number > 0, got 0.0
"""

from __future__ import annotations

import math
from typing import Any, Optional

import numpy as np
import tensorflow as tf

_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


def python_number(value: Any) -> Any:
    """A numpy scalar (``np.float32(1.0)``, ``np.int64(2)``, a 0-d array) as the Python number of
    the same value; anything else unchanged (checked by :func:`check_number`)."""
    if isinstance(value, np.number) or (
        isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.number)
    ):
        return value.item()
    return value


def check_number(name: str, value: Any, positive: bool) -> None:
    """A finite Python number, > 0 (``positive``) or >= 0; TypeError / ValueError naming ``name``."""
    accepted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    if math.isnan(value) or math.isinf(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {accepted}, got {value}")


def check_float32(name: str, value: float) -> None:
    """The step computes in float32: a value it cannot represent (overflow to inf, or a positive
    value that rounds to 0 or loses its precision) is refused, naming the float32 range."""
    if value != 0 and not _F32_TINY <= value <= _F32_MAX:
        raise ValueError(
            f"{name} must be 0 or in [{_F32_TINY:.4g}, {_F32_MAX:.4g}] (the float32 range the "
            f"step computes in), got {value:g}"
        )


#: Largest count of batch rows or pieces (a batch dimension is an int32 in TensorFlow).
MAX_BATCH_COUNT = 2**31 - 1


def check_count(name: str, value: Any, minimum: int = 1, optional: bool = True) -> None:
    """None (when ``optional``) or an integer in [``minimum``, 2**31 - 1]."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not (
        minimum <= value <= MAX_BATCH_COUNT
    ):
        none = "None or " if optional else ""
        shown = value if not isinstance(value, int) or abs(value) < 10**20 else (
            f"about {float(value):.3g}")
        raise ValueError(
            f"{name} must be {none}an integer in [{minimum}, 2**31 - 1], got {shown!r}")


def check_seed(name: str, value: Any) -> None:
    """None or an integer with ``|value| <= 2**53`` (the ledger records seeds exactly in a
    float64 column)."""
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or abs(value) > 2**53:
        raise ValueError(f"{name} must be None or an integer with |{name}| <= 2**53, got {value!r}")


def is_schedule(value: Any) -> bool:
    """Whether ``value`` is a schedule: a callable ``step -> value`` (not a class)."""
    return callable(value) and not isinstance(value, type)


def number_or_schedule(value: Any) -> Any:
    """None, a schedule, or the value as a Python float."""
    if value is None or is_schedule(value):
        return value
    return float(value)


def check_schedule_arg(name: str, value: Any, positive: bool) -> None:
    """A number in range, or a schedule (a callable ``step -> value``)."""
    if is_schedule(value):
        return
    accepted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be {accepted} or a schedule (a callable step -> value, e.g. a "
            f"keras.optimizers.schedules.LearningRateSchedule), got {type(value).__name__}"
        )
    check_number(name, value, positive)


def _evaluate(name: str, value: Any, step: tf.Tensor) -> tf.Tensor:
    """A number or a schedule's value at ``step``, as a float32 scalar tensor."""
    if not is_schedule(value):
        return tf.constant(float(value), tf.float32)
    try:
        out = tf.convert_to_tensor(value(step))
    except Exception as e:  # noqa: BLE001 -- name the argument, keep the cause
        raise TypeError(
            f"the {name} schedule {value!r} could not be evaluated at a step (it is called with "
            f"the step count, a scalar int64 tensor, and must use TensorFlow ops): {e}"
        ) from e
    if out.shape.rank not in (0, None):
        raise ValueError(f"the {name} schedule must return a scalar, got shape {out.shape}")
    if not (out.dtype.is_floating or out.dtype.is_integer):
        raise TypeError(f"the {name} schedule must return a number, got dtype {out.dtype.name}")
    return tf.reshape(tf.cast(out, tf.float32), [])


def schedule_values(clip: Any, noise_multiplier: Any, noise_stddev: Any, step: tf.Tensor):
    """``(clip, noise argument, noise stddev)`` at ``step`` as float32 tensors; the stddev is
    ``noise_multiplier * clip`` or ``noise_stddev``."""
    c = _evaluate("l2_norm_clip", clip, step)
    if noise_stddev is None:
        noise = _evaluate("noise_multiplier", noise_multiplier, step)
        return c, noise, noise * c
    noise = _evaluate("noise_stddev", noise_stddev, step)
    return c, noise, noise


def _evaluate_numpy(value: Any, steps: np.ndarray) -> Optional[np.ndarray]:
    """A number or a schedule's values at ``steps`` as float32, in numpy, or None when the
    schedule has no numpy path (a ``numpy_values(steps)`` method giving what its TensorFlow
    call gives)."""
    if not is_schedule(value):
        return np.full(steps.shape, np.float32(value), np.float32)
    numpy_values = getattr(value, "numpy_values", None)
    if numpy_values is None:
        return None
    return np.asarray(numpy_values(steps), np.float32).reshape(steps.shape)


def schedule_values_numpy(clip: Any, noise_multiplier: Any, noise_stddev: Any,
                          steps: np.ndarray) -> Optional[tuple[np.ndarray, ...]]:
    """:func:`schedule_values` at many ``steps`` at once, in numpy (float32, the same values),
    or None when a schedule has no numpy path (``numpy_values``)."""
    c = _evaluate_numpy(clip, steps)
    noise = _evaluate_numpy(
        noise_multiplier if noise_stddev is None else noise_stddev, steps)
    if c is None or noise is None:
        return None
    return c, noise, (noise * c if noise_stddev is None else noise)


def values_in_range(clip: tf.Tensor, noise: tf.Tensor, std: tf.Tensor) -> tf.Tensor:
    """A bool tensor: clip finite > 0, noise and stddev finite >= 0."""
    finite = tf.logical_and(tf.math.is_finite(clip), tf.math.is_finite(noise))
    finite = tf.logical_and(finite, tf.math.is_finite(std))
    return tf.logical_and(finite, tf.logical_and(clip > 0, tf.logical_and(noise >= 0, std >= 0)))


def raise_if_out_of_range(noise_name: str, step: int, clip, noise, std) -> None:
    """Eagerly: ValueError naming the schedule and the step when a value is out of range
    (tensors or numbers)."""
    c, z, s = (float(v.numpy() if hasattr(v, "numpy") else v) for v in (clip, noise, std))
    if not (math.isfinite(c) and c > 0):
        raise ValueError(
            f"the l2_norm_clip schedule gave {c} at step {step}; the clip must be a finite "
            "number > 0"
        )
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(
            f"the {noise_name} schedule gave {z} at step {step}; {noise_name} must be a finite "
            "number >= 0"
        )
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(
            f"the noise stddev at step {step} ({noise_name} {z} x clip {c}) is {s}; it must be "
            "a finite number >= 0"
        )


def check_clip_and_noise(clip: Any, noise_multiplier: Any, noise_stddev: Any) -> None:
    """``l2_norm_clip`` with exactly one of ``noise_multiplier`` and ``noise_stddev``, each a
    number in range or a schedule whose value at step 0 is in range."""
    if clip is None:
        raise ValueError(
            "pass l2_norm_clip (a finite number > 0 or a schedule) with exactly one of "
            "noise_multiplier and noise_stddev, or an explicit dp_sum_query"
        )
    both = "pass exactly one of noise_multiplier (noise stddev relative to the clip: " \
        "noise_multiplier * l2_norm_clip) and noise_stddev (absolute noise stddev)"
    if noise_multiplier is None and noise_stddev is None:
        raise ValueError(f"{both}; got neither")
    if noise_multiplier is not None and noise_stddev is not None:
        raise ValueError(f"{both}, not both")
    noise_name = "noise_multiplier" if noise_stddev is None else "noise_stddev"
    noise = noise_multiplier if noise_stddev is None else noise_stddev
    if is_schedule(clip) or is_schedule(noise):
        check_schedule_arg("l2_norm_clip", clip, positive=True)
        check_schedule_arg(noise_name, noise, positive=False)
        # evaluated now at step 0: a schedule that fails or is out of range fails here
        c0, z0, s0 = schedule_values(clip, noise_multiplier, noise_stddev, tf.constant(0, tf.int64))
        raise_if_out_of_range(noise_name, 0, c0, z0, s0)
        return
    check_number("l2_norm_clip", clip, positive=True)
    check_number(noise_name, noise, positive=False)
    check_float32("l2_norm_clip", float(clip))
    check_float32(noise_name, float(noise))
    if noise_stddev is None:
        check_float32(
            "noise_multiplier * l2_norm_clip (the noise stddev)", float(noise) * float(clip)
        )


def check_gradient_options(
    gradient_mode: str,
    modes: tuple[str, ...],
    jl_projections: Optional[int],
    jl_method: str,
    jl_methods: tuple[str, ...],
) -> None:
    """The gradient mode is registered; JL options only (and always) with ``'jl'``."""
    if gradient_mode not in modes:
        raise ValueError(f"gradient_mode must be one of {modes}, got {gradient_mode!r}")
    if gradient_mode == "jl":
        if (
            isinstance(jl_projections, bool)
            or not isinstance(jl_projections, int)
            or jl_projections < 1
        ):
            raise ValueError(
                "gradient_mode='jl' needs jl_projections, an integer >= 1 "
                f"(got {jl_projections!r})"
            )
        if jl_method not in jl_methods:
            raise ValueError(f"jl_method must be one of {jl_methods}, got {jl_method!r}")
    elif jl_projections is not None:
        raise ValueError("jl_projections is only used with gradient_mode='jl'")
    elif jl_method != "auto":
        raise ValueError("jl_method is only used with gradient_mode='jl'")


def check_microbatch_options(
    gradient_mode: str, num_microbatches: Optional[int], max_physical_batch_size: Optional[int]
) -> None:
    """Microbatches only with ``'microbatch'`` / ``'auto'`` (and always with ``'microbatch'``);
    physical batches only on per-example paths."""
    if gradient_mode == "microbatch" and num_microbatches is None:
        raise ValueError("gradient_mode='microbatch' needs num_microbatches (an integer >= 1)")
    if num_microbatches is not None and gradient_mode not in ("microbatch", "auto"):
        raise ValueError(
            f"num_microbatches is only used with gradient_mode='microbatch' or 'auto', "
            f"got gradient_mode={gradient_mode!r}"
        )
    if max_physical_batch_size is not None and (
        num_microbatches is not None or gradient_mode in ("microbatch", "jl")
    ):
        raise ValueError(
            "max_physical_batch_size splits a batch of per-example gradients; it cannot be "
            f"combined with gradient_mode={gradient_mode!r} / num_microbatches="
            f"{num_microbatches!r} (use 'auto', 'vectorized' or 'ghost' without microbatches)"
        )
