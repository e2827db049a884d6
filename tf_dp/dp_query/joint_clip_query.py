"""Joint clipping of a group of vectors (McMahan et al. 2018, section 3, "joint clipping").

The vectors ``x_j`` of a group are first rescaled by public scale parameters ``alpha_j``, the
concatenation of the ``x_j / alpha_j`` is clipped to one total L2 bound ``S``, Gaussian noise of
standard deviation ``sigma`` is added to the rescaled sum, and the result is scaled back by
``alpha_j``. Equivalently, each vector's clipped sum receives noise ``alpha_j * sigma``. Choosing
``alpha_j`` near the typical norm of ``x_j`` keeps one large vector from using up the whole bound.
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.gaussian_query import GaussianGlobalState, clip_weight
from tf_dp.dp_query.noise import add_gaussian_noise_structure, make_generator
from tf_dp.dp_query.validation import check_scalar


class JointClipGaussianSumQuery(dp_query.SumAggregationDPQuery):
    """Gaussian sum query with joint clipping of rescaled vectors.

    Args:
      l2_norm_clip: the total clip ``S`` on the rescaled group (finite, >= 0; may be a variable).
      stddev: the noise ``sigma`` on the rescaled sum (finite, >= 0; may be a variable).
      scales: a structure matching the records whose leaves are the ``alpha_j`` (finite, > 0).
      seed: tests and debugging only (see ``GaussianSumQuery``).

    The L2 sensitivity recorded in the ledger is ``S`` with noise ``sigma`` (the mechanism on the
    rescaled vectors), which is what the privacy of the group depends on.

    Example::

        query = tf_dp.JointClipGaussianSumQuery(
            l2_norm_clip=1.0, stddev=1.2, scales={"kernel": 1.0, "bias": 0.1})
    """

    def __init__(self, l2_norm_clip: Any, stddev: Any, scales: Any, seed: Optional[int] = None):
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip)
        self._stddev = check_scalar("stddev", stddev)
        leaves = tf.nest.flatten(scales)
        if not leaves:
            raise ValueError("scales must contain at least one scale parameter")
        checked = [check_scalar(f"scales[{i}]", a, allow_zero=False) for i, a in enumerate(leaves)]
        self._scales = tf.nest.pack_sequence_as(scales, checked)
        self._generator = make_generator(seed)
        self._seed = seed

    @property
    def scales(self) -> Any:
        return self._scales

    def initial_global_state(self) -> GaussianGlobalState:
        return GaussianGlobalState(self._l2_norm_clip, self._stddev)

    def derive_sample_params(self, global_state: GaussianGlobalState) -> Any:
        return tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32)

    def _check(self, value: Any, name: str) -> None:
        try:
            tf.nest.assert_same_structure(self._scales, value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{name} does not match the structure of scales: {e}") from None

    def initial_sample_state(self, template: Any) -> Any:
        self._check(template, "template")
        return super().initial_sample_state(template)

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        self._check(squared_norms, "squared_norms")
        rescaled = [
            tf.cast(sq, tf.float32) / (a * a)
            for sq, a in zip(tf.nest.flatten(squared_norms), tf.nest.flatten(self._scales))
        ]
        w = clip_weight(params, tf.add_n(rescaled))
        return tf.nest.map_structure(lambda _: w, squared_norms)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        self._check(record, "record")
        sq = tf.nest.map_structure(dp_query.squared_norm, record)
        weights = self.clip_weights(params, sq)
        # Clipping x_j / alpha_j by the common weight and scaling back by alpha_j is w * x_j.
        return tf.nest.map_structure(dp_query.scale, record, weights)

    def get_noised_result(self, sample_state: Any, global_state: GaussianGlobalState):
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        stddevs = tf.nest.map_structure(lambda a: stddev * a, self._scales)
        noised = add_gaussian_noise_structure(self._generator, sample_state, stddevs)
        return noised, global_state

    def sum_query_specs(self, global_state: GaussianGlobalState) -> list[dp_query.SumQuerySpec]:
        return [
            dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
            )
        ]
