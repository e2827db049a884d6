"""Fixed-shape Poisson batches: a Poisson sample cut to at most ``B`` examples, padded to ``B``.

:func:`tf_dp.data.poisson_batches` pads every batch to a high quantile of ``Binomial(n, q)`` and
emits a rarer, larger sample whole, so its batches are large (335 rows for an expected 256) and
their shape can change. :func:`truncated_poisson_batches` instead fixes the shape: at every step
each of the ``n`` examples joins the sample independently with probability ``q`` (the same
inclusion rule as ``poisson_batches``); when the sample holds more than ``B`` examples, a uniformly
random ``B`` of them are kept and the others are dropped for that step; the batch is then padded
with zero-weight rows up to exactly ``B`` rows. Every batch has shape ``[B, ...]``, so an XLA step
compiles once::

    batches = tf_dp.data.truncated_poisson_batches(x_train, y_train,
                                                   sampling_probability=256 / len(x_train))
    model.fit(batches, epochs=3)   # the ledger records ("truncated_poisson", n, q, B) per step

``B`` defaults to the smallest size with ``P[Binomial(n, q) > B] <= truncation_probability``
(``1e-6`` per step by default): for ``n = 60000`` and ``q = 256 / 60000``, ``B = 335``. The
truncation is not free: where the other records fill ``B``, an added record can displace one of
them, which the accountants charge as sensitivity ``2C`` on those steps. With ``z = 1`` and 2000
steps at that setting (``pld``, ``delta = 1e-5``), plain Poisson gives epsilon 1.016,
``B = 335`` 1.017, ``B = 317`` (``1e-4``) 1.178 and ``B = 307`` (``1e-3``) 2.24: keep the
truncation probability small (docs/data.md has the table and its command).

Privacy: the ledger records the policy ``truncated_poisson`` with ``B``, and the accountants
(``tf_dp.accounting``, ``rdp`` and ``pld``) charge the truncated mechanism, not plain Poisson:
truncation can swap an added record for one of the others (sensitivity ``2C`` on the steps where
the other records already fill ``B``). The analysis is in :mod:`tf_dp.accounting.truncated`.
The DP optimizer divides the noised sum by the public ``q * n``, never by the batch's real size.

Randomness: as in :func:`tf_dp.data.poisson_batches`, a counter-based (Philox) stateless
generator keyed from OS entropy; ``seed`` fixes the key (tests and debugging only).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.accounting.ledger_analysis import poisson_steps_per_epoch
from tf_dp.data.inclusion import included
from tf_dp.data.poisson import (  # noqa: F401 (check_arrays: balls_in_bins uses it)
    _as_numpy_leaves,
    _check_positive_int,
    _check_probability,
    SampledBatches,
    check_arrays,
)
from tf_dp.data.sampling import Sampling

__all__ = [
    "DEFAULT_TRUNCATION_PROBABILITY",
    "TruncatedPoissonBatches",
    "default_truncation_size",
    "truncated_poisson_batches",
]

#: Default per-step probability that a Poisson sample holds more than ``B`` examples (some are
#: then dropped for that step).
DEFAULT_TRUNCATION_PROBABILITY = 1e-6


def default_truncation_size(
    population_size: int,
    sampling_probability: float,
    truncation_probability: float = DEFAULT_TRUNCATION_PROBABILITY,
) -> int:
    """Smallest ``B`` with ``P[Binomial(n, q) > B] <= truncation_probability`` (at least 1).

    Example:

    >>> from tf_dp.data.truncated_poisson import default_truncation_size
    >>> default_truncation_size(60000, 256 / 60000)
    335
    """
    from scipy import stats

    if not 0.0 < truncation_probability < 1.0:
        raise ValueError(
            f"truncation_probability must be in (0, 1), got {truncation_probability!r}"
        )
    k = int(stats.binom.isf(truncation_probability, population_size, sampling_probability))
    while k > 0 and stats.binom.sf(k - 1, population_size, sampling_probability) <= (
        truncation_probability
    ):
        k -= 1  # isf may round up; keep the smallest
    while stats.binom.sf(k, population_size, sampling_probability) > truncation_probability:
        k += 1
    return max(1, min(k, population_size))


@dataclasses.dataclass(frozen=True)
class TruncatedPoissonBatches(SampledBatches):
    """Fixed-shape Poisson batches, ready for ``model.fit`` of a private model.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches of exactly
        ``max_batch_size`` rows (padding rows have weight 0), ``steps_per_epoch`` per pass.
      tf_dp_sampling: ``(n, q)``.
      steps_per_epoch: batches per pass (default ``round(1 / q)``).
      max_batch_size: ``B``, the truncation and the batch's row count (with ``user_ids``: the
        most users kept, the batch has ``B * k`` rows).
      records_per_user: ``k`` with ``user_ids`` (user-level batches), else None.
      sampling: the :class:`tf_dp.data.Sampling` of these batches (``truncated_poisson``, ``n``,
        ``q``, ``max_batch_size=B``, ``origin="sampled"``).
    """

    records_per_user: Optional[int] = None

    @property
    def sampling(self) -> Sampling:
        n, q = int(self.tf_dp_sampling[0]), float(self.tf_dp_sampling[1])
        if self.records_per_user is not None:  # users: n users, B users, k records each
            return Sampling(n, q, "truncated_poisson", origin="sampled", unit="user",
                            records_per_unit=int(self.records_per_user),
                            max_batch_size=int(self.max_batch_size))
        return Sampling(n, q, "truncated_poisson", origin="sampled",
                        max_batch_size=int(self.max_batch_size))


def sampler_key(seed: Optional[int]) -> int:
    """The Philox key of a sampler: OS entropy, or ``seed`` (tests and debugging only)."""
    if seed is None:
        return int.from_bytes(os.urandom(8), "little") >> 1  # int64-safe
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be None or an integer, got {type(seed).__name__}")
    return int(seed) & ((1 << 63) - 1)


def gather_padded(x_t, y_t, sw_t, idx: tf.Tensor, rows: int, fixed: bool):
    """``(x, y, weight)`` rows ``idx`` padded with zero rows of weight 0 up to ``rows`` rows
    (static shape ``[rows, ...]`` when ``fixed``; a longer ``idx`` is emitted whole otherwise)."""
    k = tf.shape(idx, out_type=tf.int32)[0]

    def pad(t):
        extra = tf.maximum(rows - k, 0)
        paddings = tf.concat([[[0, extra]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], axis=0)
        out = tf.pad(t, paddings)
        out.set_shape([rows if fixed else None] + t.shape[1:].as_list())
        return out

    bx = tf.nest.map_structure(lambda t: pad(tf.gather(t, idx)), x_t)
    by = tf.nest.map_structure(lambda t: pad(tf.gather(t, idx)), y_t)
    w = tf.ones([k], tf.float32) if sw_t is None else tf.gather(sw_t, idx)
    return bx, by, pad(w)


def gather_user_rows(x_t, y_t, sw_t, rows: tf.Tensor):
    """``(x, y, weight)`` of the record indices ``rows`` (a user-level batch,
    :func:`tf_dp.data.users.user_rows`): ``-1`` gives a row of zeros with weight 0."""
    real = rows >= 0
    idx = tf.maximum(rows, 0)

    def take(t):
        got = tf.gather(t, idx)
        mask = tf.reshape(real, [-1] + [1] * (len(t.shape) - 1))
        return tf.where(mask, got, tf.zeros_like(got))

    w = tf.ones_like(idx, tf.float32) if sw_t is None else tf.cast(tf.gather(sw_t, idx), tf.float32)
    return (tf.nest.map_structure(take, x_t), tf.nest.map_structure(take, y_t),
            tf.where(real, w, 0.0))


def step_rng(key: int, counter: int, stream: int = 0) -> np.random.Generator:
    """A Philox generator for host-side draws: key ``(sampler key, per-step counter)``, its
    counter's top word ``stream`` (streams 2^192 blocks apart)."""
    words = np.array([key, int(counter) & ((1 << 64) - 1)], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(
        key=words, counter=np.array([0, 0, 0, int(stream)], dtype=np.uint64)))


