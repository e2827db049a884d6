"""Noise source: a counter-based Philox generator, seeded from OS entropy by default.

McMahan et al. 2018 (section 8) ask for noise from a cryptographically seeded generator: a
predictable seed lets an adversary subtract the noise. :func:`make_generator` keys a
``tf.random.Generator`` (Philox, counter-based, so streams are reproducible only from the key and
counter) with a 64-bit key and a 128-bit starting counter from ``os.urandom``. Passing ``seed`` is
for tests and debugging only: with a known seed the noise is known and the privacy guarantee is
void.

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
            # 64-bit key and 128-bit starting counter, all from OS entropy: 192 unpredictable
            # bits of generator state (section 8 asks for a seed of at least 128 bits; the Philox
            # key alone has only 64).
            words = [int.from_bytes(os.urandom(8), "little", signed=True) for _ in range(3)]
            return tf.random.Generator.from_key_counter(
                key=words[0], counter=words[1:], alg="philox"
            )
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        return tf.random.Generator.from_seed(seed, alg="philox")


def add_gaussian_noise(generator: tf.random.Generator, value, stddev):
    """Returns ``value + N(0, stddev^2)`` elementwise (noise drawn in float32 or wider)."""
    value = tf.convert_to_tensor(value)
    noise_dtype = value.dtype if value.dtype in (tf.float32, tf.float64) else tf.float32
    noise = generator.normal(tf.shape(value), stddev=tf.cast(stddev, noise_dtype), dtype=noise_dtype)
    return value + tf.cast(noise, value.dtype)
