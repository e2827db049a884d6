"""Noise allocation across groups of a nested query (McMahan et al. 2018, section 4).

Given per-group clips ``S_g`` and a target overall noise multiplier ``z`` (the effective multiplier
of Eq. (1)), these return per-group noise standard deviations ``sigma_g`` such that
``(sum_g (S_g / sigma_g)^2)^(-1/2) == z``:

- proportional: ``sigma_g = z * sqrt(G) * S_g`` (every group gets the same noise-to-clip ratio);
- dimensionality-adjusted: ``sigma_g = z * sqrt(D / d_g) * S_g`` with ``d_g`` the number of
  parameters of group ``g`` and ``D = sum_g d_g`` (larger groups get relatively less noise).

Example (per-layer clipping with proportional allocation)::

    clips = [1.0, 0.5]
    stddevs = tf_dp.proportional_noise_allocation(noise_multiplier=1.1, l2_norm_clips=clips)
    query = tf_dp.NestedQuery(
        [tf_dp.GaussianSumQuery(c, s) for c, s in zip(clips, stddevs)])
"""

from __future__ import annotations

import math
from typing import Any

import tensorflow as tf

from tf_dp.dp_query.validation import check_scalar


def _clips(l2_norm_clips: Any) -> list[float]:
    leaves = tf.nest.flatten(l2_norm_clips)
    if not leaves:
        raise ValueError("l2_norm_clips must contain at least one clip")
    return [check_scalar(f"l2_norm_clips[{i}]", c, allow_zero=False) for i, c in enumerate(leaves)]


def proportional_noise_allocation(noise_multiplier: float, l2_norm_clips: Any) -> Any:
    """Returns ``z * sqrt(G) * S_g`` for every clip, in the structure of ``l2_norm_clips``.

    Example (two groups, clips 3 and 4):

    >>> from tf_dp.dp_query import proportional_noise_allocation
    >>> [round(s, 4) for s in proportional_noise_allocation(1.0, [3.0, 4.0])]
    [4.2426, 5.6569]
    """
    z = check_scalar("noise_multiplier", noise_multiplier)
    clips = _clips(l2_norm_clips)
    g = len(clips)
    return tf.nest.pack_sequence_as(l2_norm_clips, [z * math.sqrt(g) * c for c in clips])


def dimension_adjusted_noise_allocation(
    noise_multiplier: float, l2_norm_clips: Any, dimensions: Any
) -> Any:
    """Returns ``z * sqrt(D / d_g) * S_g`` for every clip, in the structure of ``l2_norm_clips``.

    ``dimensions`` has the structure of ``l2_norm_clips``; each leaf is a positive integer
    ``d_g`` (or a tensor/variable whose number of elements is used).
    """
    z = check_scalar("noise_multiplier", noise_multiplier)
    clips = _clips(l2_norm_clips)
    dims_in = tf.nest.flatten(dimensions)
    if len(dims_in) != len(clips):
        raise ValueError(
            f"dimensions must match l2_norm_clips: got {len(dims_in)} dimensions for "
            f"{len(clips)} clips"
        )
    dims = []
    for i, d in enumerate(dims_in):
        if hasattr(d, "shape") and not isinstance(d, int):
            d = int(tf.TensorShape(d.shape).num_elements())
        if isinstance(d, bool) or not isinstance(d, int) or d < 1:
            raise ValueError(f"dimensions[{i}] must be an integer >= 1, got {d!r}")
        dims.append(d)
    total = sum(dims)
    return tf.nest.pack_sequence_as(
        l2_norm_clips, [z * math.sqrt(total / d) * c for c, d in zip(clips, dims)]
    )
