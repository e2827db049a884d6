"""Cyclic Poisson batches: the data split into ``b`` fixed parts, each step a Poisson sample of one.

Amplified banded matrix factorization (BandMF, Choquette-Choo et al. 2023) needs every record's
participations to be at least ``b`` steps apart (b-min-separation) while keeping the randomness of
Poisson sampling. Cyclic Poisson sampling gives both: the ``n`` records are split once, at random,
into ``b`` parts of ``floor(n / b)`` or ``ceil(n / b)`` records; step ``t`` draws a Poisson sample
(every record independently with probability ``q``) of part ``t mod b`` only. A record can then be
in steps ``p, p + b, p + 2b, ...`` of its part ``p`` only::

    batches = tf_dp.data.cyclic_poisson_batches(x_train, y_train, num_parts=8, batch_size=256)
    model.fit(batches, epochs=10)   # one epoch = b steps = one cycle over the parts

``q = batch_size * b / n`` (each step's expected batch is ``batch_size``), or give
``sampling_probability``. The ledger records ``cyclic_poisson`` with the whole population ``n``,
the rate ``q`` within a part and ``num_parts = b``; the DP optimizer divides the noised sum by the
public ``q n / b``. The split is drawn once per call (fixed for the whole run, as the analysis
requires); a ``fit`` epoch is one cycle of ``b`` steps, starting at part 0.

Privacy: DP-SGD accountants charge every step as Poisson sampling of the whole data set at rate
``q`` (an upper bound); the matrix-factorization accountants use the separation.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.data.poisson import (
    DEFAULT_OVERFLOW_PROBABILITY,
    SampledBatches,
    _check_positive_int,
    _check_probability,
    default_max_batch_size,
)
from tf_dp.data.inclusion import included, poisson_subset
from tf_dp.data.sampler import (
    _pad,
    check_length,
    check_source,
    generator_dataset,
    read_records,
    source_rng,
)
from tf_dp.data.sampling import Sampling
from tf_dp.data.truncated_poisson import check_arrays, gather_padded, sampler_key

__all__ = ["CyclicPoissonBatches", "cyclic_poisson_batches", "cyclic_poisson_sample"]


@dataclasses.dataclass(frozen=True)
class CyclicPoissonBatches(SampledBatches):
    """Cyclic Poisson batches, ready for ``model.fit`` of a private model.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches, ``steps_per_epoch = b``
        per pass (one cycle over the parts, part 0 first); every pass draws fresh samples.
      tf_dp_sampling: ``(n, q)``: the whole population and the rate within a part.
      steps_per_epoch: ``b``.
      max_batch_size: the padded batch size (a larger batch is emitted whole).
      num_parts: ``b``.
      parts: ``[n]`` int array, the part of every record (fixed for the run).
    """

    num_parts: int = 1
    parts: Any = None

    @property
    def sampling(self) -> Sampling:
        n, q = int(self.tf_dp_sampling[0]), float(self.tf_dp_sampling[1])
        return Sampling(n, q, "cyclic_poisson", origin="sampled", num_parts=self.num_parts)

    @property
    def expected_batch_size(self) -> float:
        return self.sampling.expected_batch_size


def _check_cycle(n: int, num_parts: Any, batch_size: Any, sampling_probability: Any,
                 max_batch_size: Any, overflow_probability: float) -> tuple[int, float, int]:
    """``(b, q, max_batch_size)`` of a cyclic Poisson selection over ``n`` records, checked (the
    errors name the argument and its range)."""
    if num_parts is None:
        raise ValueError("num_parts is required: an integer in [1, n] (the parts of the cycle)")
    b = _check_positive_int("num_parts", num_parts)
    if b > n:
        raise ValueError(f"num_parts must be in [1, n={n}], got {b}")
    if (batch_size is None) == (sampling_probability is None):
        raise ValueError("give exactly one of batch_size and sampling_probability")
    if sampling_probability is None:
        batch_size = _check_positive_int("batch_size", batch_size)
        if batch_size * b > n:
            raise ValueError(
                f"batch_size must be in [1, n / num_parts = {n / b:g}] (q = batch_size * "
                f"num_parts / n <= 1), got {batch_size}"
            )
        sampling_probability = batch_size * b / n
    q = _check_probability(sampling_probability)
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(-(-n // b), q, overflow_probability)
    return b, q, _check_positive_int("max_batch_size", max_batch_size)


def split_into_parts(rng: np.random.Generator, n: int, b: int) -> np.ndarray:
    """The part (``[n]`` int64 in ``[0, b)``) of every record: a uniformly random permutation
    dealt round-robin, so parts hold ``n // b`` or ``n // b + 1`` records."""
    parts = np.empty(n, np.int64)
    parts[rng.permutation(n)] = np.arange(n) % b
    return parts


