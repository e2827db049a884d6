"""Poisson sampling from a random-access source: only the sampled records are ever read.

:func:`poisson_sample` draws, at every step, each of the source's ``n`` records independently
with probability ``q``, reads those records (``source.read``), pads the batch as
:func:`tf_dp.data.poisson_batches` does (rows of zeros with sample weight 0, see its module) and
returns the same :class:`~tf_dp.data.PoissonBatches`, which a private model's ``fit`` recognises:
the ledger records ``poisson`` sampling with the source's ``n`` and ``q``, sampled by tf_dp.

How a step's sample is drawn without ``n`` uniforms: first the sample size
``K ~ Binomial(n, p)``, then a uniform random subset of ``K`` of the ``n`` records (numpy's
``Generator.choice(n, K, replace=False)``: a set-based draw in ``O(K)`` time and memory when
``K < n / 50``, a partial shuffle of an ``n``-entry index otherwise). This is exactly Poisson
sampling: a given set ``S`` of ``s`` records comes out with probability
``P[K = s] / C(n, s) = p^s (1 - p)^(n - s)``, the probability that each record of ``S`` is in and
every other record out, independently. The rate used is ``p = q (1 - 2^-40)``: a relative margin
of about ``1e-12`` below the recorded ``q``, far above the float64 rounding of numpy's binomial
sampler, so that the inclusion probability ``p`` is never above ``q`` (with ``q = 1`` every record
is taken). :func:`tf_dp.data.inclusion.poisson_subset` is this draw. Memory: the source's own
index plus a few batches; the data is never copied.

With ``user_ids=`` and ``max_records_per_user=k`` the sampled units are users (user-level DP, see
:mod:`tf_dp.data.users`): every step draws the sampled users the same way (``Binomial(n_users,
p)`` users, then a uniform subset of that size; :func:`tf_dp.data.sample_user_rows`, the function
:func:`tf_dp.data.poisson_batches` uses), then reads only the at most ``k`` drawn records of each
sampled user. The batch has the user-level slot layout (``max_batch_size`` user slots of ``k``
rows, padding rows of zeros with weight 0) and ``.sampling`` says ``unit="user"``, ``k`` and the
number of users. Memory: the user index (an int64 per record, an int64 and the id per user)
on top of the source's own.

The batches are produced in a background thread of ``tf.data`` (``Dataset.from_generator``) and
``prefetch`` batches ahead, so reading overlaps the training step. Randomness comes from a Philox
generator keyed from OS entropy; ``seed`` fixes it (tests and debugging only).

Example::

    source = tf_dp.data.TFRecordSource(files, parse_fn=parse)
    batches = tf_dp.data.poisson_sample(source, sampling_probability=1e-3)
    model.fit(batches, epochs=2)   # the ledger records (n, q, "poisson"), sampled by tf_dp
"""

from __future__ import annotations

import os
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.accounting.ledger_analysis import poisson_steps_per_epoch
from tf_dp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    PoissonBatches,
    _check_positive_int,
    _check_probability,
    default_max_batch_size,
)
from tf_dp.data.inclusion import poisson_subset
from tf_dp.data.users import sample_user_rows, user_index_for


def _spec(leaf: np.ndarray) -> tf.TensorSpec:
    dtype = tf.string if leaf.dtype.kind in "OSU" else tf.as_dtype(leaf.dtype)
    return tf.TensorSpec([None] + list(leaf.shape[1:]), dtype)


def _pad(leaf: np.ndarray, rows: int) -> np.ndarray:
    extra = rows - leaf.shape[0]
    if extra <= 0:
        return leaf
    fill = np.zeros((extra,) + leaf.shape[1:], dtype=leaf.dtype)
    if leaf.dtype.kind == "O":
        fill[...] = b""
    return np.concatenate([leaf, fill])


def _scatter(leaf: np.ndarray, real: np.ndarray) -> np.ndarray:
    """``leaf``'s rows (the records read, in order) at the rows where ``real``; zeros (or
    ``b""``) elsewhere."""
    out = np.zeros((len(real),) + leaf.shape[1:], dtype=leaf.dtype)
    if leaf.dtype.kind == "O":
        out[...] = b""
    out[real] = leaf
    return out


def _split(batch: Any, what: str) -> tuple:
    if not (isinstance(batch, tuple) and len(batch) in (2, 3)):
        raise TypeError(
            f"source.read must return (x, y) or (x, y, sample_weight) for fit, got {what} of "
            f"type {type(batch).__name__}; give TFRecordSource / ArrayRecordSource a parse_fn "
            "returning (x, y), or ArraySource a y"
        )
    return batch


