"""Issue 35: the conformance harness (tf_dp.keras.conformance.check_model, bench/conformance.py).

Default run: one case per architecture family at its smallest config (a Keras layer model, a
keras-hub encoder classifier, a keras-hub decoder with LoRA), each in its own subprocess, so a
crash is a failure. The reference inside check_model is a per-example GradientTape loop (clip,
sum, divide), independent of the DP step; the step count comes from a callback, not the ledger.
The full sweep: ``pytest tests/test_conformance.py --conformance-full`` (hours on 2 cores) or
``python -m bench.conformance --out docs/coverage.md``.
"""

from __future__ import annotations

import pytest

from bench import conformance

SUBSET = ["layer:Conv2D", "hub:BertTextClassifier", "hub:GPT2CausalLM+lora"]


def _assert_conforms(record):
    assert record["status"] == "checked", record
    assert record["error"] is None, record["error"]
    assert record["trains"] and record["ledger_ok"], record
    assert record["steps"] == 3 and record["ledger_steps"] == 3
    # the check has power: the step moves the weights far more than the tolerance
    assert record["step_size"] > 100 * record["tolerance"], record
    assert record["exact"], (record["max_error"], record["tolerance"])


def test_representative_cases_conform():
    # one subprocess for the three (one TensorFlow import): a crash fails the test
    records = conformance.run_isolated_together(SUBSET, timeout=600, timing_repeats=1)
    assert [r["case"] for r in records] == SUBSET
    for record in records:
        _assert_conforms(record)
        assert record["mode"] == "ghost", (record["case"], record["fallback_reasons"])


def test_enumeration_is_programmatic_and_lists_reasons():
    import keras
    import keras_hub

    cases, skipped = conformance.all_cases()
    hub_tasks = [
        n
        for n in dir(keras_hub.models)
        if isinstance(getattr(keras_hub.models, n), type)
        and issubclass(getattr(keras_hub.models, n), keras_hub.models.Task)
        and getattr(keras_hub.models, n).backbone_cls is not None
    ]
    named = {c.removesuffix("+lora") for c in cases} | set(skipped)
    # every task class with a backbone is swept or listed with a reason (base classes aside)
    missing = [
        n
        for n in hub_tasks
        if f"hub:{n}" not in named
        and conformance._hub_kind(getattr(keras_hub.models, n)) != n
    ]
    assert not missing, missing
    assert all(skipped.values())
    for name in ("Dense", "Conv2D", "Embedding", "LayerNormalization"):
        assert f"layer:{name}" in cases
    assert f"app:{keras.applications.MobileNetV2.__name__}" in cases
    assert any(c.endswith("CausalLM+lora") for c in cases)


def pytest_generate_tests(metafunc):
    # the full sweep's cases are enumerated only when it runs (keras_hub's import is not free)
    if metafunc.function.__name__ == "test_full_sweep_case":
        full = metafunc.config.getoption("--conformance-full", default=False)
        cases = conformance.all_cases()[0] if full else ["deselected"]
        metafunc.parametrize("case", cases)


@pytest.mark.conformance_full
def test_full_sweep_case(case):
    record = conformance.run_isolated(case, timeout=900)
    if record["status"] == "not constructible":
        return  # listed with its reason in docs/coverage.md
    _assert_conforms(record)
