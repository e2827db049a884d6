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

The Keras side (``tf_dp.keras``, ``tf_dp.gradients``) needs Keras's TensorFlow backend and raises
``ImportError`` under any other ``KERAS_BACKEND`` (jax, torch, numpy, ...); the accountants, the
ledger file and the command-line tools do not import Keras and work under any backend.

Example::

    import tf_dp
    query = tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1)
"""

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "DPQuery": "tf_dp.dp_query",
    "SumAggregationDPQuery": "tf_dp.dp_query",
    "GaussianSumQuery": "tf_dp.dp_query",
    "NestedQuery": "tf_dp.dp_query",
    "NormalizedQuery": "tf_dp.dp_query",
    "JointClipGaussianSumQuery": "tf_dp.dp_query",
    "AutomaticClipSumQuery": "tf_dp.dp_query",
    "QuantileAdaptiveClipSumQuery": "tf_dp.dp_query",
    "QuantileAdaptiveClipAverageQuery": "tf_dp.dp_query",
    "NoPrivacySumQuery": "tf_dp.dp_query",
    "TreeCumulativeSumQuery": "tf_dp.dp_query",
    "TreeResidualSumQuery": "tf_dp.dp_query",
    "NoPrivacyAverageQuery": "tf_dp.dp_query",
    "proportional_noise_allocation": "tf_dp.dp_query",
    "dimension_adjusted_noise_allocation": "tf_dp.dp_query",
    "PrivacyLedger": "tf_dp.ledger.privacy_ledger",
    "QueryWithLedger": "tf_dp.ledger.query_with_ledger",
    "SampleEntry": "tf_dp.ledger.events",
    "SamplingEvent": "tf_dp.ledger.events",
    "SumQueryEvent": "tf_dp.ledger.events",
    "LedgerFileError": "tf_dp.ledger.ledger_file",
    "DPKerasSGDOptimizer": "tf_dp.keras",
    "DPKerasAdamOptimizer": "tf_dp.keras",
    "DPKerasAdagradOptimizer": "tf_dp.keras",
    "make_dp_optimizer_class": "tf_dp.keras",
    "make_private": "tf_dp.keras",
    "DPSequential": "tf_dp.keras",
    "DPModel": "tf_dp.keras",
    "PrivacyReport": "tf_dp.keras",
    "PrivacyBudget": "tf_dp.keras",
    "poisson_batches": "tf_dp.data",
    "compute_epsilon": "tf_dp.accounting",
}

_SUBMODULES = ("dp_query", "ledger", "accounting", "gradients", "keras", "cli", "data", "auditing")


def _require_tensorflow_backend() -> None:
    """Raises ``ImportError`` unless Keras runs on its TensorFlow backend.

    Called when ``tf_dp.keras`` or ``tf_dp.gradients`` is imported: their DP step is written in
    TensorFlow ops (per-example gradients, ``tf.distribute``, the ledger's variables), so under
    another backend (jax, torch, numpy, ...) it cannot run. The check is "the backend is not
    ``tensorflow``", whichever other backend it is.

    Example::

        tf_dp._require_tensorflow_backend()  # ImportError when KERAS_BACKEND=jax
    """
    import keras

    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise ImportError(
            f"tf_dp needs Keras's TensorFlow backend for training, but Keras runs on {backend!r}: "
            "set the environment variable KERAS_BACKEND=tensorflow before keras is first imported "
            "(tf_dp.accounting and the command-line tools work under any backend)"
        )


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _SUBMODULES:
        return importlib.import_module(f"tf_dp.{name}")
    raise AttributeError(f"module 'tf_dp' has no attribute {name!r}")


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS) + list(_SUBMODULES))


__all__ = sorted(_EXPORTS)
