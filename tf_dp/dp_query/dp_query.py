"""The DPQuery protocol (McMahan et al. 2018, sections 2-3).

A DP query aggregates a sample of records (here: per-example gradients, nested structures of
tensors) and releases a noised aggregate. The protocol splits that into steps so that the same
query serves a single-machine loop, microbatches, and distributed aggregation:

1. ``global_state = query.initial_global_state()`` once.
2. Per sample: ``params = query.derive_sample_params(global_state)``;
   ``state = query.initial_sample_state(template)``.
3. Per record: ``state = query.accumulate_record(params, state, record)`` (which is
   ``preprocess_record`` -- e.g. clipping -- followed by ``accumulate_preprocessed_record``).
   Partial states from several workers combine with ``merge_sample_states``.
4. ``result, global_state = query.get_noised_result(state, global_state)``.

Everything is TensorFlow ops on ``tf.nest`` structures, safe inside ``tf.function``.

Queries also describe, for the privacy ledger, the sum queries they ran
(:meth:`DPQuery.sum_query_specs`): each spec gives the L2 sensitivity and the noise standard
deviation as tensors *of that step*. Sum queries additionally expose a *norm-based clipping rule*
(:meth:`SumAggregationDPQuery.clip_weights`) that the fast gradient strategies (ghost clipping,
JL) use without materialising per-example gradients.

Example:

>>> import tensorflow as tf, tf_dp
>>> query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
>>> gs = query.initial_global_state()
>>> params = query.derive_sample_params(gs)
>>> state = query.initial_sample_state(tf.zeros([3]))
>>> for record in [tf.constant([3.0, 4.0, 0.0]), tf.constant([0.1, 0.0, 0.0])]:
...     state = query.accumulate_record(params, state, record)
>>> noised_sum, gs = query.get_noised_result(state, gs)
>>> noised_sum.shape
TensorShape([3])
"""

from __future__ import annotations

import abc
from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf


class SumQuerySpec(NamedTuple):
    """What the ledger records for one sum query of one sample (tensors, values at run time).

    ``private=False`` marks a query that adds no noise by design (``NoPrivacy*``).
    """

    l2_sensitivity: Any
    noise_stddev: Any
    private: bool = True
    #: the explicit seed of the noise generator, if the user gave one (recorded in the ledger:
    #: seeded noise is predictable, so no guarantee holds)
    noise_seed: Optional[int] = None
    #: tree aggregation (``TreeCumulativeSumQuery``): the 0-based index in its tree of the leaf
    #: this step adds (an int64 tensor); recorded as a ``tree`` event. None for other queries.
    tree_step: Any = None
    #: the query is an exact Gaussian mechanism whatever the gradient mode (e.g. the count of
    #: unclipped records of ``QuantileAdaptiveClipSumQuery``): recorded as ``gaussian`` even in a
    #: JL step, where the sum query itself is recorded as ``jl``
    exact_gaussian: bool = False
    #: grid-mode noise (``GaussianSumQuery(noise_mode="grid")``): the grid spacing ``g`` (a
    #: float64 tensor) and ``g sqrt(d)``, what the rounding adds to the
    #: L2 sensitivity (the ledger records the clip's sensitivity plus it). None: float noise.
    noise_grid: Any = None
    grid_sensitivity: Any = None
    #: correlated noise (``CorrelatedNoiseSumQuery``): the strategy's config as canonical JSON (a
    #: Python str); recorded as an ``mf`` event whose ``noise_stddev`` is that of ``Z``'s entries
    mf_strategy: Optional[str] = None


