"""The channelwise rule (forward-mode products, ``tf_dp.gradients.ghost.normalization``): every
keras-hub norm and layer scale it is registered for, and ``keras.applications``' ``LayerScale``,
against per-example gradients from a ``GradientTape`` loop over the examples, clipped and summed;
eager, ``tf.function``, XLA and mixed float16; the ghost plan must cover every variable. A layer
with a matrix variable is refused (fallback), and a layer that mixes channels through its vector
shows what the contract excludes.
"""

from __future__ import annotations

import importlib

import keras
import numpy as np
import pytest

from tests.test_ghost import LoopReference, _compile, check, rng
from tests.test_ghost_finetuning_rules import _sum_fn
from tests.test_ghost_more_rules import assert_ghost_sums, loop_sums
from tf_dp import _compat
from tf_dp.gradients.ghost import GhostClipper
from tf_dp.gradients.ghost.keras_hub_rules import CHANNELWISE
from tf_dp.gradients.ghost.normalization import channelwise_supports

L = keras.layers
WIDTH = 8


def _hub_class(module, name):
    return getattr(importlib.import_module(module), name, None)


def _make(module, name, dtype=None):
    """One instance over WIDTH channels, whatever its constructor's arguments."""
    if module is None:
        return _compat.keras_layer_scale()(0.5, WIDTH, dtype=dtype)
    cls = _hub_class(module, name)
    kwargs = {} if dtype is None else {"dtype": dtype}
    if name == "Gemma3nRMSNorm":
        kwargs["dim"] = WIDTH
    elif name.endswith("LayerScale"):
        kwargs["hidden_dim"] = WIDTH
    elif module.endswith("layers.modeling.rms_normalization"):
        kwargs["input_dim"] = WIDTH
    return cls(**kwargs)


CASES = [(m, n) for m, n in CHANNELWISE if _hub_class(m, n) is not None] + [
    (None, "keras.applications LayerScale")
]
IDS = [f"{m.split('.')[-1] if m else 'keras'}.{n}" for m, n in CASES]


def _model(module, name, dtype=None):
    keras.utils.set_random_seed(7)
    inp = keras.Input((5, 6))
    h = L.Dense(WIDTH, dtype=dtype)(inp)
    layer = _make(module, name, dtype)
    h = layer(h)
    h = L.Dense(4, activation="relu", dtype=dtype)(h)
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling1D(dtype=dtype)(h))
    model = _compile(keras.Model(inp, out))
    for v in layer.trainable_variables:  # every entry different, none at its initial value
        v.assign(rng(3).normal(size=v.shape).astype("float32"))
    return model, layer


def _data():
    r = rng(13)
    x = (r.normal(size=(6, 5, 6)) * r.uniform(0.2, 3.0, (6, 1, 1))).astype("float32")
    return x, r.integers(0, 3, 6), r.uniform(0.5, 2.0, 6).astype("float32")


def test_every_registered_class_exists():
    """A class renamed or removed by keras-hub shows up here, not as a silent fallback."""
    missing = [f"{m}.{n}" for m, n in CHANNELWISE if _hub_class(m, n) is None]
    assert not missing, missing
    assert _compat.keras_layer_scale() is not None


@pytest.mark.parametrize("module, name", CASES, ids=IDS)
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_channelwise_layers(module, name, graph):
    model, layer = _model(module, name)
    assert layer.trainable_variables
    x, y, sw = _data()
    check(model, x, y, sw, reference=LoopReference, graph=graph)


# per example: two Dense layers' products (6 and 8 terms), the norm's sum over 8 channels, the
# pooling's 5 positions, the last Dense's 4; 2 casts
TERMS = 6 + 8 + 8 + 5 + 4 + 2


@pytest.mark.parametrize("module, name", CASES, ids=IDS)
def test_xla_and_mixed_float16(module, name):
    model, _ = _model(module, name)
    x, y, _ = _data()
    ref, magnitude = loop_sums(model, (x, y, None))
    assert_ghost_sums(model, (x, y, None), ref, magnitude, TERMS, jit=True)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half, _ = _model(module, name)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert_ghost_sums(half, (x, y, None), ref, magnitude, TERMS, jit=False, dtype="float16")


class _Matrix(L.Layer):
    def build(self, shape):
        self.w = self.add_weight(shape=(shape[-1], shape[-1]))

    def call(self, x):
        return x @ self.w


class _Mixing(L.Layer):
    """Breaks the contract: every channel depends on every entry of ``v``."""

    def build(self, shape):
        self.v = self.add_weight(shape=(shape[-1],), initializer="random_normal")

    def call(self, x):
        return x * keras.ops.softmax(self.v)


def test_matrix_variables_are_refused():
    layer = _Matrix()
    layer.build((None, 4))
    assert "needs 1-D variables" in channelwise_supports(layer)


def test_a_layer_mixing_channels_is_outside_the_contract():
    """Registered for a layer that mixes channels, the rule's gradients are wrong: the all-ones
    tangent of a softmax has a zero derivative. This is why each registered class is tested."""
    from tf_dp.gradients.ghost import register_layer_norm_rule, unregister_layer_norm_rule
    from tf_dp.gradients.ghost.normalization import channelwise_forward, channelwise_rule

    register_layer_norm_rule(
        _Mixing, channelwise_rule, forward=channelwise_forward, supports=channelwise_supports
    )
    try:
        keras.utils.set_random_seed(5)
        inp = keras.Input((5, 6))
        out = L.Dense(3)(L.GlobalAveragePooling1D()(_Mixing()(L.Dense(WIDTH)(inp))))
        model = _compile(keras.Model(inp, out))
        x, y, _ = _data()
        ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
        got = [np.asarray(g) for g in _sum_fn(GhostClipper(), model, (x, y, None), False)()]
        v = model.layers[2].v
        i = [w.path for w in model.trainable_variables].index(v.path)
        assert np.abs(ref[i]).max() > 1e-3
        assert np.abs(got[i]).max() < 1e-6  # the derivative along all-ones is 0
    finally:
        unregister_layer_norm_rule(_Mixing)
