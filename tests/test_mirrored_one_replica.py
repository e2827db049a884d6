"""Private training under ``tf.distribute.MirroredStrategy()`` with ONE replica (the default on a
machine with one GPU or none): it used to fail with ``RuntimeError: merge_call called while
defining a new graph`` (the ledger's append and the step's conditional update assigned mirrored
variables inside a ``tf.cond``). A subprocess: a crash is a failure, and the GPUs are hidden
before TensorFlow starts."""

import json
import os
import sys

from tests.helpers import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
N, B, EPOCHS = 96, 16, 2  # as in helpers/mirrored_one_replica.py


def _run(mode):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.run(
        [sys.executable, os.path.join(HERE, "helpers", "mirrored_one_replica.py"), mode],
        capture_output=True, text=True, timeout=600, env=env)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1][len("REPORT "):])


def test_fit_under_one_replica_mirrored_strategy_is_the_no_strategy_run():
    r = _run("fit")
    assert r["replicas"] == 1
    steps = -(-N // B) * EPOCHS  # ceil(96 / 16) batches a pass, 2 passes
    assert r["none_steps"] == r["mirrored_steps"] == steps
    # one ledger event per global step, the same events as without a strategy
    assert len(r["mirrored_ledger"]) == steps
    assert r["mirrored_ledger"] == r["none_ledger"]
    assert r["mirrored_ledger"][0] == [N, B / N, "shuffle", 1.0, 0.0]
    # the same ops on the same values on one device (a sum over one replica is the identity and
    # a withheld step's zeros are a select): the same weights bit for bit
    assert r["mirrored_update"] > 1e-3
    assert r["weights_diff"] == 0.0
    # the repro (Poisson batches): one sampling event per applied step
    assert r["poisson_recorded"] == r["poisson_steps"] == round(N / B) * EPOCHS
