"""Correlated noise in TensorFlow: the sum query that releases ``x_t + (C^{-1} Z)_t``.

DP matrix factorization (Choquette-Choo et al. 2023, "Amplified banded matrix factorization";
Dvijotham, McMahan et al. 2024, "Efficient and near-optimal noise generation for streaming
differential privacy", the buffered linear Toeplitz (BLT) mechanism) adds to the clipped sum
``x_t`` of step ``t`` the ``t``-th row of ``C^{-1} Z``, where ``Z`` has i.i.d. ``N(0, sigma^2)``
rows (one per step, shaped like the model) and ``C`` is the strategy matrix of
``tf_dp.correlated.strategies``. The strategy hands over its noise as a recurrence (plain frozen
dataclasses, duck-typed here):

* banded (``BandedRecurrence(coef)``, ``coef`` of shape ``(n, b)``, ``coef[t, j] = C[t, t - j]``):
  ``w_t = (z_t - sum_{j=1}^{b-1} coef[t, j] w_{t-j}) / coef[t, 0]``; the state is the last
  ``b - 1`` noises ``w`` (``b = 1``, ``coef = 1``: DP-SGD's independent noise);
* BLT (``BLTRecurrence(omega, theta)``, ``d`` buffers):
  ``w_t = z_t + sum_i omega_i s_{i,t}`` and ``s_{i,t+1} = theta_i s_{i,t} + z_t`` (``s_{i,0} = 0``),
  so ``C^{-1}`` is Toeplitz with first column ``1, sum_i omega_i theta_i^(k-1)`` (lag ``k``);
  ``O(d x model size)`` work and memory per step.

:func:`banded_noise_step` and :func:`blt_noise_step` are the recurrences as pure functions of the
fresh draw ``z_t`` (tests feed their own ``z``'s); :class:`CorrelatedNoiseSumQuery` runs them with
a counter-based generator, its global state (:class:`CorrelatedNoiseState`: the step and the
buffers, fixed shapes) carried by the engine in variables, so the noise continues across compiled
steps, checkpoints and, under ``tf.distribute``, from the first replica's draw (the engine's state
variables keep the first replica's write: one draw per global step).

A banded strategy optimised for ``n`` steps has ``n`` rows; steps past ``n`` reuse the last row
(a Toeplitz continuation). Every release is recorded in the ledger as an ``mf`` sum query with
the strategy's config and the stddev of ``Z``, so the accountants rebuild ``C`` for the steps
that ran.

Example:

>>> import numpy as np, tensorflow as tf
>>> from tf_dp.correlated.noise_tf import CorrelatedNoiseSumQuery
>>> class Banded:  # what BandedStrategy.noise_recurrence() returns (b = 2)
...     coef = np.array([[1.0, 0.0], [1.0, 0.5], [1.0, 0.5]])
>>> query = CorrelatedNoiseSumQuery(1.0, 1.1, Banded(), record_specs=tf.TensorSpec([3]))
>>> gs = query.initial_global_state()
>>> state = query.accumulate_record(
...     query.derive_sample_params(gs), query.initial_sample_state(tf.zeros([3])),
...     tf.constant([3.0, 4.0, 0.0]))
>>> noised, gs = query.get_noised_result(state, gs)
>>> noised.shape, int(gs.step)
(TensorShape([3]), 1)
"""

from __future__ import annotations

import json

from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.gaussian_query import JointClipSumQuery, RecordStateMixin
from tf_dp.dp_query.noise import gaussian_noise
from tf_dp.dp_query.validation import check_scalar

__all__ = [
    "CorrelatedNoiseState",
    "CorrelatedNoiseSumQuery",
    "banded_noise_step",
    "blt_noise_step",
    "recurrence_of",
]


class CorrelatedNoiseState(NamedTuple):
    """Global state of :class:`CorrelatedNoiseSumQuery` (fixed-shape tensors).

    Attributes:
      step: int64 scalar, the steps released so far (the next release is row ``step``).
      buffers: a structure matching the records, each leaf ``[k, *shape]``: banded, the last
        ``k = b - 1`` noises (newest first); BLT, the ``k = d`` buffers ``s_i``.
      l2_norm_clip, stddev: the clip and the stddev ``sigma`` of each entry of ``Z``.
    """

    step: Any
    buffers: Any
    l2_norm_clip: Any
    stddev: Any


def recurrence_of(strategy: Any) -> Any:
    """The noise recurrence of ``strategy``: its ``noise_recurrence()`` (a strategy of
    ``tf_dp.correlated.strategies``), or ``strategy`` itself when it is already a recurrence
    (has ``coef``, or ``omega`` and ``theta``). Raises TypeError otherwise."""
    if hasattr(strategy, "noise_recurrence"):
        strategy = strategy.noise_recurrence()
    if _kind(strategy) is None:
        raise TypeError(
            "strategy must be a correlated-noise strategy (with noise_recurrence()) or a "
            "BandedRecurrence (coef) / BLTRecurrence (omega, theta), got "
            f"{type(strategy).__name__}"
        )
    return strategy


