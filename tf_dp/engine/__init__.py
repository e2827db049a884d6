"""The DP step's home: the sampling claim, the privacy configuration and the step itself.

TensorFlow only (no Keras import): the Keras optimizers and custom training loops both go
through it, and both stop on a privacy budget through :class:`BudgetPlanner` ("may the next k
steps run?").
"""

from tf_dp.data.sampling import ORIGINS, POLICIES, UNITS, Sampling
from tf_dp.engine.budget import BudgetExhaustedError, BudgetPlanner
from tf_dp.engine.config import PrivacyConfig, SpeedConfig
from tf_dp.engine.step import DPEngine

__all__ = [
    "BudgetExhaustedError",
    "BudgetPlanner",
    "DPEngine",
    "ORIGINS",
    "POLICIES",
    "PrivacyConfig",
    "SpeedConfig",
    "UNITS",
    "Sampling",
]
