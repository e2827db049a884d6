"""Adaptive clipping to a quantile of the record norms (Andrew, Thakkar, McMahan and Ramaswamy,
"Differentially private learning with adaptive clipping", NeurIPS 2021).

Each sample runs two Gaussian sum queries on the same records:

1. the clipped sum of the records with the current clip ``C_t`` and noise ``z * C_t``;
2. a count of the records the clip did not bind (``||x_i|| <= C_t``). Each record contributes
   ``b_i - 1/2`` with ``b_i`` in ``{0, 1}`` (so its contribution is at most ``1/2`` in absolute
   value: L2 sensitivity ``1/2`` under add/remove adjacency), and the sum gets Gaussian noise of
   standard deviation ``sigma_b`` (``clipped_count_stddev``).

From the noised count, the fraction of unclipped records is estimated with the *public* expected
number of records ``m`` (e.g. ``q * n`` under Poisson sampling):
``b_hat = (sum_i (b_i - 1/2) + N(0, sigma_b^2)) / m + 1/2``, and the clip moves towards the
target quantile ``gamma``: geometrically, ``C_{t+1} = C_t * exp(-eta * (b_hat - gamma))``
(default), or linearly, ``C_{t+1} = max(0, C_t - eta * (b_hat - gamma))``. If more records than
``gamma`` are unclipped the clip shrinks; if fewer, it grows.

Privacy: both queries are recorded in the ledger, each with its values of that step (sum:
sensitivity ``C_t``, noise ``z C_t``; count: sensitivity ``1/2``, noise ``sigma_b``), and the
accountants treat them as one Gaussian mechanism with the effective noise multiplier of McMahan
et al. 2018, Eq. (1): ``z_eff = (z^-2 + (2 sigma_b)^-2)^(-1/2)``. To reach a target ``z_eff``
with a chosen ``sigma_b``, use :func:`sum_noise_multiplier_for` (Andrew et al., section 3.1).

Gradient strategies build the clipped sum from the clipping rule (:meth:`clip_weights`) and the
DP optimizers then call :meth:`accumulate_norms` with the per-record norms, which adds the count:
every gradient mode works (with ``gradient_mode="jl"`` the count is of estimated norms and is
recorded as an exact Gaussian query next to the JL sum query; the accountants refuse such mixed
samples rather than guess).

The clip is a ``tf.Variable`` of the query, updated in place by :meth:`get_noised_result` (no
Python-side value checks, so the update runs inside ``tf.function``, under XLA and in replica
context; under ``tf.distribute`` the count is all-reduced with the noise of replica 0 only, and
the new clip is the same on every replica). Build the query inside ``strategy.scope()`` when
training under a ``tf.distribute`` strategy.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.gaussian_query import clip_weight
from tf_dp.dp_query.noise import add_gaussian_noise_structure, gaussian_noise, make_generator
from tf_dp.dp_query.normalized_query import NormalizedQuery
from tf_dp.dp_query.serialization import serializable_query

#: L2 sensitivity of the count query: each record contributes ``b_i - 1/2`` in ``{-1/2, 1/2}``.
COUNT_SENSITIVITY = 0.5


class AdaptiveClipGlobalState(NamedTuple):
    #: the current clip: a ``tf.Variable`` updated in place after every sample
    l2_norm_clip: Any
    noise_multiplier: float
    clipped_count_stddev: float


class AdaptiveClipSampleState(NamedTuple):
    #: sum of the clipped records (the structure of the records)
    sum_state: Any
    #: ``sum_i (b_i - 1/2)`` over the records of the sample (float32 scalar)
    unclipped_count: Any


def sum_noise_multiplier_for(
    total_noise_multiplier: float, clipped_count_stddev: float
) -> float:
    """The sum query's noise multiplier ``z`` such that the step's effective noise multiplier
    (sum and count queries together, McMahan et al. 2018, Eq. (1)) is ``total_noise_multiplier``:
    ``z = (z_eff^-2 - (2 sigma_b)^-2)^(-1/2)``.

    Raises ValueError when the count query alone already spends more than ``z_eff`` allows
    (``2 sigma_b <= z_eff``).

    Example:

    >>> from tf_dp.dp_query import sum_noise_multiplier_for
    >>> round(sum_noise_multiplier_for(1.1, clipped_count_stddev=0.05 * 256), 4)
    1.101
    """
    z_eff = _check_number("total_noise_multiplier", total_noise_multiplier, positive=True)
    sb = _check_number("clipped_count_stddev", clipped_count_stddev, positive=True)
    z_count = sb / COUNT_SENSITIVITY
    rest = z_eff**-2 - z_count**-2
    if rest <= 0:
        raise ValueError(
            f"clipped_count_stddev={sb} (count noise multiplier {z_count}) leaves no privacy for "
            f"the sum at total_noise_multiplier={z_eff}: clipped_count_stddev must be > "
            f"{z_eff * COUNT_SENSITIVITY}"
        )
    return rest**-0.5


@serializable_query
class QuantileAdaptiveClipSumQuery(dp_query.SumAggregationDPQuery):
    """Gaussian sum query whose clip follows a target quantile of the record norms.

    Args:
      initial_l2_norm_clip: the first clip ``C_0`` (a finite number > 0).
      noise_multiplier: ``z`` of the sum query: its noise stddev is ``z * C_t`` at every step
        (a finite number >= 0).
      target_unclipped_quantile: ``gamma``, the fraction of records whose norm should be at most
        the clip (in the open interval (0, 1); the paper uses 0.5).
      learning_rate: ``eta`` of the clip update (a finite number > 0; the paper uses 0.2 with the
        geometric update).
      clipped_count_stddev: ``sigma_b``, noise stddev of the count of unclipped records (a finite
        number > 0; the paper uses ``m / 20``, i.e. about 0.05 of the expected records).
      expected_num_records: ``m``, the public expected number of records per sample (a finite
        number > 0; ``q * n`` under Poisson sampling, the number of microbatches for
        microbatched training).
      geometric_update: ``True`` (default) for the geometric update, ``False`` for the linear one.
      seed: tests and debugging only (a fixed seed voids the guarantee).

    Example (through any DP optimizer, any ``gradient_mode``)::

        query = tf_dp.dp_query.QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=0.1, noise_multiplier=1.1, target_unclipped_quantile=0.5,
            learning_rate=0.2, clipped_count_stddev=256 / 20, expected_num_records=256)
        opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=0.1)
        # query.l2_norm_clip is the current clip (a tf.Variable)
    """

    def __init__(
        self,
        initial_l2_norm_clip: float,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        learning_rate: float,
        clipped_count_stddev: float,
        expected_num_records: float,
        geometric_update: bool = True,
        seed: Optional[int] = None,
    ):
        clip = _check_number("initial_l2_norm_clip", initial_l2_norm_clip, positive=True)
        self._noise_multiplier = _check_number("noise_multiplier", noise_multiplier)
        quantile = target_unclipped_quantile
        if isinstance(quantile, (bool, np.bool_)) or not isinstance(
            quantile, (int, float, np.number)
        ):
            raise TypeError(
                "target_unclipped_quantile must be a number in the open interval (0, 1), got "
                f"{type(quantile).__name__}"
            )
        quantile = float(quantile)
        if not 0 < quantile < 1:
            raise ValueError(
                "target_unclipped_quantile must be in the open interval (0, 1), got "
                f"{target_unclipped_quantile}"
            )
        self._target = quantile
        self._learning_rate = _check_number("learning_rate", learning_rate, positive=True)
        self._count_stddev = _check_number(
            "clipped_count_stddev", clipped_count_stddev, positive=True
        )
        self._expected = _check_number("expected_num_records", expected_num_records, positive=True)
        if not isinstance(geometric_update, (bool,)):
            raise TypeError(f"geometric_update must be a bool, got {geometric_update!r}")
        self._geometric = geometric_update
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if seed is not None and abs(seed) > 2**53:
            raise ValueError(f"seed must be an integer with |seed| <= 2**53, got {seed}")
        self._generator = make_generator(seed)
        self._seed = seed
        self._initial_clip = clip
        with tf.init_scope():
            # Under tf.distribute every replica computes the same new clip (the count is
            # all-reduced); the first replica's write is kept.
            self._clip = tf.Variable(
                tf.constant(clip, tf.float32),
                trainable=False,
                name="adaptive_l2_norm_clip",
                synchronization=tf.VariableSynchronization.ON_WRITE,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )

    # -- configuration ---------------------------------------------------------------------------

    @property
    def l2_norm_clip(self) -> tf.Variable:
        """The current clip (updated after every sample)."""
        return self._clip

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments, with the *current* clip as ``initial_l2_norm_clip`` (a rebuilt
        query resumes from it); see ``tf_dp.dp_query.serialize_query``."""
        return {"initial_l2_norm_clip": float(self._clip.numpy()),
                "noise_multiplier": self._noise_multiplier,
                "target_unclipped_quantile": self._target,
                "learning_rate": self._learning_rate,
                "clipped_count_stddev": self._count_stddev,
                "expected_num_records": self._expected,
                "geometric_update": self._geometric, "seed": self._seed}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantileAdaptiveClipSumQuery":
        return cls(**config)

    @property
    def noise_multiplier(self) -> float:
        return self._noise_multiplier

    @property
    def target_unclipped_quantile(self) -> float:
        return self._target

    @property
    def learning_rate(self) -> float:
        return self._learning_rate

    @property
    def clipped_count_stddev(self) -> float:
        return self._count_stddev

    @property
    def expected_num_records(self) -> float:
        return self._expected

    @property
    def geometric_update(self) -> bool:
        return self._geometric

    def effective_noise_multiplier(self) -> float:
        """``(z^-2 + (2 sigma_b)^-2)^(-1/2)``: the noise multiplier of one step as the
        accountants see it (McMahan et al. 2018, Eq. (1)); ``inf`` never, since ``sigma_b`` is
        finite; 0 when ``z`` is 0."""
        if self._noise_multiplier == 0:
            return 0.0
        return (self._noise_multiplier**-2 + (self._count_stddev / COUNT_SENSITIVITY) ** -2) ** -0.5

    # -- DPQuery protocol ------------------------------------------------------------------------

    def initial_global_state(self) -> AdaptiveClipGlobalState:
        return AdaptiveClipGlobalState(self._clip, self._noise_multiplier, self._count_stddev)

    def derive_sample_params(self, global_state: AdaptiveClipGlobalState) -> tf.Tensor:
        return tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)

    def initial_sample_state(self, template: Any) -> AdaptiveClipSampleState:
        return AdaptiveClipSampleState(
            super().initial_sample_state(template), tf.zeros([], tf.float32)
        )

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        leaves = tf.nest.flatten(squared_norms)
        total = tf.add_n([tf.cast(x, tf.float32) for x in leaves])
        w = clip_weight(params, total)
        return tf.nest.map_structure(lambda _: w, squared_norms)

    def preprocess_record(self, params: Any, record: Any) -> AdaptiveClipSampleState:
        sq = tf.nest.map_structure(dp_query.squared_norm, record)
        weights = self.clip_weights(params, sq)
        clipped = tf.nest.map_structure(dp_query.scale, record, weights)
        norm = tf.sqrt(tf.add_n([tf.cast(x, tf.float32) for x in tf.nest.flatten(sq)]))
        return AdaptiveClipSampleState(clipped, _centered_indicator(norm, params))

    def accumulate_norms(
        self, params: Any, sample_state: Any, norms: Any, record_mask: Any = None
    ) -> AdaptiveClipSampleState:
        """The sample state from a strategy's clipped sum and per-record norms ``[B]``.

        Records outside ``record_mask`` (e.g. the zero-weight padding of Poisson batches, or
        empty microbatches) contribute nothing to the count: how many there are depends on the
        size of the sample.
        """
        if isinstance(sample_state, AdaptiveClipSampleState):
            raise TypeError("accumulate_norms takes the clipped sum, not a complete sample state")
        contrib = _centered_indicator(tf.cast(norms, tf.float32), params)
        if record_mask is not None:
            contrib = tf.where(tf.cast(record_mask, tf.bool), contrib, tf.zeros_like(contrib))
        return AdaptiveClipSampleState(sample_state, tf.reduce_sum(contrib))

    def get_noised_result(self, sample_state: Any, global_state: AdaptiveClipGlobalState):
        if not isinstance(sample_state, AdaptiveClipSampleState):
            raise TypeError(
                "QuantileAdaptiveClipSumQuery needs its own sample state (the clipped sum and the "
                "count of unclipped records), from initial_sample_state/accumulate_record or "
                f"accumulate_norms; got {type(sample_state).__name__}. Inside a NestedQuery it is "
                "not supported by the gradient strategies"
            )
        clip = tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)
        stddev = tf.cast(global_state.noise_multiplier, tf.float32) * clip
        noised_sum = add_gaussian_noise_structure(self._generator, sample_state.sum_state, stddev)
        count = tf.cast(sample_state.unclipped_count, tf.float32)
        noise = tf.reshape(
            gaussian_noise(self._generator, 1, tf.float32, tf.cast(
                global_state.clipped_count_stddev, tf.float32)),
            [],
        )
        noised_count = _all_reduce_with_one_noise(count, count + noise)
        unclipped_fraction = noised_count / self._expected + COUNT_SENSITIVITY
        error = unclipped_fraction - self._target
        if self._geometric:
            new_clip = clip * tf.exp(-self._learning_rate * error)
        else:
            new_clip = tf.maximum(0.0, clip - self._learning_rate * error)
        global_state.l2_norm_clip.assign(new_clip)
        return noised_sum, global_state

    def sum_query_specs(
        self, global_state: AdaptiveClipGlobalState
    ) -> list[dp_query.SumQuerySpec]:
        clip = tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)
        return [
            dp_query.SumQuerySpec(
                clip, tf.cast(global_state.noise_multiplier, tf.float32) * clip,
                noise_seed=self._seed,
            ),
            dp_query.SumQuerySpec(
                tf.constant(COUNT_SENSITIVITY, tf.float32),
                tf.constant(global_state.clipped_count_stddev, tf.float32),
                noise_seed=self._seed,
                exact_gaussian=True,
            ),
        ]

    def derive_metrics(self, global_state: AdaptiveClipGlobalState) -> dict[str, Any]:
        return {"l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)}

    def reset_clip(self, value: Optional[float] = None) -> None:
        """Sets the clip back to ``initial_l2_norm_clip`` (or to ``value``, a finite number > 0)."""
        v = self._initial_clip if value is None else _check_number("value", value, positive=True)
        self._clip.assign(v)

    def __repr__(self) -> str:
        return (
            f"QuantileAdaptiveClipSumQuery(initial_l2_norm_clip={self._initial_clip!r}, "
            f"noise_multiplier={self._noise_multiplier!r}, "
            f"target_unclipped_quantile={self._target!r}, learning_rate={self._learning_rate!r}, "
            f"clipped_count_stddev={self._count_stddev!r}, "
            f"expected_num_records={self._expected!r}, geometric_update={self._geometric!r})"
        )


@serializable_query
class QuantileAdaptiveClipAverageQuery(NormalizedQuery):
    """:class:`QuantileAdaptiveClipSumQuery` whose noised sum is divided by the public
    ``expected_num_records`` (an average gradient). Same arguments.

    Example::

        query = tf_dp.dp_query.QuantileAdaptiveClipAverageQuery(
            initial_l2_norm_clip=0.1, noise_multiplier=1.1, target_unclipped_quantile=0.5,
            learning_rate=0.2, clipped_count_stddev=256 / 20, expected_num_records=256)
        opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=0.1)
    """

    def __init__(
        self,
        initial_l2_norm_clip: float,
        noise_multiplier: float,
        target_unclipped_quantile: float,
        learning_rate: float,
        clipped_count_stddev: float,
        expected_num_records: float,
        geometric_update: bool = True,
        seed: Optional[int] = None,
    ):
        numerator = QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip,
            noise_multiplier,
            target_unclipped_quantile,
            learning_rate,
            clipped_count_stddev,
            expected_num_records,
            geometric_update,
            seed,
        )
        super().__init__(numerator, denominator=numerator.expected_num_records)

    @property
    def l2_norm_clip(self) -> tf.Variable:
        return self.numerator_query.l2_norm_clip

    def get_config(self) -> dict[str, Any]:
        """As :meth:`QuantileAdaptiveClipSumQuery.get_config` (current clip included)."""
        return self.numerator_query.get_config()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "QuantileAdaptiveClipAverageQuery":
        return cls(**config)


