"""The command-line tools, through subprocess: numbers, both formats, clean failures."""

import json
import math
import subprocess
import sys

import pytest

from tf_dp import accounting as acc
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import write_ledger_file

BASE = ["--N=60000", "--batch_size=256", "--noise_multiplier=1.1", "--epochs=3", "--delta=1e-5"]


def _run(module, *args):
    return subprocess.run([sys.executable, "-m", f"tf_dp.cli.{module}", *args],
                          capture_output=True, text=True, timeout=300)


def test_privacy_json_all_accountants():
    p = _run("compute_dp_sgd_privacy", *BASE, "--accountant=all", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert set(out) == {"rdp", "moments", "pld", "gdp", "delta", "assumptions", "sampling"}
    assert out["delta"] == 1e-5 and "Poisson" in out["assumptions"]
    for name in ("rdp", "moments", "pld", "gdp"):
        ref = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=3, accountant=name)
        assert out[name]["epsilon"] == pytest.approx(ref.epsilon, rel=1e-9)
    assert out["rdp"]["order"] > 1 and out["moments"]["order"] > 1 and out["gdp"]["mu"] > 0
    assert out["gdp"]["certified"] is False and out["pld"]["certified"] is True


def test_privacy_text_is_honest():
    p = _run("compute_dp_sgd_privacy", *BASE, "--accountant=gdp")
    assert p.returncode == 0, p.stderr
    assert "APPROXIMATION" in p.stdout and "epsilon" in p.stdout
    ref = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=3, accountant="gdp").epsilon
    assert f"{ref:.4g}" in p.stdout
    p = _run("compute_dp_sgd_privacy", *BASE, "--sampling=shuffle")
    assert p.returncode == 0 and "NO amplification" in p.stdout


def test_microbatch_and_jl_flags():
    p = _run("compute_dp_sgd_privacy", "--N=60000", "--batch_size=256", "--noise_multiplier=2.2",
             "--epochs=3", "--delta=1e-5", "--microbatch_size=8", "--format=json")
    ref = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=3).epsilon
    assert json.loads(p.stdout)["rdp"]["epsilon"] == pytest.approx(ref, rel=1e-9)
    p = _run("compute_dp_sgd_privacy", "--N=10000", "--batch_size=100", "--noise_multiplier=1.0",
             "--steps=100", "--delta=1e-5", "--jl_projections=64", "--accountant=pld",
             "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    exact = acc.dp_sgd_epsilon(10000, 100, 1.0, 1e-5, steps=100, accountant="pld").epsilon
    assert out["pld"]["epsilon"] >= exact * 0.99 and math.isfinite(out["pld"]["epsilon"])


def test_ledger_flag(tmp_path):
    e = SampleEntry(SamplingEvent(1000, 0.01), (SumQueryEvent(1.0, 1.0),))
    path = tmp_path / "l.json"
    write_ledger_file(path, [e] * 300)
    p = _run("compute_dp_sgd_privacy", f"--ledger={path}", "--delta=1e-5", "--format=json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["rdp"]["epsilon"] == pytest.approx(
        acc.compute_epsilon([e] * 300, 1e-5).epsilon, rel=1e-12)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    p = _run("compute_dp_sgd_privacy", f"--ledger={bad}", "--delta=1e-5")
    assert p.returncode == 2 and "Traceback" not in p.stderr and len(p.stderr.splitlines()) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["--N=0", "--batch_size=1", "--noise_multiplier=1", "--epochs=1", "--delta=1e-5"],
        ["--N=100", "--batch_size=-5", "--noise_multiplier=1", "--epochs=1", "--delta=1e-5"],
        ["--N=100", "--batch_size=200", "--noise_multiplier=1", "--epochs=1", "--delta=1e-5"],
        ["--N=100", "--batch_size=10", "--noise_multiplier=1", "--epochs=1", "--delta=1.5"],
        ["--N=100", "--batch_size=10", "--noise_multiplier=1", "--epochs=1", "--delta=0"],
        ["--N=100", "--batch_size=10", "--noise_multiplier=1", "--delta=1e-5"],
        ["--N=abc"],
        ["--ledger=/nonexistent/file.json", "--delta=1e-5"],
    ],
)
def test_privacy_bad_input_exits_2(args):
    p = _run("compute_dp_sgd_privacy", *args)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and p.stdout == ""


