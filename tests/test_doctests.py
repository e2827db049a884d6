"""The usage examples (``>>>``) in tf_dp's public docstrings run, and print what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

#: the modules whose docstrings hold ``>>>`` examples: the public entry points (queries, ledger,
#: accountants, calibration, samplers, registries)
MODULES = (
    "tf_dp",
    "tf_dp.accounting",
    "tf_dp.accounting.calibration",
    "tf_dp.accounting.gdp",
    "tf_dp.accounting.ledger_analysis",
    "tf_dp.accounting.matrix_factorization",
    "tf_dp.accounting.matrix_sensitivity",
    "tf_dp.accounting.rdp",
    "tf_dp.correlated.noise_tf",
    "tf_dp.correlated.strategies",
    "tf_dp.data.balls_in_bins",
    "tf_dp.data.cyclic_poisson",
    "tf_dp.data.poisson",
    "tf_dp.data.sampling",
    "tf_dp.data.truncated_poisson",
    "tf_dp.dp_query.dp_query",
    "tf_dp.dp_query.gaussian_query",
    "tf_dp.dp_query.no_privacy_query",
    "tf_dp.dp_query.noise_allocation",
    "tf_dp.dp_query.normalized_query",
    "tf_dp.dp_query.quantile_adaptive_clip_query",
    "tf_dp.dp_query.serialization",
    "tf_dp.dp_query.tree_aggregation",
    "tf_dp.gradients",
    "tf_dp.gradients.ghost.registry",
    "tf_dp.gradients.registry",
    "tf_dp.ledger.events",
    "tf_dp.ledger.privacy_ledger",
    "tf_dp.ledger.query_with_ledger",
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE, verbose=False)
    assert result.attempted > 0, f"{name} has no >>> example"
    assert result.failed == 0
