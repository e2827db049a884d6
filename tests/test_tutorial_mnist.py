"""The main job, end to end: tutorials/mnist_dpsgd_tutorial_keras.py on a tiny real data set."""

import os
import re
import subprocess
import sys

from tests.idx_fixtures import write_digits_idx
from tf_dp.ledger.ledger_file import read_ledger_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tutorials", "mnist_dpsgd_tutorial_keras.py")


def test_tutorial_prints_accuracy_and_the_privacy_statement_of_its_saved_ledger(tmp_path):
    data_dir = str(tmp_path / "idx")
    write_digits_idx(data_dir, n_train=640, n_test=200)
    ledger_path = str(tmp_path / "out" / "ledger.json")
    cmd = [
        sys.executable, SCRIPT,
        "--data_dir", data_dir, "--epochs", "2", "--batch_size", "64",
        "--learning_rate", "0.5", "--noise_multiplier", "1.1", "--l2_norm_clip", "1.0",
        "--ledger_path", ledger_path, "--delta", "1e-5",
        "--seed", "0",  # reproducible run: the accuracy check cannot flake
        "--notry_mnist",  # the data must be the fixture, wherever the tests run
    ]
    # As a user runs it: no TF_CPP_MIN_LOG_LEVEL of their own, and a fresh matplotlib config
    # directory (Keras imports matplotlib, which then builds its font cache and says so).
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    env["MPLCONFIGDIR"] = str(tmp_path / "mplconfig")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Start-up noise is filtered; the script's own first line says what TensorFlow found, and
    # real log lines (tf_dp's choice of gradient clipper) still reach stderr.
    assert out.startswith("TensorFlow ") and "devices: " in out.splitlines()[0]
    for noise in ("cuInit", "absl::InitializeLog", "cuda drivers", "oneDNN", "font cache"):
        assert noise not in proc.stderr, proc.stderr[-3000:]
    assert "tf_dp: gradient_mode='auto' uses" in proc.stderr
    assert "Data: fashion_mnist" in out and data_dir in out
    accuracy = float(re.search(r"Test accuracy \(fashion_mnist\): ([0-9.]+)", out).group(1))
    assert 0.2 < accuracy <= 1.0  # 10 classes: well above chance after 20 DP steps
    assert re.search(r"Privacy \(from the saved ledger\): .+", out)
    epsilon = float(re.search(r"epsilon = ([0-9.eE+-]+) at delta = 1e-05", out).group(1))
    assert 0 < epsilon < 50
    entries = read_ledger_file(ledger_path)
    assert len(entries) == 2 * 10  # epochs * round(640 / 64)
    assert {(e.sampling.population_size, e.sampling.selection_probability, e.sampling.policy)
            for e in entries} == {(640, 0.1, "poisson")}
    assert entries[0].queries[0].noise_stddev == 1.1 * 1.0 or abs(
        entries[0].queries[0].noise_stddev - 1.1) < 1e-6
