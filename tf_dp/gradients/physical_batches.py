"""Physical batches: one sampled (logical) batch clipped in pieces, to bound a step's memory.

DP-SGD's batch is what the sampler drew (Poisson sampling at rate ``q``): that is the batch the
ledger records and the noise is calibrated for. The memory a strategy needs grows with the
number of records it clips at once (activations, per-layer gradient factors, per-example
gradients). :class:`PhysicalBatches` runs another per-example strategy on consecutive pieces of
at most ``max_physical_batch_size`` records, one after another, and adds their clipped sums.

Why this is the same mechanism. Per-example clipping weighs each record by its own norm only
(``min(1, C / ||g_i||)``, or the query's rule for the record's norms), so the sum of the pieces'
clipped sums equals the clipped sum of the whole batch, and the DP optimizer adds the noise once,
to that sum. The sensitivity, the sampling and the ledger entry of the step do not change;
only the step's peak memory (roughly divided by the number of pieces) and its time (smaller
matrix products, one forward and backward pass per piece) do.

The pieces run in a ``tf.while_loop`` with ``parallel_iterations=1`` (one piece in memory at a
time), all of the same static size except the first, which takes the remainder; so the step
compiles under XLA. Only exact per-example strategies (``vectorized``, ``ghost``) can be split:
microbatches clip groups of records, and JL projections are drawn per step.

Example::

    opt = tf_dp.keras.DPKerasAdamOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3,
        max_physical_batch_size=16)   # sampled batches of any size, clipped 16 records at a time
"""

from __future__ import annotations

from typing import Any, Optional

import tensorflow as tf

from tf_dp.gradients import base


def check_max_physical_batch_size(value: Any) -> Optional[int]:
    """``value`` if it is None or an integer >= 1; ValueError naming the argument otherwise."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"max_physical_batch_size must be None or an integer >= 1, got {value!r}")
    return value


def _dense(t: Any) -> tf.Tensor:
    return tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t


class PhysicalBatches(base.GradientStrategy):
    """Runs ``inner`` on pieces of at most ``max_physical_batch_size`` records and adds their
    clipped sums (see the module docstring).

    Args:
      inner: an exact per-example strategy (``VectorizedStrategy`` or the ghost strategy).
      max_physical_batch_size: records per piece, an integer >= 1.

    Attributes ``name``, ``exact``, ``mode`` and ``description`` are the inner strategy's (the
    description says that the batch is split).
    """

    def __init__(self, inner: base.GradientStrategy, max_physical_batch_size: int):
        check_max_physical_batch_size(max_physical_batch_size)
        if max_physical_batch_size is None:
            raise ValueError("max_physical_batch_size must be an integer >= 1, got None")
        if not inner.exact or inner.name not in ("vectorized", "ghost"):
            raise ValueError(
                "max_physical_batch_size needs a per-example gradient mode ('auto', 'vectorized' or "
                f"'ghost' without num_microbatches); got the {inner.name!r} strategy"
            )
        self.inner = inner
        self.max_physical_batch_size = int(max_physical_batch_size)
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

    def clipped_sum(self, loss_fn, data, variables, query, params) -> base.ClippedGradients:
        x, y, sw = data
        size = self.max_physical_batch_size
        static_b = tf.nest.flatten(x)[0].shape[0]
        if static_b is not None and static_b <= size:
            return self.inner.clipped_sum(loss_fn, data, variables, query, params)
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
            out = self.inner.clipped_sum(loss_fn, sub, variables, query, params)
            if not isinstance(out.sensitivity_multiplier, (int, float)) or (
                float(out.sensitivity_multiplier) != 1.0
            ) or out.jl_projections:
                raise ValueError("physical batches need a per-example strategy (sensitivity 1)")
            mask = out.record_mask
            if mask is None:
                mask = tf.ones([base.batch_size_of(sub[0])], tf.bool)
            return out, mask

        out0, mask0 = piece(0, first)
        acc0 = [_dense(c) for c in out0.clipped_sum]
        pred0 = out0.y_pred
        extras0 = {
            "norms": tf.cast(out0.norms, tf.float32),
            "losses": tf.cast(out0.losses, tf.float32),
            "mask": mask0,
        }

        def ta_for(t):
            return tf.TensorArray(t.dtype, size=full, element_shape=[size] + list(t.shape[1:]),
                                  infer_shape=True)

        tas0 = (
            {k: ta_for(v) for k, v in extras0.items()},
            tf.nest.map_structure(ta_for, pred0),
        )

        def body(i, acc, tas):
            # each piece starts once the previous one's sums exist: one piece's work in memory
            with tf.control_dependencies(acc):
                start = first + i * size
            out, mask = piece(start, size)
            acc = [a + tf.cast(_dense(c), a.dtype) for a, c in zip(acc, out.clipped_sum)]
            extras, preds = tas
            extras = {
                "norms": extras["norms"].write(i, tf.cast(out.norms, tf.float32)),
                "losses": extras["losses"].write(i, tf.cast(out.losses, tf.float32)),
                "mask": extras["mask"].write(i, mask),
            }
            preds = tf.nest.map_structure(lambda ta, t: ta.write(i, t), preds, out.y_pred)
            return i + 1, acc, (extras, preds)

        _, acc, (extras, preds) = tf.while_loop(
            lambda i, *_: i < full,
            body,
            (tf.constant(0, b.dtype), acc0, tas0),
            parallel_iterations=1,
        )

        def join(head, ta):
            rest = ta.stack()
            rest = tf.reshape(rest, tf.concat([[full * size], tf.shape(rest)[2:]], 0))
            return tf.concat([head, tf.cast(rest, head.dtype)], 0)

        norms = join(extras0["norms"], extras["norms"])
        return base.ClippedGradients(
            clipped_sum=acc,
            norms=norms,
            num_records=b,
            sensitivity_multiplier=1.0,
            y_pred=tf.nest.map_structure(join, pred0, preds),
            losses=join(extras0["losses"], extras["losses"]),
            noise_after_sum=True,
            record_mask=join(extras0["mask"], extras["mask"]),
        )
