"""The Poisson inclusion rules shared by every tf_dp sampler (examples and users).

- :func:`included`: the per-unit test on a float64 uniform, for graph samplers that draw one
  uniform per unit.
- :func:`poisson_subset`: a whole Poisson sample of ``range(n)`` drawn in ``O(K)`` work for a
  sample of ``K`` units, for the host samplers (:func:`tf_dp.data.poisson_sample` and the
  user-level samplers).
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

__all__ = ["RATE_MARGIN", "included", "poisson_subset"]

#: Relative margin of :func:`poisson_subset`'s binomial rate below the recorded ``q``.
RATE_MARGIN = 2.0**-40


def included(u: tf.Tensor, q: tf.Tensor) -> tf.Tensor:
    """Whether an example with uniform ``u`` (float64, a multiple of ``2^-52`` in ``[0, 1)``, as
    ``tf.random.stateless_uniform`` draws it) joins a sample of rate ``q``: ``u + 2^-52 <= q``, so
    that the ``floor(q 2^52)`` lowest of the ``2^52`` values join (probability at most ``q``).

    Example::

        included(tf.constant([0.0, 0.5], tf.float64), tf.constant(0.5, tf.float64))  # [True, False]
    """
    return u + 2.0**-52 <= q


def poisson_subset(rng: np.random.Generator, n: int, q: float) -> np.ndarray:
    """A Poisson sample of ``range(n)`` at rate at most ``q``: sorted int64 indices.

    Draws the sample size ``K ~ Binomial(n, p)``, then a uniform random ``K``-subset of
    ``range(n)`` (``rng.choice(n, K, replace=False)``: a set-based draw in ``O(K)`` time and
    memory when ``K < n / 50``, a partial shuffle of an ``n``-entry index otherwise). A given set
    of ``s`` indices then comes out with probability ``P[K = s] / C(n, s) = p^s (1 - p)^(n - s)``:
    each index is in independently with probability ``p``, as in Poisson sampling. The rate is
    ``p = q (1 - 2^-40)``, a relative margin far above the float64 rounding of numpy's binomial
    sampler, so that the inclusion probability is never above ``q``; with ``q = 1`` every index
    is taken.

    Args:
      rng: the generator to draw from (its state advances).
      n: the population size (>= 0).
      q: the recorded rate, in (0, 1].

    Example::

        rng = np.random.Generator(np.random.Philox(0))
        poisson_subset(rng, 10**7, 1e-4)   # about 1000 sorted indices, O(1000) work
    """
    if q >= 1.0:
        return np.arange(n, dtype=np.int64)
    size = int(rng.binomial(n, q * (1.0 - RATE_MARGIN)))
    return np.sort(rng.choice(n, size=size, replace=False, shuffle=False)).astype(np.int64)
