"""keras-hub text models through the DP step (issue 33 item 1).

A tiny ``RobertaTextClassifier`` used to kill the process: its token embedding (tracked both by
``TokenAndPositionEmbedding`` and by the backbone) was planned as a model-level variable, and the
ghost clipper's whole-model fallback ran ``tf.vectorized_map`` over the attention's rank-3
``EinsumDense`` kernels (a segmentation fault in TF 2.21). Every run that could crash runs here in
a subprocess, so a crash is a failure, not a dead suite.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import model_gradient_terms, norm_terms, tolerance
from tf_dp.dp_query import GaussianSumQuery
from tf_dp.gradients import base
from tf_dp.gradients.ghost import GhostClipper
from tf_dp.keras import PerExampleLoss
from tests.helpers import warm_python

pytest.importorskip("keras_hub")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# builds a tiny keras-hub classifier or LM (vocabulary 120, 1 layer, 2 heads, hidden 16,
# intermediate 32, sequence 10), no dropout
BUILD = """
import json, sys
import numpy as np, keras, keras_hub, tensorflow as tf
import tf_dp
kind = sys.argv[1]
keras.utils.set_random_seed(0)
V, T, B = 120, 10, 6
rng = np.random.default_rng(1)
ids = rng.integers(1, V, (B, T)).astype("int32")
mask = np.ones((B, T), "int32")
mask[0, 7:] = 0
small = dict(vocabulary_size=V, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
             max_sequence_length=T, dropout=0.0)
if kind == "roberta":
    backbone = keras_hub.models.RobertaBackbone(**small)
    model = keras_hub.models.RobertaTextClassifier(backbone=backbone, num_classes=2,
                                                   preprocessor=None, dropout=0.0)
    x = {"token_ids": ids, "padding_mask": mask}
elif kind == "bert":
    backbone = keras_hub.models.BertBackbone(**small)
    model = keras_hub.models.BertTextClassifier(backbone=backbone, num_classes=2,
                                                preprocessor=None, dropout=0.0)
    x = {"token_ids": ids, "segment_ids": np.zeros_like(ids), "padding_mask": mask}
elif kind == "distil_bert":
    backbone = keras_hub.models.DistilBertBackbone(**small)
    model = keras_hub.models.DistilBertTextClassifier(backbone=backbone, num_classes=2,
                                                      preprocessor=None, dropout=0.0)
    x = {"token_ids": ids, "padding_mask": mask}
else:
    backbone = keras_hub.models.GPT2Backbone(**small)
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    x = {"token_ids": ids, "padding_mask": mask}
if kind == "gpt2":
    y = np.roll(ids, -1, axis=1)
else:
    y = rng.integers(0, 2, B)
model = tf_dp.keras.make_private(model)
"""

TRAIN = """
mode = sys.argv[2]
opt = tf_dp.keras.DPKerasAdamOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                       learning_rate=1e-3, gradient_mode=mode)
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
before = [v.numpy() for v in model.trainable_variables]
hist = model.fit(x, y, batch_size=3, epochs=1, steps_per_epoch=2, shuffle=False, verbose=0)
moved = sum(int(not np.array_equal(a, v.numpy()))
            for a, v in zip(before, model.trainable_variables))
print("RESULT" + json.dumps({"description": opt.gradient_clipper.description,
                             "loss": [float(l) for l in hist.history["loss"]],
                             "moved": moved, "variables": len(before)}))
"""

# one DP-SGD step with noise 0 vs the per-example reference: each example's gradient from a
# GradientTape loop, clipped, summed, divided by the batch, times the learning rate
EXACT = """
from tests.helpers.tolerance import model_gradient_terms, norm_terms, tolerance
C, LR = 0.05, 1.0
model(x)
w0 = [v.numpy().astype(np.float64) for v in model.trainable_variables]
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
records = []
for i in range(B):
    xi = {k: v[i:i + 1] for k, v in x.items()}
    with tf.GradientTape() as tape:
        l = loss(y[i:i + 1], model(xi, training=True))
    g = tape.gradient(l, model.trainable_variables)
    records.append([np.array(tf.convert_to_tensor(a), np.float64) for a in g])
total = [np.zeros_like(w) for w in w0]
magnitude = [np.zeros_like(w) for w in w0]
for rec in records:
    norm = np.sqrt(sum(float(np.sum(a * a)) for a in rec))
    f = min(1.0, C / norm)
    total = [t + f * a for t, a in zip(total, rec)]
    magnitude = [m + f * np.abs(a) for m, a in zip(magnitude, rec)]
