"""Ghost rules and per-layer fallbacks assume a layer's outputs have the examples on axis 0. Layers
that break it (issue 35: keras-hub Mixtral's and GPT-OSS's mixture-of-experts routers see tokens
flattened to ``[B*T, d]``; ViT's position embedding looks up a ``[1, P]`` id table broadcast over
the batch) made a rule return per-token or per-table norms and the step fail with an ``AddN`` shape
mismatch. The clipper now moves such a layer's variables to the per-layer fallback of the recorded
layer whose call encloses it (or to the whole-model fallback), in eager, ``tf.function`` (static or
unknown batch size: a trace-only shape probe) and XLA.

Every check is against per-example gradients from a ``GradientTape`` loop over the examples
(``LoopReference``), clipped to the median norm (some examples clipped, some not) and summed. The
fallbacks here run ``tf.vectorized_map`` over custom layers, so each test runs in a subprocess of
its own (a crash is a failure, not a dead suite).
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
from tests.test_ghost import LoopReference, RecordingQuery, _compile, check, rng
from tf_dp.gradients.ghost import GhostClipper
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers


class ToyMoE(L.Layer):
    # no rule: tokens flattened to [B*T, d], a Dense router on them (a rule, but its axis 0 is
    # the tokens), an expert bank of its own ([E, d, d], einsum over all experts)
    def build(self, shape):
        d = shape[-1]
        self.router = L.Dense(3, use_bias=False, name="router")
        self.router.build((None, d))
        self.bank = self.add_weight(shape=(3, d, d), name="bank")

    def call(self, x):
        b, t = ops.shape(x)[0], ops.shape(x)[1]
        flat = ops.reshape(x, (-1, x.shape[-1]))
        p = ops.softmax(self.router(flat))
        out = ops.einsum("td,edh->eth", flat, self.bank)
        mixed = ops.sum(out * ops.transpose(p)[:, :, None], axis=0)
        return ops.reshape(mixed, (b, t, x.shape[-1]))


class ClassTokenAndPositions(L.Layer):
    # no rule: a class token of its own tiled over the batch, and a position Embedding (a rule)
    # looked up with [1, P] ids and broadcast over the batch, like keras-hub ViT's patch embedding
    def build(self, shape):
        self.token = self.add_weight(shape=(1, 1, shape[-1]), name="class_token")
        self.positions = L.Embedding(shape[1] + 1, shape[-1], name="positions")
        self.positions.build((1, shape[1] + 1))

    def call(self, x):
        ids = ops.expand_dims(ops.arange(x.shape[1] + 1), 0)
        tok = ops.tile(self.token, (ops.shape(x)[0], 1, 1))
        return ops.concatenate([tok, x], axis=1) + self.positions(ids)


def toy_moe_model():
    return keras.Sequential(
        [keras.Input((4, 6)), L.Dense(6), ToyMoE(), L.GlobalAveragePooling1D(), L.Dense(3)]
    )


def class_token_model():
    return keras.Sequential(
        [keras.Input((4, 6)), ClassTokenAndPositions(), L.Flatten(), L.Dense(3)]
    )


class PositionsModel(keras.Model):
    # a model (not a layer) adds the position table: no recorded layer encloses the lookup, so
    # the table goes to the whole-model fallback
    def __init__(self):
        super().__init__()
        self.inner = L.Dense(6)
        self.positions = L.Embedding(4, 6)
        self.head = L.Dense(3)

    def call(self, x):
        ids = ops.expand_dims(ops.arange(4), 0)
        return self.head(ops.mean(self.inner(x) + self.positions(ids), axis=1))


def data(seed, n=5):
    r = rng(seed)
    return r.normal(size=(n, 4, 6)).astype("float32"), r.integers(0, 3, n)


def clipped_vs_loop(model, x, y, jit_compile):
    # the clipped sum from a tf.function traced with an unknown batch size ([None, 4, 6]: the
    # static shapes cannot tell [B*T] from [B]) vs the GradientTape loop's
    _compile(model)
    loss_fn = PerExampleLoss(model)
    ref_q = RecordingQuery(1e9, 0.0)
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

    @tf.function(
        jit_compile=jit_compile,
        input_signature=[tf.TensorSpec([None, 4, 6], tf.float32), tf.TensorSpec([None], tf.int64)],
    )
    def step(x, y):
        return ghost.clipped_sum(loss_fn, (x, y, None), model.trainable_variables, query,
                                 params).clipped_sum

    got = step(tf.constant(x), tf.constant(y, tf.int64))
    # float32: a per-example gradient's roundings, the squared norm over all parameters, the sum
    # over the B records; scale: the sum of the clipped norms
    params_n = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    terms = model_gradient_terms(model, classes=3) + 16 + norm_terms(params_n) + len(y)
    atol = tolerance("float32", terms, float(np.sum(np.minimum(norms, clip))))
    for v, a, b in zip(model.trainable_variables, got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)
    # the probe checked every recorded layer: no run-time axis-0 assertion left in the step
    ops = step.get_concrete_function().graph.get_operations()
    assert not [op for op in ops if "axis 0" in str(op.node_def)], "run-time axis-0 checks"
    return ghost
"""


SCENARIOS = {
    "router_graph": """
        x, y = data(1)
        ghost = check(toy_moe_model(), x, y, expect_mode="mixed", graph=True,
                      reference=LoopReference)
        print(ghost.description)
    """,
    "class_token": """
        x, y = data(2)
        ghost = check(class_token_model(), x, y, expect_mode="mixed", reference=LoopReference)
        print(ghost.description)
    """,
    "unknown_batch": """
        for build, seed in ((toy_moe_model, 3), (class_token_model, 4)):
            x, y = data(seed)
            print(clipped_vs_loop(build(), x, y, False).description)
    """,
    "unknown_batch_xla": """
        for build, seed in ((toy_moe_model, 3), (class_token_model, 4)):
            x, y = data(seed)
            print(clipped_vs_loop(build(), x, y, True).description)
    """,
    "model_level": """
        model = PositionsModel()
        x, y = data(5)
        model(x)
        ghost = clipped_vs_loop(model, x, y, False)
        print(ghost.description, ghost.plan(model).model_level_names)
    """,
}

@pytest.fixture(scope="module")
def results():
    """All scenarios in one subprocess (one TensorFlow import; a crash fails every test)."""
    return run_scenarios(PRELUDE, SCENARIOS)


_ok = scenario_output


def test_router_on_flattened_tokens(results):
    """A ruled Dense called on [B*T, d] tokens: its kernel goes to the enclosing fallback."""
    out = _ok(results, "router_graph")
    assert "router: output shape [20, 3] has no example axis 0" in out, out
    assert "per-example gradients through toy_mo_e" in out, out


def test_class_token_and_position_table(results):
    """A ruled Embedding looked up with [1, P] ids and broadcast over the batch (eager)."""
    out = _ok(results, "class_token")
    assert "positions: output shape [1, 5, 6] has no example axis 0" in out, out


@pytest.mark.parametrize("name", ["unknown_batch", "unknown_batch_xla"])
def test_unknown_batch_size(results, name):
    """Traced with batch None (as model.fit traces), eager-free tf.function and XLA: the shape
    probe finds both layers; the clipped sums equal the loop's."""
    out = _ok(results, name)
    assert "router: output shape [" in out and "positions: output shape [1, 5, 6]" in out, out


def test_position_table_added_by_the_model(results):
    """No recorded layer encloses the lookup: the table goes to the whole-model fallback."""
    out = _ok(results, "model_level")
    assert "per-example gradients through the model" in out, out