def test_noise_from_budget_json_and_text():
    p = _run("compute_noise_from_budget", "--N=60000", "--batch_size=256", "--epsilon=2",
             "--epochs=3", "--delta=1e-5", "--accountant=rdp", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    s = out["rdp"]["noise_multiplier"]
    assert acc.dp_sgd_epsilon(60000, 256, s, 1e-5, epochs=3).epsilon <= 2.0
    assert acc.dp_sgd_epsilon(60000, 256, s * 0.99, 1e-5, epochs=3).epsilon > 2.0
    assert out["delta"] == 1e-5 and "assumptions" in out
    p = _run("compute_noise_from_budget", "--N=60000", "--batch_size=256", "--epsilon=2",
             "--epochs=3", "--delta=1e-5", "--accountant=gdp")
    assert p.returncode == 0 and "noise_multiplier" in p.stdout and "APPROXIMATE" in p.stdout


@pytest.mark.parametrize(
    "args",
    [
        ["--N=100", "--batch_size=10", "--epsilon=-1", "--epochs=1", "--delta=1e-5"],
        ["--N=100", "--batch_size=1000", "--epsilon=1", "--epochs=1", "--delta=1e-5"],
        ["--N=100", "--batch_size=100", "--epsilon=1e-6", "--epochs=1000", "--delta=1e-10"],
    ],
)
def test_noise_from_budget_bad_input_exits_2(args):
    p = _run("compute_noise_from_budget", *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_shuffle_counts_the_given_epochs():
    # 10000 / 64 is 156.25: an epoch is 157 steps (the last batch partial). Five epochs are five
    # full-batch Gaussians with noise multiplier 2 / 2: mu = sqrt(5) (it was sqrt(6)).
    p = _run("compute_dp_sgd_privacy", "--N=10000", "--batch_size=64", "--noise_multiplier=2",
             "--epochs=5", "--sampling=shuffle", "--delta=1e-5", "--accountant=gdp",
             "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["gdp"]["mu"] == pytest.approx(math.sqrt(5.0), rel=1e-12)
    assert "785 steps (5 epochs of 157 steps)" in out["assumptions"]


@pytest.mark.parametrize("module,own", [("compute_dp_sgd_privacy", "noise_multiplier"),
                                        ("compute_noise_from_budget", "epsilon")])
@pytest.mark.parametrize("arg", ["--help", "-h"])
def test_help_lists_every_flag(module, own, arg):
    p = _run(module, arg)
    assert p.returncode == 0 and p.stderr == ""
    for name in ("N", "batch_size", "epochs", "steps", "delta", "accountant", "sampling",
                 "microbatch_size", "format", own):
        assert f"--{name}:" in p.stdout, name
    assert "rdp|moments|pld|gdp|all" in p.stdout


def test_huge_epochs_are_composed_or_refused_with_the_range():
    p = _run("compute_dp_sgd_privacy", "--N=60000", "--batch_size=256", "--noise_multiplier=1.1",
             "--epochs=1e9", "--delta=1e-5", "--format=json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["rdp"]["epsilon"] == pytest.approx(
        acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=1e9).epsilon, rel=1e-12)
    for module, extra in [("compute_dp_sgd_privacy", "--noise_multiplier=1.1"),
                          ("compute_noise_from_budget", "--epsilon=3")]:
        p = _run(module, "--N=60000", "--batch_size=256", extra, "--epochs=1e300",
                 "--delta=1e-5")
        assert p.returncode == 2 and "Traceback" not in p.stderr and p.stdout == ""
        assert len(p.stderr.strip().splitlines()) == 1
        assert "--epochs must be in (0, 4.255e+12]" in p.stderr


def test_pld_budget_names_pld():
    p = _run("compute_noise_from_budget", "--N=100", "--batch_size=100", "--epsilon=1e-6",
             "--epochs=1000", "--delta=1e-10", "--accountant=pld")
    assert p.returncode == 2 and "'pld' accountant" in p.stderr and "rdp" not in p.stderr


def _audit_file(tmp_path, lower_bound, delta=1e-5):
    # the file AuditReport.save writes, from a report's summary (the real audit runs in
    # tests/test_auditing.py; here its figures are chosen to sit below / above the CLI's epsilon)
    from tf_dp.auditing.report_file import write_report_file

    path = tmp_path / "audit.json"
    write_report_file(str(path), {
        "lower_bound": lower_bound, "delta": delta, "confidence": 0.95,
        "certified_epsilon": float("inf"), "threat_model": "white_box", "trainings": 2,
        "num_canaries": 500})
    return path


def test_audit_report_is_printed_beside_the_ledger_analysis(tmp_path):
    ref = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=3, accountant="rdp").epsilon
    below = _audit_file(tmp_path, 0.5 * ref)
    p = _run("compute_dp_sgd_privacy", *BASE, f"--audit_report={below}", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["audit"]["lower_bound"] == pytest.approx(0.5 * ref) and out["audit"]["above"] == []
    p = _run("compute_dp_sgd_privacy", *BASE, f"--audit_report={below}")
    assert f"epsilon >= {0.5 * ref:.4g}" in p.stdout and "consistent" in p.stdout
    above = _audit_file(tmp_path, 1.5 * ref)
    p = _run("compute_dp_sgd_privacy", *BASE, f"--audit_report={above}", "--accountant=all")
    assert p.returncode == 0 and "VIOLATION" in p.stdout and "rdp" in p.stdout.split("VIOLATION")[1]
    other_delta = _audit_file(tmp_path, 1.5 * ref, delta=1e-3)
    p = _run("compute_dp_sgd_privacy", *BASE, f"--audit_report={other_delta}")
    assert "not compared" in p.stdout and "VIOLATION" not in p.stdout
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "something else"}')
    p = _run("compute_dp_sgd_privacy", *BASE, f"--audit_report={bad}")
    assert p.returncode == 2 and "audit report" in p.stderr and "Traceback" not in p.stderr


def test_audit_report_save_round_trips_through_the_cli(tmp_path):
    import keras
    import numpy as np

    import tf_dp.keras
    from tf_dp.auditing import audit_dp_sgd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4)).astype("float32")
    report = audit_dp_sgd(
        model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1,
            gradient_mode="vectorized"),
        x=x, y=(x[:, 0] > 0).astype("int32"),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps=3, num_canaries=200, seed=0)
    path = tmp_path / "audit.json"
    report.save(str(path))
    # noise off: the audit is far above what sigma = 4 would certify for this run
    p = _run("compute_dp_sgd_privacy", "--N=132", "--batch_size=132", "--noise_multiplier=4",
             "--steps=3", "--delta=1e-5", f"--audit_report={path}", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["audit"]["lower_bound"] == pytest.approx(report.lower_bound, rel=1e-12)
    assert out["audit"]["above"] == ["rdp"]


@pytest.mark.parametrize("module,args,flag", [
    ("compute_dp_sgd_privacy", ["--batch_size=10", "--noise_multiplier=1", "--epochs=1",
                                "--delta=1e-5"], "--N"),
    ("compute_dp_sgd_privacy", ["--N=100", "--batch_size=10", "--epochs=1", "--delta=1e-5"],
     "--noise_multiplier"),
    ("compute_dp_sgd_privacy", ["--N=100", "--batch_size=10", "--noise_multiplier=1",
                                "--epochs=1"], "--delta"),
    ("compute_noise_from_budget", ["--N=100", "--batch_size=10", "--epochs=1",
                                   "--delta=1e-5"], "--epsilon"),
])
def test_missing_flag_is_reported_as_required(module, args, flag):
    p = _run(module, *args)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert f"{flag} is required" in p.stderr and "got None" not in p.stderr