expected = [w - LR * t / B for w, t in zip(w0, total)]
opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=C, noise_multiplier=0.0, learning_rate=LR,
                                      gradient_mode=sys.argv[2])
model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0)
params = sum(int(np.prod(w.shape)) for w in w0)
# float32: one example's gradient (model_gradient_terms), ghost's sums over pairs of the T
# positions (T^2), the norm over all parameters, the sum over the B records; scale: the largest
# sum of one entry's clipped absolute values, times LR / B; plus the weight's own rounding
terms = model_gradient_terms(model, classes=2) + T * T + norm_terms(params) + B
scale = LR * max(float(m.max()) for m in magnitude) / B
tol = tolerance("float32", terms, scale) + tolerance("float32", 1, max(float(np.abs(w).max()) for w in w0))
err = max(float(np.abs(v.numpy().astype(np.float64) - e).max())
          for v, e in zip(model.trainable_variables, expected))
step = max(float(np.abs(e - w).max()) for e, w in zip(expected, w0))
print("RESULT" + json.dumps({"description": opt.gradient_clipper.description, "err": err,
                             "tol": tol, "step": step}))
"""


def _run(script: str, *args: str) -> dict:
    proc = warm_python.run(
        [sys.executable, "-c", textwrap.dedent(BUILD + script), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": "-1"},
    )
    assert proc.returncode == 0, (
        f"exit status {proc.returncode} (negative: killed by a signal, e.g. -11 segfault)\n"
        + proc.stderr[-3000:]
    )
    line = [s for s in proc.stdout.splitlines() if s.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT") :])


@pytest.mark.parametrize("mode", ["auto", "ghost"])
def test_roberta_classifier_trains_on_ghost_rules(mode):
    out = _run(TRAIN, "roberta", mode)
    # every variable (the token embedding included) on an exact ghost rule: no fallback at all
    assert out["description"] == "ghost"
    assert len(out["loss"]) == 1 and np.isfinite(out["loss"][0])
    assert out["moved"] == out["variables"]


@pytest.mark.parametrize("mode", ["auto", "ghost"])
def test_roberta_dp_step_equals_per_example_reference(mode):
    out = _run(EXACT, "roberta", mode)
    assert out["description"] == "ghost"
    assert (
        out["step"] > 100 * out["tol"]
    )  # the step is far above the tolerance: a real check
    assert out["err"] <= out["tol"], out


@pytest.mark.parametrize("kind", ["bert", "distil_bert", "gpt2"])
def test_other_keras_hub_text_models_train_one_step(kind):
    out = _run(TRAIN, kind, "auto")
    assert out["description"] == "ghost", out
    assert all(np.isfinite(out["loss"]))
    assert out["moved"] == out["variables"]


# -- the fallback never vectorises a model vectorized_map would crash on ------------------------


class _Calls(keras.layers.Layer):
    """Calls a layer it shares with the model (no rule: its sublayer looks possibly tied)."""

    def __init__(self, inner, **kwargs):
        super().__init__(**kwargs)
        self.inner = inner

    def call(self, x):
        return self.inner(x)


class _ScaledAttention(keras.layers.Layer):
    """A layer without a rule that owns a variable and runs attention (rank-3 EinsumDense)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.mha = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)

    def build(self, shape):
        self.scale = self.add_weight(
            shape=(shape[-1],), initializer="ones", name="scale"
        )

    def call(self, x):
        return self.mha(x * self.scale, x)


class _Model(keras.Model):
    def __init__(self):
        super().__init__()
        self.embedding = keras.layers.Embedding(30, 8)
        self.calls = _Calls(self.embedding)
        self.attention = _ScaledAttention()
        self.pool = keras.layers.GlobalAveragePooling1D()
        self.head = keras.layers.Dense(3)

    def call(self, ids):
        return self.head(self.pool(self.attention(self.calls(ids))))