def cyclic_poisson_batches(
    x: Any,
    y: Any = None,
    num_parts: Optional[int] = None,
    batch_size: Optional[int] = None,
    sample_weight: Any = None,
    sampling_probability: Optional[float] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
) -> CyclicPoissonBatches:
    """Batches where step ``t`` is a Poisson sample of part ``t mod num_parts`` of the data.

    Args:
      x: inputs, an array or a nested structure (dict, tuple) of arrays with ``n`` rows each.
      y: targets, ``n`` rows; required (padding is masked through the sample weight).
      num_parts: ``b`` in [1, n], the parts (the band of a BandMF strategy, for its
        amplification); ``b = 1`` is plain Poisson sampling.
      batch_size: the expected batch size; ``q = batch_size * b / n`` (at most 1). Give this or
        ``sampling_probability``.
      sample_weight: optional per-example weights ``[n]``; padding rows get weight 0.
      sampling_probability: ``q`` in (0, 1], the rate within the part of the step.
      max_batch_size: padded batch size; default: the ``1 - overflow_probability`` quantile of
        ``Binomial(ceil(n / b), q)``. A larger batch is emitted whole (never truncated).
      seed: fixes the split and the sampling. Tests and debugging only (default: OS entropy).
      overflow_probability: per-step probability that the default ``max_batch_size`` is exceeded.

    Returns:
      A :class:`CyclicPoissonBatches`; pass it to a private model's ``fit``.

    Example:

    >>> import numpy as np, tf_dp
    >>> x, y = np.arange(100, dtype=np.float32)[:, None], np.zeros(100, np.int32)
    >>> batches = tf_dp.data.cyclic_poisson_batches(x, y, num_parts=4, batch_size=5, seed=0)
    >>> batches.steps_per_epoch, batches.sampling.policy, batches.sampling_probability
    (4, 'cyclic_poisson', 0.2)
    >>> first = [xb.numpy()[w.numpy() > 0, 0].astype(int) for xb, _, w in batches.dataset]
    >>> all(set(batches.parts[b]) <= {t} for t, b in enumerate(first))  # step t: part t only
    True
    """
    x, y, sample_weight, n = check_arrays(x, y, sample_weight)
    b, q, max_batch_size = _check_cycle(n, num_parts, batch_size, sampling_probability,
                                        max_batch_size, overflow_probability)
    key = sampler_key(seed)
    parts = split_into_parts(np.random.Generator(np.random.Philox(key=key)), n, b)
    x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
    y_t = tf.nest.map_structure(tf.convert_to_tensor, y)
    sw_t = None if sample_weight is None else tf.convert_to_tensor(sample_weight)
    parts_t = tf.constant(parts)
    key_t = tf.constant(key, tf.int64)

    def batch(step: tf.Tensor, counter: tf.Tensor):
        u = tf.random.stateless_uniform(
            [n], seed=tf.stack([tf.bitwise.bitwise_xor(key_t, counter), step]), dtype=tf.float64
        )
        # included(): probability floor(q 2^52) 2^-52 <= q (u < q would be above q off the grid)
        chosen = tf.logical_and(tf.equal(parts_t, step), included(u, tf.constant(q, tf.float64)))
        idx = tf.reshape(tf.where(chosen), [-1])
        return gather_padded(x_t, y_t, sw_t, idx, max_batch_size, fixed=False)

    # One random counter per pass (a fresh one at every iteration of the dataset), repeated for
    # the pass's b steps; enumerate() numbers the steps (the parts) 0..b-1.
    passes = tf.data.Dataset.random(seed=key % (1 << 31), rerandomize_each_iteration=True)
    dataset = (
        passes.take(1)
        .flat_map(lambda c: tf.data.Dataset.from_tensors(c).repeat(b))
        .enumerate()
        .map(batch)
        .apply(tf.data.experimental.assert_cardinality(b))  # Keras restarts it every epoch
        .prefetch(2)
    )
    return CyclicPoissonBatches(
        dataset=dataset,
        tf_dp_sampling=(n, q),
        steps_per_epoch=b,
        max_batch_size=max_batch_size,
        num_parts=b,
        parts=parts,
    )


def cyclic_poisson_sample(
    source: Any,
    num_parts: Optional[int] = None,
    batch_size: Optional[int] = None,
    sampling_probability: Optional[float] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
    prefetch: int = 2,
) -> CyclicPoissonBatches:
    """:func:`cyclic_poisson_batches` over a random-access source, reading only the selected
    records (``source.read``): the split into ``num_parts`` parts is drawn once, then step ``t``
    of every pass reads a Poisson sample (rate ``q``: a ``Binomial(m, p)`` size, ``p <= q``, then
    a uniform subset; :func:`tf_dp.data.inclusion.poisson_subset`) of part ``t mod b``'s ``m``
    records. Same arguments, claim and batches as the array version, plus:

    Args:
      source: a :class:`~tf_dp.data.RandomAccessSource` whose ``read`` returns ``(x, y)`` or
        ``(x, y, sample_weight)`` numpy batches (``ArraySource`` over memmaps, ``TFRecordSource``,
        ``ArrayRecordSource``, ``hdf5_source``).
      prefetch: batches read ahead of the training step (>= 1), in a ``tf.data`` thread.

    Returns:
      A :class:`CyclicPoissonBatches` (``.sampling``: ``Sampling(n, q, "cyclic_poisson",
      "sampled", num_parts=b)``).

    Example::

        source = tf_dp.data.ArraySource(np.load("x.npy", mmap_mode="r"), np.load("y.npy"))
        batches = tf_dp.data.cyclic_poisson_sample(source, num_parts=8, batch_size=256)
        model.fit(batches, epochs=10)   # one epoch = one cycle of 8 steps
    """
    n = check_source(source)
    b, q, max_batch_size = _check_cycle(n, num_parts, batch_size, sampling_probability,
                                        max_batch_size, overflow_probability)
    prefetch = _check_positive_int("prefetch", prefetch)
    rng = source_rng(seed)
    parts = split_into_parts(rng, n, b)
    members = [np.flatnonzero(parts == p) for p in range(b)]  # sorted record ids of each part

    def batches():
        for part in members:
            check_length(source, n)
            idx = part[poisson_subset(rng, len(part), q)]
            got = read_records(source, idx)  # only the selected records are read
            yield tf.nest.map_structure(lambda a: _pad(a, max_batch_size), got)

    return CyclicPoissonBatches(
        dataset=generator_dataset(source, batches, b, prefetch),
        tf_dp_sampling=(n, q),
        steps_per_epoch=b,
        max_batch_size=max_batch_size,
        num_parts=b,
        parts=parts,
    )
