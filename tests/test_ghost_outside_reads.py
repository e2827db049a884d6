"""A ghost rule sees only its own layer's calls. Models that use a layer's variable without calling
the layer (issue 35: keras-hub's Gemma 4 decoder block computes ``ops.matmul(x,
self.ffw_linear.kernel)`` for its feed-forward network; a hand-written language model ties its
output projection with ``ops.matmul(h, ops.transpose(self.embed.embeddings))``) left that use out of
the norms and the clipped sum: the variable trained on part of its gradient, or not at all (the
conformance sweep's Gemma4CausalLM step was off by 25%). The clipper now watches which variables
each recorded call, and the rest of the forward pass, reads; a layer whose variable is read outside
its calls moves to the per-layer fallback of the recorded layer whose call encloses every use (or
to the whole-model fallback).

Every check is against per-example gradients from a ``GradientTape`` loop over the examples,
clipped to the median norm (some examples clipped, some not) and summed, in eager mode, in a
``tf.function`` traced with an unknown batch size, and under XLA. The fallbacks run
``tf.vectorized_map`` over custom layers, so the scenarios run in a subprocess (a crash is a
failure, not a dead suite).
"""

from __future__ import annotations

import pytest

from tests.helpers.scenarios import run_scenarios, scenario_output


PRELUDE = """
import os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tests.helpers.tolerance import model_gradient_terms, norm_terms, tolerance
from tests.test_ghost import LoopReference, RecordingQuery, _compile, rng
from tf_dp.gradients.ghost import GhostClipper
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers


class GatedBlock(L.Layer):
    # no rule (a scale of its own): calls its Dense `gate`, but uses `proj`'s kernel directly,
    # as keras-hub's Gemma 4 decoder block does with its feed-forward kernels
    def build(self, shape):
        d = shape[-1]
        self.scale = self.add_weight(shape=(d,), initializer="ones", name="scale")
        self.gate = L.Dense(8, name="gate")
        self.gate.build(shape)
        self.proj = L.Dense(d, use_bias=False, name="proj")
        self.proj.build(tuple(shape[:-1]) + (8,))

    def call(self, x):
        h = keras.activations.gelu(self.gate(x * self.scale))
        return x + ops.matmul(h, self.proj.kernel)


class RoutedBlock(L.Layer):
    # no variables of its own: calls its Dense `gate` and multiplies by `proj`'s kernel, as
    # keras-hub's Gemma 4 decoder block does; registered below with a forward-only rule that
    # computes that product as `proj`'s own call
    def build(self, shape):
        d = shape[-1]
        self.gate = L.Dense(8, name="gate")
        self.gate.build(shape)
        self.proj = L.Dense(d, use_bias=False, name="proj")
        self.proj.build(tuple(shape[:-1]) + (8,))

    def call(self, x):
        h = keras.activations.gelu(self.gate(x))
        return x + ops.matmul(h, self.proj.kernel)


def _routed_forward(layer, call, args, kwargs, watch):
    from tf_dp.gradients.ghost.dense import call_with_matmuls_through_layers

    return call_with_matmuls_through_layers(layer, call, args, kwargs, ["proj"]), None


def routed_model():
    import tf_dp.gradients.ghost as ghost_rules

    ghost_rules.register_layer_norm_rule(
        RoutedBlock, lambda layer, context, grads: [], forward=_routed_forward,
        variables=lambda layer: [])
    return keras.Sequential(
        [keras.Input((4, 6)), L.Dense(6), RoutedBlock(name="block"), L.GlobalAveragePooling1D(),
         L.Dense(3)]
    )


def block_model():
    return keras.Sequential(
        [keras.Input((4, 6)), L.Dense(6), GatedBlock(name="block"), L.GlobalAveragePooling1D(),
         L.Dense(3)]
    )


class TiedLM(keras.Model):
    # the embedding table is looked up (a rule) and reused, at model level, as the output
    # projection: the second use is outside every recorded call
    def __init__(self):
        super().__init__()
        self.embed = L.Embedding(11, 6, name="embed")
        self.mix = L.Dense(6, activation="tanh", name="mix")

    def call(self, ids):
        h = ops.mean(self.mix(self.embed(ids)), axis=1)
        return ops.matmul(h, ops.transpose(self.embed.embeddings))


def float_data(seed, n=5):
    r = rng(seed)
    return r.normal(size=(n, 4, 6)).astype("float32"), r.integers(0, 3, n)


def id_data(seed, n=5):
    r = rng(seed)
    return r.integers(0, 11, (n, 4)).astype("int64"), r.integers(0, 11, n)


def clipped_vs_loop(model, x, y, mode):
    # the ghost clipped sum (eager, or a tf.function traced with batch None, with or without
    # XLA) vs a GradientTape loop's per-example gradients clipped to their median norm
    _compile(model)
    model(x[:1])
    loss_fn = PerExampleLoss(model)
    per_ex, _, _ = LoopReference().per_example_gradients(
        loss_fn, (x, y, None), model.trainable_variables)
    per_ex = [np.asarray(g, np.float64) for g in per_ex]
    norms = np.sqrt(sum((g.reshape(len(y), -1) ** 2).sum(1) for g in per_ex))
    clip = float(np.median(norms))
    weights = np.minimum(1.0, clip / norms)
    want = [np.tensordot(weights, g, axes=1) for g in per_ex]
    ghost = GhostClipper()
    query = RecordingQuery(clip, 0.0)
    params = query.derive_sample_params(query.initial_global_state())

    def step(x, y):
        return ghost.clipped_sum(loss_fn, (x, y, None), model.trainable_variables, query,
                                 params).clipped_sum

    if mode != "eager":
        spec = [tf.TensorSpec((None,) + x.shape[1:], tf.as_dtype(x.dtype)),
                tf.TensorSpec([None], tf.int64)]
        step = tf.function(step, jit_compile=mode == "xla", input_signature=spec)
    got = step(tf.constant(x), tf.constant(y, tf.int64))
    # float32: a per-example gradient's roundings, the squared norm over all parameters, the sum
    # over the B records; scale: the sum of the clipped norms
    params_n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    terms = model_gradient_terms(model, classes=11) + 16 + norm_terms(params_n) + len(y)
    atol = tolerance("float32", terms, float(np.sum(np.minimum(norms, clip))))
    for v, a, b in zip(model.trainable_variables, got, want):
        assert np.abs(b).max() > 100 * atol, ("a variable without gradient", v.path)
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)
    return ghost
"""


