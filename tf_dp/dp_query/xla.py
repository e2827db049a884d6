"""Whether code is being traced for XLA (``jit_compile=True``), where shapes must be static."""

from __future__ import annotations

import tensorflow as tf

from tf_dp import _compat


def in_xla_context() -> bool:
    """True while tracing a function that XLA compiles (``tf.function(jit_compile=True)``, or a
    Keras model compiled with ``jit_compile=True``).

    Code that needs a data-dependent shape or a variable that changes shape takes its fixed-shape
    route here. If TensorFlow's context check (internal) is unavailable, the answer is True: the
    fixed-shape routes are correct everywhere, only slower or less convenient.
    """
    if tf.executing_eagerly():
        return False
    return _compat.graph_in_xla_context()
