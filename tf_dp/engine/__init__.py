"""The DP step's home: the sampling claim, the privacy configuration and the step itself.

TensorFlow only (no Keras import): the Keras optimizers and custom training loops both go
through it.
"""

from tf_dp.data.sampling import ORIGINS, POLICIES, UNITS, Sampling

__all__ = ["ORIGINS", "POLICIES", "UNITS", "Sampling"]
