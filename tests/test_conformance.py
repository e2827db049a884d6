"""Issue 35: the conformance harness (tf_dp.keras.conformance.check_model, bench/conformance.py).

Default run: one case per architecture family at its smallest config (a Keras layer model, a
keras-hub encoder classifier, a keras-hub decoder with LoRA, and the families below), run one
after the other in a subprocess (``run_isolated_together``: a crash fails the case it happened in,
and the cases after it run in a new process). The reference inside check_model is a per-example
GradientTape loop (clip, sum, divide), independent of the DP step; the step count comes from a callback, not the ledger.
The full sweep: ``pytest tests/test_conformance.py --conformance-full`` (hours on 2 cores) or
``python -m bench.conformance --out docs/coverage.md``.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest

from bench import conformance
from tests.helpers import warm_python

SUBSET = ["layer:Conv2D", "hub:BertTextClassifier", "hub:GPT2CausalLM+lora"]


def _records(cases):
    """The records of ``cases``, from one subprocess shared by this file's subsets."""
    every = _every_record()
    return [every[c] for c in cases]


@functools.lru_cache(maxsize=1)
def _every_record():
    cases = SUBSET + SUBSET2 + SUBSET3
    records = conformance.run_isolated_together(cases, timeout=900, timing_repeats=1)
    assert [r["case"] for r in records] == cases
    return {r["case"]: r for r in records}


def _assert_conforms(record):
    assert record["status"] == "checked", record
    assert record["error"] is None, record["error"]
    assert record["trains"] and record["ledger_ok"], record
    assert record["steps"] == 3 and record["ledger_steps"] == 3
    # the check has power: the step moves the weights far more than the tolerance
    assert record["step_size"] > 100 * record["tolerance"], record
    assert record["exact"], (record["max_error"], record["tolerance"])


def _assert_image_conforms(record):
    """An image model's float32 bound grows with the squared number of input positions (loose):
    the check still has power when the step moves the weights by more than the bound."""
    assert record["status"] == "checked" and record["error"] is None, record
    assert record["trains"] and record["ledger_ok"] and record["ledger_steps"] == 3, record
    assert record["step_size"] > record["tolerance"], record
    assert record["exact"], (record["max_error"], record["tolerance"])


def test_representative_cases_conform():
    records = _records(SUBSET)
    assert [r["case"] for r in records] == SUBSET
    for record in records:
        _assert_conforms(record)
        assert record["mode"] == "ghost", (record["case"], record["fallback_reasons"])
    # the LoRA case checks the adapters (a plain .keras copy of a keras-hub model loses them and
    # trained every weight instead)
    lora = records[-1]["fast_rule_variables"] + records[-1]["fallback_variables"]
    assert any(v.endswith("lora_kernel_a") for v in lora), lora
    assert not any(v.endswith("/kernel") for v in lora), lora


#: a masked LM whose head only calls its tied embedding (a registered container), and a keras-hub
#: image classifier with BatchNormalization, checked after fix_for_dp
SUBSET2 = ["hub:RoformerV2MaskedLM", "hub:ResNetImageClassifier"]


def test_more_families_conform_on_rules_alone():
    records = _records(SUBSET2)
    assert [r["case"] for r in records] == SUBSET2
    _assert_conforms(records[0])
    _assert_image_conforms(records[1])
    for record in records:
        assert record["mode"] == "ghost", (record["case"], record["fallback_reasons"])
    groupnorm = [v for v in records[1]["fast_rule_variables"] if "gamma" in v]
    assert groupnorm, records[1]["fast_rule_variables"]  # the BatchNormalization replacements


#: keras-hub Gemma 4 (its feed-forward kernels used through ``ops.matmul``, rerouted to their
#: layers' calls by a forward-only rule) and PaliGemma (a ``[1, P]`` position lookup broadcast
#: over the batch): both fell back to per-example gradients before their rules
SUBSET3 = ["hub:Gemma4CausalLM", "hub:PaliGemmaCausalLM"]


def test_gemma4_and_pali_gemma_conform_on_rules_alone():
    records = _records(SUBSET3)
    assert [r["case"] for r in records] == SUBSET3
    _assert_conforms(records[0])
    _assert_image_conforms(records[1])  # PaliGemma's image encoder: the loose image bound
    for record in records:
        assert record["mode"] == "ghost", (record["case"], record["fallback_reasons"])
    ffw = [v for v in records[0]["fast_rule_variables"] if "/ffw_" in v]
    assert len(ffw) == 3, records[0]["fast_rule_variables"]
    assert any("position_embedding" in v for v in records[1]["fast_rule_variables"])


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


def test_app_case_is_the_fixed_model():
    # fix_for_dp returns (model, report): the case is the rebuilt model, without BatchNormalization
    import keras

    model, x, y, _ = conformance.build_case("app:MobileNetV3Small")
    assert isinstance(model, keras.Model)
    kinds = {type(layer).__name__ for layer in model.layers}
    assert "BatchNormalization" not in kinds and "GroupNormalization" in kinds
    assert model(x).shape == (conformance.BATCH, 3)
    assert np.shape(y) == (conformance.BATCH,)


