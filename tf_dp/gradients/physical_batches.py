"""Physical batches: one sampled (logical) batch clipped in pieces, to bound a step's memory.

DP-SGD's batch is what the sampler drew (Poisson sampling at rate ``q``): that is the batch the
ledger records and the noise is calibrated for. The memory a clipper needs grows with the
number of records it clips at once (activations, per-layer gradient factors, per-example
gradients). :class:`PhysicalBatches` runs another per-example clipper on consecutive pieces of
at most ``max_physical_batch_size`` records, one after another, and adds their clipped sums.

Why this is the same mechanism. Per-example clipping weighs each record by its own norm only
(``min(1, C / ||g_i||)``, or the query's rule for the record's norms), so the sum of the pieces'
clipped sums equals the clipped sum of the whole batch, and the DP optimizer adds the noise once,
to that sum. The sensitivity, the sampling and the ledger entry of the step do not change;
only the step's peak memory (roughly divided by the number of pieces) and its time (smaller
matrix products, one forward and backward pass per piece) do.

The pieces run in a ``tf.while_loop`` with ``parallel_iterations=1`` (one piece in memory at a
time), all of the same static size except the first, which takes the remainder; so the step
compiles under XLA. Only exact per-example clippers (``vectorized``, ``ghost``) can be split:
microbatches clip groups of records, and JL projections are drawn per step.

Example::

    opt = tf_dp.keras.DPKerasAdamOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3,
        max_physical_batch_size=16)   # sampled batches of any size, clipped 16 records at a time
"""

from __future__ import annotations

import numbers
from typing import Any, Optional

import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients import base