def _centered_indicator(norm: tf.Tensor, clip: Any) -> tf.Tensor:
    """``1[norm <= clip] - 1/2`` (a NaN norm counts as clipped)."""
    below = tf.less_equal(norm, tf.cast(clip, norm.dtype))
    return tf.cast(below, tf.float32) - COUNT_SENSITIVITY


def _all_reduce_with_one_noise(count: tf.Tensor, noised: tf.Tensor) -> tf.Tensor:
    """Outside ``tf.distribute``: ``noised``. In a replica step of ``k > 1`` replicas: the sum of
    every replica's count plus replica 0's noise only (one draw per global step)."""
    if not tf.distribute.has_strategy():
        return noised
    ctx = tf.distribute.get_replica_context()
    if ctx is None or ctx.num_replicas_in_sync == 1:
        return noised
    first = tf.equal(ctx.replica_id_in_sync_group, 0)
    return ctx.all_reduce(tf.distribute.ReduceOp.SUM, tf.where(first, noised, count))


def _check_number(name: str, value: Any, positive: bool = False) -> float:
    """A Python or numpy number, finite and >= 0 (> 0 if ``positive``); returns it as a float."""
    accepted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
        raise TypeError(f"{name} must be {accepted} (a number), got {type(value).__name__}")
    v = float(value)
    if math.isnan(v) or math.isinf(v) or v < 0 or (positive and v == 0):
        raise ValueError(f"{name} must be {accepted}, got {value}")
    return v
