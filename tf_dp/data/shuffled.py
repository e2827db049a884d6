"""Sequential sources: fixed-size batches of full passes, accounted without amplification.

A ``tf.data`` pipeline that reads files in order (``TFRecordDataset``, ``TextLineDataset``, a
generator) has no random access, so it cannot draw a Poisson sample cheaply: a true Poisson sample
of a sequential source reads the *whole* source at every step (each of the ``n`` records is kept
with probability ``q``), i.e. ``n`` record reads for about ``q n`` records used, ``1 / q`` times
the I/O of one pass per step (1000 passes per expected epoch at ``q = 1e-3``). With random access,
:func:`tf_dp.data.poisson_sample` does it at the cost of the sampled records only.

:func:`shuffled_passes` is the supported path for such a pipeline: it batches one pass of the
data set into fixed-size batches per epoch (the last holding the ``n mod b`` left over), checks
that every pass holds exactly ``population_size`` records (reading one batch ahead, so that a
pass with records left after its last batch raises before that batch is trained), and tells ``fit`` that the batches are
``shuffle`` batches: the ledger then gets the accounting that assumes no amplification by
subsampling (each record once per pass; ``docs/accounting.md``, "Sampling shuffle"). That bound
holds whatever the order of the records, so shuffling (``shuffle_buffer_size``) helps training,
not the guarantee.

Declaring ``poisson`` (``set_sampling(n, b / n, "poisson")``) for a ``shuffle().batch()``
pipeline is wrong: its batches are not Poisson samples, and the amplification the declaration
buys is not there. With ``n = 60000``, ``b = 256``, noise multiplier 1.1, 5 epochs and
``delta = 1e-5``, the false declaration prints epsilon 0.92 (RDP), the run's real bound is 26.5.

Example::

    records = tf.data.TFRecordDataset(files).map(parse_one)        # (x, y) per record
    batches = tf_dp.data.shuffled_passes(records, population_size=60000, batch_size=256,
                                         shuffle_buffer_size=10000)
    model.fit(batches, epochs=5)   # ledger: shuffle, n = 60000, q = 256 / 60000, sampled by tf_dp
"""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import tensorflow as tf

from tf_dp.data.poisson import _check_positive_int
from tf_dp.data.sampling import Sampling


@dataclasses.dataclass(frozen=True)
class ShuffledPasses:
    """Fixed-size batches of one full pass per epoch, ready for a private model's ``fit``.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches, ``steps_per_epoch``
        per pass; iterating it raises ``InvalidArgumentError`` naming ``population_size`` when a
        pass holds more or fewer records, before the pass's last batch is handed over (each
        batch is handed over once the element after it, the next batch or the end of the pass,
        has been read), so ``fit`` never trains a pass of another size to its end.
      tf_dp_sampling: ``(n, b / n)``.
      steps_per_epoch: ``ceil(n / b)``.
      max_batch_size: ``b``.
    """

    dataset: tf.data.Dataset
    tf_dp_sampling: tuple[int, float]
    steps_per_epoch: int
    max_batch_size: int
    num_shards: int = 1

    @property
    def sampling(self) -> Sampling:
        """``Sampling(n, b / n, policy="shuffle", origin="sampled")``."""
        n, q = self.tf_dp_sampling
        return Sampling(int(n), float(q), policy="shuffle", origin="sampled")

    def __len__(self) -> int:
        return self.steps_per_epoch