def read_records(source: Any, indices: np.ndarray) -> tuple:
    """``(x, y, sample_weight)`` of the records of ``source`` at ``indices``, one row each,
    unpadded (weight 1 when the source gives none)."""
    parts = _split(source.read(indices), "a batch")
    k = len(indices)
    leaves = [np.asarray(a) for a in tf.nest.flatten(parts)]
    if any(leaf.ndim == 0 or leaf.shape[0] != k for leaf in leaves):
        raise ValueError(
            f"source.read returned a batch whose arrays do not all have {k} rows (one per "
            "index asked)"
        )
    parts = tf.nest.pack_sequence_as(parts, leaves)
    weight = np.ones(k, np.float32) if len(parts) == 2 else parts[2].astype(np.float32)
    return parts[0], parts[1], weight.reshape(k)


def check_source(source: Any) -> int:
    """The number of records of a random-access source; ``TypeError``/``ValueError`` naming
    ``source`` when it has no ``len``/``read`` or no record."""
    if not (hasattr(source, "__len__") and callable(getattr(source, "read", None))):
        raise TypeError(
            "source must be a random-access source with __len__ and read(indices) (e.g. "
            f"tf_dp.data.ArraySource(x, y) for arrays), got {type(source).__name__}"
        )
    n = len(source)
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
        raise ValueError(f"source must hold at least one record, len(source) = {n!r}")
    return int(n)


def source_rng(seed: Optional[int], stream: int = 0) -> np.random.Generator:
    """A Philox generator keyed from OS entropy, or from ``seed`` (tests and debugging only)."""
    if seed is None:
        return np.random.Generator(np.random.Philox(int.from_bytes(os.urandom(16), "little")))
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be None or an integer, got {type(seed).__name__}")
    return np.random.Generator(np.random.Philox([int(seed) & ((1 << 64) - 1), stream]))


def generator_dataset(source: Any, batches, steps: int, prefetch: int) -> tf.data.Dataset:
    """A ``tf.data`` pipeline over ``batches()`` (a generator of one pass of padded
    ``(x, y, sample_weight)`` numpy batches), ``steps`` per pass, read ``prefetch`` ahead; the
    element spec comes from the source's first record."""
    first = read_records(source, np.array([0], np.int64))
    signature = tf.nest.map_structure(_spec, first)
    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps))
    return dataset.prefetch(prefetch)


def check_length(source: Any, n: int) -> None:
    """``ValueError`` when the source no longer holds ``n`` records (the recorded population
    size would be false)."""
    if len(source) != n:
        raise ValueError(
            f"source changed length from {n} to {len(source)} records during sampling: the "
            "recorded population size would be false; a source must not change in training"
        )