def _kind(recurrence: Any) -> Optional[str]:
    if hasattr(recurrence, "coef"):
        return "banded"
    if hasattr(recurrence, "omega") and hasattr(recurrence, "theta"):
        return "blt"
    return None


def _along(vector: tf.Tensor, rank: int) -> tf.Tensor:
    """``vector`` ([k]) shaped to broadcast against ``[k, *shape]`` of rank ``rank``."""
    return tf.reshape(vector, [-1] + [1] * (rank - 1))


def _weighted_sum(weights: tf.Tensor, buffers: tf.Tensor) -> tf.Tensor:
    """``sum_j weights[j] * buffers[j]`` ([k] and [k, *shape]) as one matrix-vector product (no
    [k, *shape] temporary)."""
    if buffers.shape[0] == 0:  # b = 1: no past noise
        return tf.zeros(tf.shape(buffers)[1:], buffers.dtype)
    flat = tf.reshape(buffers, [tf.shape(buffers)[0], -1])
    out = tf.linalg.matvec(flat, tf.cast(weights, buffers.dtype), transpose_a=True)
    return tf.reshape(out, tf.shape(buffers)[1:])


def banded_noise_step(coef_row: Any, buffers: Any, z: Any):
    """One step of the banded recurrence: returns ``(w_t, new_buffers)``.

    Args:
      coef_row: ``[b]``, the row ``coef[t]`` (``coef[t, 0] > 0``).
      buffers: ``[b - 1, *shape]``, the last noises ``w_{t-1}, ..., w_{t-b+1}`` (zeros before the
        first step).
      z: ``[*shape]``, the fresh draw ``z_t``.
    """
    z = tf.convert_to_tensor(z)
    coef_row = tf.cast(coef_row, z.dtype)
    past = _weighted_sum(coef_row[1:], buffers)
    w = (z - past) / coef_row[0]
    if buffers.shape[0] == 0:
        return w, buffers
    return w, tf.concat([w[tf.newaxis], buffers[:-1]], axis=0)


def blt_noise_step(omega: Any, theta: Any, buffers: Any, z: Any):
    """One step of the BLT recurrence: returns ``(w_t, new_buffers)``.

    ``w_t = z_t + sum_i omega_i s_i`` and ``s_i <- theta_i s_i + z_t`` (``buffers`` is
    ``[d, *shape]``, the ``s_i``; ``omega``, ``theta`` are ``[d]``).
    """
    z = tf.convert_to_tensor(z)
    w = z + _weighted_sum(tf.cast(omega, z.dtype), buffers)
    theta = _along(tf.cast(theta, z.dtype), buffers.shape.rank)
    return w, theta * buffers + z[tf.newaxis]


def _check_recurrence(recurrence: Any) -> tuple[str, tuple[np.ndarray, ...]]:
    kind = _kind(recurrence)
    if kind == "banded":
        coef = np.asarray(recurrence.coef, np.float64)
        if coef.ndim != 2 or coef.shape[0] < 1 or coef.shape[1] < 1:
            raise ValueError(
                f"BandedRecurrence.coef must have shape (num_steps, bands) with both >= 1, got "
                f"{coef.shape}"
            )
        if not np.all(np.isfinite(coef)) or not np.all(coef[:, 0] > 0):
            raise ValueError(
                "BandedRecurrence.coef must be finite with coef[t, 0] > 0 for every step t"
            )
        return kind, (coef,)
    if kind == "blt":
        omega = np.asarray(recurrence.omega, np.float64).reshape(-1)
        theta = np.asarray(recurrence.theta, np.float64).reshape(-1)
        if omega.shape != theta.shape or omega.size < 1:
            raise ValueError(
                "BLTRecurrence.omega and theta must be vectors of the same length >= 1 (one entry "
                f"per buffer), got {omega.shape} and {theta.shape}"
            )
        if not (np.all(np.isfinite(omega)) and np.all(np.isfinite(theta))) or not np.all(
            np.abs(theta) < 1
        ):
            raise ValueError("BLTRecurrence needs finite omega and theta with |theta_i| < 1")
        return kind, (omega, theta)
    raise TypeError(
        "recurrence must be a BandedRecurrence (coef) or a BLTRecurrence (omega, theta), got "
        f"{type(recurrence).__name__}"
    )