def shuffled_passes(
    dataset: tf.data.Dataset,
    population_size: int,
    batch_size: int,
    shuffle_buffer_size: Optional[int] = None,
    seed: Optional[int] = None,
) -> ShuffledPasses:
    """Batches a finite ``tf.data`` pipeline of single records into one pass per epoch.

    Args:
      dataset: a finite ``tf.data.Dataset`` of single records ``(x, y)`` or
        ``(x, y, sample_weight)`` (not batched), the same records on every iteration.
      population_size: ``n``, the number of records of one pass; checked on every pass.
      batch_size: ``b`` in ``[1, n]``; every batch holds ``b`` records but the last of a pass
        (``n mod b`` when that is not 0).
      shuffle_buffer_size: optional ``Dataset.shuffle`` buffer (reshuffled every pass).
      seed: seed of that shuffle (tests and debugging only).

    Returns:
      A :class:`ShuffledPasses`; passed to a private model's ``fit``, the ledger records
      ``shuffle`` sampling of ``n`` records at ``q = b / n`` and a new pass at every epoch.

    Example::

        ds = tf.data.Dataset.from_tensor_slices((x, y))
        model.fit(tf_dp.data.shuffled_passes(ds, len(x), 64), epochs=3)
    """
    if not isinstance(dataset, tf.data.Dataset):
        raise TypeError(f"dataset must be a tf.data.Dataset, got {type(dataset).__name__}")
    spec = dataset.element_spec
    if not (isinstance(spec, tuple) and len(spec) in (2, 3)):
        raise ValueError(
            "dataset must yield single records (x, y) or (x, y, sample_weight), got elements "
            f"{spec}"
        )
    if dataset.cardinality() == tf.data.INFINITE_CARDINALITY:
        raise ValueError("dataset must be finite (one pass per epoch): remove its repeat()")
    n = _check_positive_int("population_size", population_size)
    b = _check_positive_int("batch_size", batch_size)
    if b > n:
        raise ValueError(f"batch_size must be in [1, population_size={n}], got {b}")
    if shuffle_buffer_size is not None:
        buffer = _check_positive_int("shuffle_buffer_size", shuffle_buffer_size)
        dataset = dataset.shuffle(buffer, seed=seed, reshuffle_each_iteration=True)
    steps = math.ceil(n / b)

    def with_weight(*record):
        w = tf.ones([], tf.float32) if len(record) == 2 else tf.cast(record[2], tf.float32)
        return record[0], record[1], w

    batched = dataset.map(with_weight).batch(b)
    # An empty end-of-pass marker after the last batch, so a pass that ends early is caught too.
    empty = tf.nest.map_structure(
        lambda s: tf.zeros([0] + [d or 0 for d in s.shape[1:]], s.dtype),
        batched.element_spec,
    )
    marked = batched.map(lambda *t: (False, t)).concatenate(
        tf.data.Dataset.from_tensors((True, empty))
    )

    def delay(state, element):
        """Hands a batch over once the element after it has been read (the next batch or the
        end marker): the last batch of a pass is checked against what follows it."""
        total, have, previous = state
        end, batch = element
        seen = total + tf.cast(tf.shape(batch[2])[0], tf.int64)
        return (seen, tf.constant(True), batch), (have, previous, total, end)

    def check(position, state):
        _, batch, seen, next_is_end = state
        last = tf.equal(position, steps - 1)
        more = tf.logical_or(seen > n, tf.logical_and(last, tf.logical_not(next_is_end)))
        fewer = tf.logical_or(
            tf.logical_and(next_is_end, position < steps - 1),
            tf.logical_and(last, seen < n),
        )
        checks = [
            tf.debugging.Assert(
                tf.logical_not(more),
                [
                    f"population_size={n}: a pass of the dataset holds more than {n} records "
                    f"(batch_size={b}, {steps} batches per pass); records read in this pass:",
                    seen,
                ],
            ),
            tf.debugging.Assert(
                tf.logical_not(fewer),
                [
                    f"population_size={n}: a pass of the dataset holds fewer than {n} records; "
                    "it ended after (records):",
                    seen,
                ],
            ),
        ]
        with tf.control_dependencies(checks):
            return tf.nest.map_structure(tf.identity, batch)

    initial = (tf.constant(0, tf.int64), tf.constant(False), empty)
    batched = (
        marked.scan(initial, delay)
        .filter(lambda have, batch, seen, next_is_end: have)
        .enumerate()
        .map(check)
        .apply(tf.data.experimental.assert_cardinality(steps))
        .prefetch(2)
    )
    return ShuffledPasses(
        dataset=batched,
        tf_dp_sampling=(n, b / n),
        steps_per_epoch=steps,
        max_batch_size=b,
    )
