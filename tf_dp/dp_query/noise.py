"""Noise source: a counter-based Philox generator, seeded from OS entropy by default.

McMahan et al. 2018 (section 8) ask for noise from a cryptographically seeded generator: a
predictable seed lets an adversary subtract the noise. :func:`make_generator` keys a
``tf.random.Generator`` (Philox, counter-based, so streams are reproducible only from the key) with
64 bits from ``os.urandom``. Passing ``seed`` is for tests and debugging only: with a known seed the
noise is known and the privacy guarantee is void.

Caveat (same section): Gaussian samples in floating point are not exactly Gaussian; the accountants
treat them as exact, as every DP-SGD implementation does.
"""

from __future__ import annotations

import os
from typing import Optional

import tensorflow as tf


def make_generator(seed: Optional[int] = None) -> tf.random.Generator:
    """Returns a Philox generator keyed from OS entropy, or from ``seed`` (tests only)."""
    with tf.init_scope():
        if seed is None:
            key = int.from_bytes(os.urandom(8), "little") >> 1  # int64 range
            return tf.random.Generator.from_key_counter(key=key, counter=[0, 0], alg="philox")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        return tf.random.Generator.from_seed(seed, alg="philox")


def add_gaussian_noise(generator: tf.random.Generator, value, stddev):
    """Returns ``value + N(0, stddev^2)`` elementwise (noise drawn in float32 or wider)."""
    value = tf.convert_to_tensor(value)
    noise_dtype = value.dtype if value.dtype in (tf.float32, tf.float64) else tf.float32
    noise = generator.normal(tf.shape(value), stddev=tf.cast(stddev, noise_dtype), dtype=noise_dtype)
    return value + tf.cast(noise, value.dtype)
