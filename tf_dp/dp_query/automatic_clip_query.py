"""Automatic clipping (Bu, Zhang, Mao and Karypis, "Automatic clipping: differentially private
deep learning made easier and stronger", 2022).

Instead of clipping (weight ``min(1, C / ||g_i||)``), every record is *normalised*: its weight is
``C / (||g_i|| + gamma)``. The clipped record has norm ``C ||g_i|| / (||g_i|| + gamma) < C``, so
the L2 sensitivity of the sum is still ``C`` (one record added or removed), and the Gaussian noise
``stddev = noise_multiplier * C`` gives exactly the guarantee of DP-SGD with clip ``C``. The
stability constant ``gamma > 0`` keeps small gradients from being blown up without bound (the
paper uses ``gamma = 0.01``).

Since the weight of a record is a function of its norm only, the rule is a norm-based clipping
rule (:meth:`clip_weights`) and every gradient mode supports it. Per-layer automatic clipping is a
``NestedQuery`` of ``AutomaticClipSumQuery``s, one per variable (each normalises that variable's
part of the gradient by its own norm).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.noise import add_gaussian_noise_structure, make_generator
from tf_dp.dp_query.validation import check_scalar
from tf_dp.dp_query.serialization import plain_number, serializable_query


class AutomaticClipGlobalState(NamedTuple):
    l2_norm_clip: Any
    stddev: Any
    gamma: Any


def automatic_clip_weight(l2_norm_clip, gamma, squared_norm):
    """``C / (||x|| + gamma)`` (``gamma > 0``, so never a division by zero)."""
    clip = tf.cast(l2_norm_clip, squared_norm.dtype)
    return clip / (tf.sqrt(squared_norm) + tf.cast(gamma, squared_norm.dtype))


@serializable_query
class AutomaticClipSumQuery(dp_query.SumAggregationDPQuery):
    """Sums records normalised to weight ``C / (||x|| + gamma)`` and adds Gaussian noise.

    The whole record (every leaf of its structure) is normalised jointly by its global L2 norm.
    The ledger records L2 sensitivity ``l2_norm_clip`` (each normalised record has norm below
    ``C``) and the noise ``stddev``.

    Args:
      l2_norm_clip: ``C`` (finite, > 0); may be a ``tf.Variable`` (its value at each step is
        recorded). With ``C = 1`` and the learning rate tuned instead, no clip needs choosing
        (the paper's recommendation).
      stddev: noise standard deviation (finite, >= 0), ``noise_multiplier * C`` for DP-SGD; may be
        a ``tf.Variable``.
      gamma: the stability constant (a finite number > 0; the paper uses 0.01).
      seed: tests and debugging only (see ``GaussianSumQuery``: a fixed seed voids the guarantee).

    Example (global, through a DP optimizer; any ``gradient_mode``)::

        query = tf_dp.dp_query.AutomaticClipSumQuery(l2_norm_clip=1.0, stddev=1.1 * 1.0)
        opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=0.5)

    Per-layer (one query per trainable variable, in ``model.trainable_variables`` order)::

        query = tf_dp.NestedQuery([
            tf_dp.dp_query.AutomaticClipSumQuery(1.0, stddev=1.1 * 2 ** 0.5)
            for _ in model.trainable_variables])
    """

    def __init__(
        self,
        l2_norm_clip: Any,
        stddev: Any,
        gamma: float = 0.01,
        seed: Optional[int] = None,
    ):
        if l2_norm_clip is None:
            raise ValueError("l2_norm_clip must be a finite number > 0, got None")
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip, allow_zero=False)
        self._stddev = check_scalar("stddev", stddev)
        if gamma is None or _is_tensor(gamma):
            raise TypeError(f"gamma must be a finite number > 0 (a Python number), got {gamma!r}")
        self._gamma = check_scalar("gamma", gamma, allow_zero=False)
        if seed is not None and abs(seed) > 2**53:
            raise ValueError(f"seed must be an integer with |seed| <= 2**53, got {seed}")
        self._generator = make_generator(seed)
        self._seed = seed

    @property
    def l2_norm_clip(self) -> Any:
        return self._l2_norm_clip

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments (Python numbers); see ``tf_dp.dp_query.serialize_query``."""
        return {"l2_norm_clip": plain_number("l2_norm_clip", self._l2_norm_clip, self),
                "stddev": plain_number("stddev", self._stddev, self),
                "gamma": float(self._gamma), "seed": self._seed}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "AutomaticClipSumQuery":
        return cls(**config)

    @property
    def stddev(self) -> Any:
        return self._stddev

    @property
    def gamma(self) -> float:
        return self._gamma

    def initial_global_state(self) -> AutomaticClipGlobalState:
        return AutomaticClipGlobalState(self._l2_norm_clip, self._stddev, self._gamma)

    def derive_sample_params(self, global_state: AutomaticClipGlobalState) -> Any:
        return tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        leaves = tf.nest.flatten(squared_norms)
        total = tf.add_n([tf.cast(x, tf.float32) for x in leaves])
        w = automatic_clip_weight(params, self._gamma, total)
        return tf.nest.map_structure(lambda _: w, squared_norms)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        sq = tf.nest.map_structure(dp_query.squared_norm, record)
        weights = self.clip_weights(params, sq)
        return tf.nest.map_structure(dp_query.scale, record, weights)

    def get_noised_result(self, sample_state: Any, global_state: AutomaticClipGlobalState):
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        return add_gaussian_noise_structure(self._generator, sample_state, stddev), global_state

    def sum_query_specs(
        self, global_state: AutomaticClipGlobalState
    ) -> list[dp_query.SumQuerySpec]:
        # each normalised record has norm C ||g|| / (||g|| + gamma) < C: sensitivity C
        return [
            dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
            )
        ]

    def derive_metrics(self, global_state: AutomaticClipGlobalState) -> dict[str, Any]:
        return {"l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)}

    def __repr__(self) -> str:
        return (
            f"AutomaticClipSumQuery(l2_norm_clip={self._l2_norm_clip!r}, "
            f"stddev={self._stddev!r}, gamma={self._gamma!r})"
        )


def _is_tensor(value: Any) -> bool:
    return isinstance(value, (tf.Tensor, tf.Variable))
