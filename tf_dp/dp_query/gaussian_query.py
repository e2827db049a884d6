"""Gaussian sum query: clip each record to L2 norm ``C``, sum, add ``N(0, sigma^2)`` noise.

This is the sanitizer of DP-SGD (Abadi et al. 2016, Algorithm 1) and the basic Gaussian sum query
of McMahan et al. 2018 (section 3).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.noise import add_gaussian_noise_structure, make_generator
from tf_dp.dp_query.validation import check_scalar


class GaussianGlobalState(NamedTuple):
    l2_norm_clip: Any
    stddev: Any


def clip_weight(l2_norm_clip, squared_norm):
    """``min(1, C / ||x||)``, 0 where both are 0, computed without dividing by zero."""
    clip = tf.cast(l2_norm_clip, squared_norm.dtype)
    norm = tf.sqrt(squared_norm)
    return tf.math.divide_no_nan(clip, tf.maximum(norm, clip))


class GaussianSumQuery(dp_query.SumAggregationDPQuery):
    """Sums records clipped to L2 norm ``l2_norm_clip`` and adds Gaussian noise of ``stddev``.

    The whole record (every leaf of its structure) is clipped jointly: its global L2 norm is at most
    ``l2_norm_clip``. For DP-SGD, ``stddev = noise_multiplier * l2_norm_clip``.

    Args:
      l2_norm_clip: clip bound ``C`` (finite, >= 0). A ``tf.Variable`` may be passed to change the
        clip during training (e.g. a decreasing-clip schedule); the ledger records its value at
        every step.
      stddev: noise standard deviation (finite, >= 0); may also be a ``tf.Variable``.
      seed: for tests and debugging only. ``None`` (the default) keys the Philox generator from OS
        entropy; a fixed seed makes the noise predictable and voids the privacy guarantee.

    Example::

        query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
        gs = query.initial_global_state()
        params = query.derive_sample_params(gs)
        state = query.initial_sample_state(tf.zeros([2]))
        state = query.accumulate_record(params, state, tf.constant([3.0, 4.0]))  # clipped to [.6, .8]
        noised_sum, gs = query.get_noised_result(state, gs)
    """

    def __init__(self, l2_norm_clip: Any, stddev: Any, seed: Optional[int] = None):
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip)
        self._stddev = check_scalar("stddev", stddev)
        self._generator = make_generator(seed)
        if seed is not None and abs(seed) > 2**53:
            # the ledger records the seed exactly in a float64 column
            raise ValueError(f"seed must be an integer with |seed| <= 2**53, got {seed}")
        self._seed = seed

    @property
    def l2_norm_clip(self) -> Any:
        return self._l2_norm_clip

    @property
    def stddev(self) -> Any:
        return self._stddev

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments (Python numbers); see ``tf_dp.dp_query.serialize_query``."""
        from tf_dp.dp_query.serialization import plain_number

        return {"l2_norm_clip": plain_number("l2_norm_clip", self._l2_norm_clip, self),
                "stddev": plain_number("stddev", self._stddev, self), "seed": self._seed}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GaussianSumQuery":
        return cls(**config)

    def initial_global_state(self) -> GaussianGlobalState:
        return GaussianGlobalState(self._l2_norm_clip, self._stddev)

    def derive_sample_params(self, global_state: GaussianGlobalState) -> Any:
        return tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        leaves = tf.nest.flatten(squared_norms)
        total = tf.add_n([tf.cast(x, tf.float32) for x in leaves])
        w = clip_weight(params, total)
        return tf.nest.map_structure(lambda _: w, squared_norms)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        sq = tf.nest.map_structure(dp_query.squared_norm, record)
        weights = self.clip_weights(params, sq)
        return tf.nest.map_structure(dp_query.scale, record, weights)

    def get_noised_result(self, sample_state: Any, global_state: GaussianGlobalState):
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        noised = add_gaussian_noise_structure(self._generator, sample_state, stddev)
        return noised, global_state

    def sum_query_specs(self, global_state: GaussianGlobalState) -> list[dp_query.SumQuerySpec]:
        return [
            dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
            )
        ]

    def derive_metrics(self, global_state: GaussianGlobalState) -> dict[str, Any]:
        return {"l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)}

    def __repr__(self) -> str:
        return f"GaussianSumQuery(l2_norm_clip={self._l2_norm_clip!r}, stddev={self._stddev!r})"
