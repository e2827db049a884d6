"""Balls-in-bins batches: every pass throws each example into one of ``T`` batches at random.

At the start of every pass over the data, each of the ``n`` examples is assigned to one of ``T``
batches independently and uniformly at random (Chua et al. 2025, "Balls-and-Bins Sampling for
DP-SGD"); the pass then trains on the ``T`` batches in order. Every example is used exactly once
per pass, as with shuffling, while the batches are independent of each other's sizes, as with
Poisson sampling. A batch holds ``Binomial(n, 1 / T)`` examples (``n / T`` on average); it is
padded with zero-weight rows to ``max_batch_size`` (default: the ``1 - overflow_probability``
quantile, ``1e-6`` per step), and a rarer larger batch is emitted whole, never truncated::

    batches = tf_dp.data.balls_in_bins_batches(x_train, y_train, batch_size=256)
    model.fit(batches, epochs=3)   # the ledger records ("balls_in_bins", n, q = 1 / T) per step

``T = ceil(n / batch_size)`` by default (``num_batches`` sets it). The ledger records
``balls_in_bins`` with ``q = 1 / T`` (each example's chance to be in a given step) and marks the
first step of every pass (each ``fit`` epoch). The DP optimizer divides the noised sum by the
public ``n / T``.

Privacy: the certified bound (``tf_dp.accounting.compute_epsilon``) charges each pass as one
Gaussian mechanism with sensitivity ``C`` (an added example changes exactly one batch of its pass;
no amplification assumed), counted per pass as for shuffled batches but under add/remove
adjacency. The amplification balls-in-bins gives is estimated, not proven, by
:func:`tf_dp.accounting.balls_in_bins_estimate` (Monte Carlo, with its confidence stated).

``fit`` must run whole passes: ``steps_per_epoch`` is ``T`` (a different value is refused), so
that every ``fit`` epoch is one assignment of the examples to batches.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    SampledBatches,
    _check_positive_int,
)
from tf_dp.data.sampling import Sampling
from tf_dp.data.truncated_poisson import (
    check_arrays,
    check_shards,
    gather_padded,
    gather_user_rows,
    sampler_key,
    sharded_dataset,
    step_rng,
)
from tf_dp.data.users import user_rows

__all__ = ["BallsInBinsBatches", "balls_in_bins_batches"]


@dataclasses.dataclass(frozen=True)
class BallsInBinsBatches(SampledBatches):
    """Balls-in-bins batches, ready for ``model.fit`` of a private model.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches, exactly
        ``steps_per_epoch = T`` per pass; every pass draws a fresh assignment.
      tf_dp_sampling: ``(n, 1 / T)``.
      steps_per_epoch: ``T``, the batches of one pass.
      max_batch_size: the padded batch size (a larger batch is emitted whole); with
        ``user_ids`` in user slots (rows are slots * k).
      records_per_user: ``k`` with ``user_ids`` (user-level batches), else None.
      sampling: the :class:`tf_dp.data.Sampling` (``balls_in_bins``, ``origin="sampled"``).
    """

    records_per_user: Optional[int] = None

    @property
    def sampling(self) -> Sampling:
        n, q = int(self.tf_dp_sampling[0]), float(self.tf_dp_sampling[1])
        if self.records_per_user is not None:  # users thrown into the bins, k records each
            return Sampling(n, q, "balls_in_bins", origin="sampled", unit="user",
                            records_per_unit=int(self.records_per_user))
        return Sampling(n, q, "balls_in_bins", origin="sampled")


def batches_per_pass(n: int, batch_size: Optional[int], num_batches: Optional[int]) -> int:
    """``T``, the batches of one pass: ``num_batches``, or ``ceil(n / batch_size)`` (exactly one
    given; each checked against ``[1, n]``)."""
    if (batch_size is None) == (num_batches is None):
        raise ValueError("give exactly one of batch_size (expected size b) and num_batches (T)")
    if num_batches is None:
        batch_size = _check_positive_int("batch_size", batch_size)
        if batch_size > n:
            raise ValueError(f"batch_size must be in [1, n={n}], got {batch_size}")
        num_batches = math.ceil(n / batch_size)
    num_batches = _check_positive_int("num_batches", num_batches)
    if num_batches > n:
        raise ValueError(f"num_batches must be in [1, n={n}], got {num_batches}")
    return num_batches


def balls_in_bins_batches(
    x: Any,
    y: Any = None,
    batch_size: Optional[int] = None,
    sample_weight: Any = None,
    num_batches: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> BallsInBinsBatches:
    """Batches where every pass assigns each example to one of ``T`` batches uniformly at random.

    Args:
      x: inputs, an array or a nested structure (dict, tuple) of arrays with ``n`` rows each.
      y: targets, ``n`` rows; required (padding is masked through the sample weight).
      batch_size: the expected batch size ``b``; ``T = ceil(n / b)``. Give this or
        ``num_batches``.
      sample_weight: optional per-example weights ``[n]``; padding rows get weight 0.
      num_batches: ``T`` in [1, n], the batches of one pass.
      max_batch_size: padded batch size; default: the ``1 - overflow_probability`` quantile of
        ``Binomial(n, 1 / T)``. A larger batch is emitted whole (never truncated).
      seed: fixes the sampling randomness. Tests and debugging only (default: OS entropy).
      overflow_probability: per-step probability that the default ``max_batch_size`` is exceeded.
      user_ids: for user-level DP: one integer or string id per example (``[n]``). Every pass
        then throws each *user* into one of ``T`` batches (``T`` from ``batch_size`` or
        ``num_batches``, counted in users), and each user of a batch contributes at most
        ``max_records_per_user`` of its examples (a fresh uniformly random choice at each
        pass); the DP step clips each user's summed gradient to ``C``. ``max_batch_size``
        counts user slots of ``k`` rows. The ledger records ``balls_in_bins`` over ``n =
        number of users``, unit ``user``; the accountants charge the same mechanism over users.
      max_records_per_user: ``k`` >= 1, required with ``user_ids``.
      num_shards, shard_index: multi-worker training: every worker passes the whole data set,
        its ``shard_index`` in ``[0, num_shards)`` and the same ``seed`` (required: a secret the
        workers share). All workers draw the same assignment every pass; at each step worker
        ``w`` trains on every ``num_shards``-th example of the step's batch from position ``w``
        (padded to ``ceil(max_batch_size / num_shards)`` rows): each example is in one replica
        of one step per pass. Not with ``user_ids`` yet.

    Returns:
      A :class:`BallsInBinsBatches`; pass it to a private model's ``fit``.

    Example:

    >>> import numpy as np, tf_dp
    >>> x, y = np.arange(100, dtype=np.float32)[:, None], np.zeros(100, np.int32)
    >>> batches = tf_dp.data.balls_in_bins_batches(x, y, batch_size=10, seed=0)
    >>> batches.steps_per_epoch, batches.sampling.policy, batches.expected_batch_size
    (10, 'balls_in_bins', 10.0)
    >>> seen = [xb.numpy()[w.numpy() > 0, 0] for xb, _, w in batches.dataset]  # one pass
    >>> sorted(float(v) for b in seen for v in b) == [float(i) for i in range(100)]
    True
    """
    from tf_dp.data.poisson import default_max_batch_size

    from tf_dp.data.users import user_index_for

    x, y, sample_weight, n = check_arrays(x, y, sample_weight)
    users, k_user = user_index_for(user_ids, max_records_per_user, n)
    units = n if users is None else users.num_users
    num_shards, shard_index = check_shards(num_shards, shard_index, seed, units, user_ids)
    t = batches_per_pass(units, batch_size, num_batches)
    q = 1.0 / t
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(units, q, overflow_probability)
    max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
    key = sampler_key(seed)
    x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
    y_t = tf.nest.map_structure(tf.convert_to_tensor, y)
    sw_t = None if sample_weight is None else tf.convert_to_tensor(sample_weight)
    key_t = tf.constant(key, tf.int64)

    def batch(step: tf.Tensor, counter: tf.Tensor):
        # The pass's assignment, redrawn from its key at every step (O(n) work, no state).
        bins = tf.random.stateless_uniform(
            [n], seed=tf.stack([key_t, counter]), minval=0, maxval=t, dtype=tf.int64
        )
        idx = tf.reshape(tf.where(tf.equal(bins, step)), [-1])
        return gather_padded(x_t, y_t, sw_t, idx, max_batch_size, fixed=False)

    if users is not None:
        def draw_rows(step: np.ndarray, counter: np.ndarray) -> np.ndarray:
            # the pass's assignment of users, redrawn from (key, counter) at every step; the
            # records of the step's users from (key, counter, step)
            bins = step_rng(key, counter).integers(0, t, size=users.num_users)
            chosen = np.flatnonzero(bins == int(step)).astype(np.int64)
            return user_rows(users, chosen, k_user, max_batch_size,
                             step_rng(key, counter, int(step) + 1))

        def batch(step: tf.Tensor, counter: tf.Tensor):  # noqa: F811 (user slots of k rows)
            rows = tf.numpy_function(draw_rows, [step, counter], tf.int64, stateful=False)
            rows.set_shape([None])
            return gather_user_rows(x_t, y_t, sw_t, rows)

    # One random counter per pass (a fresh one at every iteration of the dataset), repeated for
    # the pass's T steps; enumerate() numbers the steps 0..T-1.
    passes = tf.data.Dataset.random(seed=key % (1 << 31), rerandomize_each_iteration=True)
    dataset = (
        passes.take(1)
        .flat_map(lambda c: tf.data.Dataset.from_tensors(c).repeat(t))
        .enumerate()
        .map(batch)
        .apply(tf.data.experimental.assert_cardinality(t))  # Keras restarts it every epoch
        .prefetch(2)
    )
    if num_shards > 1:  # the shared assignment of every pass, this worker's share of a step
        def draw(pass_id: int, step: int) -> np.ndarray:
            bins = step_rng(key, pass_id).integers(0, t, size=n)
            return np.flatnonzero(bins == step).astype(np.int64)

        dataset = sharded_dataset(draw, t, num_shards, shard_index,
                                  -(-max_batch_size // num_shards), x_t, y_t, sw_t)
    return BallsInBinsBatches(
        dataset=dataset,
        tf_dp_sampling=(units, q),
        steps_per_epoch=t,
        max_batch_size=max_batch_size,
        num_shards=num_shards,
        records_per_user=k_user,
    )
