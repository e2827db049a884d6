"""Keras 3 integration: DP optimizers, private models, callbacks."""

from tf_dp._backend import require_tensorflow_backend

require_tensorflow_backend()  # before any module that runs Keras on TensorFlow ops

from tf_dp.keras import callbacks, schedules
from tf_dp.keras.callbacks import (
    BackupAndRestore,
    BudgetExhaustedError,
    LedgerCheckpoint,
    PrivacyBudget,
    PrivacyReport,
)
from tf_dp.keras.custom_loop import DPTrainStep
from tf_dp.keras.fixing import DPCompatibilityReport, fix_for_dp, validate_for_dp
from tf_dp.keras.ftrl import DPKerasFTRLOptimizer
from tf_dp.keras.losses import PerExampleLoss
from tf_dp.keras.mf import DPKerasMFOptimizer
from tf_dp.keras.models import DPModel, DPSequential, is_private, make_private
from tf_dp.keras.schedules import DecreasingClip
from tf_dp.dp_query.partition_selection import SparseEmbeddingConfig
from tf_dp.keras.optimizers import (
    DPKerasAdagradOptimizer,
    DPKerasAdamOptimizer,
    DPKerasSGDOptimizer,
    DPOptimizerMixin,
    make_dp_optimizer_class,
)

__all__ = [
    "BackupAndRestore",
    "BudgetExhaustedError",
    "LedgerCheckpoint",
    "PrivacyBudget",
    "PrivacyReport",
    "callbacks",
    "schedules",
    "DecreasingClip",
    "DPCompatibilityReport",
    "DPKerasAdagradOptimizer",
    "DPKerasAdamOptimizer",
    "DPKerasFTRLOptimizer",
    "DPKerasMFOptimizer",
    "DPKerasSGDOptimizer",
    "DPModel",
    "DPOptimizerMixin",
    "DPSequential",
    "DPTrainStep",
    "PerExampleLoss",
    "SparseEmbeddingConfig",
    "fix_for_dp",
    "is_private",
    "make_dp_optimizer_class",
    "make_private",
    "validate_for_dp",
]
