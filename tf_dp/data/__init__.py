"""Input pipelines for DP training.

- :func:`poisson_batches`: Poisson-sampled, padded batches of in-memory data for ``model.fit``
  (the ledger records ``poisson`` sampling with the real ``n`` and ``q``); with ``user_ids``,
  Poisson sampling of users for user-level DP (:mod:`tf_dp.data.users`).
- :func:`load_mnist_or_fashion_mnist`: MNIST when it can be fetched, else Fashion-MNIST IDX files
  from a local directory (never synthetic data).

Example::

    (x, y), (x_test, y_test), name = tf_dp.data.load_mnist_or_fashion_mnist()
    model.fit(tf_dp.data.poisson_batches(x[..., None] / 255.0, y, sampling_probability=256 / len(x)),
              epochs=1)
"""

from tf_dp.data.datasets import (
    DEBIAN_FASHION_MNIST_DIR,
    DataNotFoundError,
    load_fashion_mnist_idx,
    load_mnist_or_fashion_mnist,
    read_idx,
)
from tf_dp.data.poisson import PoissonBatches, default_max_batch_size, poisson_batches
from tf_dp.data.sampling import ORIGINS, POLICIES, UNITS, Sampling
from tf_dp.data.users import UserIndex, sample_user_rows

__all__ = [
    "ORIGINS",
    "POLICIES",
    "UNITS",
    "Sampling",
    "DEBIAN_FASHION_MNIST_DIR",
    "DataNotFoundError",
    "PoissonBatches",
    "UserIndex",
    "default_max_batch_size",
    "load_fashion_mnist_idx",
    "load_mnist_or_fashion_mnist",
    "poisson_batches",
    "read_idx",
    "sample_user_rows",
]
