"""Gaussian sum query: clip each record to L2 norm ``C``, sum, add ``N(0, sigma^2)`` noise.

This is the sanitizer of DP-SGD (Abadi et al. 2016, Algorithm 1) and the basic Gaussian sum query
of McMahan et al. 2018 (section 3).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.noise import (
    DEFAULT_NOISE_MODE,
    GRID_BITS,
    PrefetchedNoise,
    add_gaussian_noise_structure,
    add_grid_noise_structure,
    check_noise_mode,
    grid_sensitivity,
    grid_spacing,
    make_generator,
    num_coordinates,
)
from tf_dp.dp_query.validation import check_scalar
from tf_dp.dp_query.serialization import plain_number, serializable_query


class GaussianGlobalState(NamedTuple):
    l2_norm_clip: Any
    stddev: Any


def clip_weight(l2_norm_clip, squared_norm):
    """``min(1, C / ||x||)``, 0 where both are 0, computed without dividing by zero."""
    clip = tf.cast(l2_norm_clip, squared_norm.dtype)
    norm = tf.sqrt(squared_norm)
    return tf.math.divide_no_nan(clip, tf.maximum(norm, clip))


class JointClipSumQuery(dp_query.SumAggregationDPQuery):
    """A sum query that clips every record jointly (the global L2 norm of all its leaves) to the
    global state's ``l2_norm_clip``: the clipping half of :class:`GaussianSumQuery`,
    ``TreeCumulativeSumQuery`` and ``CorrelatedNoiseSumQuery``, which differ in their noise only.
    A subclass's global state has an ``l2_norm_clip`` field."""

    def derive_sample_params(self, global_state: Any) -> Any:
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


class RecordStateMixin:
    """For a query whose global state is sized from the structure of one record and whose noise
    comes from its own generator (tree aggregation, correlated noise): the seed, checked (an
    integer with ``|seed| <= 2**53``, which the ledger's float64 column records exactly, or None
    for OS entropy) and the record specs (:func:`tf_dp.dp_query.dp_query.as_record_spec`)."""

    def _init_record_state(self, seed: Optional[int], record_specs: Any) -> None:
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if seed is not None and abs(seed) > 2**53:
            raise ValueError(f"seed must be an integer with |seed| <= 2**53, got {seed}")
        self._seed = seed
        self._generator = make_generator(seed)
        self._specs = None
        if record_specs is not None:
            self.set_record_specs(record_specs)

    def set_record_specs(self, record_specs: Any) -> None:
        """Sets the structure of one record (see the ``record_specs`` argument)."""
        self._specs = tf.nest.map_structure(dp_query.as_record_spec, record_specs)

    @property
    def record_specs(self) -> Any:
        return self._specs

    @property
    def noise_seed(self) -> Optional[int]:
        return self._seed

    def _zeros_per_record(self, k: int) -> Any:
        """Zeros ``[k, *shape]`` for every leaf of a record (state dtype), once the specs are
        known (else a ``ValueError`` that says to set them)."""
        if self._specs is None:
            raise ValueError(
                f"{type(self).__name__} needs record_specs (the structure of one record, e.g. "
                "model.trainable_variables) before initial_global_state"
            )
        return tf.nest.map_structure(
            lambda s: tf.zeros([k] + s.shape.as_list(), dp_query.state_dtype(s.dtype)),
            self._specs,
        )


