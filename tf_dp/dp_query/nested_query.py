"""Nested query: a structure of queries, each applied to the matching part of every record.

This is separate clipping (McMahan et al. 2018, section 3): each group of vectors is clipped and
noised by its own query. Per-layer clipping is a ``NestedQuery`` with one query per layer. For
accounting, the groups of one sample combine into one Gaussian mechanism by Eq. (1) of the paper
(the ledger does this).
"""

from __future__ import annotations

from typing import Any

import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.serialization import (
    deserialize_structure,
    serializable_query,
    serialize_structure,
)


@serializable_query
class NestedQuery(dp_query.DPQuery):
    """Applies a structure of queries to records of a matching (or deeper) structure.

    Args:
      queries: a ``tf.nest`` structure (dict, list, tuple, ...) whose leaves are ``DPQuery``
        instances. Each record must have this structure at its top levels; the part of the record
        under a leaf query is what that query sees.

    Example (per-layer clipping of a two-variable model)::

        query = tf_dp.NestedQuery([
            tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.5),   # kernel
            tf_dp.GaussianSumQuery(l2_norm_clip=0.1, stddev=0.15),  # bias
        ])
        state = query.initial_sample_state([tf.zeros([3, 2]), tf.zeros([2])])
    """

    def __init__(self, queries: Any):
        leaves = tf.nest.flatten(queries)
        if not leaves:
            raise ValueError("queries must contain at least one DPQuery")
        for i, q in enumerate(leaves):
            if not isinstance(q, dp_query.DPQuery):
                raise TypeError(
                    f"queries must be a structure of DPQuery instances; leaf {i} is "
                    f"{type(q).__name__}"
                )
        self._queries = queries

    @property
    def queries(self) -> Any:
        return self._queries

    def get_config(self) -> dict[str, Any]:
        """The structure and every leaf query's config; see ``tf_dp.dp_query.serialize_query``."""
        return {"queries": serialize_structure(self._queries)}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "NestedQuery":
        return cls(deserialize_structure(config["queries"]))

    def _map(self, fn, *structures):
        columns = [flatten_up_to(self._queries, s) for s in structures]
        leaves = [fn(q, *parts) for q, *parts in zip(tf.nest.flatten(self._queries), *columns)]
        return tf.nest.pack_sequence_as(self._queries, leaves)

    def _check(self, value: Any, name: str) -> None:
        try:
            flatten_up_to(self._queries, value)
        except (ValueError, TypeError) as e:
            raise ValueError(
                f"{name} does not match the structure of the NestedQuery's queries: {e}"
            ) from None

    def initial_global_state(self) -> Any:
        return self._map(lambda q: q.initial_global_state())

    def derive_sample_params(self, global_state: Any) -> Any:
        self._check(global_state, "global_state")
        return self._map(lambda q, gs: q.derive_sample_params(gs), global_state)

    def initial_sample_state(self, template: Any) -> Any:
        self._check(template, "template")
        return self._map(lambda q, t: q.initial_sample_state(t), template)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        self._check(record, "record")
        return self._map(lambda q, p, r: q.preprocess_record(p, r), params, record)

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        self._check(preprocessed_record, "preprocessed_record")
        return self._map(
            lambda q, s, r: q.accumulate_preprocessed_record(s, r), sample_state, preprocessed_record
        )

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        self._check(sample_state_1, "sample_state_1")
        self._check(sample_state_2, "sample_state_2")
        return self._map(lambda q, a, b: q.merge_sample_states(a, b), sample_state_1, sample_state_2)

    def get_noised_result(self, sample_state: Any, global_state: Any):
        self._check(sample_state, "sample_state")
        self._check(global_state, "global_state")
        pairs = self._map(lambda q, s, gs: _Pair(q.get_noised_result(s, gs)), sample_state, global_state)
        flat = tf.nest.flatten(pairs)
        result = tf.nest.pack_sequence_as(self._queries, [p.value[0] for p in flat])
        new_gs = tf.nest.pack_sequence_as(self._queries, [p.value[1] for p in flat])
        return result, new_gs

    def sum_query_specs(self, global_state: Any) -> list[dp_query.SumQuerySpec]:
        self._check(global_state, "global_state")
        specs: list[dp_query.SumQuerySpec] = []
        for q, gs in zip(
            tf.nest.flatten(self._queries),
            flatten_up_to(self._queries, global_state),
        ):
            specs.extend(q.sum_query_specs(gs))
        return specs

    def derive_metrics(self, global_state: Any) -> dict[str, Any]:
        metrics: dict[str, Any] = {}
        for i, (q, gs) in enumerate(
            zip(tf.nest.flatten(self._queries), flatten_up_to(self._queries, global_state))
        ):
            path = f"query_{i}"
            for k, v in q.derive_metrics(gs).items():
                metrics[f"{path}/{k}"] = v
        return metrics

    @property
    def supports_norm_clipping(self) -> bool:
        return all(q.supports_norm_clipping for q in tf.nest.flatten(self._queries))

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        self._check(squared_norms, "squared_norms")
        return self._map(lambda q, p, sq: q.clip_weights(p, sq), params, squared_norms)


class _Pair:
    """Opaque holder so that tf.nest does not descend into a (result, state) tuple."""

    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def flatten_up_to(shallow: Any, deep: Any) -> list[Any]:
    """Flattens ``deep`` down to the leaves of ``shallow`` (``tf.nest`` ordering: sorted dict keys).

    Raises ValueError when ``deep`` does not have ``shallow``'s structure at its top levels.
    """
    if not tf.nest.is_nested(shallow):
        return [deep]
    if isinstance(shallow, dict):
        if not isinstance(deep, dict) or sorted(deep) != sorted(shallow):
            raise ValueError(
                f"expected a dict with keys {sorted(shallow)}, got "
                f"{sorted(deep) if isinstance(deep, dict) else type(deep).__name__}"
            )
        out: list[Any] = []
        for k in sorted(shallow):
            out.extend(flatten_up_to(shallow[k], deep[k]))
        return out
    if isinstance(shallow, (list, tuple)):
        if not isinstance(deep, (list, tuple)) or len(deep) != len(shallow):
            raise ValueError(
                f"expected a sequence of length {len(shallow)}, got "
                f"{len(deep) if isinstance(deep, (list, tuple)) else type(deep).__name__}"
            )
        out = []
        for a, b in zip(shallow, deep):
            out.extend(flatten_up_to(a, b))
        return out
    raise TypeError(f"unsupported structure type {type(shallow).__name__} in queries")