def test_fallback_with_rank3_einsum_loops_over_examples_and_is_exact(monkeypatch):
    keras.utils.set_random_seed(0)
    model = _Model()
    B, T, C = 5, 6, 0.1
    rng = np.random.default_rng(2)
    x = rng.integers(0, 30, (B, T)).astype("int32")
    y = rng.integers(0, 3, B).astype("int32")
    model(x)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert base.vectorized_map_blocker(model) is not None

    def refuse(*args, **kwargs):
        raise AssertionError("tf.vectorized_map called on a model it crashes on")

    monkeypatch.setattr(tf, "vectorized_map", refuse)
    clipper = GhostClipper()
    query = GaussianSumQuery(C, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    out = clipper.clipped_sum(
        PerExampleLoss(model),
        (tf.constant(x), tf.constant(y), None),
        model.trainable_variables,
        query,
        params,
        model=model,
    )
    # the plan says which path runs: both fallbacks (the shared embedding as a model-level
    # variable, the attention layer's own variable) loop over the examples
    d = clipper.description
    name = model.attention.name
    assert "model-level variables: " in d and name in d, d
    assert (
        f"per-example loop, not vectorized_map, for: {name}, model-level variables" in d
    ), d

    _assert_equals_reference(model, x, y, C, out)


def _assert_equals_reference(model, x, y, C, out):
    """``out`` (clipped sum and norms) equals each example's GradientTape gradient, clipped to
    ``C`` and summed, to float32 tolerances derived from the computation."""
    B, T = x.shape
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="sum")
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    magnitude = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    norms = []
    for i in range(B):
        with tf.GradientTape() as tape:
            value = loss(y[i : i + 1], model(x[i : i + 1], training=True))
        g = [
            np.asarray(tf.convert_to_tensor(a), np.float64)
            for a in tape.gradient(value, model.trainable_variables)
        ]
        norm = np.sqrt(sum(float(np.sum(a * a)) for a in g))
        norms.append(norm)
        f = min(1.0, C / norm)
        total = [t + f * a for t, a in zip(total, g)]
        magnitude = [m + f * np.abs(a) for m, a in zip(magnitude, g)]
    assert min(norms) > C  # every record clipped: the weights matter
    params_count = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    # a per-example gradient, ghost's sums over pairs of the T positions, the norm, the B records
    terms = model_gradient_terms(model, classes=3) + T * T + norm_terms(params_count) + B
    atol = tolerance("float32", terms, max(float(m.max()) for m in magnitude))
    for v, got, want in zip(model.trainable_variables, out.clipped_sum, total):
        np.testing.assert_allclose(
            np.asarray(got, np.float64), want, rtol=0, atol=atol, err_msg=v.path
        )
    np.testing.assert_allclose(
        np.asarray(out.norms, np.float64),
        norms,
        rtol=tolerance(
            "float32", model_gradient_terms(model, classes=3) + T * T + norm_terms(params_count)
        ),
    )


def test_vectorized_clipper_loops_over_examples_of_a_crashing_model(monkeypatch):
    """VectorizedClipper used directly (its supports() refuses the model) and PerUserClipper on it
    compute per-example gradients in a loop, never with vectorized_map, and stay exact."""
    from tf_dp.gradients import VectorizedClipper
    from tf_dp.gradients.per_user import PerUserClipper

    keras.utils.set_random_seed(0)
    model = _Model()
    C = 0.1
    rng = np.random.default_rng(3)
    x = rng.integers(0, 30, (4, 6)).astype("int32")
    y = rng.integers(0, 3, 4).astype("int32")
    model(x)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    def refuse(*args, **kwargs):
        raise AssertionError("tf.vectorized_map called on a model it crashes on")

    monkeypatch.setattr(tf, "vectorized_map", refuse)
    query = GaussianSumQuery(C, 0.0)
    params = query.derive_sample_params(query.initial_global_state())
    data = (tf.constant(x), tf.constant(y), None)
    out = VectorizedClipper().clipped_sum(
        PerExampleLoss(model), data, model.trainable_variables, query, params
    )
    _assert_equals_reference(model, x, y, C, out)
    per_user = PerUserClipper(VectorizedClipper(), records_per_user=1).clipped_sum(
        PerExampleLoss(model), data, model.trainable_variables, query, params
    )
    _assert_equals_reference(model, x, y, C, per_user)


def test_vectorized_clipper_without_while_loop_refuses_a_crashing_model():
    from tf_dp.gradients import VectorizedClipper

    keras.utils.set_random_seed(0)
    model = _Model()
    x = np.zeros((2, 6), "int32")
    model(x)
    model.compile(loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    with pytest.raises(ValueError, match="fallback_to_while_loop=False"):
        VectorizedClipper(fallback_to_while_loop=False).per_example_gradients(
            PerExampleLoss(model),
            (tf.constant(x), tf.constant([0, 1]), None),
            model.trainable_variables,
            model=model,
        )
