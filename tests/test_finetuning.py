"""DP fine-tuning of keras-hub models built from tiny configs (random weights: no download).

BERT classifier, GPT-2 and Gemma causal LMs, full fine-tuning and LoRA (``enable_lora``): in
``gradient_mode="auto"`` the ghost strategy covers every trainable variable with a norm rule (no
per-example gradient fallback, asserted on the plan), and its clipped sum with per-token targets
and padding masks equals a per-example loop's. A GPT-2 with LoRA trains with ``fit`` on Poisson
batches.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

import tf_dp
from tests.test_ghost import LoopReference, check, rng
from tf_dp.gradients import make_clipper
from tf_dp.gradients.ghost import GhostClipper

keras_hub = pytest.importorskip("keras_hub")
M = keras_hub.models
VOCAB, T, B = 100, 8, 5


def gpt2():
    return M.GPT2CausalLM(M.GPT2Backbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=16))


def gemma():
    return M.GemmaCausalLM(M.GemmaBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=16, intermediate_dim=32, head_dim=8))


def bert():
    backbone = M.BertBackbone(
        vocabulary_size=VOCAB, num_layers=1, num_heads=2, hidden_dim=16, intermediate_dim=32,
        dropout=0.0, max_sequence_length=16)
    return M.BertTextClassifier(backbone, num_classes=3, dropout=0.0)


BUILDERS = {"gpt2": gpt2, "gemma": gemma, "bert": bert}


def build(name, lora, r):
    keras.utils.set_random_seed(0)
    model = BUILDERS[name]()
    if lora:
        model.backbone.enable_lora(lora)
        for v in model.trainable_variables:  # lora_kernel_b starts at 0: draw it
            if v.path.endswith("lora_kernel_b"):
                v.assign(0.1 * r.normal(size=v.shape).astype("float32"))
    return model


def batch(name, r):
    ids = r.integers(1, VOCAB, (B, T)).astype("int32")
    mask = np.ones((B, T), bool)
    mask[1, 5:] = False
    mask[3, 3:] = False
    ids[~mask] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    if name == "bert":
        x["segment_ids"] = np.zeros_like(ids)
        return x, r.integers(0, 3, B), None
    # per-token targets, padding tokens weighted 0
    return x, r.integers(0, VOCAB, (B, T)).astype("int32"), mask.astype("float32")


@pytest.mark.parametrize("lora", [None, 4], ids=["full", "lora4"])
@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_auto_is_exact_ghost_with_no_fallback(name, lora):
    r = rng(1)
    model = build(name, lora, r)
    if lora:  # the backbone's kernels are frozen (biases of LoRA layers and new heads train)
        assert not any(v.path.endswith("/kernel") and "transformer" in v.path
                       for v in model.trainable_variables)
        assert any(v.path.endswith("lora_kernel_a") for v in model.trainable_variables)
    strategy = make_clipper("auto", model=model)
    assert isinstance(strategy, GhostClipper)
    assert strategy.mode == "ghost", strategy.description
    x, y, sw = batch(name, r)
    check(model, x, y, sw, reference=LoopReference)


def test_fit_lora_causal_lm_on_poisson_batches():
    r = rng(2)
    model = build("gpt2", 2, r)
    n = 24
    ids = r.integers(1, VOCAB, (n, T)).astype("int32")
    mask = np.ones((n, T), bool)
    mask[::3, 6:] = False
    ids[~mask] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    y = np.roll(ids, -1, axis=1)
    model = tf_dp.keras.make_private(model)
    model.compile(
        optimizer=tf_dp.keras.DPKerasAdamOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [v.numpy() for v in model.trainable_variables]
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=0)
    model.fit(batches, verbose=0)
    assert model.optimizer.gradient_strategy.description == "ghost"
    assert model.optimizer.ledger.num_samples == batches.steps_per_epoch == 4
    after = [v.numpy() for v in model.trainable_variables]
    assert all(np.all(np.isfinite(a)) for a in after)
    assert any(not np.allclose(a, b) for a, b in zip(after, before))
