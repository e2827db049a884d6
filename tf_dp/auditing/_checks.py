"""Argument checks shared by the auditing estimators (numpy only)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def probability(name: str, value: Any, *, allow_zero: bool = False) -> float:
    """``value`` as a float in (0, 1) (or [0, 1) with ``allow_zero``), else ``ValueError``."""
    ok = isinstance(value, (int, float, np.floating)) and not isinstance(value, bool)
    low_ok = ok and (value >= 0.0 if allow_zero else value > 0.0)
    if not (ok and low_ok and value < 1.0 and math.isfinite(value)):
        interval = "[0, 1)" if allow_zero else "(0, 1)"
        raise ValueError(f"{name} must be a number in {interval}, got {value!r}")
    return float(value)


def percent(level: float) -> str:
    """A confidence level as a percentage to 0.01%, rounded down (not to overstate it): 0.95 ->
    "95%", 0.975 -> "97.5%", 1 - 0.05 / 3 -> "98.33%"."""
    return f"{math.floor(level * 1e4 + 1e-6) / 100:g}%"


def scores_and_labels(scores: Any, included: Any) -> tuple[np.ndarray, np.ndarray]:
    """1-D float scores and boolean inclusion flags of the same length, both classes present."""
    s = np.asarray(scores, dtype=np.float64)
    b = np.asarray(included)
    if s.ndim != 1 or b.shape != s.shape:
        raise ValueError(
            f"scores and included must be 1-D arrays of the same length, got shapes {s.shape} "
            f"and {b.shape}"
        )
    if not np.all(np.isfinite(s)):
        raise ValueError("scores must be finite numbers")
    if b.dtype != bool:
        if not np.all(np.isin(b, (0, 1))):
            raise ValueError("included must hold booleans (or 0/1): True for a canary trained on")
        b = b.astype(bool)
    if b.all() or not b.any():
        raise ValueError("included must mark at least one canary in and one out")
    return s, b
