"""User-level sampling: Poisson sampling of users, at most ``k`` records per sampled user.

Many private data sets hold several records per person. Example-level DP protects one record;
user-level DP protects all the records of one user (neighbouring data sets differ by adding or
removing one user with every record they have). tf_dp's user-level DP-SGD step:

1. **Sampling.** At every step each of the ``n_users`` users is included independently with
   probability ``q`` (Poisson sampling of users). From each sampled user, at most ``k`` of their
   records are drawn uniformly at random without replacement (all of them when they have ``k``
   or fewer). The users are drawn as ``Binomial(n_users, q)`` users, then a uniform subset of
   that size (:func:`tf_dp.data.inclusion.poisson_subset`, the same distribution as one coin
   per user), so a step's work grows with the sampled users' records, not with ``n_users``.
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

Multi-worker training (``num_shards=W``, ``shard_index=w``): worker ``w`` samples, at rate
``q``, the users whose position in the :class:`UserIndex` is ``w`` modulo ``W``
(:meth:`UserIndex.shard`), with all their records. The shards partition the users, so a user is
sampled by at most one worker per step, the union of the workers' samples is one Poisson sample
of all users at rate ``q``, and a sampled user still contributes at most ``k`` records. Every
worker records the total number of users and ``q``; the denominator is the global
``q * n_users``.

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

from tf_dp.data.inclusion import poisson_subset


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

    def shard(self, num_shards: int, shard_index: int) -> "UserIndex":
        """The users ``u`` with ``u % num_shards == shard_index`` (``u``: the user's position in
        this index) and all their records, for multi-worker sampling: the shards partition the
        users, and each user's records live on one shard. ``order`` keeps the record indices of
        the whole data set.

        Raises ValueError naming ``num_shards`` when it exceeds the number of users (a shard
        would have none).

        Example::

            index.shard(2, 1).user_keys   # the ids of users 1, 3, 5, ...
        """
        if num_shards > self.num_users:
            raise ValueError(
                f"num_shards must be <= the number of users ({self.num_users}) with user_ids, "
                f"got {num_shards}"
            )
        if num_shards == 1:
            return self
        users = np.arange(shard_index, self.num_users, num_shards, dtype=np.int64)
        positions, _ = _records_of(self.starts, users)
        counts = np.diff(self.starts)[users]
        starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        return UserIndex(order=self.order[positions], starts=starts,
                         user_keys=self.user_keys[users])


def check_records_per_user(k: Any) -> int:
    """``k`` as an int if it is an integer >= 1; ValueError naming ``max_records_per_user``."""
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"max_records_per_user must be an integer >= 1, got {k!r}")
    return int(k)


def user_index_for(
    user_ids: Any, max_records_per_user: Any, num_records: int
) -> tuple[Optional[UserIndex], Optional[int]]:
    """A sampler's user arguments checked: ``(UserIndex, k)``, or ``(None, None)`` without ids.

    Raises ValueError naming the argument: ``max_records_per_user`` missing, not an integer >= 1,
    or given without ``user_ids``; ``user_ids`` of the wrong dtype, shape or length.

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
    return UserIndex.from_user_ids(user_ids, num_records), k


def _records_of(starts: np.ndarray, users: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, owner)``: the positions in ``order`` of ``users``' records, user after
    user, and for each the position of its user in ``users`` (``O(records)`` work)."""
    first = starts[users]
    counts = starts[users + 1] - first
    owner = np.repeat(np.arange(len(users), dtype=np.int64), counts)
    before = np.cumsum(counts) - counts  # records of the earlier users
    positions = np.arange(len(owner), dtype=np.int64) + (first - before)[owner]
    return positions, owner


def sample_user_rows(
    index: UserIndex,
    q: float,
    k: int,
    max_users: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """The record indices of one user-level batch: Poisson-sampled users, at most ``k`` records
    each, in slots of ``k`` rows.

    Every user of ``index`` joins independently with probability ``q``
    (:func:`tf_dp.data.inclusion.poisson_subset`, the draw the example-level
    :func:`tf_dp.data.poisson_sample` uses: ``Binomial(n_users, q)`` users, then a uniform subset
    of that size); a sampled user's records are ranked by fresh uniform keys and the ``k`` first
    are kept (a uniformly random subset of ``min(k, c)`` of its ``c`` records). Sampled user
    ``j`` (in user order) fills slot ``j``: rows ``j k .. j k + k - 1``. The work is proportional
    to the sampled users' records, not to the number of users.

    Args:
      index: the users to sample from (a :class:`UserIndex`, or one shard of it,
        :meth:`UserIndex.shard`).
      q: the per-user inclusion probability, in (0, 1].
      k: the most records per sampled user.
      max_users: slots per batch; a batch with more sampled users gets one slot per user.
      rng: the generator to draw from (its state advances).

    Returns:
      int64 ``[max(max_users, users sampled) * k]``: record indices, ``-1`` for padding rows.

    Example::

        index = UserIndex.from_user_ids(user_of_record, len(user_of_record))
        rows = sample_user_rows(index, 0.01, 4, 32, np.random.default_rng())
    """
    return user_rows(index, poisson_subset(rng, index.num_users, q), k, max_users, rng)


def user_rows(
    index: UserIndex,
    users: np.ndarray,
    k: int,
    max_users: int,
    rng: np.random.Generator,
) -> np.ndarray:
    """The record indices of one user-level batch of the given ``users``: at most ``k`` records
    each (a uniformly random subset of ``min(k, c)`` of a user's ``c`` records), user ``j`` of
    ``users`` in slot ``j`` (rows ``j k .. j k + k - 1``), ``-1`` for padding rows.

    The selection of the users is the caller's (:func:`sample_user_rows`: Poisson; the truncated
    Poisson and balls-in-bins samplers of :mod:`tf_dp.data`: their own).

    Args:
      index: the :class:`UserIndex` the users are positions of.
      users: int64 positions of the batch's users in ``index``, ascending.
      k: the most records per user.
      max_users: slots per batch; more users get one slot each.
      rng: the generator of the record choice (its state advances).

    Returns:
      int64 ``[max(max_users, len(users)) * k]``.

    Example::

        rows = user_rows(index, np.array([0, 5]), 4, 8, np.random.default_rng())  # 32 rows
    """
    users = np.asarray(users, dtype=np.int64)
    positions, owner = _records_of(index.starts, users)
    # ranks within each user by a fresh uniform key: sorted by owner, then by the key
    by = np.lexsort((rng.random(len(positions)), owner))
    positions = positions[by]
    counts = index.starts[users + 1] - index.starts[users]
    rank = np.arange(len(positions), dtype=np.int64) - (np.cumsum(counts) - counts)[owner]
    keep = rank < k
    num_slots = max(int(max_users), len(users))
    rows = np.full(num_slots * k, -1, np.int64)
    rows[owner[keep] * k + rank[keep]] = index.order[positions[keep]]
    return rows
