"""User-level sampling: Poisson sampling of users, at most ``k`` records per sampled user.

Many private data sets hold several records per person. Example-level DP protects one record;
user-level DP protects all the records of one user (neighbouring data sets differ by adding or
removing one user with every record they have). tf_dp's user-level DP-SGD step:

1. **Sampling.** At every step each of the ``n_users`` users is included independently with
   probability ``q`` (Poisson sampling of users). From each sampled user, at most ``k`` of their
   records are drawn uniformly at random without replacement (all of them when they have ``k``
   or fewer).
2. **Clipping.** The sum of a sampled user's per-record gradients is clipped to ``C`` (one
   clipped vector per user, in every gradient mode), and the clipped user sums are added.
3. **Noise and denominator.** Gaussian noise of standard deviation ``sigma C`` is added to the
   sum, which is divided by the expected number of users per batch ``q * n_users``.

Adding or removing one user changes the sum by one clipped vector of norm at most ``C``, so the
ledger records sensitivity ``C`` with the population and rate of *users* (``unit="user"``): the
accountants then give a user-level guarantee, the same epsilon as an example-level run with ``n``
records at rate ``q``. The role of ``k``: it bounds a user's work per step (and the batch's
size), and it bounds the user's contribution only through the clip: whatever ``k`` is, the user's
clipped sum has norm at most ``C``, so ``k`` never changes the sensitivity or the epsilon. A
larger ``k`` uses more of each sampled user's data per step (more signal in the user's sum, more
compute per step); a smaller one a smaller, cheaper batch.

Batch layout (what the train step relies on): a batch has ``max_users * k`` rows (more if more
users are sampled; never truncated), in ``max_users`` slots of ``k`` consecutive rows: row ``r``
belongs to user slot ``r // k``. A user with fewer than ``k`` drawn records, and every slot no
user took, is padded with rows of sample weight 0, which add nothing to any sum (their loss, and
hence every gradient factor of theirs, is zero). The slot of a row is its position, so the batch
needs no extra element; under ``tf.distribute`` batches are padded to a multiple of
``replicas * k`` rows so that each replica gets whole slots.

Any source that can fetch records by index uses the same function: :func:`sample_user_rows` turns
a :class:`UserIndex` into the record indices of one batch (``-1`` for padding), and the source
gathers those records. :func:`tf_dp.data.poisson_batches` does this for in-memory arrays, and
:func:`tf_dp.data.poisson_sample` for random-access sources (files, memmaps)::

    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=64 / n_users,
                                         user_ids=user_of_record, max_records_per_user=4)
    model.fit(batches, epochs=2)   # ledger: unit "user", n = users, q, k = 4, sampled by tf_dp
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.data.inclusion import included


@dataclasses.dataclass(frozen=True)
class UserIndex:
    """The records of a data set grouped by user, for :func:`sample_user_rows`.

    Attributes:
      order: int64 ``[n_records]``, record indices sorted by user (user 0's records first).
      starts: int64 ``[n_users + 1]``: user ``u``'s records are ``order[starts[u]:starts[u+1]]``.
      user_keys: the distinct user ids, in the order of the users (``user_keys[u]`` is user
        ``u``'s id as given).
    """

    order: np.ndarray
    starts: np.ndarray
    user_keys: np.ndarray

    @property
    def num_users(self) -> int:
        return int(len(self.starts) - 1)

    @property
    def num_records(self) -> int:
        return int(len(self.order))

    def records_per_user(self) -> np.ndarray:
        """``[n_users]``: how many records each user has."""
        return np.diff(self.starts)

    @classmethod
    def from_user_ids(cls, user_ids: Any, num_records: int) -> "UserIndex":
        """Groups ``num_records`` records by ``user_ids`` (one integer or string id per record).

        Raises ValueError (naming ``user_ids``) for ids of the wrong dtype, shape or length.

        Example::

            index = UserIndex.from_user_ids(np.array([7, 3, 7, 7]), 4)
            index.num_users, index.records_per_user()   # 2, [1, 3]
        """
        ids = np.asarray(user_ids)
        if ids.ndim != 1:
            raise ValueError(
                f"user_ids must be a 1-D array with one id per record, got shape {ids.shape}"
            )
        if ids.shape[0] != num_records:
            raise ValueError(
                f"user_ids must hold one id per record ({num_records}), got {ids.shape[0]}"
            )
        if not (np.issubdtype(ids.dtype, np.integer) or ids.dtype.kind in "US"):
            raise ValueError(
                "user_ids must be integers or strings (one id per record), got dtype "
                f"{ids.dtype}"
            )
        if num_records < 1:
            raise ValueError("user_ids must hold at least one id")
        keys, inverse = np.unique(ids, return_inverse=True)
        order = np.argsort(inverse, kind="stable").astype(np.int64)
        counts = np.bincount(inverse, minlength=len(keys))
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return cls(order=order, starts=starts, user_keys=keys)


def check_records_per_user(k: Any) -> int:
    """``k`` as an int if it is an integer >= 1; ValueError naming ``max_records_per_user``."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"max_records_per_user must be an integer >= 1, got {k!r}")
    return int(k)


def user_index_for(
    user_ids: Any, max_records_per_user: Any, num_records: int, num_shards: int = 1
) -> tuple[Optional[UserIndex], Optional[int]]:
    """A sampler's user arguments checked: ``(UserIndex, k)``, or ``(None, None)`` without ids.

    Raises ValueError naming the argument: ``max_records_per_user`` missing, not an integer >= 1,
    or given without ``user_ids``; ``user_ids`` of the wrong dtype, shape or length; ``num_shards``
    other than 1 with ``user_ids`` (user-level sampling is not sharded).

    Example::

        index, k = user_index_for(np.array([7, 3, 7]), 2, 3)   # 2 users, k = 2
    """
    if user_ids is None:
        if max_records_per_user is not None:
            raise ValueError("max_records_per_user is only used with user_ids")
        return None, None
    if max_records_per_user is None:
        raise ValueError(
            "max_records_per_user must be an integer >= 1 with user_ids (the most records "
            "one sampled user contributes to a batch), got None"
        )
    k = check_records_per_user(max_records_per_user)
    index = UserIndex.from_user_ids(user_ids, num_records)
    if num_shards != 1:
        raise ValueError(
            f"num_shards must be 1 with user_ids (user-level sampling is not sharded), got "
            f"{num_shards!r}"
        )
    return index, k


def sample_user_rows(
    order: tf.Tensor,
    starts: tf.Tensor,
    q: tf.Tensor,
    k: int,
    max_users: int,
    seed: tf.Tensor,
) -> tf.Tensor:
    """The record indices of one user-level batch (graph-safe: for ``tf.data`` maps).

    Every user joins independently with probability ``q`` (:func:`tf_dp.data.inclusion.included`
    on a float64 uniform, as for examples); a sampled user's records are ranked by fresh uniform
    keys and the ``k`` first are kept (a uniformly random subset of ``min(k, c)`` of its ``c``
    records). Sampled user ``j`` (in user order) fills slot ``j``: rows ``j k .. j k + k - 1``.

    Args:
      order, starts: a :class:`UserIndex`'s arrays as int64 tensors.
      q: float64 scalar, the per-user inclusion probability.
      k: the most records per sampled user.
      max_users: slots per batch; a batch with more sampled users gets one slot per user.
      seed: int64 ``[2]``, the Philox key of this step (``stateless_uniform`` seed).

    Returns:
      int64 ``[max(max_users, users sampled) * k]``: record indices, ``-1`` for padding rows.

    Example::

        rows = sample_user_rows(tf.constant(index.order), tf.constant(index.starts),
                                tf.constant(0.01, tf.float64), 4, 32, tf.constant([1, 2], tf.int64))
    """

    n_users = tf.shape(starts, out_type=tf.int64)[0] - 1
    u = tf.random.stateless_uniform([n_users], seed=seed, dtype=tf.float64)
    users = tf.reshape(tf.where(included(u, q)), [-1])  # sampled users, in user order
    first = tf.gather(starts, users)
    counts = tf.gather(starts, users + 1) - first
    positions = tf.ragged.range(first, first + counts)  # each sampled user's records
    flat = positions.flat_values
    slot = positions.value_rowids()
    # ranks within each user by a fresh uniform key: slot + v sorts by user, then by v
    v = tf.random.stateless_uniform(
        tf.shape(flat), seed=tf.random.experimental.stateless_fold_in(seed, 1), dtype=tf.float64
    )
    by = tf.argsort(tf.cast(slot, tf.float64) + v, stable=True)
    sorted_flat = tf.gather(flat, by)
    sorted_slot = tf.gather(slot, by)
    rank = tf.range(tf.size(sorted_flat, out_type=tf.int64)) - tf.gather(
        tf.cumsum(counts, exclusive=True), sorted_slot
    )
    keep = rank < k
    records = tf.gather(order, tf.boolean_mask(sorted_flat, keep))
    target = tf.boolean_mask(sorted_slot * k + rank, keep)
    num_slots = tf.maximum(tf.cast(max_users, tf.int64), tf.size(users, out_type=tf.int64))
    return tf.tensor_scatter_nd_update(
        tf.fill([num_slots * k], tf.constant(-1, tf.int64)), target[:, None], records
    )
