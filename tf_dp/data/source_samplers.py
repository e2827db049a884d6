"""Truncated Poisson and balls-in-bins batches read from a random-access source.

The file-source counterparts of :func:`tf_dp.data.truncated_poisson_batches` and
:func:`tf_dp.data.balls_in_bins_batches`: the same batch selections, the same sampling claims in
the ledger, but only the selected records are read (``source.read``), from any
:class:`~tf_dp.data.RandomAccessSource` (``ArraySource`` over memmaps, ``TFRecordSource``,
``ArrayRecordSource``, ``hdf5_source``), as :func:`tf_dp.data.poisson_sample` does for Poisson.

* :func:`truncated_poisson_sample`: every step draws a Poisson sample (the same draw as
  :func:`~tf_dp.data.poisson_sample`: a ``Binomial(n, p)`` size, then a uniform subset, with
  ``p <= q``); a sample larger than ``B`` keeps a uniformly random ``B`` of its records; every
  batch has exactly ``B`` rows (padding rows of zeros with sample weight 0).
* :func:`balls_in_bins_sample`: every pass assigns each record to one of ``T`` batches uniformly
  at random (``T`` draws of ``integers(0, T)``, one per record: ``O(n)`` memory per pass, 16 bytes
  a record), then the ``T`` steps read the batches in order; each record is read once per pass.

Randomness: a Philox generator keyed from OS entropy; ``seed`` fixes it (tests and debugging
only). Reading runs in a ``tf.data`` background thread, ``prefetch`` batches ahead.

User-level units (``user_ids=``, ``max_records_per_user=k``): the selection runs over users
(truncated Poisson: users sampled at rate ``q``, cut to ``B`` users; balls-in-bins: users thrown
into the ``T`` batches), each selected user contributes at most ``k`` records chosen uniformly at
random (:func:`tf_dp.data.users.user_rows`), and only those records are read; batches have the
user-slot layout of :mod:`tf_dp.data.users`.

Sharding over workers (``num_shards``) is offered here for Poisson only
(:func:`~tf_dp.data.poisson_sample`): a per-worker truncation or a per-worker bin assignment
would not be the global selection the accountants analyse. Over in-memory arrays,
:func:`~tf_dp.data.truncated_poisson_batches` and :func:`~tf_dp.data.balls_in_bins_batches`
shard one global selection drawn from a seed all workers share.

Example::

    source = tf_dp.data.ArraySource(np.load("x.npy", mmap_mode="r"), np.load("y.npy"))
    model.fit(tf_dp.data.truncated_poisson_sample(source, sampling_probability=0.01), epochs=3)
    model.fit(tf_dp.data.balls_in_bins_sample(source, batch_size=256), epochs=3)
"""

from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.accounting.ledger_analysis import poisson_steps_per_epoch
from tf_dp.data.balls_in_bins import BallsInBinsBatches, batches_per_pass
from tf_dp.data.inclusion import poisson_subset
from tf_dp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    _check_positive_int,
    _check_probability,
    default_max_batch_size,
)
from tf_dp.data.sampler import (
    _pad,
    _scatter,
    check_length,
    check_source,
    generator_dataset,
    read_records,
    source_rng,
)
from tf_dp.data.truncated_poisson import (
    DEFAULT_TRUNCATION_PROBABILITY,
    TruncatedPoissonBatches,
    default_truncation_size,
    truncated_user_rows,
)
from tf_dp.data.users import user_index_for, user_rows

__all__ = ["balls_in_bins_sample", "truncated_poisson_sample"]


def _padded(source: Any, indices: np.ndarray, rows: int) -> tuple:
    return tf.nest.map_structure(lambda a: _pad(a, rows), read_records(source, indices))


def _slotted(source: Any, slots: np.ndarray) -> tuple:
    """The records of a user-level batch (``-1``: a padding row of zeros, weight 0)."""
    real = slots >= 0
    if real.any():
        got = read_records(source, slots[real])
    else:
        got = tf.nest.map_structure(lambda a: a[:0], read_records(source, np.array([0])))
    return tf.nest.map_structure(lambda a: _scatter(a, real), got)