def test_masked_lm_and_seq2seq_inputs():
    # masked LM: logits at the MASKS masked positions, labels one per masked position; seq2seq:
    # logits over the decoder's sequence, labels its next tokens
    model, x, y, _ = conformance.build_case("hub:BertMaskedLM")
    b, m, s, v = conformance.BATCH, conformance.MASKS, conformance.SEQ, conformance.VOCAB
    positions = x["mask_positions"]
    assert positions.shape == (b, m) and positions.min() >= 0 and positions.max() < s
    assert all(len(set(row)) == m for row in positions)
    assert model(x).shape == (b, m, v) and y.shape == (b, m) and y.max() < v
    model, x, y, _ = conformance.build_case("hub:BartSeq2SeqLM")
    assert {"encoder_token_ids", "decoder_token_ids"} <= set(x)
    assert model(x).shape == (b, s, v)
    np.testing.assert_array_equal(y[:, :-1], x["decoder_token_ids"][:, 1:])


@pytest.mark.parametrize(
    "case", ["hub:ResNetImageClassifier", "hub:VGGImageClassifier", "hub:SmolLM3CausalLM"]
)
def test_list_valued_backbone_configs_are_made(case):
    # per-stage (stackwise_*) and per-layer (layer_types, rope_layer_enabled_list) settings
    model, x, y, _ = conformance.build_case(case)
    out = model(x)
    assert out.shape[0] == conformance.BATCH and np.all(np.isfinite(np.asarray(out)))


@pytest.mark.parametrize(
    "name", ["MultiHeadAttention", "Bidirectional", "LSTMCell", "EinsumDense"]
)
def test_layers_needing_a_structure_are_built(name):
    # attention on a query and a value, a wrapper around an LSTM, a cell inside RNN, an equation
    model, x, y, _ = conformance.build_case(f"layer:{name}")
    assert model(x).shape == (conformance.BATCH, 3)
    assert any(type(layer).__name__ == name or name in str(layer.get_config())
               for layer in model.layers)


def test_sub_model_arguments_are_named_in_the_reason():
    with pytest.raises(conformance.NotConstructible, match="sub-model 'vision_encoder'"):
        conformance.build_case("hub:BLIP2CausalLM")
    # a task with required settings of its own: listed with the reason, not a crashed case
    with pytest.raises(conformance.NotConstructible, match="backbone_hidden_size"):
        conformance.build_case("hub:Gemma4AssistantCausalLM")


def test_float64_build_separates_rounding_from_the_rules():
    """``--floatx float64``: the model and its inputs in float64 (a subprocess: the float type is
    global); the step still equals the reference, now within the float32 norms' rounding."""
    import json
    import os
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = warm_python.run(
        [sys.executable, "-m", "bench.conformance", "--case", "layer:Conv2D", "--floatx",
         "float64", "--timing_repeats", "1"],
        cwd=root, capture_output=True, text=True, timeout=600,
        env={**os.environ, "PYTHONPATH": root, "TF_CPP_MIN_LOG_LEVEL": "2"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads(proc.stdout.strip().splitlines()[-1])
    _assert_conforms(record)
    assert record["weights_dtype"] == ["float64"], record
    # float32 norms give clip weights to ~1e-7 relative; float32 weights would round to ~6e-8
    # of the largest weight on their own, float64 ones do not
    assert record["max_error"] < 1e-5 * record["step_size"], record


def test_results_of_several_files_last_record_wins(tmp_path):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    a.write_text('{"case": "x", "status": "crashed"}\n{"case": "y", "status": "timeout"}\n')
    b.write_text('{"case": "x", "status": "timeout"}\n\n')
    done = conformance.read_results([str(a), str(b), str(tmp_path / "missing.jsonl")])
    assert done == {
        "x": {"case": "x", "status": "timeout"},
        "y": {"case": "y", "status": "timeout"},
    }
    merged = tmp_path / "m.jsonl"
    conformance.main(
        ["--cases", "x,y,z", "--resume", f"{a},{b}", "--merged_out", str(merged),
         "--table_only", "--out", str(tmp_path / "t.md")]
    )
    assert len(merged.read_text().splitlines()) == 2
    assert "z" in (tmp_path / "t.md").read_text().split("Not yet run")[1]


def test_cases_together_one_crash_fails_one_case(monkeypatch):
    # a process that dies in case "b" (and, started again, in "d"): "b" and "d" are the failures,
    # every other case still runs, each in the process after the crash
    calls = []

    def one_process(cases, timeout, timing_repeats):
        calls.append(list(cases))
        found = {}
        for case in cases:
            if case in ("b", "d"):
                return found, "crashed", f"exit code -11 in {case}"
            found[case] = {"case": case, "status": "checked"}
        return found, "crashed", "not used"

    monkeypatch.setattr(conformance, "_run_in_one_process", one_process)
    records = conformance.run_isolated_together(["a", "b", "c", "d", "e"], timeout=5)
    assert calls == [["a", "b", "c", "d", "e"], ["c", "d", "e"], ["e"]]
    assert [r["status"] for r in records] == ["checked", "crashed", "checked", "crashed", "checked"]
    assert records[1]["error"] == "exit code -11 in b" and records[3]["error"].endswith("in d")


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
