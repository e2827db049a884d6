"""Input pipelines for DP training.

- :func:`poisson_batches`: Poisson-sampled, padded batches of in-memory data for ``model.fit``
  (the ledger records ``poisson`` sampling with the real ``n`` and ``q``); with ``user_ids``,
  Poisson sampling of users for user-level DP (:mod:`tf_dp.data.users`).
- :func:`poisson_sample`: the same from a random-access source (:class:`ArraySource` over numpy
  arrays, memmaps and h5py datasets, :func:`hdf5_source`, :class:`TFRecordSource`,
  :class:`ArrayRecordSource`), reading only the sampled records.
- :func:`truncated_poisson_batches`: Poisson-sampled batches of one fixed shape ``[B, ...]`` (a
  sample larger than ``B`` is cut to a random ``B``; the ledger records ``truncated_poisson`` with
  ``B`` and the accountants charge the truncation).
- :func:`balls_in_bins_batches`: every pass throws each example into one of ``T`` batches at
  random (each example once per pass; the ledger records ``balls_in_bins``).
- :func:`cyclic_poisson_batches`: the data split into ``b`` parts, step ``t`` a Poisson sample of
  part ``t mod b`` (participations ``b`` steps apart; the ledger records ``cyclic_poisson``);
  :func:`cyclic_poisson_sample` reads the same selection from a random-access source.
- :func:`shuffled_passes`: fixed-size batches of full passes of a sequential ``tf.data`` pipeline
  (the ledger records ``shuffle``: no amplification assumed).
- :class:`Sampling`: the sampling claim every sampler hands over (population, rate, policy,
  whether tf_dp drew the batches, example- or user-level).
- :func:`load_mnist_or_fashion_mnist`: MNIST when it can be fetched, else Fashion-MNIST IDX files
  from a local directory (never synthetic data); :func:`load_imdb_or_fortunes`: IMDb when it
  can be fetched, else Debian's fortunes (four topics, labelled as the fallback).

Example::

    (x, y), (x_test, y_test), name = tf_dp.data.load_mnist_or_fashion_mnist()
    model.fit(tf_dp.data.poisson_batches(x[..., None] / 255.0, y, sampling_probability=256 / len(x)),
              epochs=1)
"""

from tf_dp.data.arrayrecord import ArrayRecordSource
from tf_dp.data.balls_in_bins import BallsInBinsBatches, balls_in_bins_batches
from tf_dp.data.cyclic_poisson import (
    CyclicPoissonBatches,
    cyclic_poisson_batches,
    cyclic_poisson_sample,
)
from tf_dp.data.datasets import (
    DEBIAN_FASHION_MNIST_DIR,
    DataNotFoundError,
    load_fashion_mnist_idx,
    load_mnist_or_fashion_mnist,
    read_idx,
)
from tf_dp.data.poisson import (
    PoissonBatches,
    SampledBatches,
    default_max_batch_size,
    poisson_batches,
)
from tf_dp.data.sampler import poisson_sample
from tf_dp.data.source_samplers import balls_in_bins_sample, truncated_poisson_sample
from tf_dp.data.sampling import ORIGINS, POLICIES, UNITS, Sampling
from tf_dp.data.shuffled import ShuffledPasses, shuffled_passes
from tf_dp.data.source import ArraySource, RandomAccessSource, hdf5_source
from tf_dp.data.text_datasets import (
    DEBIAN_FORTUNES_DIR,
    FORTUNE_TOPICS,
    encode_fortunes,
    load_imdb_or_fortunes,
    read_fortunes,
)
from tf_dp.data.tfrecord import TFRecordSource
from tf_dp.data.truncated_poisson import (
    TruncatedPoissonBatches,
    default_truncation_size,
    truncated_poisson_batches,
)
from tf_dp.data.users import UserIndex, sample_user_rows

__all__ = [
    "ArrayRecordSource",
    "ORIGINS",
    "POLICIES",
    "UNITS",
    "Sampling",
    "ArraySource",
    "BallsInBinsBatches",
    "DEBIAN_FASHION_MNIST_DIR",
    "DEBIAN_FORTUNES_DIR",
    "FORTUNE_TOPICS",
    "DataNotFoundError",
    "PoissonBatches",
    "RandomAccessSource",
    "SampledBatches",
    "ShuffledPasses",
    "TFRecordSource",
    "TruncatedPoissonBatches",
    "UserIndex",
    "balls_in_bins_batches",
    "cyclic_poisson_batches",
    "cyclic_poisson_sample",
    "CyclicPoissonBatches",
    "balls_in_bins_sample",
    "default_max_batch_size",
    "default_truncation_size",
    "hdf5_source",
    "encode_fortunes",
    "load_fashion_mnist_idx",
    "load_imdb_or_fortunes",
    "load_mnist_or_fashion_mnist",
    "poisson_batches",
    "poisson_sample",
    "read_fortunes",
    "read_idx",
    "shuffled_passes",
    "truncated_poisson_batches",
    "truncated_poisson_sample",
    "sample_user_rows",
]

from tf_dp import _compat as _ag_compat  # noqa: E402

# tf_dp's code is traced as written, not rewritten by AutoGraph (every tf_dp module that uses
# TensorFlow imports tf_dp.dp_query or tf_dp.data: tests/test_import_isolation.py)
_ag_compat.exclude_from_autograph()