def check_shards(num_shards: Any, shard_index: Any, seed: Optional[int], units: int,
                 user_ids: Any) -> tuple[int, int]:
    """``(num_shards, shard_index)`` checked for a sampler whose workers draw one global
    selection from a shared ``seed`` (ValueError naming the argument and its range)."""
    num_shards = _check_positive_int("num_shards", num_shards)
    if isinstance(shard_index, bool) or not isinstance(shard_index, (int, np.integer)) or not (
        0 <= shard_index < num_shards
    ):
        raise ValueError(
            f"shard_index must be an integer in [0, num_shards={num_shards}), got {shard_index!r}"
        )
    if num_shards > 1:
        if seed is None:
            raise ValueError(
                "seed must be an integer, the same on every worker, with num_shards > 1: the "
                "workers draw one global selection from it (draw it once from OS entropy, e.g. "
                "secrets.randbits(63), hand it to the workers as you hand them TF_CONFIG, and "
                "keep it secret: it determines the batches)"
            )
        if user_ids is not None:
            raise ValueError(
                "num_shards must be 1 with user_ids (user-level selections are not sharded over "
                f"workers yet; poisson_batches shards users), got {num_shards}"
            )
        if num_shards > units:
            raise ValueError(f"num_shards must be in [1, n={units}], got {num_shards}")
    return num_shards, int(shard_index)


