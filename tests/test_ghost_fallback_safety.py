"""Layers the conformance sweep found without a ghost rule (issue 35, item 4) train through the
ghost clipper's per-layer fallback without crashing the process, and exactly: ``ConvLSTM1D``,
``ConvLSTM2D`` and ``ConvLSTM3D`` (a convolutional recurrence inside a Keras RNN loop: the
fallback's ``vectorized_map`` cannot convert it and it takes ``map_fn`` over the examples). Each
layer runs in a subprocess of its own (a segmentation fault is this test's failure, not a dead
suite), in eager and in ``tf.function``, against per-example gradients from a ``GradientTape``
loop over the examples, clipped to the median norm and summed.

Opt-in (``--conformance-full``, with the full sweep): the three subprocesses take about 8 minutes
on the shared 2-core machine (the per-example ``map_fn`` over a recurrent loop, eager and traced).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import os, sys
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
from tests.test_ghost import LoopReference, check, rng

L = keras.layers
name = sys.argv[1]
rank = {"ConvLSTM1D": 1, "ConvLSTM2D": 2, "ConvLSTM3D": 3}[name]
shape = (3,) + (4,) * rank + (2,)
layer = getattr(L, name)(2, 2, padding="same")
model = keras.Sequential([keras.Input(shape), layer, L.Flatten(), L.Dense(3)])
r = rng(81)
x = r.normal(size=(4,) + shape).astype("float32")
y = r.integers(0, 3, 4)
for graph in (False, True):
    ghost = check(model, x, y, expect_mode="mixed", graph=graph, reference=LoopReference)
print("DESCRIPTION", ghost.description)
"""


@pytest.mark.conformance_full
@pytest.mark.parametrize("name", ["ConvLSTM1D", "ConvLSTM2D", "ConvLSTM3D"])
def test_conv_lstm_fallback(name):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, name],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "PYTHONPATH": ROOT, "TF_CPP_MIN_LOG_LEVEL": "2"},
    )
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-4000:])
    assert f"ghost+vectorized (layers: {name.lower().replace('convlstm', 'conv_lstm')}" in (
        proc.stdout
    ), proc.stdout
