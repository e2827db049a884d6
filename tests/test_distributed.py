"""Private training under tf.distribute.MirroredStrategy on 2 logical CPU devices (subprocesses:
logical devices must be configured before TensorFlow starts)."""

import json
import math
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def _run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, os.path.join(HERE, "helpers", script), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("mode", ["vectorized", "ghost", "microbatch"])
def test_mirrored_strategy_noises_once_per_global_step(mode):
    r = _run("mirrored_run.py", mode)
    if mode != "microbatch":
        # Noise 0: the all-reduced clipped sum equals the one-device one.
        assert r["max_abs_diff"] <= 1e-5 * max(1.0, r["max_abs_update"] / 1e-3)
        assert r["max_abs_update"] > 1e-4
    # One draw of N(0, sigma^2 C^2) per coordinate and step: not sigma*sqrt(2) (a draw per
    # replica, summed) nor 2 sigma (two copies of one draw). Tolerance: 5 standard errors of a
    # sample variance, sqrt(2 / count).
    tol = 5 * math.sqrt(2.0 / r["noise_count"])
    assert abs(r["noise_var"] / r["expected_var"] - 1.0) < tol
    assert r["in_sync"]
    sens = 2 * 0.5 if mode == "microbatch" else 0.5
    assert r["ledger"] == [[32, 1.0, "shuffle", sens, 1.0]] * 5
    # Poisson batches: one sampling event per global step, the global population and rate.
    assert r["poisson_recorded"] == r["poisson_steps"] == 40
    assert r["poisson_ledger"] == [[400, 0.05, "poisson"]]