def truncated_poisson_sample(
    source: Any,
    sampling_probability: float,
    steps_per_epoch: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    truncation_probability: float = DEFAULT_TRUNCATION_PROBABILITY,
    prefetch: int = 2,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
) -> TruncatedPoissonBatches:
    """Poisson batches of one fixed shape ``[B, ...]`` read from a random-access source.

    Args:
      source: a :class:`~tf_dp.data.RandomAccessSource` whose ``read`` returns ``(x, y)`` or
        ``(x, y, sample_weight)`` numpy batches.
      sampling_probability: ``q`` in (0, 1], each record's inclusion probability at every step.
      steps_per_epoch: batches per epoch; default ``round(1 / q)``.
      max_batch_size: ``B`` in [1, n], the rows of every batch and the most records kept;
        default :func:`~tf_dp.data.default_truncation_size` at ``truncation_probability``.
      seed: fixes the sampling randomness (tests and debugging only; default OS entropy).
      truncation_probability: per-step probability that the default ``B`` drops records.
      prefetch: batches read ahead of the training step (>= 1).
      user_ids, max_records_per_user: user-level units (see the module docstring): ``B`` users
        per batch, every batch ``B * k`` rows.

    Returns:
      A :class:`~tf_dp.data.TruncatedPoissonBatches`; ``.sampling`` is
      ``Sampling(n, q, "truncated_poisson", "sampled", max_batch_size=B)`` (with ``user_ids``:
      ``n`` users, ``unit="user"``, ``records_per_unit=k``).

    Example::

        source = tf_dp.data.TFRecordSource(files, parse_fn=parse)
        batches = tf_dp.data.truncated_poisson_sample(source, sampling_probability=1e-3)
        model.fit(batches, epochs=2)   # one batch shape for every step
    """
    n = check_source(source)
    q = _check_probability(sampling_probability)
    users, k_user = user_index_for(user_ids, max_records_per_user, n)
    units = n if users is None else users.num_users
    if steps_per_epoch is None:
        steps_per_epoch = poisson_steps_per_epoch(q)
    steps_per_epoch = _check_positive_int("steps_per_epoch", steps_per_epoch)
    if max_batch_size is None:
        max_batch_size = default_truncation_size(units, q, truncation_probability)
    b = _check_positive_int("max_batch_size", max_batch_size)
    if b > units:
        what = "n" if users is None else "number of users"
        raise ValueError(
            f"max_batch_size must be in [1, {what}={units}] (a larger B never truncates: use "
            f"poisson_sample), got {b}"
        )
    prefetch = _check_positive_int("prefetch", prefetch)
    rng = source_rng(seed)

    def batches():
        for _ in range(steps_per_epoch):
            check_length(source, n)
            if users is not None:
                yield _slotted(source, truncated_user_rows(users, q, k_user, b, rng))
                continue
            idx = poisson_subset(rng, n, q)
            if len(idx) > b:  # keep a uniformly random B of the sample
                idx = np.sort(rng.choice(idx, size=b, replace=False))
            yield _padded(source, idx, b)

    return TruncatedPoissonBatches(
        dataset=generator_dataset(source, batches, steps_per_epoch, prefetch),
        tf_dp_sampling=(units, q),
        steps_per_epoch=steps_per_epoch,
        max_batch_size=b,
        records_per_user=k_user,
    )


def balls_in_bins_sample(
    source: Any,
    batch_size: Optional[int] = None,
    num_batches: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
    prefetch: int = 2,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
) -> BallsInBinsBatches:
    """Balls-in-bins batches read from a random-access source: every pass assigns each record to
    one of ``T`` batches uniformly at random and reads each batch at its step.

    Args:
      source: a :class:`~tf_dp.data.RandomAccessSource` whose ``read`` returns ``(x, y)`` or
        ``(x, y, sample_weight)`` numpy batches.
      batch_size: the expected batch size ``b``; ``T = ceil(n / b)``. Give this or
        ``num_batches``.
      num_batches: ``T`` in [1, n], the batches of one pass.
      max_batch_size: padded batch size; default the ``1 - overflow_probability`` quantile of
        ``Binomial(n, 1 / T)``. A larger batch is emitted whole (never truncated).
      seed: fixes the sampling randomness (tests and debugging only; default OS entropy).
      overflow_probability: per-step probability that the default ``max_batch_size`` is exceeded.
      prefetch: batches read ahead of the training step (>= 1).
      user_ids, max_records_per_user: user-level units: every pass throws each user into one of
        ``T`` batches; a batch has ``max_batch_size`` slots of ``k`` rows (more if more users).

    Returns:
      A :class:`~tf_dp.data.BallsInBinsBatches`; ``.sampling`` is
      ``Sampling(n, 1 / T, "balls_in_bins", "sampled")`` (with ``user_ids``: ``n`` users,
      ``unit="user"``, ``records_per_unit=k``).

    Example::

        source = tf_dp.data.ArraySource(np.load("x.npy", mmap_mode="r"), np.load("y.npy"))
        model.fit(tf_dp.data.balls_in_bins_sample(source, batch_size=256), epochs=3)
    """
    n = check_source(source)
    users, k_user = user_index_for(user_ids, max_records_per_user, n)
    units = n if users is None else users.num_users
    t = batches_per_pass(units, batch_size, num_batches)
    q = 1.0 / t
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(units, q, overflow_probability)
    rows = _check_positive_int("max_batch_size", max_batch_size)
    prefetch = _check_positive_int("prefetch", prefetch)
    rng = source_rng(seed)

    def batches():  # one pass: a fresh assignment every time the dataset is iterated
        check_length(source, n)
        bins = rng.integers(0, t, size=units)
        order = np.argsort(bins, kind="stable")  # units grouped by batch, ascending within
        ends = np.cumsum(np.bincount(bins, minlength=t))
        for step in range(t):
            check_length(source, n)
            start = ends[step - 1] if step else 0
            chosen = order[start:ends[step]].astype(np.int64)
            if users is not None:  # the step's users, at most k records each
                yield _slotted(source, user_rows(users, chosen, k_user, rows, rng))
            else:
                yield _padded(source, chosen, rows)

    return BallsInBinsBatches(
        dataset=generator_dataset(source, batches, t, prefetch),
        tf_dp_sampling=(units, q),
        steps_per_epoch=t,
        max_batch_size=rows,
        records_per_user=k_user,
    )
