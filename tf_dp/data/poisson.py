"""Poisson-sampled batches for ``model.fit``: each example joins each batch independently.

DP-SGD's tightest accounting (privacy amplification by subsampling; Abadi et al. 2016, Bu et al.
2019) assumes *Poisson sampling*: at every step, every one of the ``n`` training examples is
included independently with probability ``q``. Batch sizes then vary, following
``Binomial(n, q)``, and a batch may even be empty. :func:`poisson_batches` draws such batches from
in-memory arrays as a ``tf.data.Dataset`` and tells a private model's ``fit`` the real ``n`` and
``q``, so that the ledger records ``poisson`` sampling::

    batches = tf_dp.data.poisson_batches(x_train, y_train, sampling_probability=256 / len(x_train))
    model.fit(batches, epochs=3)          # the ledger records (n, q, "poisson") at every step

With ``user_ids=...`` and ``max_records_per_user=k`` the sampled units are users (user-level DP:
Poisson sampling of users, at most ``k`` records per sampled user, each user's summed gradient
clipped; see :mod:`tf_dp.data.users`). Each step's users are drawn on the host as
``Binomial(n_users, q)`` users and a uniform subset of that size
(:func:`tf_dp.data.sample_user_rows`), in work proportional to the sample::

    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=64 / n_users,
                                         user_ids=user_of_record, max_records_per_user=4)

How variable batch sizes are handled:

- Every batch is padded with rows of zeros whose sample weight is 0 (to one of a few sizes, see
  ``pad_sizes`` below; at most ``max_batch_size``)
  (real rows get weight 1, or the user's ``sample_weight``). A zero-weight row has zero loss, hence
  a zero per-example gradient: it adds nothing to the clipped sum, whatever the clip. The DP
  optimizer divides the noised sum by the *expected* batch size ``q * n`` (public), never by the
  padded size, so padding does not change the update.
- ``max_batch_size`` defaults to a high quantile of ``Binomial(n, q)`` (exceeded with probability
  ``overflow_probability``, 1e-6 by default, per step). If a step's sample is larger anyway, the
  full sample is emitted unpadded (never truncated: dropping examples would change the mechanism
  the ledger describes). The dataset's batch dimension is ``None``, so Keras traces its train step
  once; a larger batch costs no retrace there (an XLA-compiled step would recompile for it).
- By default (``pad_sizes="auto"``) a sample is padded only up to the smallest of a few sizes
  (the median, 0.9 and 0.999 quantiles of ``Binomial(n, q)`` and ``max_batch_size``:
  :func:`default_pad_sizes`) that holds it, not always to ``max_batch_size``: at an expected
  batch of 8 out of 60000 a step computes on 10 rows on average instead of 25, at 256 on 269
  instead of 335. An XLA-compiled step compiles once per pad size (four at most);
  ``pad_sizes=None`` pads every batch to ``max_batch_size`` (one shape). The pad sizes decide only
  how many zero-weight rows follow the sample: the sample, the update and the ledger are the
  same whichever sizes are used.
- An empty sample is an all-padding batch: the clipped sum is zero, noise is still added, and the
  step is recorded, exactly as the Poisson mechanism requires.

Randomness: each pass over the dataset draws fresh samples from a counter-based (Philox) stateless
generator whose key comes from OS entropy (``os.urandom``). ``seed`` fixes the key: for tests and
debugging only, since a known seed lets anyone replay which examples were in which batch.
Each example's uniform ``u`` is a float64 on the grid ``k 2^-52`` (``k < 2^52``); the example
joins when ``u + 2^-52 <= q`` (:func:`included`), i.e. with probability ``floor(q 2^52) 2^-52``,
never above the recorded ``q`` (the test ``u < q`` would give ``ceil(q 2^52) 2^-52 >= q``).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Optional

import numpy as np
import tensorflow as tf

from tf_dp.accounting.ledger_analysis import poisson_steps_per_epoch
from tf_dp.data.inclusion import included
from tf_dp.data.sampling import Sampling

#: Default per-step probability that a Poisson sample exceeds the padded ``max_batch_size``.
DEFAULT_OVERFLOW_PROBABILITY = 1e-6


def default_max_batch_size(
    population_size: int,
    sampling_probability: float,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
) -> int:
    """Smallest ``k`` with ``P[Binomial(n, q) > k] <= overflow_probability`` (at least 1).

    Example:

    >>> from tf_dp.data.poisson import default_max_batch_size
    >>> default_max_batch_size(60000, 256 / 60000)
    335
    """
    from scipy import stats

    n = population_size
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= _INT64_MAX:
        raise ValueError(
            f"population_size must be an integer >= 1 and <= 2**63 - 1, got {population_size!r}"
        )
    sampling_probability = _check_probability(sampling_probability)
    if not 0.0 < overflow_probability < 1.0:
        raise ValueError(f"overflow_probability must be in (0, 1), got {overflow_probability!r}")
    k = int(stats.binom.isf(overflow_probability, population_size, sampling_probability))
    return max(1, min(k, population_size))


#: The ``Binomial(n, q)`` quantiles that :func:`default_pad_sizes` pads to below the maximum.
PAD_QUANTILES = (0.5, 0.9, 0.999)


def default_pad_sizes(
    population_size: int, sampling_probability: float, max_batch_size: int
) -> tuple[int, ...]:
    """The padded batch sizes :func:`poisson_batches` uses by default: the median, 0.9 and 0.999
    quantiles of ``Binomial(n, q)`` (each at least 1 and at most ``max_batch_size``) and
    ``max_batch_size``, increasing, without repeats (at most four shapes).

    A sample of ``k`` units is padded to the smallest size ``>= k``: the expected padded size
    stays near ``n q`` (about ``1.25 n q`` at ``n q = 8``, ``1.05 n q`` at 256), while a compiled
    step sees at most four batch shapes (plus a rare oversized sample, emitted whole).

    Example:

    >>> from tf_dp.data.poisson import default_pad_sizes
    >>> default_pad_sizes(60000, 8 / 60000, 25)
    (8, 12, 18, 25)
    """
    from scipy import stats

    b = _check_positive_int("max_batch_size", max_batch_size)
    n = population_size
    if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or not 1 <= n <= _INT64_MAX:
        raise ValueError(
            f"population_size must be an integer >= 1 and <= 2**63 - 1, got {population_size!r}"
        )
    q = _check_probability(sampling_probability)
    sizes = {b}
    for p in PAD_QUANTILES:
        sizes.add(min(b, max(1, int(stats.binom.ppf(p, int(n), q)))))
    return tuple(sorted(sizes))


def _check_pad_sizes(pad_sizes: Any) -> tuple[int, ...]:
    """A sequence of pad sizes: integers >= 1, returned sorted without repeats."""
    if isinstance(pad_sizes, (str, bytes)) or not hasattr(pad_sizes, "__iter__"):
        raise TypeError(
            "pad_sizes must be 'auto', None or a sequence of integers >= 1, got "
            f"{pad_sizes!r}"
        )
    sizes = list(pad_sizes)
    if not sizes:
        raise ValueError("pad_sizes must hold at least one size (or be 'auto' / None), got []")
    for v in sizes:
        _check_positive_int("every pad_sizes entry", v)
    return tuple(sorted({int(v) for v in sizes}))


@dataclasses.dataclass(frozen=True)
class SampledBatches:
    """What every tf_dp batch selection returns: batches ready for ``model.fit`` of a private
    model, with the sampling claim they carry (a private model's ``fit`` takes the object itself
    and declares the claim to its optimizer).

    Subclasses (:class:`PoissonBatches`, :class:`~tf_dp.data.TruncatedPoissonBatches`,
    :class:`~tf_dp.data.BallsInBinsBatches`) say which :class:`~tf_dp.data.Sampling` it is.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches, ``steps_per_epoch`` of
        them per pass (padding rows have weight 0).
      tf_dp_sampling: ``(n, q)``, the population size and the per-unit selection probability.
      steps_per_epoch: batches per pass.
      max_batch_size: the rows of a padded batch.
      num_shards: input pipelines the batches were split over (1: none).
    """

    dataset: tf.data.Dataset
    tf_dp_sampling: tuple[int, float]
    steps_per_epoch: int
    max_batch_size: int
    num_shards: int = 1

    @property
    def sampling(self) -> Sampling:
        raise NotImplementedError

    @property
    def population_size(self) -> int:
        return self.tf_dp_sampling[0]

    @property
    def sampling_probability(self) -> float:
        return self.tf_dp_sampling[1]

    @property
    def expected_batch_size(self) -> float:
        n, q = self.tf_dp_sampling
        return n * q

    def __len__(self) -> int:
        return self.steps_per_epoch


@dataclasses.dataclass(frozen=True)
class PoissonBatches(SampledBatches):
    """Poisson-sampled batches, ready for ``model.fit`` of a private model.

    Attributes:
      dataset: a ``tf.data.Dataset`` of ``(x, y, sample_weight)`` batches, ``steps_per_epoch`` of
        them per pass (each pass draws fresh samples). Usable with ``fit`` directly (pass
        ``steps_per_epoch`` and call ``optimizer.set_sampling(n, q, "poisson")`` yourself), but
        passing this object to a private model's ``fit`` does both for you.
      tf_dp_sampling: ``(n, q)``, the population size and the per-unit inclusion probability
        (users and their rate with ``user_ids``).
      steps_per_epoch: number of batches per epoch (default ``round(1 / q)``: one expected pass).
      max_batch_size: the padded batch size (user slots with ``user_ids``: rows are slots * k).
      expected_batch_size: ``q * n``.
      sampling: the :class:`tf_dp.data.Sampling` of these batches: ``poisson``, ``(n, q)``,
        ``origin="sampled"`` (tf_dp drew them), user-level with ``user_ids``.
      records_per_user: ``k`` with ``user_ids`` (user-level batches), else None.
      pad_sizes: the batch sizes a sample is padded to (the smallest that holds it; a sample
        larger than all of them is emitted whole), increasing; the last is ``max_batch_size``.
    """

    records_per_user: Optional[int] = None
    pad_sizes: Optional[tuple[int, ...]] = None

    @property
    def sampling(self) -> Sampling:
        """The sampling claim these batches carry: Poisson, performed by tf_dp (``sampled``),
        over examples, or over users (``unit="user"``, ``records_per_unit=k``) when built with
        ``user_ids``."""
        n, q = int(self.tf_dp_sampling[0]), float(self.tf_dp_sampling[1])
        if self.records_per_user is None:
            return Sampling(n, q, "poisson", origin="sampled")
        return Sampling(n, q, "poisson", origin="sampled", unit="user",
                        records_per_unit=self.records_per_user)


def _as_numpy_leaves(name: str, value: Any) -> Any:
    def convert(t):
        if isinstance(t, (tf.RaggedTensor, tf.SparseTensor)):
            raise TypeError(
                f"{name} must be rectangular in-memory arrays, got a {type(t).__name__}: pad the "
                "records to one shape first (e.g. keras.utils.pad_sequences, or .to_tensor())"
            )
        if isinstance(t, tf.Tensor):
            return t.numpy()
        if isinstance(t, tf.data.Dataset):
            raise TypeError(
                f"{name} must be in-memory arrays (numpy or tensors), got a tf.data.Dataset; "
                "Poisson sampling needs random access to every example"
            )
        arr = np.asarray(t)
        if arr.ndim == 0:
            raise ValueError(
                f"{name} must be an array (or a dict / tuple of arrays) with a leading example "
                f"dimension, got a structure with a scalar leaf {t!r}; a Python list of records "
                "is read as a structure: pass np.asarray(...) of it, padding records of "
                "different lengths to one shape first (e.g. keras.utils.pad_sequences)"
            )
        return arr

    if isinstance(value, (list, tuple)) and value and all(
        isinstance(v, (list, tuple)) for v in value
    ):  # a list of records, some of another length than others: ragged
        lengths = {len(v) for v in value}
        if len(lengths) > 1:
            raise ValueError(
                f"{name} is ragged (a list of records of lengths {sorted(lengths)[:5]}...): pad "
                "the records to one shape first (e.g. keras.utils.pad_sequences)"
            )
    return tf.nest.map_structure(convert, value)


def _check_probability(q: Any) -> float:
    if isinstance(q, bool) or not isinstance(q, (int, float, np.floating, np.integer)):
        raise TypeError(
            "sampling_probability must be a number in (0, 1] (e.g. batch_size / len(x)), "
            f"got {type(q).__name__}"
        )
    q = float(q)
    if not (math.isfinite(q) and 0.0 < q <= 1.0):
        raise ValueError(f"sampling_probability must be in (0, 1], got {q}")
    return q


_INT64_MAX = 2**63 - 1  # counts reach TensorFlow as int64


def _check_positive_int(name: str, value: Any) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, np.integer))
        or not 1 <= value <= _INT64_MAX
    ):
        raise ValueError(
            f"{name} must be None or an integer >= 1 and <= 2**63 - 1, got {value!r}"
        )
    return int(value)


def check_arrays(x: Any, y: Any, sample_weight: Any):
    """Validates in-memory ``x``, ``y`` and ``sample_weight`` for a tf_dp sampler; returns them
    as numpy (weights float32 ``[n]`` or None) with ``n``. Errors name the argument."""
    x = _as_numpy_leaves("x", x)
    if y is None:
        raise ValueError(
            "y is required: padded rows are masked with sample_weight 0, which Keras applies "
            "only together with targets"
        )
    y = _as_numpy_leaves("y", y)
    leaves = tf.nest.flatten(x) + tf.nest.flatten(y)
    n = int(leaves[0].shape[0])
    for leaf in leaves:
        if leaf.shape[0] != n:
            raise ValueError(
                f"x and y must have the same number of examples in every array; got {n} and "
                f"{leaf.shape[0]}"
            )
    if n < 1:
        raise ValueError("x must hold at least one example")
    if sample_weight is not None:
        sample_weight = np.asarray(sample_weight, dtype=np.float32).reshape(-1)
        if sample_weight.shape[0] != n:
            raise ValueError(
                f"sample_weight must have one weight per example ({n}), got "
                f"{sample_weight.shape[0]}"
            )
        if not np.all(np.isfinite(sample_weight)) or np.any(sample_weight < 0):
            raise ValueError("sample_weight must be finite and >= 0")
    return x, y, sample_weight, n


def poisson_batches(
    x: Any,
    y: Any = None,
    sampling_probability: Optional[float] = None,
    sample_weight: Any = None,
    steps_per_epoch: Optional[int] = None,
    max_batch_size: Optional[int] = None,
    seed: Optional[int] = None,
    overflow_probability: float = DEFAULT_OVERFLOW_PROBABILITY,
    num_shards: int = 1,
    shard_index: int = 0,
    user_ids: Any = None,
    max_records_per_user: Optional[int] = None,
    pad_sizes: Any = "auto",
) -> PoissonBatches:
    """Poisson-sampled, padded batches of in-memory data for a private model's ``fit``.

    Args:
      x: inputs, an array or a nested structure (dict, tuple) of arrays with ``n`` rows each.
      y: targets (same structure rules), ``n`` rows; required (padding is masked through the
        sample weight, which Keras only applies together with targets).
      sampling_probability: ``q`` in (0, 1]: each example is in each batch independently with
        probability ``q``; the expected batch size is ``q * n``.
      sample_weight: optional per-example weights ``[n]``; padded rows always get weight 0.
      steps_per_epoch: batches per epoch; default ``round(1 / q)`` (one expected pass).
      max_batch_size: padded batch size; default: the ``1 - overflow_probability`` quantile of
        ``Binomial(n, q)``. A larger sample is emitted whole (see the module docstring).
      seed: fixes the sampling randomness. Tests and debugging only (default: OS entropy).
      overflow_probability: per-step probability that the default ``max_batch_size`` is exceeded.
      num_shards, shard_index: for multi-worker training (``MultiWorkerMirroredStrategy``): every
        worker passes the *whole* data set and its own ``shard_index`` in ``[0, num_shards)``;
        worker ``w`` Poisson-samples (rate ``q``, its own randomness) only the examples whose index
        is ``w`` modulo ``num_shards``. The shards partition the data, so the union of the
        workers' batches at a step is one Poisson sample of rate ``q`` over all ``n`` examples,
        and every worker declares the global ``n`` and ``q``.
      user_ids: for user-level DP: one integer or string id per example (``[n]``). Users are
        Poisson-sampled at rate ``sampling_probability`` and each sampled user contributes at
        most ``max_records_per_user`` of its examples, chosen uniformly at random; the DP step
        clips the sum of each user's gradients to ``C`` (see :mod:`tf_dp.data.users`).
        ``steps_per_epoch`` and ``max_batch_size`` then count users (a batch has
        ``max_batch_size * k`` rows). With ``num_shards > 1`` worker ``w`` samples the users
        whose position in the :class:`~tf_dp.data.UserIndex` is ``w`` modulo ``num_shards``,
        with all their records, and every worker declares the total number of users and ``q``.
      max_records_per_user: ``k`` >= 1, required with ``user_ids``.
      pad_sizes: the batch sizes a sample of ``k`` examples is padded to: the smallest one
        ``>= k`` (zero-weight rows; a sample larger than all of them is emitted whole).
        ``"auto"`` (default): :func:`default_pad_sizes` (at most four sizes, the last
        ``max_batch_size``); ``None``: ``max_batch_size`` only (every batch one
        shape); or a
        sequence of integers >= 1, whose largest is then ``max_batch_size`` (pass
        ``max_batch_size`` equal to it or not at all). With ``user_ids`` only ``"auto"`` or
        ``None`` (user slots are always padded to ``max_batch_size``).

    Returns:
      A :class:`PoissonBatches` (``.dataset``, ``.tf_dp_sampling == (n, q)``, ``.steps_per_epoch``).

    Example (``model.fit(batches, epochs=3)`` on a private model trains on these batches and
    declares the sampling to its DP optimizer):

    >>> import numpy as np, tf_dp
    >>> x, y = np.ones((100, 2), np.float32), np.zeros(100, np.int32)
    >>> batches = tf_dp.data.poisson_batches(x, y, sampling_probability=0.1, seed=0)
    >>> batches.tf_dp_sampling, batches.steps_per_epoch, batches.expected_batch_size
    ((100, 0.1), 10, 10.0)
    >>> xb, yb, weights = next(iter(batches.dataset))
    >>> xb.shape[0] == weights.shape[0] and xb.shape[0] in batches.pad_sizes  # padded, weight 0
    True
    """
    x = _as_numpy_leaves("x", x)  # first: a data set or ragged x is the real problem
    q = _check_probability(sampling_probability)
    x, y, sample_weight, n = check_arrays(x, y, sample_weight)
    from tf_dp.data.users import user_index_for

    all_users, k = user_index_for(user_ids, max_records_per_user, n)
    num_shards = _check_positive_int("num_shards", num_shards)
    if isinstance(shard_index, bool) or not isinstance(shard_index, (int, np.integer)) or not (
        0 <= shard_index < num_shards
    ):
        raise ValueError(
            f"shard_index must be an integer in [0, num_shards={num_shards}), got {shard_index!r}"
        )
    shard_index = int(shard_index)
    if num_shards > n:
        raise ValueError(f"num_shards must be <= the number of examples ({n}), got {num_shards}")
    users = None if all_users is None else all_users.shard(num_shards, shard_index)
    if steps_per_epoch is None:
        steps_per_epoch = poisson_steps_per_epoch(q)
        if steps_per_epoch > _INT64_MAX:
            raise ValueError(
                f"sampling_probability={q!r} gives a default steps_per_epoch of round(1 / q) = "
                f"{float(steps_per_epoch):.3g} steps, beyond int64: pass sampling_probability >= "
                f"{1 / _INT64_MAX:.3g} or steps_per_epoch in [1, 2**63 - 1]"
            )
    steps_per_epoch = _check_positive_int("steps_per_epoch", steps_per_epoch)
    shard_rows = np.arange(shard_index, n, num_shards) if users is None else users.order
    units = len(shard_rows) if users is None else users.num_users
    sizes = None
    if not (pad_sizes is None or (isinstance(pad_sizes, str) and pad_sizes == "auto")):
        if users is not None:
            raise ValueError(
                "pad_sizes must be 'auto' or None with user_ids (user slots are padded to "
                f"max_batch_size), got {pad_sizes!r}"
            )
        sizes = _check_pad_sizes(pad_sizes)
        if max_batch_size is not None and max_batch_size != sizes[-1]:
            raise ValueError(
                f"max_batch_size must be None or the largest of pad_sizes ({sizes[-1]}), got "
                f"{max_batch_size!r}"
            )
        max_batch_size = sizes[-1]
    if max_batch_size is None:
        max_batch_size = default_max_batch_size(units, q, overflow_probability)
    max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
    if sizes is None:
        auto = isinstance(pad_sizes, str) and users is None
        sizes = default_pad_sizes(units, q, max_batch_size) if auto else (max_batch_size,)
    if seed is None:
        key = int.from_bytes(os.urandom(8), "little") >> 1  # OS entropy; int64-safe
    else:
        if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
            raise TypeError(f"seed must be None or an integer, got {type(seed).__name__}")
        key = int(seed) & ((1 << 63) - 1)
        key = (key + 0x9E3779B97F4A7C15 * shard_index) & ((1 << 63) - 1)  # a key per shard

    if num_shards > 1:  # this worker's examples (its users' records) only
        x = tf.nest.map_structure(lambda t: t[shard_rows], x)
        y = tf.nest.map_structure(lambda t: t[shard_rows], y)
        if sample_weight is not None:
            sample_weight = sample_weight[shard_rows]
    rows = len(shard_rows)
    x_t = tf.nest.map_structure(tf.convert_to_tensor, x)
    y_t = tf.nest.map_structure(tf.convert_to_tensor, y)
    sw_t = None if sample_weight is None else tf.convert_to_tensor(sample_weight)
    q64 = tf.constant(q, tf.float64)
    key_t = tf.constant(key, tf.int64)

    sizes_t = tf.constant(sizes, tf.int32)

    def padded_size(k: tf.Tensor) -> tf.Tensor:
        # The smallest pad size >= k; k itself when the sample is larger than every size.
        fits = sizes_t >= k
        return tf.where(tf.reduce_any(fits),
                        tf.reduce_min(tf.where(fits, sizes_t, tf.int32.max)), k)

    def pad(t: tf.Tensor, k: tf.Tensor) -> tf.Tensor:
        # Pads the batch dimension from k rows up to its pad size (no-op when k is larger).
        extra = padded_size(k) - k
        paddings = tf.concat(
            [[[0, extra]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], axis=0
        )
        out = tf.pad(t, paddings)
        out.set_shape([None] + t.shape[1:].as_list())
        return out

    def sample(counter: tf.Tensor):
        # A Philox key per step: (OS-entropy key, per-step random counter from the dataset).
        u = tf.random.stateless_uniform([rows], seed=tf.stack([key_t, counter]), dtype=tf.float64)
        idx = tf.reshape(tf.where(included(u, q64)), [-1])
        k = tf.shape(idx, out_type=tf.int32)[0]
        bx = tf.nest.map_structure(lambda t: pad(tf.gather(t, idx), k), x_t)
        by = tf.nest.map_structure(lambda t: pad(tf.gather(t, idx), k), y_t)
        w = tf.ones([k], tf.float32) if sw_t is None else tf.gather(sw_t, idx)
        bw = pad(w, k)
        return bx, by, bw

    if users is not None:
        from tf_dp.data.users import UserIndex, sample_user_rows

        if num_shards > 1:  # x holds this shard's records, in the shard index's order
            users = UserIndex(np.arange(rows, dtype=np.int64), users.starts, users.user_keys)

        def draw_rows(counter: np.ndarray) -> np.ndarray:
            # A Philox key per step: (OS-entropy key, per-step random counter from the dataset).
            words = np.array([key, int(counter) & ((1 << 64) - 1)], dtype=np.uint64)
            rng = np.random.Generator(np.random.Philox(key=words))
            return sample_user_rows(users, q, k, max_batch_size, rng)

        def sample(counter: tf.Tensor):  # noqa: F811 (the user-level sampler)
            rows_ = tf.numpy_function(draw_rows, [counter], tf.int64, stateful=False)
            rows_.set_shape([None])
            real = rows_ >= 0
            idx = tf.maximum(rows_, 0)

            def take(t):
                got = tf.gather(t, idx)
                mask = tf.reshape(real, [-1] + [1] * (len(t.shape) - 1))
                return tf.where(mask, got, tf.zeros_like(got))

            w = tf.ones_like(idx, tf.float32) if sw_t is None else tf.gather(sw_t, idx)
            bw = tf.where(real, w, 0.0)
            return (tf.nest.map_structure(take, x_t), tf.nest.map_structure(take, y_t), bw)

        n_units = all_users.num_users
    else:
        n_units = n
    # Fresh random counters on every pass over the dataset (Keras re-iterates it each epoch).
    counters = tf.data.Dataset.random(seed=key % (1 << 31), rerandomize_each_iteration=True)
    dataset = counters.take(steps_per_epoch).map(sample).prefetch(2)
    if num_shards > 1:  # already this worker's shard: tf.distribute must not shard it again
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
        dataset = dataset.with_options(options)
    return PoissonBatches(
        dataset=dataset,
        tf_dp_sampling=(n_units, q),
        steps_per_epoch=steps_per_epoch,
        max_batch_size=max_batch_size,
        num_shards=num_shards,
        records_per_user=None if users is None else k,
        pad_sizes=sizes,
    )


def pad_to_multiple(dataset: tf.data.Dataset, multiple: int) -> tf.data.Dataset:
    """Pads every ``(x, y, sample_weight)`` batch of ``dataset`` with zero rows of sample weight
    0 up to a multiple of ``multiple`` rows (a batch already a multiple is left as it is).

    ``tf.distribute`` splits a global batch between ``multiple`` replicas; with a size that is
    not a multiple the pieces differ in shape and the replicas cannot be combined. Padding rows
    have weight 0, so they change neither the sample nor the update.

    Example: ``pad_to_multiple(poisson_batches(x, y, sampling_probability=0.01).dataset, 2)``.
    """
    multiple = _check_positive_int("multiple", multiple)
    if multiple == 1:
        return dataset

    def pad_batch(bx, by, bw):
        k = tf.shape(bw)[0]
        extra = (multiple - k % multiple) % multiple

        def pad(t):
            paddings = tf.concat([[[0, extra]], tf.zeros([tf.rank(t) - 1, 2], tf.int32)], axis=0)
            out = tf.pad(t, paddings)
            out.set_shape([None] + t.shape[1:].as_list())
            return out

        return (tf.nest.map_structure(pad, bx), tf.nest.map_structure(pad, by), pad(bw))

    return dataset.map(pad_batch)