def check_max_physical_batch_size(value: Any) -> Optional[int]:
    """``value`` as an int if it is an integer >= 1 (numpy integers too), None if None;
    ValueError naming the argument otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not (
        1 <= value <= 2**31 - 1  # a batch dimension is an int32 in TensorFlow
    ):
        shown = value if not isinstance(value, numbers.Integral) or abs(value) < 10**20 else (
            f"about {float(value):.3g}")
        raise ValueError(
            f"max_physical_batch_size must be None or an integer in [1, 2**31 - 1], got {shown!r}")
    return int(value)


def _dense(t: Any) -> tf.Tensor:
    return tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t


class PhysicalBatches(base.GradientClipper):
    """Runs ``inner`` on pieces of at most ``max_physical_batch_size`` records and adds their
    clipped sums (see the module docstring).

    Args:
      inner: an exact per-example clipper (``VectorizedClipper`` or the ghost clipper).
      max_physical_batch_size: records per piece, an integer >= 1.

    Attributes ``name``, ``exact``, ``mode`` and ``description`` are the inner clipper's (the
    description says that the batch is split).
    """

    def __init__(self, inner: base.GradientClipper, max_physical_batch_size: int):
        max_physical_batch_size = check_max_physical_batch_size(max_physical_batch_size)
        if max_physical_batch_size is None:
            raise ValueError("max_physical_batch_size must be an integer >= 1, got None")
        if not inner.exact or inner.name not in ("vectorized", "ghost"):
            raise ValueError(
                "max_physical_batch_size needs a per-example gradient mode ('auto', 'vectorized' or "
                f"'ghost' without num_microbatches); got the {inner.name!r} clipper"
            )
        self.inner = inner
        self.max_physical_batch_size = max_physical_batch_size
        self.name = inner.name
        self.exact = inner.exact

    @property
    def mode(self) -> Optional[str]:
        return getattr(self.inner, "mode", self.inner.name)

    @property
    def description(self) -> Optional[str]:
        inner = getattr(self.inner, "description", None) or self.inner.name
        return f"{inner}, in physical batches of at most {self.max_physical_batch_size}"

    def supports(self, model: Optional[Any]) -> Optional[str]:
        return self.inner.supports(model)

    def __repr__(self) -> str:
        return f"PhysicalBatches({self.inner!r}, max_physical_batch_size={self.max_physical_batch_size})"

    @property
    def needs_model(self) -> bool:
        return bool(getattr(self.inner, "needs_model", False))

    def clipped_sum(
        self, loss_fn, data, variables, query, params, model=None
    ) -> base.ClippedGradients:
        size = self.max_physical_batch_size
        static_b = tf.nest.flatten(data[0])[0].shape[0]
        extra = {"model": model} if model is not None and self.needs_model else {}
        if static_b is not None and static_b <= size:
            return self.inner.clipped_sum(loss_fn, data, variables, query, params, **extra)
        # zero-weight rows (Poisson padding) become copies of a real row of the whole batch, so
        # that a piece made only of padding is still valid input (e.g. not all padding tokens)
        data = base.fill_padding_rows(data)
        x, y, sw = data
        b = base.batch_size_of(x)
        full = tf.maximum((b - 1) // size, 0)  # full pieces after the first
        first = b - full * size  # 1 .. size records (the remainder), or 0 for an empty batch

        def rows(t, start, n):
            t = tf.convert_to_tensor(t)
            if isinstance(n, int):
                # a gather of n clamped indices: a static piece shape that stays valid when XLA
                # compiles the loop for a batch shorter than one piece (the loop then never runs)
                return tf.gather(t, tf.minimum(start + tf.range(n, dtype=b.dtype), b - 1))
            return t[:n]

        def piece(start, n):
            sub = tuple(
                None if part is None else tf.nest.map_structure(lambda t: rows(t, start, n), part)
                for part in (x, y, sw)
            )
            out = self.inner.clipped_sum(loss_fn, sub, variables, query, params, **extra)
            if not isinstance(out.sensitivity_multiplier, (int, float)) or (
                float(out.sensitivity_multiplier) != 1.0
            ) or out.jl_projections:
                raise ValueError("physical batches need a per-example clipper (sensitivity 1)")
            mask = out.record_mask
            if mask is None:
                mask = tf.ones([base.batch_size_of(sub[0])], tf.bool)
            return out, mask

        out0, mask0 = piece(0, first)
        acc0 = [_dense(c) for c in out0.clipped_sum]
        # Keras's output masks (``_keras_mask``, read by compiled metrics) travel with y_pred
        masked = [_compat.keras_mask(t) is not None for t in tf.nest.flatten(out0.y_pred)]

        def outputs(out, mask):
            """A piece's per-record outputs, gathered for the whole batch."""
            pred = tf.nest.flatten(out.y_pred)
            return {
                "norms": tf.cast(out.norms, tf.float32),
                "losses": tf.cast(out.losses, tf.float32),
                "mask": mask,
                "pred": pred,
                "pred_mask": [t._keras_mask for t, m in zip(pred, masked) if m],
            }

        head = outputs(out0, mask0)

        def ta_for(t):
            return tf.TensorArray(t.dtype, size=full, element_shape=[size] + list(t.shape[1:]))

        def body(i, acc, tas):
            # each piece starts once the previous one's sums exist: one piece's work in memory
            with tf.control_dependencies(acc):
                start = first + i * size
            out, mask = piece(start, size)
            acc = [a + tf.cast(_dense(c), a.dtype) for a, c in zip(acc, out.clipped_sum)]
            tas = tf.nest.map_structure(lambda ta, t: ta.write(i, t), tas, outputs(out, mask))
            return i + 1, acc, tas

        _, acc, tas = tf.while_loop(
            lambda i, *_: i < full,
            body,
            (tf.constant(0, b.dtype), acc0, tf.nest.map_structure(ta_for, head)),
            parallel_iterations=1,
        )

        def join(first_rows, ta):
            def with_rest():
                rest = ta.stack()
                rest = tf.reshape(rest, tf.concat([[full * size], tf.shape(rest)[2:]], 0))
                return tf.concat([first_rows, tf.cast(rest, first_rows.dtype)], 0)

            # no full piece: nothing to stack (an empty TensorArray cannot be stacked when its
            # element shape is only partly known, e.g. outputs of a dynamic length)
            return tf.cond(full > 0, with_rest, lambda: tf.identity(first_rows))

        joined = tf.nest.map_structure(join, head, tas)
        pred = joined["pred"]
        pred_masks = iter(joined["pred_mask"])
        for t, m in zip(pred, masked):
            if m:
                t._keras_mask = next(pred_masks)
        return base.ClippedGradients(
            clipped_sum=acc,
            norms=joined["norms"],
            num_records=b,
            sensitivity_multiplier=1.0,
            y_pred=tf.nest.pack_sequence_as(out0.y_pred, pred),
            losses=joined["losses"],
            noise_after_sum=True,
            record_mask=joined["mask"],
        )
