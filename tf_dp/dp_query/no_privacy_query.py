"""Queries without privacy, for baselines and debugging.

They are recorded in the ledger with mechanism ``none``: any accountant reports infinite epsilon
for a run that used one, so a non-private run can never be mistaken for a private one.
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_dp.dp_query import dp_query


class NoPrivacySumQuery(dp_query.SumAggregationDPQuery):
    """Sums records as they are: no clipping, no noise. Recorded as non-private.

    Example::

        query = tf_dp.NoPrivacySumQuery()
    """

    def get_noised_result(self, sample_state: Any, global_state: Any):
        return sample_state, global_state

    def sum_query_specs(self, global_state: Any) -> list[dp_query.SumQuerySpec]:
        return [dp_query.SumQuerySpec(tf.constant(0.0), tf.constant(0.0), private=False)]


class NoPrivacyAverageQuery(dp_query.DPQuery):
    """Averages records (optionally weighted) with no clipping or noise. Recorded as non-private.

    The sample state is ``(weighted sum, total weight)``; the result is their ratio (0 when no
    weight was accumulated).

    Example:

    >>> import tensorflow as tf, tf_dp
    >>> query = tf_dp.NoPrivacyAverageQuery()
    >>> state = query.initial_sample_state(tf.zeros([2]))
    >>> state = query.accumulate_record((), state, tf.constant([1.0, 3.0]))
    >>> state = query.accumulate_record((), state, tf.constant([3.0, 5.0]))
    >>> mean, _ = query.get_noised_result(state, query.initial_global_state())
    >>> mean.numpy().tolist()
    [2.0, 4.0]
    """

    def initial_sample_state(self, template: Any) -> Any:
        zeros = tf.nest.map_structure(dp_query._zeros_like_spec, template)
        return (zeros, tf.constant(0.0))

    def preprocess_record(self, params: Any, record: Any) -> Any:
        return (record, tf.constant(1.0))

    def accumulate_weighted_record(self, sample_state: Any, record: Any, weight: Any) -> Any:
        """Adds ``weight * record`` and ``weight`` to the state."""
        w = tf.cast(weight, tf.float32)
        weighted = tf.nest.map_structure(lambda r: dp_query.scale(r, w), record)
        return self.accumulate_preprocessed_record(sample_state, (weighted, w))

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        total, count = sample_state
        record, weight = preprocessed_record
        dp_query._check_same_structure(total, record, "record")
        return (tf.nest.map_structure(dp_query._add, total, record), count + weight)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        return self.accumulate_preprocessed_record(sample_state_1, sample_state_2)

    def get_noised_result(self, sample_state: Any, global_state: Any):
        total, count = sample_state

        def divide(v):
            v = tf.convert_to_tensor(v)
            return tf.math.divide_no_nan(v, tf.cast(count, v.dtype))

        return tf.nest.map_structure(divide, total), global_state

    def sum_query_specs(self, global_state: Any) -> list[dp_query.SumQuerySpec]:
        return [dp_query.SumQuerySpec(tf.constant(0.0), tf.constant(0.0), private=False)]
