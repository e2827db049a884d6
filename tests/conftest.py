"""Test tiers as pytest markers, assigned by test file, so a change has a short loop.

- ``unit``: mechanisms, ledger, accountants, CLI, lint, imports, BUILD and doctests; no Keras
  training
  (``python -m pytest tests -m unit``: 470 tests in 90 s on 2 cores with nothing else running).
- ``e2e``: notebooks, the tutorial script, README snippets, research quick runs, multi-device and
  multi-worker runs in subprocesses.
- ``integration``: everything else (Keras training through the DP step).

README's test command runs all three. A test file not listed below is ``integration``.
"""

from __future__ import annotations

import gc
import pathlib
import sys

import pytest

UNIT = {
    "test_accounting_gdp",
    "test_accounting_jl",
    "test_accounting_ledger",
    "test_accounting_pld",
    "test_accounting_rdp",
    "test_accounting_tradeoff",
    "test_batch_selection_accounting",
    "test_batch_selection_calibration",
    "test_mf_accounting",
    "test_mf_ledger",
    "test_cli",
    "test_data_datasets",
    "test_dp_query_graph",
    "test_dp_query_validation",
    "test_data_sampling",
    "test_ledger",
    "test_ledger_file",
    "test_ledger_runs",
    "test_ledger_flush",
    "test_lint",
    "test_noise",
    "test_partition_selection",
    "test_tree_aggregation",
    "test_correlated_noise",
    "test_research_correlated_noise",
    "test_public_api",
    "test_imports",
    "test_build",
    "test_doctests",
    "test_ghost_registry",
    "test_bench_step_time",
    "test_autograph",
}

E2E = {
    "test_distributed",
    "test_mirrored_one_replica",
    "test_docs_blocks",
    "test_multi_worker",
    "test_multi_worker_selections",
    "test_notebooks",
    "test_readme",
    "test_research_quick",
    "test_seeded_runs",
    "test_tutorial_mnist",
}

TIERS = ("unit", "integration", "e2e")


def tier_of(path: str | pathlib.Path) -> str:
    """The tier of a test file (by its stem)."""
    stem = pathlib.Path(path).stem
    if stem in UNIT:
        return "unit"
    if stem in E2E:
        return "e2e"
    return "integration"


def pytest_addoption(parser):
    parser.addoption(
        "--conformance-full",
        action="store_true",
        default=False,
        help="also run the full conformance sweep (tests marked conformance_full: every Keras "
        "layer, keras.applications model and keras-hub task, one subprocess each; hours on 2 "
        "cores). Without it those tests are deselected, not skipped.",
    )


def pytest_configure(config):
    for name in TIERS:
        config.addinivalue_line(
            "markers", f"{name}: tf_dp test tier (see tests/conftest.py)"
        )
    config.addinivalue_line(
        "markers",
        "conformance_full: the full conformance sweep (opt-in: --conformance-full)",
    )


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, tier_of(item.path)))
    if not config.getoption("--conformance-full", default=False):
        full = [item for item in items if item.get_closest_marker("conformance_full")]
        if full:
            config.hook.pytest_deselected(items=full)
            items[:] = [
                item
                for item in items
                if not item.get_closest_marker("conformance_full")
            ]


@pytest.fixture(autouse=True, scope="module")
def _release_a_files_models():
    """After each test file: Keras's session cleared and a full garbage collection. A test worker
    runs many files in one process; without this it keeps every file's models and traced
    functions (about 2 GB and 1.8 million objects after six files), and some later tests ran
    20 times slower than alone (tests/test_mf_optimizer.py's physical-batch case: 3 s alone,
    44 to 85 s after five other files).

    What survives that collection is then frozen (``gc.freeze()``: moved to the permanent
    generation, which later collections do not scan). Most of it cannot be freed at all: every
    traced train step leaves TensorFlow graphs (the branches of its ``tf.cond``s, nested
    ``tf.function`` graphs) in reference cycles that run through TensorFlow's C++ graph objects,
    which Python's collector does not see. Without the freeze every later collection scanned
    them again: after 40 files a worker held 3 million objects and each file's teardown took
    10 to 100 s (1,000 s of the suite's 3,700 s of worker time)."""
    yield
    if "keras" in sys.modules:
        sys.modules["keras"].backend.clear_session()  # also runs gc.collect()
    else:
        gc.collect()
    gc.freeze()