class CorrelatedNoiseSumQuery(RecordStateMixin, JointClipSumQuery):
    """The clipped sum of step ``t`` plus row ``t`` of ``C^{-1} Z`` (DP matrix factorization).

    Records are clipped jointly to ``l2_norm_clip`` (as ``GaussianSumQuery``); each entry of
    ``Z`` is ``N(0, stddev^2)``. Carried by the engine of a DP optimizer
    (:class:`tf_dp.keras.DPKerasMFOptimizer`), which keeps the state in variables.

    Args:
      l2_norm_clip: clip bound ``C`` of each record (finite, >= 0).
      stddev: ``sigma``, the stddev of each entry of ``Z`` (finite, >= 0); the
        noise multiplier times the clip, for a strategy calibrated in noise multipliers.
      recurrence: a strategy of ``tf_dp.correlated.strategies`` or its ``noise_recurrence()``.
      record_specs: the structure of one record (``tf.TensorSpec``\\ s, tensors or variables);
        may be given later with :meth:`set_record_specs`.
      seed: tests and debugging only (a known seed makes the noise predictable and voids the
        guarantee); ``None`` keys the generator from OS entropy.
    """

    def __init__(
        self,
        l2_norm_clip: Any,
        stddev: Any,
        recurrence: Any,
        record_specs: Any = None,
        seed: Optional[int] = None,
    ):
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip)
        self._stddev = check_scalar("stddev", stddev)
        # the strategy's config (C), recorded with every release for the accountants; a bare
        # recurrence has none, and its releases are recorded without noise (epsilon = inf)
        self._strategy_json = (
            json.dumps(recurrence.to_config(), sort_keys=True, separators=(",", ":"),
                       allow_nan=False)
            if hasattr(recurrence, "to_config") else None
        )
        self._recurrence = recurrence_of(recurrence)
        self._kind, arrays = _check_recurrence(self._recurrence)
        if self._kind == "banded":
            (self._coef,) = arrays
            self._buffers = self._coef.shape[1] - 1
        else:
            self._omega, self._theta = arrays
            self._buffers = self._omega.size
        self._init_record_state(seed, record_specs)

    # -- configuration ---------------------------------------------------------------------------

    @property
    def recurrence(self) -> Any:
        return self._recurrence

    @property
    def kind(self) -> str:
        """``"banded"`` or ``"blt"``."""
        return self._kind

    @property
    def num_buffers(self) -> int:
        """Model-sized buffers in the state: ``b - 1`` (banded) or ``d`` (BLT)."""
        return self._buffers

    @property
    def l2_norm_clip(self) -> Any:
        return self._l2_norm_clip

    @property
    def stddev(self) -> Any:
        return self._stddev

    # -- DPQuery protocol ------------------------------------------------------------------------

    def initial_global_state(self) -> CorrelatedNoiseState:
        buffers = self._zeros_per_record(self._buffers)
        return CorrelatedNoiseState(
            tf.constant(0, tf.int64), buffers, self._l2_norm_clip, self._stddev
        )

    def noise_step(self, step: Any, buffers: Any, z: Any):
        """The recurrence at step ``step`` on one leaf: ``(w_t, new_buffers)`` from the draw
        ``z`` (``[*shape]``) and that leaf's buffers."""
        if self._kind == "banded":
            n = self._coef.shape[0]
            row = tf.gather(
                tf.constant(self._coef, buffers.dtype),
                tf.minimum(tf.cast(step, tf.int64), n - 1),
            )
            return banded_noise_step(row, buffers, z)
        return blt_noise_step(self._omega, self._theta, buffers, z)

    def get_noised_result(self, sample_state: Any, global_state: CorrelatedNoiseState):
        dense = tf.nest.map_structure(
            lambda t: tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t,
            sample_state,
        )
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        step = tf.cast(global_state.step, tf.int64)
        out, new_buffers = [], []
        for x, buf in zip(tf.nest.flatten(dense), tf.nest.flatten(global_state.buffers)):
            buf = tf.convert_to_tensor(buf)
            shape = buf.shape[1:]
            z = gaussian_noise(
                self._generator, shape.num_elements(), buf.dtype, tf.cast(stddev, buf.dtype)
            )
            w, new = self.noise_step(step, buf, tf.reshape(z, shape))
            out.append(x + tf.cast(w, x.dtype))
            new_buffers.append(new)
        new_state = global_state._replace(
            step=step + 1,
            buffers=tf.nest.pack_sequence_as(global_state.buffers, new_buffers),
        )
        return tf.nest.pack_sequence_as(dense, out), new_state

    def sum_query_specs(self, global_state: CorrelatedNoiseState) -> list[dp_query.SumQuerySpec]:
        # Each release is recorded as an ``mf`` sum query carrying the strategy's config (C) and
        # the stddev of Z's entries: the accountants read the run's C from the ledger
        # (tf_dp.accounting.compute_epsilon). A bare recurrence (no config) is recorded without
        # noise, so every accountant reports an infinite epsilon (a valid bound), never DP-SGD's.
        if self._strategy_json is None:
            return [dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.constant(0.0, tf.float32), noise_seed=self._seed)]
        return [
            dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
                mf_strategy=self._strategy_json,
            )
        ]

    def derive_metrics(self, global_state: CorrelatedNoiseState) -> dict[str, Any]:
        return {
            "l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
            "mf_step": tf.cast(global_state.step, tf.int64),
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(l2_norm_clip={self._l2_norm_clip!r}, stddev={self._stddev!r}, "
            f"{self._kind}, buffers={self._buffers})"
        )
