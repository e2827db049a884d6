"""keras-hub's ``MaskedLMHead`` on the ghost route (``masked_lm_head_rule``): tied to the input
``ReversibleEmbedding`` (its table used twice: lookup and output projection) or with its own
kernel, with and without a final activation; against per-example gradients from a
``GradientTape`` loop, clipped and summed: eager, ``tf.function``, XLA and mixed float16, with
every variable on a rule (mode ``"ghost"``)."""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest

from tests.test_ghost import LoopReference, check, rng
from tests.test_ghost_more_rules import assert_ghost_sums, loop_sums

L = keras.layers
VOCAB, SEQ, MASKED, DIM = 20, 6, 2, 8


def _model(tied=True, activation=None, dtype=None):
    keras.utils.set_random_seed(17)
    ids = keras.Input((SEQ,), dtype="int32", name="ids")
    positions = keras.Input((MASKED,), dtype="int32", name="positions")
    embedding = keras_hub.layers.ReversibleEmbedding(VOCAB, DIM, dtype=dtype)
    h = L.Dense(DIM, activation="tanh", dtype=dtype)(embedding(ids))
    head = keras_hub.layers.MaskedLMHead(
        vocabulary_size=VOCAB,
        token_embedding=embedding if tied else None,
        intermediate_activation="gelu",
        activation=activation,
        dtype=dtype,
    )
    out = head(h, mask_positions=positions)
    model = keras.Model({"ids": ids, "positions": positions}, out)
    model.compile(
        optimizer="sgd",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    head._bias.assign(rng(5).normal(size=head._bias.shape).astype("float32"))
    return model


def _data():
    r = rng(23)
    ids = r.integers(0, VOCAB, (6, SEQ)).astype("int32")
    positions = np.stack([r.choice(SEQ, MASKED, replace=False) for _ in range(6)]).astype("int32")
    y = r.integers(0, VOCAB, (6, MASKED))
    return {"ids": ids, "positions": positions}, y


CASES = {
    "tied": dict(tied=True),
    "untied": dict(tied=False),
    "tied-log-softmax": dict(tied=True, activation="log_softmax"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_masked_lm_head(case, graph):
    model = _model(**CASES[case])
    x, y = _data()
    check(model, x, y, rng(3).uniform(0.5, 2.0, 6).astype("float32"),
          reference=LoopReference, graph=graph)


# per example: the embedding lookup, the Dense's 8 inputs, the head's Dense (8) and layer norm
# (8), the projection's 8, the softmax over 20 logits, 2 masked positions; casts
TERMS = 8 + 8 + 8 + 8 + VOCAB + MASKED + 2


@pytest.mark.parametrize("case", sorted(CASES))
def test_masked_lm_head_xla_and_mixed_float16(case):
    model = _model(**CASES[case])
    x, y = _data()
    ref, magnitude = loop_sums(model, (x, y, None))
    assert_ghost_sums(model, (x, y, None), ref, magnitude, TERMS, jit=True)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = _model(**CASES[case])
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert_ghost_sums(half, (x, y, None), ref, magnitude, TERMS, jit=False, dtype="float16")
