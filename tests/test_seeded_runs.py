"""A seeded run repeats bit for bit in another process in the microbatch and JL modes.

``helpers/seeded_fit.py`` trains a tiny model (eagerly, in a ``tf.function``, under XLA, and the
microbatch mode under ``MirroredStrategy`` on 2 logical CPU devices) with ``noise_seed=7``; two
processes must report the same weights, and the two replicas of a step their own assignments.
"""

import json
import math
import os
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _run_twice():
    """Runs ``helpers/seeded_fit.py`` in two processes at once: their output lines by tag."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    script = os.path.join(HERE, "helpers", "seeded_fit.py")
    procs = [subprocess.Popen([sys.executable, script], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=900)
        tags = {}
        for line in stdout.splitlines():
            tag, _, body = line.partition(" ")
            if tag in ("REPORT", "REPLICAS"):
                tags[tag] = json.loads(body)
        assert "REPORT" in tags, stderr[-3000:]
        out.append((tags, p.returncode, stderr))
    return out


def test_seeded_fit_repeats_bit_for_bit_in_another_process():
    (a, code_a, err_a), (b, code_b, err_b) = _run_twice()
    for key, weights in a["REPORT"].items():
        assert np.array_equal(weights, b["REPORT"][key]), key
    assert code_a == 0 and code_b == 0, err_a[-3000:] + err_b[-3000:]
    # Under MirroredStrategy each replica draws its own assignment (the replica id is folded
    # into the key): two independent uniform assignments to 4 microbatches agree on
    # Binomial(n, 1/4) examples; within 6 standard deviations of n/4.
    first, second = (np.array(r) for r in a["REPLICAS"])
    assert np.array_equal(first, np.array(b["REPLICAS"][0]))
    n = first.size
    assert abs(np.sum(first == second) - n / 4) < 6 * math.sqrt(n * 0.25 * 0.75)
