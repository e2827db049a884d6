"""tf_dp: differentially private training for TensorFlow / Keras 3.

Public API (imported lazily, so that ``tf_dp.accounting`` and the command-line tools start without
loading TensorFlow):

- Queries (``tf_dp.dp_query``): ``GaussianSumQuery``, ``NestedQuery``, ``NormalizedQuery``,
  ``JointClipGaussianSumQuery``, ``AutomaticClipSumQuery``, ``QuantileAdaptiveClipSumQuery``,
  ``QuantileAdaptiveClipAverageQuery``, ``NoPrivacySumQuery``, ``NoPrivacyAverageQuery``,
  ``proportional_noise_allocation``, ``dimension_adjusted_noise_allocation``,
  ``TreeCumulativeSumQuery``, ``TreeResidualSumQuery`` (tree aggregation, DP-FTRL).
- Ledger (``tf_dp.ledger``): ``PrivacyLedger``, ``QueryWithLedger``.
- Keras (``tf_dp.keras``): DP optimizers and models.
- Accounting (``tf_dp.accounting``).
- ``set_progress(False)``: no progress lines on stderr from tf_dp's long work (tracing a big
  model's first DP step, calibrating noise, long ledger analyses, audits); also
  ``TF_DP_PROGRESS=0``.

The Keras side (``tf_dp.keras``, ``tf_dp.gradients``) needs Keras's TensorFlow backend and raises
``ImportError`` under any other ``KERAS_BACKEND`` (jax, torch, numpy, ...); the accountants, the
ledger file and the command-line tools do not import Keras and work under any backend.

Example:

>>> import tf_dp
>>> query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
>>> query.get_config()
{'l2_norm_clip': 1.0, 'stddev': 1.1, 'seed': None, 'noise_mode': 'continuous'}
"""

from tf_dp._backend import require_tensorflow_backend as _require_tensorflow_backend  # noqa: F401
from tf_dp._progress import set_progress as set_progress  # public: tf_dp.set_progress

__version__ = "0.1.0"

_EXPORTS = {
    "DPQuery": "dp_query",
    "SumAggregationDPQuery": "dp_query",
    "GaussianSumQuery": "dp_query",
    "NestedQuery": "dp_query",
    "NormalizedQuery": "dp_query",
    "JointClipGaussianSumQuery": "dp_query",
    "AutomaticClipSumQuery": "dp_query",
    "QuantileAdaptiveClipSumQuery": "dp_query",
    "QuantileAdaptiveClipAverageQuery": "dp_query",
    "NoPrivacySumQuery": "dp_query",
    "TreeCumulativeSumQuery": "dp_query",
    "TreeResidualSumQuery": "dp_query",
    "NoPrivacyAverageQuery": "dp_query",
    "proportional_noise_allocation": "dp_query",
    "dimension_adjusted_noise_allocation": "dp_query",
    "PrivacyLedger": "ledger",
    "QueryWithLedger": "ledger",
    "SampleEntry": "ledger",
    "SamplingEvent": "ledger",
    "SumQueryEvent": "ledger",
    "LedgerFileError": "ledger",
    "DPKerasSGDOptimizer": "keras",
    "DPKerasAdamOptimizer": "keras",
    "DPKerasAdagradOptimizer": "keras",
    "make_dp_optimizer_class": "keras",
    "make_private": "keras",
    "DPSequential": "keras",
    "DPModel": "keras",
    "PrivacyReport": "keras",
    "PrivacyBudget": "keras",
    "poisson_batches": "data",
    "compute_epsilon": "accounting",
}

_SUBMODULES = (
    "dp_query", "ledger", "accounting", "gradients", "engine", "keras", "cli", "data", "auditing"
)


def _submodule(name: str):
    """``tf_dp.<name>``, imported on first use (plain imports: each subpackage is a module of its
    own, and the accountants must not pull in TensorFlow)."""
    if name == "dp_query":
        import tf_dp.dp_query as module
    elif name == "ledger":
        import tf_dp.ledger as module
    elif name == "accounting":
        import tf_dp.accounting as module
    elif name == "gradients":
        import tf_dp.gradients as module
    elif name == "engine":
        import tf_dp.engine as module
    elif name == "keras":
        import tf_dp.keras as module
    elif name == "cli":
        import tf_dp.cli as module
    elif name == "data":
        import tf_dp.data as module
    elif name == "auditing":
        import tf_dp.auditing as module
    else:
        raise AttributeError(f"module 'tf_dp' has no attribute {name!r}")
    return module


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(_submodule(_EXPORTS[name]), name)
        globals()[name] = value  # resolved once
        return value
    if name in _SUBMODULES:
        return _submodule(name)
    raise AttributeError(f"module 'tf_dp' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS) + list(_SUBMODULES))


__all__ = sorted([*_EXPORTS, "set_progress"])
