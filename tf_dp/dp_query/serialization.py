"""Query configurations: what a ``.keras`` file stores for an optimizer built from ``dp_sum_query``.

``serialize_query(query)`` gives ``{"class_name": ..., "config": ...}`` (JSON-compatible) for the
queries a user hands to a DP optimizer, and ``deserialize_query`` rebuilds the query. A query's
state that changes during training is stored as of the call: an adaptive query's *current* clip
becomes the rebuilt query's ``initial_l2_norm_clip``, so a reloaded model resumes from the clip it
reached. Seeds are stored as given (``None``, the default, keys the rebuilt query's noise from OS
entropy again).

A query class is serialisable when it is decorated with :func:`serializable_query` (the
built-in queries are, in their own modules; a user's query class can be too). This module imports
nothing but the ``DPQuery`` protocol, so every query module can import it.

Example:

>>> import tf_dp
>>> query = tf_dp.QuantileAdaptiveClipSumQuery(0.1, 1.1, 0.5, 0.2, 256 / 20, 256)
>>> config = tf_dp.dp_query.serialize_query(query)
>>> config["class_name"]
'QuantileAdaptiveClipSumQuery'
>>> same = tf_dp.dp_query.deserialize_query(config)
>>> same.get_config() == query.get_config()
True
"""

from __future__ import annotations

import numbers
from typing import Any, TypeVar

import numpy as np
import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery


_REGISTRY: dict[str, type] = {}

Q = TypeVar("Q", bound=type)


def serializable_query(cls: Q) -> Q:
    """Class decorator: ``serialize_query`` / ``deserialize_query`` accept ``cls``.

    The class must implement ``get_config()`` (JSON-compatible values) and
    ``from_config(config)``; it is registered under its ``__name__``, which a serialised config
    stores as ``class_name``. A different class under a name already taken raises ValueError.

    Example:

    >>> import tf_dp
    >>> from tf_dp.dp_query import deserialize_query, serializable_query, serialize_query
    >>> @serializable_query
    ... class MyGaussianQuery(tf_dp.GaussianSumQuery):
    ...     pass
    >>> config = serialize_query(MyGaussianQuery(l2_norm_clip=1.0, stddev=1.1))
    >>> config["class_name"], config["config"]["l2_norm_clip"]
    ('MyGaussianQuery', 1.0)
    >>> type(deserialize_query(config)).__name__
    'MyGaussianQuery'
    """
    if not (isinstance(cls, type) and issubclass(cls, DPQuery)):
        raise TypeError(f"serializable_query decorates DPQuery subclasses, got {cls!r}")
    name = cls.__name__
    known = _REGISTRY.get(name)
    if known is not None and (known.__module__, known.__qualname__) != (
        cls.__module__, cls.__qualname__
    ):
        raise ValueError(
            f"a serialisable query named {name!r} is already registered "
            f"({known.__module__}.{known.__qualname__}); rename the class"
        )
    _REGISTRY[name] = cls
    return cls


def serializable_query_classes() -> tuple[str, ...]:
    """The class names ``deserialize_query`` accepts (sorted)."""
    return tuple(sorted(_REGISTRY))


def plain_number(name: str, value: Any, query: DPQuery) -> float:
    """``value`` as a Python float, or NotImplementedError when it is a tensor/variable (a value
    that changes at run time has no fixed configuration)."""
    if isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)):
        return float(value)
    raise NotImplementedError(
        f"{type(query).__name__} with {name} of type {type(value).__name__} cannot be serialised: "
        "only Python or numpy numbers can (use a clip or noise schedule through l2_norm_clip= / "
        "noise_multiplier= instead of a variable in the query)"
    )


def serialize_query(query: DPQuery) -> dict[str, Any]:
    """``{"class_name", "config"}`` of ``query``; NotImplementedError for a query class that
    cannot be serialised (it names the class and the ones that can)."""
    name = type(query).__name__
    if _REGISTRY.get(name) is not type(query):
        raise NotImplementedError(
            f"{name} cannot be serialised: decorate the class with "
            "@tf_dp.dp_query.serializable_query (it needs get_config and from_config); "
            f"registered query classes: {list(serializable_query_classes())}"
        )
    return {"class_name": name, "config": query.get_config()}


def deserialize_query(config: dict[str, Any]) -> DPQuery:
    """The query ``serialize_query`` described. ValueError for an unknown class name."""
    if not isinstance(config, dict) or set(config) != {"class_name", "config"}:
        raise ValueError(
            "config must be a dict with keys 'class_name' and 'config' (from serialize_query), "
            f"got {config!r}"
        )
    cls = _REGISTRY.get(config["class_name"])
    if cls is None:
        raise ValueError(
            f"class_name must be one of {list(serializable_query_classes())} (classes decorated "
            f"with @serializable_query, imported before loading), got {config['class_name']!r}"
        )
    return cls.from_config(config["config"])


def serialize_structure(queries: Any) -> dict[str, Any]:
    """A ``tf.nest`` structure of queries as JSON: the serialised leaves, and the structure with
    each leaf replaced by its index (lists, tuples and dicts with string keys)."""
    leaves = tf.nest.flatten(queries)
    indices = tf.nest.pack_sequence_as(queries, list(range(len(leaves))))
    return {"leaves": [serialize_query(q) for q in leaves], "structure": _to_json(indices)}


def deserialize_structure(config: dict[str, Any]) -> Any:
    leaves = [deserialize_query(c) for c in config["leaves"]]
    return _from_json(config["structure"], leaves)


def _to_json(structure: Any) -> Any:
    if isinstance(structure, int):
        return structure
    if isinstance(structure, dict):
        if not all(isinstance(k, str) for k in structure):
            raise NotImplementedError("NestedQuery with non-string dict keys cannot be serialised")
        return {"dict": {k: _to_json(v) for k, v in structure.items()}}
    if isinstance(structure, (list, tuple)) and type(structure) in (list, tuple):
        return {type(structure).__name__: [_to_json(v) for v in structure]}
    raise NotImplementedError(
        f"NestedQuery with a {type(structure).__name__} structure cannot be serialised (lists, "
        "tuples and dicts can)"
    )


def _from_json(structure: Any, leaves: list[DPQuery]) -> Any:
    if isinstance(structure, int):
        return leaves[structure]
    ((kind, items),) = structure.items()
    if kind == "dict":
        return {k: _from_json(v, leaves) for k, v in items.items()}
    seq = [_from_json(v, leaves) for v in items]
    return tuple(seq) if kind == "tuple" else seq
