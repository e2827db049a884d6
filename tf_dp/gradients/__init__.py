"""Per-example clipping strategies (see ``base.py`` for the contract)."""

from tf_dp import _require_tensorflow_backend

_require_tensorflow_backend()  # before any module that runs Keras on TensorFlow ops

from tf_dp.gradients.base import ClippedGradients, GradientStrategy
from tf_dp.gradients.microbatch import MicrobatchStrategy
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.gradients.registry import gradient_modes, make_strategy, register_gradient_mode
from tf_dp.gradients.vectorized import VectorizedStrategy

__all__ = [
    "ClippedGradients",
    "GradientStrategy",
    "MicrobatchStrategy",
    "PhysicalBatches",
    "VectorizedStrategy",
    "gradient_modes",
    "make_strategy",
    "register_gradient_mode",
]