def sharded_dataset(draw, steps: int, num_shards: int, shard_index: int, rows: int,
                    x_t, y_t, sw_t) -> tf.data.Dataset:
    """Worker ``shard_index``'s share of one global selection per step, for multi-worker
    training: ``draw(pass_id, step)`` (numpy, the same on every worker: a shared key) gives the
    step's global indices; this worker takes every ``num_shards``-th of them from position
    ``shard_index`` (the shares partition the step's examples) padded with weight-0 rows to
    ``rows``. The pass number counts iterations of the dataset (each fit epoch one pass)."""
    passes = iter(range(1 << 62))

    def steps_of_a_pass():
        pass_id = next(passes)
        for step in range(steps):
            yield np.int64(pass_id), np.int64(step)

    def share(pass_id: np.ndarray, step: np.ndarray) -> np.ndarray:
        return draw(int(pass_id), int(step))[shard_index::num_shards].astype(np.int64)

    def batch(pass_id, step):
        idx = tf.numpy_function(share, [pass_id, step], tf.int64, stateful=False)
        idx.set_shape([None])
        return gather_padded(x_t, y_t, sw_t, idx, rows, fixed=False)

    spec = (tf.TensorSpec([], tf.int64), tf.TensorSpec([], tf.int64))
    dataset = (tf.data.Dataset.from_generator(steps_of_a_pass, output_signature=spec)
               .map(batch)
               .apply(tf.data.experimental.assert_cardinality(steps))
               .prefetch(2))
    options = tf.data.Options()  # already this worker's share: tf.distribute must not shard it
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    return dataset.with_options(options)


def truncated_user_rows(index, q: float, k: int, b: int, rng: np.random.Generator) -> np.ndarray:
    """One truncated-Poisson user-level batch: users Poisson-sampled at rate ``q``
    (:func:`tf_dp.data.inclusion.poisson_subset`), more than ``b`` cut to a uniformly random
    ``b`` of them, at most ``k`` records each, ``b`` slots of ``k`` rows (``-1``: padding)."""
    from tf_dp.data.inclusion import poisson_subset
    from tf_dp.data.users import user_rows

    users = poisson_subset(rng, index.num_users, q)
    if len(users) > b:  # keep a uniformly random B of the sampled users
        users = np.sort(rng.choice(users, size=b, replace=False))
    return user_rows(index, users, k, b, rng)


