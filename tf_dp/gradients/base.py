"""Gradient strategies: from a per-example loss to the clipped sum of per-example gradients.

A strategy receives

- ``loss_fn``: a :class:`PerExampleLoss`-like callable ``loss_fn(x, y, sample_weight)`` that runs
  the model forward (training mode) and returns ``(per_example_losses [B], y_pred)``;
- ``data``: the batch ``(x, y, sample_weight)`` (``sample_weight`` may be None);
- ``variables``: the trainable variables (Keras 3 or ``tf.Variable``);
- ``query`` and ``params``: the DP sum query and its sample params. Exact strategies clip through
  the query's clipping rule (:meth:`tf_dp.dp_query.DPQuery.clip_weights` from per-record squared
  norms, one leaf per variable), so per-layer (nested) and joint clipping work on every path.

and returns a :class:`ClippedGradients`: the clipped sum (one tensor per variable, the query's
sample state), the per-record norms (for metrics), the number of records (examples, or
microbatches), the L2 sensitivity multiplier of one record (1 for single examples, 2 for
randomly assigned microbatches under add/remove adjacency), and ``y_pred`` and the per-example
losses for metrics.

Strategies never add noise: the DP optimizer's query does (``get_noised_result``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Sequence

import tensorflow as tf


@dataclasses.dataclass
class ClippedGradients:
    clipped_sum: list[Any]
    norms: tf.Tensor
    num_records: tf.Tensor
    sensitivity_multiplier: Any = 1.0
    y_pred: Any = None
    losses: Any = None
    jl_projections: int = 0
    #: ask the DP optimizer to draw the noise only once the clipped sum exists (a control
    #: dependency). By default the executor may draw it early, next to the forward and backward
    #: pass (faster on a free core, but the noise is then held through the step's peak).
    noise_after_sum: bool = False


LossFn = Callable[[Any, Any, Any], tuple[tf.Tensor, Any]]


def as_tf_variables(variables: Sequence[Any]) -> list[tf.Variable]:
    """The ``tf.Variable`` behind each (Keras 3 or TF) variable."""
    out = []
    for v in variables:
        inner = getattr(v, "value", None) if not isinstance(v, tf.Variable) else v
        out.append(inner if isinstance(inner, tf.Variable) else v)
    return out


def squared_norms_of(per_example_grads: Sequence[tf.Tensor]) -> list[tf.Tensor]:
    """Per-example squared norms ``[B]`` of stacked per-example gradients ``[B, ...]``."""
    out = []
    for g in per_example_grads:
        g = tf.cast(g, tf.float32) if g.dtype != tf.float64 else g
        out.append(tf.reduce_sum(tf.reshape(tf.square(g), [tf.shape(g)[0], -1]), axis=1))
    return out


def weighted_sum(weights: tf.Tensor, per_example_grads: tf.Tensor) -> tf.Tensor:
    """``sum_i w_i g_i`` for ``g`` of shape ``[B, ...]``."""
    w = tf.cast(weights, per_example_grads.dtype)
    return tf.tensordot(w, per_example_grads, axes=1)


def global_norms(squared_norms: Sequence[tf.Tensor]) -> tf.Tensor:
    return tf.sqrt(tf.add_n([tf.cast(s, tf.float32) for s in squared_norms]))


def check_weights_structure(query, variables) -> None:
    if not query.supports_norm_clipping:
        raise TypeError(
            f"the gradient strategy needs a query with a norm-based clipping rule, but "
            f"{type(query).__name__} has none"
        )


class GradientStrategy(abc.ABC):
    """Computes the clipped sum of per-record gradients. See the module docstring."""

    #: registry name (``gradient_mode``)
    name: str = ""
    #: exact strategies give the same clipped sum as per-example clipping
    exact: bool = True

    @abc.abstractmethod
    def clipped_sum(
        self,
        loss_fn: LossFn,
        data: tuple[Any, Any, Any],
        variables: Sequence[Any],
        query: Any,
        params: Any,
    ) -> ClippedGradients:
        ...

    def supports(self, model: Optional[Any]) -> Optional[str]:
        """``None`` if the strategy supports ``model``; otherwise the reason it does not."""
        return None

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def vectorized_map_blocker(model: Optional[Any]) -> Optional[str]:
    """Why ``tf.vectorized_map`` cannot take per-example gradients of ``model`` (or None).

    On TF 2.21, vectorising the gradient of an ``EinsumDense`` whose kernel has rank >= 3 (every
    ``MultiHeadAttention`` has some) kills the process with a segmentation fault inside
    TensorFlow, so the strategies built on it refuse such models up front.
    """
    if model is None:
        return None
    import keras  # local: the gradients layer does not otherwise need Keras

    flatten = getattr(model, "_flatten_layers", None)
    layers = list(flatten(include_self=False)) if flatten is not None else []
    for layer in layers:
        kernel = getattr(layer, "kernel", None)
        if isinstance(layer, keras.layers.EinsumDense) and kernel is not None and len(
            kernel.shape
        ) >= 3:
            return (
                f"layer {layer.name!r} (EinsumDense with a rank-{len(kernel.shape)} kernel, e.g. "
                "inside MultiHeadAttention) crashes TensorFlow's vectorized_map (segmentation "
                "fault in TF 2.21); use gradient_mode='ghost' or 'auto', which cover it"
            )
    return None


def batch_size_of(x: Any) -> tf.Tensor:
    first = tf.nest.flatten(x)[0]
    return tf.shape(first)[0]