SCENARIOS = {
    f"{name}_{mode}": f"""
        x, y = {data}(7)
        ghost = clipped_vs_loop({build}(), x, y, {mode!r})
        print(ghost.description)
    """
    for name, build, data in (("block", "block_model", "float_data"), ("tied", "TiedLM", "id_data"),
                              ("routed", "routed_model", "float_data"))
    for mode in ("eager", "graph", "xla")
}

@pytest.fixture(scope="module")
def results():
    """All scenarios in one subprocess (one TensorFlow import; a crash fails every test)."""
    return run_scenarios(PRELUDE, SCENARIOS)


_ok = scenario_output


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_kernel_used_without_calling_its_layer(results, mode):
    """A block multiplies by a child Dense's kernel instead of calling the Dense (Gemma 4): the
    kernel's gradient reaches the clipped sum, through the block's per-layer fallback."""
    out = _ok(results, f"block_{mode}")
    assert "block/proj/kernel read outside the layer's call" in out, out
    assert "per-example gradients through block" in out, out


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_table_looked_up_and_reused_as_output_projection(results, mode):
    """An Embedding called for the lookup and its table reused by the model as the output
    projection: both uses reach the clipped sum, through the whole-model fallback."""
    out = _ok(results, f"tied_{mode}")
    assert "embed/embeddings read outside the layer's call" in out, out
    assert "per-example gradients through the model" in out, out


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
def test_forward_only_rule_routes_the_kernel_use_through_its_layer(results, mode):
    """The same block with a forward-only rule (no variables; its forward computes the product as
    ``proj``'s call, :func:`tf_dp.gradients.ghost.dense.call_with_matmuls_through_layers`): every
    variable on a rule, nothing read outside, and the clipped sum still equals the loop's."""
    out = _ok(results, f"routed_{mode}")
    assert out.strip() == "ghost (calls rerouted to sublayer rules: block)", out
