"""DP aggregate queries (McMahan et al. 2018): clip, accumulate, noise. See ``dp_query.py``."""

from tf_dp.dp_query.automatic_clip_query import AutomaticClipSumQuery
from tf_dp.dp_query.dp_query import DPQuery, SumAggregationDPQuery, SumQuerySpec
from tf_dp.dp_query.gaussian_query import GaussianSumQuery
from tf_dp.dp_query.joint_clip_query import JointClipGaussianSumQuery
from tf_dp.dp_query.nested_query import NestedQuery
from tf_dp.dp_query.no_privacy_query import NoPrivacyAverageQuery, NoPrivacySumQuery
from tf_dp.dp_query.noise import make_generator
from tf_dp.dp_query.noise_allocation import (
    dimension_adjusted_noise_allocation,
    proportional_noise_allocation,
)
from tf_dp.dp_query.normalized_query import NormalizedQuery
from tf_dp.dp_query.serialization import (
    deserialize_query,
    serializable_query,
    serialize_query,
)
from tf_dp.dp_query.tree_aggregation import TreeCumulativeSumQuery, TreeResidualSumQuery
from tf_dp.dp_query.quantile_adaptive_clip_query import (
    QuantileAdaptiveClipAverageQuery,
    QuantileAdaptiveClipSumQuery,
    sum_noise_multiplier_for,
)

__all__ = [
    "DPQuery",
    "SumAggregationDPQuery",
    "SumQuerySpec",
    "GaussianSumQuery",
    "JointClipGaussianSumQuery",
    "NestedQuery",
    "NoPrivacySumQuery",
    "NoPrivacyAverageQuery",
    "NormalizedQuery",
    "TreeCumulativeSumQuery",
    "TreeResidualSumQuery",
    "AutomaticClipSumQuery",
    "QuantileAdaptiveClipSumQuery",
    "QuantileAdaptiveClipAverageQuery",
    "sum_noise_multiplier_for",
    "serialize_query",
    "serializable_query",
    "deserialize_query",
    "make_generator",
    "proportional_noise_allocation",
    "dimension_adjusted_noise_allocation",
]

from tf_dp import _compat as _ag_compat  # noqa: E402

# tf_dp's code is traced as written, not rewritten by AutoGraph (every tf_dp module that uses
# TensorFlow imports tf_dp.dp_query or tf_dp.data: tests/test_import_isolation.py)
_ag_compat.exclude_from_autograph()