@serializable_query
class GaussianSumQuery(JointClipSumQuery):
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
      noise_mode: ``"continuous"`` (default) or ``"grid"``. ``"continuous"`` adds float noise to
        the float sum: the low bits of the result depend on the sum (Mironov 2012) and are not
        covered by the guarantee. ``"grid"`` releases ``g round(s / g) + g round(eta / g)``
        (float64, cast to the sum's dtype), a multiple of the power of two ``g`` (the largest
        with ``g sqrt(d) <= C 2^-10``, ``d`` the number of coordinates): post-processing of the
        Gaussian mechanism on the rounded sum, whose sensitivity ``C + g sqrt(d)`` the ledger
        records. See :func:`tf_dp.dp_query.noise.add_grid_noise_structure`.

    Example (with ``stddev=0.0`` the released sum is the clipped sum itself):

    >>> import tensorflow as tf, tf_dp
    >>> query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=0.0)
    >>> gs = query.initial_global_state()
    >>> params = query.derive_sample_params(gs)
    >>> state = query.initial_sample_state(tf.zeros([2]))
    >>> state = query.accumulate_record(params, state, tf.constant([3.0, 4.0]))  # norm 5 -> 1
    >>> state = query.accumulate_record(params, state, tf.constant([0.0, 0.5]))  # kept
    >>> noised_sum, gs = query.get_noised_result(state, gs)
    >>> [round(float(v), 4) for v in noised_sum]
    [0.6, 1.3]
    """

    def __init__(
        self, l2_norm_clip: Any, stddev: Any, seed: Optional[int] = None,
        noise_mode: str = DEFAULT_NOISE_MODE,
    ):
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip)
        self._stddev = check_scalar("stddev", stddev)
        self._noise_mode = check_noise_mode(noise_mode)
        self._dimension: Optional[int] = None  # coordinates of the sum, known once noised
        self._generator = make_generator(seed)
        self._prefetch = PrefetchedNoise(self._generator)
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

    @property
    def noise_mode(self) -> str:
        """``"grid"`` or ``"continuous"`` (see the class docstring)."""
        return self._noise_mode

    def get_config(self) -> dict[str, Any]:
        """Constructor arguments (Python numbers); see ``tf_dp.dp_query.serialize_query``."""
        return {"l2_norm_clip": plain_number("l2_norm_clip", self._l2_norm_clip, self),
                "stddev": plain_number("stddev", self._stddev, self), "seed": self._seed,
                "noise_mode": self._noise_mode}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "GaussianSumQuery":
        return cls(**config)

    def initial_global_state(self) -> GaussianGlobalState:
        return GaussianGlobalState(self._l2_norm_clip, self._stddev)

    def get_noised_result(self, sample_state: Any, global_state: GaussianGlobalState):
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        if self._noise_mode == "continuous":
            if PrefetchedNoise.applies_to(sample_state):  # XLA: noise drawn ahead, outside XLA
                return self._prefetch.add_to(sample_state, stddev), global_state
            noised = add_gaussian_noise_structure(self._generator, sample_state, stddev)
            return noised, global_state
        d = num_coordinates(sample_state)
        if not isinstance(d, int):
            raise ValueError(
                "noise_mode='grid' needs the sum's shape while tracing (the grid and the "
                "recorded sensitivity depend on its size); use noise_mode='continuous'"
            )
        self._dimension = d
        grid = grid_spacing(global_state.l2_norm_clip, d)
        return add_grid_noise_structure(self._generator, sample_state, stddev, grid), global_state

    @property
    def prefetched_noise(self) -> PrefetchedNoise:
        """The noise this query's XLA-compiled steps read, drawn ahead between compiled calls
        (:class:`tf_dp.dp_query.noise.PrefetchedNoise`; call its ``refill()`` eagerly)."""
        return self._prefetch

    def sum_query_specs(self, global_state: GaussianGlobalState) -> list[dp_query.SumQuerySpec]:
        clip = tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)
        grid = extra = None
        if self._noise_mode == "grid":
            if self._dimension is None:  # before the first noised sum: the bound g sqrt(d)
                extra = tf.cast(clip, tf.float64) * 2.0**-GRID_BITS  # <= C 2^-10
                grid = grid_spacing(clip, 1)  # >= the grid of any d
            else:
                grid = grid_spacing(clip, self._dimension)
                extra = grid_sensitivity(0.0, grid, self._dimension)
        return [
            dp_query.SumQuerySpec(
                clip,
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
                noise_grid=grid,
                grid_sensitivity=extra,
            )
        ]

    def derive_metrics(self, global_state: GaussianGlobalState) -> dict[str, Any]:
        return {"l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)}

    def __repr__(self) -> str:
        return (f"GaussianSumQuery(l2_norm_clip={self._l2_norm_clip!r}, stddev={self._stddev!r}, "
                f"noise_mode={self._noise_mode!r})")
