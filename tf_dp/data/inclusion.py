"""The Poisson inclusion test shared by every tf_dp sampler (examples and users)."""

from __future__ import annotations

import tensorflow as tf

__all__ = ["included"]


def included(u: tf.Tensor, q: tf.Tensor) -> tf.Tensor:
    """Whether an example with uniform ``u`` (float64, a multiple of ``2^-52`` in ``[0, 1)``, as
    ``tf.random.stateless_uniform`` draws it) joins a sample of rate ``q``: ``u + 2^-52 <= q``, so
    that the ``floor(q 2^52)`` lowest of the ``2^52`` values join (probability at most ``q``).

    Example::

        included(tf.constant([0.0, 0.5], tf.float64), tf.constant(0.5, tf.float64))  # [True, False]
    """
    return u + 2.0**-52 <= q
