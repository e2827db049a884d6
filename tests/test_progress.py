"""Progress lines on tf_dp's long work (tf_dp._progress): a line on stderr once work has run past
the delay, with what runs and for how long (and how far, for counted loops), and a last line when
it ends; ``tf_dp.set_progress(False)`` or ``TF_DP_PROGRESS=0`` silence them.

The delay (5 s in use) is set to 0 here and the monitor polls every 20 ms, so that work of a
fraction of a second shows its lines; what the tests check is which work reports, not how long
it takes."""

import re
import time

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp import _progress


@pytest.fixture(autouse=True)
def fast_progress(monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 0.0)
    monkeypatch.setattr(_progress, "INTERVAL", 0.05)
    monkeypatch.setattr(_progress, "_POLL", 0.02)
    monkeypatch.delenv("TF_DP_PROGRESS", raising=False)
    monkeypatch.setattr(_progress, "_enabled", None)
    _progress._monitor_thread = None  # a fresh monitor with the fast poll
    yield


def _lines(capsys, what):
    return [line for line in capsys.readouterr().err.splitlines()
            if line.startswith("tf_dp: ") and what in line]


def test_work_past_the_delay_reports_while_running_and_at_the_end(capsys):
    with _progress.working("sleeping"):
        time.sleep(0.3)
    lines = _lines(capsys, "sleeping")
    assert len(lines) >= 2 and re.fullmatch(r"tf_dp: sleeping\.\.\. \d+ s", lines[0])
    assert re.fullmatch(r"tf_dp: sleeping: done in 0\.\d s", lines[-1])
    for _ in _progress.counted(range(3), "looping"):
        time.sleep(0.15)
    lines = _lines(capsys, "looping")
    assert any(re.fullmatch(r"tf_dp: looping\.\.\. [12]/3 \d+ s", line) for line in lines)
    assert lines[-1].startswith("tf_dp: looping: done in")


def test_short_work_says_nothing(capsys, monkeypatch):
    monkeypatch.setattr(_progress, "DELAY", 5.0)
    with _progress.working("quick"):
        time.sleep(0.1)
    assert _lines(capsys, "quick") == []


def test_an_error_ends_the_lines_with_its_name(capsys):
    with pytest.raises(KeyError), _progress.working("failing"):
        time.sleep(0.1)
        raise KeyError("x")
    assert _lines(capsys, "failing")[-1].startswith("tf_dp: failing: stopped (KeyError) in")
    time.sleep(0.1)
    assert _lines(capsys, "failing") == []  # nothing after the end


def test_the_switch_and_the_environment_variable_turn_it_off(capsys, monkeypatch):
    tf_dp.set_progress(False)
    try:
        with _progress.working("silenced"):
            time.sleep(0.2)
        assert _lines(capsys, "silenced") == []
    finally:
        tf_dp.set_progress(True)
    monkeypatch.setattr(_progress, "_enabled", None)
    for value in ("0", "false", "off", "no"):
        monkeypatch.setenv("TF_DP_PROGRESS", value)
        with _progress.working("by env"):
            time.sleep(0.1)
        assert _lines(capsys, "by env") == [], value
    tf_dp.set_progress(True)  # the setting wins over the environment
    with _progress.working("forced on"):
        time.sleep(0.1)
    assert _lines(capsys, "forced on")
    with pytest.raises(TypeError, match="enabled must be True or False"):
        tf_dp.set_progress("no")


@pytest.mark.parametrize("on", [True, False])
def test_calibration_and_long_ledgers_report(capsys, on):
    from tf_dp import accounting
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    tf_dp.set_progress(on)
    try:
        # each well past the 20 ms poll (about 1.5 s and 0.2 s on an idle 2-core CPU)
        sigma = accounting.calibrate_noise_multiplier(2.0, 1e-5, 1000, 100, steps=10,
                                                      accountant="pld", rtol=0.1)
        runs = [(SampleEntry(SamplingEvent(60_000, 0.01), (SumQueryEvent(1.0, 1.0 + i / 1e3),)),
                 100) for i in range(2000)]
        accounting.compute_epsilon(runs, 1e-5, accountant="rdp")
    finally:
        tf_dp.set_progress(True)
    assert sigma > 0
    out = capsys.readouterr().err
    calibrating = re.findall(r"tf_dp: calibrating the noise multiplier for epsilon <= 2 "
                             r"\(pld accountant\): done in", out)
    ledger = re.findall(r"tf_dp: computing epsilon of a 200000-step ledger \(2000 runs, rdp "
                        r"accountant\): done in", out)
    assert (len(calibrating), len(ledger)) == ((1, 1) if on else (0, 0))


@pytest.mark.parametrize("on", [True, False])
def test_the_first_dp_step_and_an_audit_report(capsys, on):
    from tf_dp.auditing import audit_dp_sgd

    tf_dp.set_progress(on)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    try:
        model = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)),
                                                           keras.layers.Dense(2)], name="tiny"))
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=0),
                  epochs=2, verbose=0)
        first = _lines(capsys, "first DP step")
        audit_dp_sgd(
            model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
            optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
            x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps=2, num_canaries=20, trainings=2, seed=0)
        audit = _lines(capsys, "audit_dp_sgd")
    finally:
        tf_dp.set_progress(True)
    if not on:
        assert first == [] and audit == []
        return
    # the first call only (tracing), named by the model; later steps say nothing
    assert re.fullmatch(r"tf_dp: tracing and compiling the first DP step of 'tiny' \(2 trainable "
                        r"variables\): done in \d+\.\d s", first[-1])
    assert all("'tiny'" in line for line in first)
    assert audit[-1].startswith("tf_dp: audit_dp_sgd: training 2 models: done in")
    assert any(re.search(r"training 2 models\.\.\. [01]/2", line) for line in audit)