class DPQuery(abc.ABC):
    """Interface of all DP aggregate queries. See the module docstring for the call sequence."""

    def initial_global_state(self) -> Any:
        """Returns the state carried across samples (e.g. clip and noise parameters)."""
        return ()

    def derive_sample_params(self, global_state: Any) -> Any:
        """Returns the parameters used to process every record of one sample."""
        del global_state
        return ()

    @abc.abstractmethod
    def initial_sample_state(self, template: Any) -> Any:
        """Returns an empty accumulator shaped like ``template`` (a structure of tensors/specs)."""

    def preprocess_record(self, params: Any, record: Any) -> Any:
        """Transforms one record before accumulation (e.g. clips it). Default: identity."""
        del params
        return record

    @abc.abstractmethod
    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        """Adds a preprocessed record to the accumulator."""

    def accumulate_record(self, params: Any, sample_state: Any, record: Any) -> Any:
        """Preprocesses ``record`` and adds it to ``sample_state``."""
        return self.accumulate_preprocessed_record(
            sample_state, self.preprocess_record(params, record)
        )

    @abc.abstractmethod
    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        """Combines two partial accumulators (e.g. from two workers or microbatch groups)."""

    @abc.abstractmethod
    def get_noised_result(self, sample_state: Any, global_state: Any) -> tuple[Any, Any]:
        """Returns ``(noised_result, new_global_state)``."""

    def derive_metrics(self, global_state: Any) -> dict[str, Any]:
        """Returns a dict of scalar metrics about the global state (for logging)."""
        del global_state
        return {}

    @abc.abstractmethod
    def sum_query_specs(self, global_state: Any) -> list[SumQuerySpec]:
        """The sum queries one ``get_noised_result`` call performs, for the privacy ledger."""

    @property
    def supports_norm_clipping(self) -> bool:
        """Whether :meth:`clip_weights` is available (needed by the ghost and JL strategies)."""
        return False

    def accumulate_norms(
        self, params: Any, sample_state: Any, norms: Any, record_mask: Any = None
    ) -> Any:
        """Completes a sample state that a gradient clipper built from the clipping rule.

        Strategies sum the clipped records themselves (:meth:`clip_weights`); a query whose sample
        state holds more than that sum (``QuantileAdaptiveClipSumQuery``: the count of records
        the clip did not bind) adds it here from the per-record norms ``[B]`` the rule saw and
        ``record_mask`` (``[B]`` bool: the records of the sample, e.g. not Poisson padding;
        ``None``: all). The DP optimizers call it before :meth:`get_noised_result`. Default:
        ``sample_state`` unchanged.
        """
        del params, norms, record_mask
        return sample_state

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        """Norm-based clipping rule; see :meth:`SumAggregationDPQuery.clip_weights`."""
        raise NotImplementedError(
            f"{type(self).__name__} has no norm-based clipping rule; fast gradient strategies "
            "(ghost, jl) need a sum query such as GaussianSumQuery or NestedQuery of them"
        )


