"""The DP step's home: the sampling claim, the privacy configuration and the step itself.

TensorFlow only (no Keras import): the Keras optimizers and custom training loops both go
through it.
"""

from tf_dp.data.sampling import ORIGINS, POLICIES, UNITS, Sampling
from tf_dp.engine.config import PrivacyConfig, SpeedConfig
from tf_dp.engine.step import DPEngine

__all__ = ["DPEngine", "ORIGINS", "POLICIES", "PrivacyConfig", "SpeedConfig", "UNITS", "Sampling"]
