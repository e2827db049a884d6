"""Per-example gradient clippers (see ``base.py`` for the contract).

A *gradient clipper* (:class:`GradientClipper`) turns a batch's per-example losses into the
clipped sum the DP query noises: ``vectorized`` and ``microbatch`` materialise per-example
gradients, ``ghost`` and ``jl`` do not. :func:`make_clipper` builds one from a ``gradient_mode``
name. (These are unrelated to ``tf.distribute`` strategies, which decide where a step runs.)

The names of earlier releases (``GradientStrategy``, ``MicrobatchStrategy``,
``VectorizedStrategy``, ``GhostStrategy``, ``JLStrategy``, ``make_strategy``) still resolve, with a
``DeprecationWarning``.

Example:

>>> from tf_dp.gradients import make_clipper
>>> make_clipper("microbatch", num_microbatches=2).name
'microbatch'
"""

import warnings

from tf_dp._backend import require_tensorflow_backend

require_tensorflow_backend()  # before any module that runs Keras on TensorFlow ops

from tf_dp.gradients.base import ClippedGradients, GradientClipper
from tf_dp.gradients.ghost.clipper import GhostClipper
from tf_dp.gradients.jl import JLClipper
from tf_dp.gradients.microbatch import MicrobatchClipper
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.gradients.registry import gradient_modes, make_clipper, register_gradient_mode
from tf_dp.gradients.vectorized import VectorizedClipper

__all__ = [
    "ClippedGradients",
    "GhostClipper",
    "GradientClipper",
    "JLClipper",
    "MicrobatchClipper",
    "PhysicalBatches",
    "VectorizedClipper",
    "gradient_modes",
    "make_clipper",
    "register_gradient_mode",
]

#: deprecated name -> current name
DEPRECATED = {
    "GradientStrategy": "GradientClipper",
    "MicrobatchStrategy": "MicrobatchClipper",
    "VectorizedStrategy": "VectorizedClipper",
    "GhostStrategy": "GhostClipper",
    "JLStrategy": "JLClipper",
    "make_strategy": "make_clipper",
}


def __getattr__(name):
    if name in DEPRECATED:
        warnings.warn(
            f"tf_dp.gradients.{name} is deprecated; use tf_dp.gradients.{DEPRECATED[name]} "
            "(gradient clippers are unrelated to tf.distribute strategies)",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[DEPRECATED[name]]
    raise AttributeError(f"module 'tf_dp.gradients' has no attribute {name!r}")
