"""Argument checks shared by the queries: fail early, name the argument and the accepted range."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import tensorflow as tf


def is_tensor_like(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable)) or (
        hasattr(value, "value") and hasattr(value, "assign") and not isinstance(value, np.ndarray)
    )


def check_scalar(name: str, value: Any, *, allow_zero: bool = True) -> Any:
    """Checks a clip / stddev-like argument: a finite scalar >= 0 (or > 0).

    Python numbers and numpy scalars are checked now. Tensors and variables (values that change at
    run time, e.g. a clip schedule) are checked when eager; inside graphs the run-time value is what
    the ledger records.
    """
    accepted = "a finite number >= 0" if allow_zero else "a finite number > 0"
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {accepted}, got a bool")
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__} {value!r}")
    if is_tensor_like(value):
        # Keras 3 variables report shape as a tuple and dtype as a string: normalise both.
        shape = tf.TensorShape(value.shape)
        if shape.rank not in (0, None):
            raise ValueError(f"{name} must be a scalar, got shape {shape}")
        dtype = tf.as_dtype(value.dtype)
        if not dtype.is_floating and not dtype.is_integer:
            raise TypeError(f"{name} must be a numeric scalar, got dtype {dtype.name}")
        if tf.executing_eagerly():
            try:
                v = float(tf.convert_to_tensor(value).numpy())
            except (AttributeError, TypeError, ValueError):
                return value
            _check_number(name, v, allow_zero, accepted)
        return value
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}") from None
    if np.ndim(value) != 0:
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(value)}")
    _check_number(name, v, allow_zero, accepted)
    return v


def _check_number(name: str, v: float, allow_zero: bool, accepted: str) -> None:
    if math.isnan(v) or math.isinf(v) or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"{name} must be {accepted}, got {v}")
