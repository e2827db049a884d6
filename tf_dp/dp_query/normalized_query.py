"""Normalized query: a sum query's noised result divided by a denominator (an average)."""

from __future__ import annotations

from typing import Any, NamedTuple

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.validation import check_scalar
from tf_dp.dp_query.serialization import (
    deserialize_query,
    plain_number,
    serializable_query,
    serialize_query,
)


class NormalizedGlobalState(NamedTuple):
    numerator_state: Any
    denominator: Any


@serializable_query
class NormalizedQuery(dp_query.DPQuery):
    """Divides the noised result of ``numerator_query`` by ``denominator``.

    The denominator is public (e.g. the expected batch size ``q * n`` under Poisson sampling, as in
    Abadi et al. 2016); it must not depend on the private data, or the result is not DP.

    Args:
      numerator_query: a DPQuery (typically a ``GaussianSumQuery``).
      denominator: a finite number > 0, or a scalar tensor/variable read at run time.

    Example:

    >>> import tensorflow as tf, tf_dp
    >>> query = tf_dp.NormalizedQuery(tf_dp.GaussianSumQuery(1.0, 0.0), denominator=4.0)
    >>> gs = query.initial_global_state()
    >>> state = query.initial_sample_state(tf.zeros([1]))
    >>> for x in (0.5, 3.0):  # the second record is clipped to 1.0
    ...     state = query.accumulate_record(query.derive_sample_params(gs), state, tf.constant([x]))
    >>> float(query.get_noised_result(state, gs)[0][0])
    0.375
    """

    def __init__(self, numerator_query: dp_query.DPQuery, denominator: Any):
        if not isinstance(numerator_query, dp_query.DPQuery):
            raise TypeError(
                f"numerator_query must be a DPQuery, got {type(numerator_query).__name__}"
            )
        if denominator is None:
            raise ValueError("denominator must be a finite number > 0 or a scalar tensor, got None")
        self._numerator = numerator_query
        self._denominator = check_scalar("denominator", denominator, allow_zero=False)

    @property
    def numerator_query(self) -> dp_query.DPQuery:
        return self._numerator

    def get_config(self) -> dict[str, Any]:
        """The numerator's config and the denominator; see ``tf_dp.dp_query.serialize_query``."""
        return {"numerator_query": serialize_query(self._numerator),
                "denominator": plain_number("denominator", self._denominator, self)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NormalizedQuery":
        return cls(deserialize_query(config["numerator_query"]), config["denominator"])

    def initial_global_state(self) -> NormalizedGlobalState:
        return NormalizedGlobalState(self._numerator.initial_global_state(), self._denominator)

    def derive_sample_params(self, global_state: NormalizedGlobalState) -> Any:
        return self._numerator.derive_sample_params(global_state.numerator_state)

    def initial_sample_state(self, template: Any) -> Any:
        return self._numerator.initial_sample_state(template)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        return self._numerator.preprocess_record(params, record)

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        return self._numerator.accumulate_preprocessed_record(sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        return self._numerator.merge_sample_states(sample_state_1, sample_state_2)

    def get_noised_result(self, sample_state: Any, global_state: NormalizedGlobalState):
        noised, num_state = self._numerator.get_noised_result(
            sample_state, global_state.numerator_state
        )
        denom = global_state.denominator

        def divide(v):
            v = tf.convert_to_tensor(v)
            return v / tf.cast(denom, v.dtype)

        return tf.nest.map_structure(divide, noised), NormalizedGlobalState(num_state, denom)

    def sum_query_specs(self, global_state: NormalizedGlobalState) -> list[dp_query.SumQuerySpec]:
        return self._numerator.sum_query_specs(global_state.numerator_state)

    def derive_metrics(self, global_state: NormalizedGlobalState) -> dict[str, Any]:
        return self._numerator.derive_metrics(global_state.numerator_state)

    @property
    def supports_norm_clipping(self) -> bool:
        return self._numerator.supports_norm_clipping

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        return self._numerator.clip_weights(params, squared_norms)

    def accumulate_norms(
        self, params: Any, sample_state: Any, norms: Any, record_mask: Any = None
    ) -> Any:
        return self._numerator.accumulate_norms(params, sample_state, norms, record_mask)