def truncated_poisson_batches(
    x: Any,
    y: Any = None,
    sampling_probability: Optional[float] = None,
    sample_weight: Any = None,
    steps_per_epoch: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    truncation_probability: float = DEFAULT_TRUNCATION_PROBABILITY,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
    num_shards: int = 1,
    shard_index: int = 0,
) -> TruncatedPoissonBatches:
    """Poisson-sampled batches of one fixed shape ``[B, ...]`` (cut at ``B``, padded to ``B``).

    Args:
      x: inputs, an array or a nested structure (dict, tuple) of arrays with ``n`` rows each.
      y: targets, ``n`` rows; required (padding is masked through the sample weight).
      sampling_probability: ``q`` in (0, 1]: each example joins each step's sample
        independently with probability ``q``.
      sample_weight: optional per-example weights ``[n]``; padding rows get weight 0.
      steps_per_epoch: batches per epoch; default ``round(1 / q)``.
      max_batch_size: ``B`` >= 1, the rows of every batch and the most examples kept; default
        :func:`default_truncation_size` at ``truncation_probability``.
      seed: fixes the sampling randomness. Tests and debugging only (default: OS entropy).
      truncation_probability: per-step probability that the default ``B`` drops examples.
      user_ids: for user-level DP: one integer or string id per example (``[n]``). The sampled
        units are then users (:mod:`tf_dp.data.users`): each user joins with probability ``q``,
        a sample of more than ``B`` users keeps a uniformly random ``B`` of them, and each kept
        user contributes at most ``max_records_per_user`` of its examples (chosen uniformly at
        random); the DP step clips each user's summed gradient to ``C``. ``B`` and
        ``steps_per_epoch`` count users; every batch has ``B * k`` rows in ``B`` slots of ``k``.
        The ledger records ``truncated_poisson`` over ``n = number of users``, unit ``user``,
        and the accountants charge the same truncated mechanism over users.
      max_records_per_user: ``k`` >= 1, required with ``user_ids``.
      num_shards, shard_index: multi-worker training (``MultiWorkerMirroredStrategy``): every
        worker passes the whole data set, its own ``shard_index`` in ``[0, num_shards)`` and the
        same ``seed`` (required: a secret the workers share). All workers draw the same global
        truncated sample at every step and worker ``w`` trains on every ``num_shards``-th of its
        examples from position ``w`` (padded to ``ceil(B / num_shards)`` rows), so each example
        is in at most one replica and a global step is one truncated Poisson sample of all ``n``
        examples; every worker records ``(n, q, B)``. Not with ``user_ids`` yet.

    Returns:
      A :class:`TruncatedPoissonBatches`; pass it to a private model's ``fit``.

    Example:

    >>> import numpy as np, tf_dp
    >>> x, y = np.ones((100, 2), np.float32), np.zeros(100, np.int32)
    >>> batches = tf_dp.data.truncated_poisson_batches(x, y, sampling_probability=0.1, seed=0)
    >>> batches.max_batch_size, batches.sampling.policy, batches.sampling.max_batch_size
    (27, 'truncated_poisson', 27)
    >>> xb, yb, weights = next(iter(batches.dataset))
    >>> xb.shape[0] == weights.shape[0] == 27   # every batch has B rows; padding has weight 0
    True
    """
    from tf_dp.data.users import user_index_for

    x, y, sample_weight, n = check_arrays(x, y, sample_weight)
    q = _check_probability(sampling_probability)
    users, k_user = user_index_for(user_ids, max_records_per_user, n)
    units = n if users is None else users.num_users
    num_shards, shard_index = check_shards(num_shards, shard_index, seed, units, user_ids)
    if steps_per_epoch is None:
        steps_per_epoch = poisson_steps_per_epoch(q)
        if steps_per_epoch > 2**63 - 1:
            raise ValueError(
                f"sampling_probability={q!r} gives a default steps_per_epoch of round(1 / q) = "
                f"{float(steps_per_epoch):.3g} steps, beyond int64: pass sampling_probability >= "
                f"{1 / (2**63 - 1):.3g} or steps_per_epoch in [1, 2**63 - 1]"
            )
    steps_per_epoch = _check_positive_int("steps_per_epoch", steps_per_epoch)
    if max_batch_size is None:
        max_batch_size = default_truncation_size(units, q, truncation_probability)
    max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
    if max_batch_size > units:
        what = "n" if users is None else "number of users"
        raise ValueError(
            f"max_batch_size must be in [1, {what}={units}] (a larger B never truncates: use "
            f"poisson_batches), got {max_batch_size}"
        )
    key = sampler_key(seed)
    x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
    y_t = tf.nest.map_structure(tf.convert_to_tensor, y)
    sw_t = None if sample_weight is None else tf.convert_to_tensor(sample_weight)
    q64 = tf.constant(q, tf.float64)
    key_t = tf.constant(key, tf.int64)
    b = max_batch_size

    def sample(counter: tf.Tensor):
        # A Philox key per step: (the sampler's key, a per-step random counter).
        u = tf.random.stateless_uniform([n], seed=tf.stack([key_t, counter]), dtype=tf.float64)
        idx = tf.reshape(tf.where(included(u, q64)), [-1])
        # More than B: keep a uniformly random B of them (a stateless shuffle, its own key).
        shuffled = tf.random.experimental.stateless_shuffle(
            idx, seed=tf.stack([key_t ^ 0x5DEECE66D, counter])
        )
        idx = tf.cond(tf.size(idx) > b, lambda: shuffled[:b], lambda: idx)
        return gather_padded(x_t, y_t, sw_t, idx, b, fixed=True)

    if users is not None:
        def draw_rows(counter: np.ndarray) -> np.ndarray:
            return truncated_user_rows(users, q, k_user, b, step_rng(key, counter))

        def sample(counter: tf.Tensor):  # noqa: F811 (user-level: B slots of k rows)
            rows = tf.numpy_function(draw_rows, [counter], tf.int64, stateful=False)
            rows.set_shape([b * k_user])
            return gather_user_rows(x_t, y_t, sw_t, rows)

    counters = tf.data.Dataset.random(seed=key % (1 << 31), rerandomize_each_iteration=True)
    dataset = counters.take(steps_per_epoch).map(sample).prefetch(2)
    if num_shards > 1:  # one global draw per step from the shared key, this worker's share
        from tf_dp.data.inclusion import poisson_subset

        def draw(pass_id: int, step: int) -> np.ndarray:
            rng = step_rng(key, pass_id * steps_per_epoch + step)
            idx = poisson_subset(rng, n, q)
            if len(idx) > b:  # keep a uniformly random B of the global sample
                idx = np.sort(rng.choice(idx, size=b, replace=False))
            return idx

        dataset = sharded_dataset(draw, steps_per_epoch, num_shards, shard_index,
                                  -(-b // num_shards), x_t, y_t, sw_t)
    return TruncatedPoissonBatches(
        dataset=dataset,
        tf_dp_sampling=(units, q),
        steps_per_epoch=steps_per_epoch,
        max_batch_size=max_batch_size,
        num_shards=num_shards,
        records_per_user=k_user,
    )
