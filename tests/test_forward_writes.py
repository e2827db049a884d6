"""Layers that write trainable variables in their forward pass: Keras's ``SpectralNormalization``
writes the normalised kernel (and its power-iteration vector) on every training call, then calls
the layer it wraps. A DP step is exact for such a model only if it runs the forward pass once:
the ghost clipper's mixed plan ran a rules pass and a fallback pass, the second writing the
kernel again, and its update was off by a third of the step (the conformance sweep's one
inexact layer). ``gradient_mode="auto"`` now picks the whole-model route, and an explicit
``"ghost"`` is refused at the first step, before any update.
"""

from __future__ import annotations

import keras
import numpy as np
import pytest

import tf_dp
from tf_dp.keras.conformance import check_model

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _model(tail: bool) -> keras.Model:
    keras.utils.set_random_seed(0)
    inp = keras.Input((5,))
    out = keras.layers.SpectralNormalization(keras.layers.Dense(4))(inp)
    if tail:
        out = keras.layers.Dense(3)(out)
    return keras.Model(inp, out)


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(4, 5)).astype("float32"), np.arange(4) % 3


@pytest.mark.parametrize("tail", [False, True], ids=["alone", "with_dense_head"])
def test_auto_step_equals_one_forward_reference(tail):
    # check_model: noise 0, clip at the median per-example norm (two examples clipped), against
    # per-example GradientTape gradients each taken from the same state after one forward pass
    x, y = _data()
    record = check_model(_model(tail), x, y, LOSS, timing_repeats=1)
    assert record.error is None, record.error
    assert record.exact, (record.max_error, record.tolerance, record.step_size)
    assert record.step_size > 0.1  # a step the error bound is small against
    assert record.mode == "vectorized"


def test_explicit_ghost_is_refused_before_a_step():
    x, y = _data()
    model = tf_dp.keras.make_private(_model(True))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.1, gradient_mode="ghost"
        ),
        loss=LOSS,
    )
    bias = [v.numpy().copy() for v in model.trainable_variables if "bias" in v.path]
    with pytest.raises(ValueError, match="SpectralNormalization.*gradient_mode='vectorized'"):
        model.fit(x, y, batch_size=4, verbose=0)
    # refused at the first step, before any update (the forward pass it began may have written
    # the normalised kernel: SpectralNormalization's own doing) and before any ledger row
    assert int(model.optimizer.iterations.numpy()) == 0
    assert len(model.optimizer.ledger.samples()) == 0
    after = [v.numpy() for v in model.trainable_variables if "bias" in v.path]
    for a, b in zip(bias, after):
        np.testing.assert_array_equal(a, b)
