"""Private training under tf.distribute.MirroredStrategy on 2 logical CPU devices (subprocesses:
logical devices must be configured before TensorFlow starts)."""

import functools
import json
import math
import os
import sys

import pytest

from tests.helpers.tolerance import (
    dense_gradient_terms,
    norm_terms,
    sgd_tolerance,
    tolerance,
)
from tests.helpers import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
#: helpers/mirrored_run.py trains a 64-16-4 network (1108 parameters) with learning rate 1 on
#: batches of 32 split over 2 replicas: a gradient's roundings, its norm, the sum of 32 rows and
#: of 2 replicas, the division (tests/helpers/tolerance.py); |w| <= 1 + 5 steps of <= 0.5
MIRRORED_TERMS = dense_gradient_terms([64, 16, 4]) + norm_terms(1108) + 32 + 2 + 1


def _run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.run([sys.executable, os.path.join(HERE, "helpers", script), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


@pytest.mark.parametrize("mode", ["vectorized", "ghost", "microbatch", "ghost:5"])
def test_mirrored_strategy_noises_once_per_global_step(mode):
    r = _run("mirrored_run.py", mode)
    if mode != "microbatch":
        # Noise 0: the all-reduced clipped sum equals the one-device one.
        # 5 steps of clipped means (clip 0.5); a replica's sum lost or doubled moves the
        # weights by O(max_abs_update / 2), far above this
        atol = sgd_tolerance("float32", 5, 1.0, 0.5, MIRRORED_TERMS, weight_scale=3.5)
        assert r["max_abs_diff"] <= atol, (r["max_abs_diff"], atol)
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
    assert r["journal_is_ledger"]  # the journal reads the mirrored ledger tables
    if mode == "ghost:5":  # each replica's records clipped 5 at a time
        assert r["description"].endswith("in physical batches of at most 5"), r["description"]



def test_mirrored_adaptive_clipping_counts_across_replicas_and_noises_the_count_once():
    r = _run("mirrored_run.py", "adaptive")
    # the clip of every step (from the ledger) and the weights equal the one-device run's
    # the clip follows the (integer) unclipped counts through the same ops: one rounding per
    # step of the 3; a count off by one moves it by exp(0.1 / 32) - 1 = 3e-3
    assert r["clips"]["mirrored"] == pytest.approx(r["clips"]["one"], rel=tolerance("float32", 3))
    assert len(set(round(c, 6) for c in r["clips"]["one"])) == 4  # the clip moved at every step
    # 3 steps of learning rate 1 on means clipped to <= 0.1 (the clip starts at 0.05)
    assert r["weights_diff"] < sgd_tolerance("float32", 3, 1.0, 0.1, MIRRORED_TERMS, 1.5)
    assert r["clip_replicas_equal"]
    assert r["steps"] == 300 and r["count_queries"] == [[0.5, 2.0]]
    # one draw of N(0, sigma_b^2 = 4) per step: not 8 (a draw per replica) nor 16 (one draw
    # counted twice); tolerance 5 standard errors of a sample variance, sqrt(2 / steps)
    noise = r["count_noise"]
    var = sum(v * v for v in noise) / len(noise)
    assert abs(var / 4.0 - 1.0) < 5 * math.sqrt(2.0 / len(noise))


def test_a_declared_shuffle_batch_limits_the_global_batch_not_each_replicas_share():
    """2 replicas, declared shuffle batch 4 (n = 32): global batches of 4 train (8 steps, a
    pass); global batches of 8 (a share of 4 on each replica, each within the declared size)
    are refused before anything is recorded or applied, since a pass of 4 such steps has every
    record take part twice within the 8 steps the ledger counts as one pass."""
    r = _run("mirrored_shuffle_batch.py")
    ok, twice = r["declared"], r["twice"]
    assert ok["error"] is None and ok["ledger"] == ok["iterations"] == 8 and ok["changed"]
    assert twice["error"] is not None and "batch size" in twice["error"]
    assert "accepted 1 .." in twice["error"] and "[4]" in twice["error"]
    assert twice["ledger"] == twice["iterations"] == 0 and not twice["changed"]


#: helpers/mirrored_fixed_shape.py: an 8-16-3 network (195 parameters), clip 0.5, learning rate
#: 1, 2 epochs of at most 40 steps; batches of up to 58 rows over 2 replicas: per step a gradient's
#: roundings, its norm, the batch's and the replicas' sums and the division. An update is at most
#: 0.5 * 58 / 15 < 2 per weight (a sum of clipped rows over the public expected batch size), so
#: |w| <= 1 + 40 * 2.
FIXED_SHAPE_TERMS = dense_gradient_terms([8, 16, 3]) + norm_terms(195) + 58 + 2 + 1


@functools.lru_cache(maxsize=None)
def _fixed_shape_report():
    return _run("mirrored_fixed_shape.py")  # one subprocess for both selections


@pytest.mark.parametrize("kind", ["truncated_poisson", "balls_in_bins"])
def test_fixed_shape_selections_split_over_replicas_as_one_global_step(kind):
    """The same seeded batches on 2 replicas and on one device (noise 0): the same weights, and
    one ledger row per global step with the selection's own claim."""
    import numpy as np

    r = _fixed_shape_report()[kind]
    mirrored, one = r["mirrored"], r["one"]
    assert mirrored["replicas"] == 2 and one["replicas"] == 1
    for run in (mirrored, one):
        assert run["ledger"] == run["iterations"] == 2 * r["steps_per_epoch"]
        assert run["policies"] == [kind]
    assert mirrored["max_batch_size"] == ([r["b"]] if kind == "truncated_poisson" else [0])
    steps = 2 * r["steps_per_epoch"]
    atol = sgd_tolerance("float32", steps=steps, learning_rate=1.0, update_scale=2.0,
                         terms=FIXED_SHAPE_TERMS, weight_scale=1.0 + steps * 2.0)
    moved = 0.0
    for a, b, w0 in zip(mirrored["weights"], one["weights"], one["init"]):
        a, b, w0 = np.asarray(a), np.asarray(b), np.asarray(w0)
        assert abs(a - b).max() <= atol
        moved = max(moved, abs(b - w0).max())
    assert moved > 10 * atol  # the runs trained: equal weights are not the untouched init