def poisson_sample(
    source: Any,
    sampling_probability: float,
    steps_per_epoch: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
    num_shards: int = 1,
    shard_index: int = 0,
    prefetch: int = 2,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
) -> PoissonBatches:
    """Poisson-sampled, padded batches read from a random-access source, for ``fit``.

    Args:
      source: a :class:`~tf_dp.data.RandomAccessSource` (``len`` and ``read(indices)``) whose
        ``read`` returns ``(x, y)`` or ``(x, y, sample_weight)`` numpy batches.
      sampling_probability: ``q`` in (0, 1], each record's inclusion probability at every step.
      steps_per_epoch: batches per epoch; default ``round(1 / q)`` (one expected pass).
      max_batch_size: padded batch size; default the ``1 - overflow_probability`` quantile of
        ``Binomial(n / num_shards, q)``. A larger sample is emitted whole, never truncated.
      seed: fixes the sampling randomness (tests and debugging only; default OS entropy).
      overflow_probability: per-step probability that the default ``max_batch_size`` is exceeded.
      num_shards, shard_index: multi-worker training, as for :func:`tf_dp.data.poisson_batches`:
        worker ``shard_index`` samples, at rate ``q``, the records whose index is ``shard_index``
        modulo ``num_shards`` (with ``user_ids``: the users whose position in the
        :class:`~tf_dp.data.UserIndex` is, with all their records); the union over workers is
        one Poisson sample of all ``n`` records (users).
      prefetch: batches read ahead of the training step (>= 1).
      user_ids: for user-level DP: one integer or string id per record of the source (an array
        of ``len(source)`` ids; a memmap is fine, it is read once to group the records). Users
        are Poisson-sampled at rate ``q`` and each sampled user contributes at most
        ``max_records_per_user`` of its records, chosen uniformly at random
        (:func:`tf_dp.data.sample_user_rows`, as :func:`tf_dp.data.poisson_batches` does); only
        those records are read. ``steps_per_epoch`` and ``max_batch_size`` then count users (a
        batch has ``max_batch_size * k`` rows in slots of ``k``, padding rows of weight 0).
      max_records_per_user: ``k`` >= 1, required with ``user_ids``.

    Returns:
      A :class:`~tf_dp.data.PoissonBatches`; ``.sampling`` is
      ``Sampling(n, q, policy="poisson", origin="sampled")``, or with ``user_ids``
      ``Sampling(n_users, q, "poisson", "sampled", unit="user", records_per_unit=k)``.

    Raises (before anything runs): ``TypeError``/``ValueError`` naming the argument for a source
    without ``len``/``read``, an empty source, ``q`` outside (0, 1], bad integers, ``user_ids``
    of the wrong dtype, shape or length, ``max_records_per_user`` < 1 or missing. While
    iterating: ``ValueError`` if the source's length changed since this call, or a batch has
    the wrong number of rows (the step that would use it never runs).

    Example::

        source = tf_dp.data.ArraySource(np.load("x.npy", mmap_mode="r"), np.load("y.npy"))
        model.fit(tf_dp.data.poisson_sample(source, sampling_probability=0.01), epochs=3)
        users = np.load("user_of_record.npy", mmap_mode="r")    # one id per record
        model.fit(tf_dp.data.poisson_sample(source, sampling_probability=64 / n_users,
                                            user_ids=users, max_records_per_user=4), epochs=3)
    """
    n = check_source(source)
    q = _check_probability(sampling_probability)
    num_shards = _check_positive_int("num_shards", num_shards)
    if isinstance(shard_index, bool) or not isinstance(shard_index, (int, np.integer)) or not (
        0 <= shard_index < num_shards
    ):
        raise ValueError(
            f"shard_index must be an integer in [0, num_shards={num_shards}), got {shard_index!r}"
        )
    shard_index = int(shard_index)
    if num_shards > n:
        raise ValueError(f"num_shards must be <= the number of records ({n}), got {num_shards}")
    prefetch = _check_positive_int("prefetch", prefetch)
    all_users, k_user = user_index_for(user_ids, max_records_per_user, n)
    users = None if all_users is None else all_users.shard(num_shards, shard_index)
    rows = len(range(shard_index, n, num_shards))
    if steps_per_epoch is None:
        steps_per_epoch = poisson_steps_per_epoch(q)
    steps_per_epoch = _check_positive_int("steps_per_epoch", steps_per_epoch)
    if max_batch_size is None:
        units = rows if users is None else users.num_users
        max_batch_size = default_max_batch_size(units, q, overflow_probability)
    max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
    rng = source_rng(seed, shard_index)  # a stream per shard

    def draw() -> np.ndarray:
        check_length(source, n)
        return shard_index + num_shards * poisson_subset(rng, rows, q)

    def read(indices: np.ndarray) -> tuple:
        return read_records(source, indices)

    # the element spec, from one record
    first = read(np.array([shard_index if users is None else users.order[0]], np.int64))
    signature = tf.nest.map_structure(_spec, first)

    def to_batch(indices: np.ndarray) -> tuple:
        return tf.nest.map_structure(lambda a: _pad(a, max_batch_size), read(indices))

    if users is not None:
        empty = tf.nest.map_structure(lambda a: a[:0], first)

        def draw() -> np.ndarray:  # noqa: F811 (user-level: record indices, -1 for padding)
            check_length(source, n)
            return sample_user_rows(users, q, k_user, max_batch_size, rng)

        def to_batch(slots: np.ndarray) -> tuple:  # noqa: F811 (the records in their slots)
            real = slots >= 0
            got = read(slots[real]) if real.any() else empty
            return tf.nest.map_structure(lambda a: _scatter(a, real), got)

    def batches():
        for _ in range(steps_per_epoch):
            yield to_batch(draw())

    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    dataset = dataset.apply(tf.data.experimental.assert_cardinality(steps_per_epoch))
    dataset = dataset.prefetch(prefetch)
    if num_shards > 1:  # already this worker's shard: tf.distribute must not shard it again
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset = dataset.with_options(options)
    return PoissonBatches(
        dataset=dataset,
        tf_dp_sampling=(n if all_users is None else all_users.num_users, q),
        steps_per_epoch=steps_per_epoch,
        max_batch_size=max_batch_size,
        num_shards=num_shards,
        records_per_user=k_user,
    )