class SumAggregationDPQuery(DPQuery):
    """Base class for queries whose sample state is the sum of the (preprocessed) records."""

    def initial_sample_state(self, template: Any) -> Any:
        return tf.nest.map_structure(_zeros_like_spec, template)

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        _check_same_structure(sample_state, preprocessed_record, "record")
        return tf.nest.map_structure(_add, sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        _check_same_structure(sample_state_1, sample_state_2, "sample_state_2")
        return tf.nest.map_structure(_add, sample_state_1, sample_state_2)

    @property
    def supports_norm_clipping(self) -> bool:
        return True

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        """Per-record clipping weights from per-record squared norms.

        Args:
          params: from :meth:`derive_sample_params`.
          squared_norms: a structure matching the records, each leaf the squared L2 norm of that
            part of each record (a tensor of shape ``[B]`` for ``B`` records, or a scalar).

        Returns:
          A structure matching ``squared_norms``: for each leaf, the weight ``w_i`` such that the
          clipped record is ``w_i * record_i`` on that leaf. Summing ``w_i * g_i`` over records is
          exactly what :meth:`accumulate_record` would have produced.
        """
        return tf.nest.map_structure(tf.ones_like, squared_norms)


def _zeros_like_spec(t: Any) -> tf.Tensor:
    if isinstance(t, tf.TensorSpec):
        return tf.zeros(t.shape, t.dtype)
    if isinstance(t, tf.IndexedSlices):
        return tf.zeros(t.dense_shape, t.values.dtype)
    if isinstance(t, tf.Variable) or hasattr(t, "value") and not isinstance(t, tf.Tensor):
        t = tf.convert_to_tensor(t)
    return tf.zeros_like(t)


def _check_shapes(a: Any, b: Any) -> None:
    """Refuses a record whose static shape or dtype differs from the (dense) accumulator's.

    Without this, ``state + record`` would silently broadcast a record of shape ``[1]`` into a
    state of shape ``[d]``. For ``tf.IndexedSlices`` the row shape (all but the first dimension)
    is compared.
    """
    a_shape = tf.TensorShape(a.shape)
    if isinstance(b, tf.IndexedSlices):
        b_shape = tf.TensorShape(b.values.shape)
        if a_shape.rank is None or b_shape.rank is None:
            return
        a_shape, b_shape = a_shape[1:], b_shape[1:]
    else:
        b_shape = tf.TensorShape(b.shape if hasattr(b, "shape") else np.shape(b))
    b_dtype = b.values.dtype if isinstance(b, tf.IndexedSlices) else getattr(b, "dtype", None)
    if isinstance(b_dtype, tf.DType) and isinstance(a.dtype, tf.DType) and b_dtype != a.dtype:
        raise TypeError(
            f"record has dtype {b_dtype.name}, but the sample state has dtype {a.dtype.name}"
        )
    if not a_shape.is_compatible_with(b_shape):
        raise ValueError(
            f"record has shape {b_shape}, which does not match the sample state's shape {a_shape}"
        )


def _add(a: Any, b: Any) -> Any:
    if not isinstance(a, tf.IndexedSlices):
        _check_shapes(a, b)
    if isinstance(b, tf.IndexedSlices):
        b = tf.convert_to_tensor(b) if isinstance(a, tf.IndexedSlices) else b
        if not isinstance(a, tf.IndexedSlices):
            return tf.tensor_scatter_nd_add(a, tf.expand_dims(b.indices, -1), b.values)
    if isinstance(a, tf.IndexedSlices):
        a = tf.convert_to_tensor(a)
    return a + b


def _check_same_structure(a: Any, b: Any, name: str) -> None:
    try:
        tf.nest.assert_same_structure(a, b, expand_composites=False)
    except (ValueError, TypeError) as e:
        raise ValueError(f"{name} does not match the structure of the sample state: {e}") from None


def state_dtype(dtype: tf.DType) -> tf.DType:
    """The dtype a query keeps per-record state in (noise buffers, tree nodes) for records of
    ``dtype``: float64 for float64 records, float32 otherwise (half-precision records included)."""
    return tf.float64 if dtype == tf.float64 else tf.float32


def as_record_spec(x: Any) -> tf.TensorSpec:
    """The ``tf.TensorSpec`` of one leaf of a record (what a stateful query sizes its state
    from): a ``TensorSpec``, a shape (float32), or anything with ``shape`` and ``dtype`` (tensors,
    variables); it must have a fully defined shape and a floating dtype (else
    ``TypeError``/``ValueError`` naming ``record_specs``)."""
    if isinstance(x, tf.TensorSpec):
        spec = x
    elif isinstance(x, (tf.TensorShape, list, tuple)) and all(
        isinstance(d, (int, type(None))) for d in x
    ):
        spec = tf.TensorSpec(tf.TensorShape(x), tf.float32)
    elif hasattr(x, "shape") and hasattr(x, "dtype"):
        spec = tf.TensorSpec(tf.TensorShape(x.shape), tf.as_dtype(x.dtype))
    else:
        raise TypeError(
            "record_specs must be a structure of tf.TensorSpec, tensors or variables, got a "
            f"{type(x).__name__}"
        )
    if not spec.shape.is_fully_defined():
        raise ValueError(f"record_specs must have fully defined shapes, got {spec.shape}")
    if not spec.dtype.is_floating:
        raise TypeError(f"record_specs must be floating point, got {spec.dtype.name}")
    return spec


def squared_norm(t: Any) -> tf.Tensor:
    """Squared L2 norm of a tensor or ``tf.IndexedSlices`` (float32 or wider)."""
    if isinstance(t, tf.IndexedSlices):
        # Rows may repeat (a token used twice): sum duplicate rows first, as the dense gradient does.
        unique, idx = tf.unique(t.indices)
        t = tf.math.unsorted_segment_sum(t.values, idx, tf.shape(unique)[0])
    t = tf.convert_to_tensor(t)
    if t.dtype in (tf.float16, tf.bfloat16):
        t = tf.cast(t, tf.float32)
    return tf.reduce_sum(tf.square(t))


def scale(t: Any, w: Any) -> Any:
    """``w * t`` for a tensor or ``tf.IndexedSlices``, casting ``w`` to ``t``'s dtype."""
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(t.values * tf.cast(w, t.values.dtype), t.indices, t.dense_shape)
    t = tf.convert_to_tensor(t)
    return t * tf.cast(w, t.dtype)
