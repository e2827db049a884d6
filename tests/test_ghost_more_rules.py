"""Exact ghost rules for layers that fell back to per-example gradients before (issue 35, item 3):
``DepthwiseConv1D``/``DepthwiseConv2D`` and keras-hub's RMS layer norms (Llama, Mistral, Phi-3,
Qwen, Qwen3, T5, Qwen3.5). Each is checked against per-example gradients from a ``GradientTape``
loop over the examples (``LoopReference``), clipped and summed: eager, ``tf.function``, XLA and
mixed float16, and the ghost plan must cover every variable (mode ``"ghost"``, no fallback).
``research/ghost/rule_coverage.py`` lists which layers have rules.
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import tolerance
from tests.test_ghost import LoopReference, _compile, check, rng
from tests.test_ghost_finetuning_rules import _sum_fn
from tf_dp.gradients.ghost import GhostClipper

L = keras.layers


def _hub_class(module, name):
    import importlib

    return getattr(importlib.import_module(module), name)


RMS_NORMS = [
    ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"),
    ("keras_hub.src.models.mistral.mistral_layer_norm", "MistralLayerNormalization"),
    ("keras_hub.src.models.phi3.phi3_layernorm", "Phi3LayerNorm"),
    ("keras_hub.src.models.qwen.qwen_layernorm", "QwenLayerNorm"),
    ("keras_hub.src.models.qwen3.qwen3_layernorm", "Qwen3LayerNorm"),
    ("keras_hub.src.models.t5.t5_layer_norm", "T5LayerNorm"),
    ("keras_hub.src.models.qwen3_5.qwen3_5_layers", "Qwen3_5LayerNorm"),
    ("keras_hub.src.models.mixtral.mixtral_layer_norm", "MixtralLayerNormalization"),
    ("keras_hub.src.models.gpt_oss.gpt_oss_layer_norm", "GptOssLayerNormalization"),
]


def _magnitude(model, data):
    """The largest sum over the examples of one gradient entry's absolute values (the scale of a
    sum's rounding error), from one loop-reference run per example (inputs may be dicts)."""
    total = None
    for i in range(len(data[1])):
        one = tuple(
            None if d is None else tf.nest.map_structure(lambda t: t[i : i + 1], d)  # noqa: B023
            for d in data
        )
        grads = [np.abs(np.asarray(g)) for g in _sum_fn(LoopReference(), model, one)()]
        total = grads if total is None else [t + g for t, g in zip(total, grads)]
    return max(float(t.max()) for t in total)


def loop_sums(model, data):
    """``(sums, magnitude)``: the unclipped per-example-loop sums and their rounding scale."""
    return [np.asarray(g) for g in _sum_fn(LoopReference(), model, data)()], _magnitude(model, data)


def assert_ghost_sums(model, data, ref, magnitude, terms, jit=None, dtype="float32"):
    """The ghost clipper's unclipped sums of ``model`` on ``data`` (eager when ``jit`` is None,
    else a ``tf.function``, XLA if ``jit``) equal ``ref`` within the bound of ``terms`` roundings
    in ``dtype``, with every variable on a rule (mode ``"ghost"``)."""
    x, y, sw = data
    tensors = (tf.nest.map_structure(tf.constant, x), tf.constant(y), sw)
    strategy = GhostClipper()
    got = _sum_fn(strategy, model, tensors, jit)()
    assert strategy.mode == "ghost", strategy.description
    atol = tolerance(dtype, terms, magnitude)
    for v, a, b in zip(model.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


# -- depthwise convolutions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, graph",
    [
        (dict(kernel_size=3, depth_multiplier=2, padding="same"), False),
        (dict(kernel_size=(3, 2), strides=2, padding="valid", activation="relu"), True),
        (
            dict(kernel_size=3, dilation_rate=2, padding="same", depth_multiplier=3),
            False,
        ),
    ],
)
def test_depthwise_conv2d(kwargs, graph):
    r = rng(11)
    model = keras.Sequential(
        [
            keras.Input((9, 9, 3)),
            L.DepthwiseConv2D(**kwargs),
            L.Conv2D(4, 3, activation="relu"),
            L.GlobalAveragePooling2D(),
            L.Dense(3),
        ]
    )
    # ids 0 and 1 draw the kernel so that examples differ in scale: some are clipped, some not
    x = (r.normal(size=(6, 9, 9, 3)) * r.uniform(0.2, 3.0, (6, 1, 1, 1))).astype(
        "float32"
    )
    ghost = check(model, x, r.integers(0, 3, 6), graph=graph, reference=LoopReference)
    assert ghost.mode == "ghost", ghost.description


@pytest.mark.parametrize("padding", ["same", "valid"])
def test_depthwise_conv1d(padding):
    r = rng(12)
    model = keras.Sequential(
        [
            keras.Input((10, 4)),
            L.DepthwiseConv1D(3, depth_multiplier=2, dilation_rate=2, padding=padding),
            L.Dense(5, activation="tanh"),
            L.GlobalAveragePooling1D(),
            L.Dense(3),
        ]
    )
    x = (r.normal(size=(6, 10, 4)) * r.uniform(0.2, 3.0, (6, 1, 1))).astype("float32")
    sw = r.uniform(0.5, 2.0, 6).astype("float32")
    check(model, x, r.integers(0, 3, 6), sw, reference=LoopReference)


# -- keras-hub RMS layer norms ---------------------------------------------------------------------


def _norm_model(norm_class, dtype=None, **norm_kwargs):
    inp = keras.Input((5, 6))
    h = L.Dense(8, dtype=dtype)(inp)
    norm = norm_class(dtype=dtype, **norm_kwargs)
    h = norm(h)
    h = L.Dense(4, activation="relu", dtype=dtype)(h)
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling1D(dtype=dtype)(h))
    model = keras.Model(inp, out)
    scale = norm.trainable_variables[0]
    # scales start at 1 (or 0 for the (1 + scale) form): draw them so every entry matters
    scale.assign(rng(3).normal(size=scale.shape).astype("float32"))
    return model


@pytest.mark.parametrize("module, name", RMS_NORMS, ids=[n for _, n in RMS_NORMS])
def test_keras_hub_rms_norms(module, name):
    r = rng(13)
    model = _norm_model(_hub_class(module, name))
    x = (r.normal(size=(6, 5, 6)) * r.uniform(0.2, 3.0, (6, 1, 1))).astype("float32")
    sw = r.uniform(0.5, 2.0, 6).astype("float32")
    check(model, x, r.integers(0, 3, 6), sw, reference=LoopReference)


def test_qwen3_norm_over_heads():
    """Qwen3's query/key norm: a scale of ``head_dim`` applied to ``[B, T, heads, head_dim]``."""
    r = rng(14)
    cls = _hub_class("keras_hub.src.models.qwen3.qwen3_layernorm", "Qwen3LayerNorm")
    inp = keras.Input((5, 6))
    h = L.EinsumDense("btc,chd->bthd", output_shape=(5, 2, 4))(inp)
    norm = cls(head_dim=4)
    h = L.Reshape((5, 8))(norm(h))
    model = keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling1D()(h)))
    norm.scale.assign(r.normal(size=norm.scale.shape).astype("float32"))
    x = (r.normal(size=(6, 5, 6)) * r.uniform(0.2, 3.0, (6, 1, 1))).astype("float32")
    check(model, x, r.integers(0, 3, 6), reference=LoopReference, graph=True)


# -- XLA and mixed float16 -------------------------------------------------------------------------


def _combined(dtype=None):
    keras.utils.set_random_seed(21)
    norm_class = _hub_class(
        "keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm"
    )
    inp = keras.Input((8, 8, 3))
    h = L.DepthwiseConv2D(3, depth_multiplier=2, padding="same", dtype=dtype)(inp)
    h = L.Reshape((64, 6), dtype=dtype)(h)
    h = L.Dense(8, dtype=dtype)(h)
    norm = norm_class(dtype=dtype)
    h = norm(h)
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling1D(dtype=dtype)(h))
    norm.scale.assign(rng(5).normal(size=norm.scale.shape).astype("float32"))
    return _compile(keras.Model(inp, out))


# roundings on the way to one per-example gradient entry of _combined (tests/helpers/tolerance.py):
# forward: depthwise fan-in 9 + bias 1, dense 6 + 1, RMS norm 8 + 3, mean over 64 positions, dense
# 8 + 1, log-softmax 3; backward the same chain without the softmax, the depthwise kernel's sum over
# the 64 positions; 2 casts
COMBINED_TERMS = 2 * ((9 + 1) + (6 + 1) + (8 + 3) + 64 + (8 + 1)) + 3 + 64 + 2


def _data():
    r = rng(22)
    x = (r.normal(size=(5, 8, 8, 3)) * r.uniform(0.2, 3.0, (5, 1, 1, 1))).astype(
        "float32"
    )
    return x, r.integers(0, 3, 5)


def _relative(dtype=None):
    keras.utils.set_random_seed(23)
    cls = _hub_class(
        "keras_hub.src.models.deberta_v3.relative_embedding", "RelativeEmbedding"
    )
    inp = keras.Input((8, 8, 3))
    h = L.Reshape((8, 24), dtype=dtype)(inp)
    h = L.Dense(6, dtype=dtype)(h)  # [B, 8, 6]: 8 rows = 2 * bucket_size
    rel = cls(hidden_dim=6, bucket_size=4, dtype=dtype)
    h = L.Add(dtype=dtype)([h, rel(h)])
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling1D(dtype=dtype)(h))
    gamma = rel.layer_norm.gamma
    gamma.assign(rng(6).normal(size=gamma.shape).astype("float32"))
    return _compile(keras.Model(inp, out))


# roundings of _relative: dense fan-in 24 + 1, the table's layer norm 6 + 3, add 1, mean over 8,
# dense 6 + 1, log-softmax 3; backward the same without the softmax, the layer norm's VJP 6 + 3
# and the sums over 8 rows; 2 casts
RELATIVE_TERMS = 2 * ((24 + 1) + (6 + 3) + 1 + 8 + (6 + 1)) + 3 + (6 + 3) + 8 + 2


def _separable(dtype=None):
    keras.utils.set_random_seed(24)
    inp = keras.Input((8, 8, 3))
    h = L.SeparableConv2D(4, 3, depth_multiplier=2, padding="same", dtype=dtype)(inp)
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling2D(dtype=dtype)(h))
    return _compile(keras.Model(inp, out))


# roundings of _separable: depthwise fan-in 9, pointwise 6 + bias 1, mean over 64 pixels, dense
# 4 + 1, log-softmax 3; backward the same without the softmax, both kernels' sums over the 64
# pixels; 2 casts
SEPARABLE_TERMS = 2 * (9 + 7 + 64 + 5) + 3 + 64 + 64 + 2


def _transpose(dtype=None):
    keras.utils.set_random_seed(25)
    inp = keras.Input((8, 8, 3))
    h = L.Conv2DTranspose(
        4, 3, strides=2, padding="same", activation="tanh", dtype=dtype
    )(inp)
    out = L.Dense(3, dtype="float32")(L.GlobalAveragePooling2D(dtype=dtype)(h))
    return _compile(keras.Model(inp, out))


# roundings of _transpose: each output pixel sums at most 3 x 3 x 3 products + bias 1, tanh 1,
# mean over 256 pixels, dense 4 + 1, log-softmax 3; backward the same without the softmax, the
# kernel's sum over the 64 input pixels; 2 casts
TRANSPOSE_TERMS = 2 * (27 + 2 + 256 + 5) + 3 + 64 + 2

MODELS = {
    "transpose": (_transpose, TRANSPOSE_TERMS),
    "separable": (_separable, SEPARABLE_TERMS),
    "depthwise_llama_norm": (_combined, COMBINED_TERMS),
    "relative": (_relative, RELATIVE_TERMS),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_xla(name):
    build, terms = MODELS[name]
    model = build()
    x, y = _data()
    ref, magnitude = loop_sums(model, (x, y, None))
    assert_ghost_sums(model, (x, y, None), ref, magnitude, terms, jit=True)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_mixed_precision(name):
    build, terms = MODELS[name]
    model = build()
    x, y = _data()
    ref, magnitude = loop_sums(model, (x, y, None))
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        half = build()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    half.set_weights(model.get_weights())
    assert_ghost_sums(half, (x, y, None), ref, magnitude, terms, jit=False, dtype="float16")


# -- a whole keras-hub backbone --------------------------------------------------------------------


def test_tiny_llama_backbone_has_no_fallback():
    """LlamaBackbone (tiny config, random init): every variable by a rule, sums == the loop."""
    keras.utils.set_random_seed(31)
    backbone = keras_hub.models.LlamaBackbone(
        vocabulary_size=40,
        num_layers=1,
        num_query_heads=2,
        num_key_value_heads=1,
        hidden_dim=8,
        intermediate_dim=16,
    )
    seq = backbone.output
    model = _compile(
        keras.Model(backbone.input, L.Dense(3)(L.GlobalAveragePooling1D()(seq)))
    )
    r = rng(32)
    ids = r.integers(1, 40, (4, 6)).astype("int32")
    mask = np.ones((4, 6), "int32")
    mask[1, 4:] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    y = r.integers(0, 3, 4)
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
    strategy = GhostClipper()
    got = _sum_fn(strategy, model, (x, y, None))()
    assert strategy.mode == "ghost", strategy.description
    # float32 roundings of one gradient entry: per block embedding 1, RMS norm 8 + 3, attention
    # projections 8 + 1 and scores 4 + softmax 6 + values 6, output 8 + 1, RMS norm 8 + 3, gated
    # feed-forward 8 + 16 + 2, final norm 8 + 3, mean 6, head 8 + 1, log-softmax 3; doubled for
    # the backward pass, plus the embedding's sum over 6 tokens and 2 casts
    terms = 2 * (1 + 11 + 9 + 16 + 9 + 11 + 26 + 11 + 6 + 9) + 3 + 6 + 2
    atol = tolerance("float32", terms, _magnitude(model, (x, y, None)))
    for v, a, b in zip(model.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


# -- keras-hub DeBERTa-v3's relative embedding ------------------------------------------------------


def test_deberta_relative_embedding():
    """The table's layer norm repeated over the batch: the per-example VJP in closed form."""
    r = rng(41)
    cls = _hub_class(
        "keras_hub.src.models.deberta_v3.relative_embedding", "RelativeEmbedding"
    )
    inp = keras.Input((6, 5))
    rel = cls(hidden_dim=5, bucket_size=3)
    h = L.Add()([inp, rel(inp)])
    h = L.Dense(4, activation="tanh")(h)
    model = keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling1D()(h)))
    gamma = rel.layer_norm.gamma
    gamma.assign(r.normal(size=gamma.shape).astype("float32"))
    x = (r.normal(size=(6, 6, 5)) * r.uniform(0.2, 3.0, (6, 1, 1))).astype("float32")
    sw = r.uniform(0.5, 2.0, 6).astype("float32")
    check(model, x, r.integers(0, 3, 6), sw, reference=LoopReference, graph=True)


def test_tiny_deberta_v3_backbone_has_no_fallback():
    keras.utils.set_random_seed(42)
    backbone = keras_hub.models.DebertaV3Backbone(
        vocabulary_size=40,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        dropout=0.0,
        max_sequence_length=16,
        bucket_size=4,
    )
    seq = backbone.output
    model = _compile(
        keras.Model(backbone.input, L.Dense(3)(L.GlobalAveragePooling1D()(seq)))
    )
    r = rng(43)
    ids = r.integers(1, 40, (4, 6)).astype("int32")
    mask = np.ones((4, 6), "int32")
    mask[2, 3:] = 0
    x = {"token_ids": ids, "padding_mask": mask}
    y = r.integers(0, 3, 4)
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
    strategy = GhostClipper()
    got = _sum_fn(strategy, model, (x, y, None))()
    assert strategy.mode == "ghost", strategy.description
    # float32 roundings of one gradient entry: embedding 1, layer norm 8 + 3, relative embedding's
    # layer norm 8 + 3 and its 8 buckets, attention projections 8 + 1, disentangled scores
    # (content and two position terms) 3 x 4 + softmax 6 + values 6, output 8 + 1, layer norm
    # 8 + 3, feed-forward 8 + 16 + 2, layer norm 8 + 3, mean 6, head 8 + 1, log-softmax 3;
    # doubled for the backward pass, plus the embedding's sum over 6 tokens and 2 casts
    terms = (
        2 * (1 + 11 + 11 + 8 + 9 + 12 + 6 + 6 + 9 + 11 + 26 + 11 + 6 + 9) + 3 + 6 + 2
    )
    atol = tolerance("float32", terms, _magnitude(model, (x, y, None)))
    for v, a, b in zip(model.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


# -- keras-hub ViT's patch embedding (class token, position table broadcast over the batch) --------


@pytest.mark.parametrize("use_class_token, jit", [(True, None), (False, None)])
def test_tiny_vit_backbone_has_no_fallback(use_class_token, jit):
    """ViTBackbone (tiny, random init): the class token's and the position table's per-example
    gradients are slices of the patch embedding's output gradient; no variable falls back."""
    keras.utils.set_random_seed(44)
    backbone = keras_hub.models.ViTBackbone(
        image_shape=(8, 8, 3),
        patch_size=4,
        num_layers=1,
        num_heads=2,
        hidden_dim=8,
        mlp_dim=16,
        use_class_token=use_class_token,
    )
    model = _compile(
        keras.Model(backbone.input, L.Dense(3)(L.GlobalAveragePooling1D()(backbone.output)))
    )
    r = rng(45)
    x = r.normal(size=(4, 8, 8, 3)).astype("float32")
    y = r.integers(0, 3, 4)
    ref = [np.asarray(g) for g in _sum_fn(LoopReference(), model, (x, y, None))()]
    strategy = GhostClipper()
    got = _sum_fn(strategy, model, (tf.constant(x), tf.constant(y), None), jit)()
    assert strategy.mode == "ghost", strategy.description
    # float32 roundings of one gradient entry: patch convolution 4 x 4 x 3 + bias, class token
    # and position add 1, layer norm 8 + 3, attention projections 8 + 1, scores 4 + softmax 5 +
    # values 5, output 8 + 1, layer norm 8 + 3, MLP 8 + 16 + 2, layer norm 8 + 3, mean 5, head
    # 8 + 1, log-softmax 3; doubled for the backward pass, plus the conv kernel's sum over the 4
    # patches and 2 casts
    terms = 2 * (49 + 1 + 11 + 9 + 14 + 9 + 11 + 26 + 11 + 5 + 9) + 3 + 4 + 2
    atol = tolerance("float32", terms, _magnitude(model, (x, y, None)))
    for v, a, b in zip(model.trainable_variables, got, ref):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)


# -- separable convolutions ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer, shape, graph",
    [
        (
            lambda: L.SeparableConv2D(4, 3, depth_multiplier=2, padding="same"),
            (9, 9, 3),
            False,
        ),
        (
            lambda: L.SeparableConv2D(
                5, (3, 2), strides=2, activation="relu", use_bias=False
            ),
            (9, 9, 3),
            True,
        ),
        (
            lambda: L.SeparableConv2D(4, 3, dilation_rate=2, padding="same"),
            (9, 9, 3),
            False,
        ),
        (
            lambda: L.SeparableConv1D(4, 3, depth_multiplier=3, padding="same"),
            (10, 3),
            False,
        ),
        (lambda: L.SeparableConv1D(4, 3, strides=2, activation="tanh"), (10, 3), True),
    ],
)
def test_separable_conv(layer, shape, graph):
    r = rng(51)
    pool = L.GlobalAveragePooling2D() if len(shape) == 3 else L.GlobalAveragePooling1D()
    model = keras.Sequential([keras.Input(shape), layer(), pool, L.Dense(3)])
    size = (6,) + shape
    scale = r.uniform(0.2, 3.0, (6,) + (1,) * len(shape))
    x = (r.normal(size=size) * scale).astype("float32")
    check(model, x, r.integers(0, 3, 6), graph=graph, reference=LoopReference)


# -- transposed convolutions -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "layer, shape, graph",
    [
        (lambda: L.Conv2DTranspose(4, 3, strides=2, padding="same"), (5, 5, 3), False),
        (lambda: L.Conv2DTranspose(4, 3, strides=2, padding="valid"), (5, 5, 3), True),
        (
            lambda: L.Conv2DTranspose(4, 2, strides=3, activation="relu"),
            (4, 4, 9),
            False,
        ),
        (lambda: L.Conv2DTranspose(3, (3, 2), padding="same"), (5, 6, 2), False),
        (lambda: L.Conv1DTranspose(4, 3, strides=2, padding="same"), (7, 3), False),
        (lambda: L.Conv1DTranspose(4, 4, strides=2, use_bias=False), (7, 3), True),
    ],
)
def test_conv_transpose(layer, shape, graph):
    r = rng(61)
    pool = L.GlobalAveragePooling2D() if len(shape) == 3 else L.GlobalAveragePooling1D()
    model = keras.Sequential(
        [keras.Input(shape), layer(), L.Activation("tanh"), pool, L.Dense(3)]
    )
    size = (6,) + shape
    scale = r.uniform(0.2, 3.0, (6,) + (1,) * len(shape))
    x = (r.normal(size=size) * scale).astype("float32")
    check(model, x, r.integers(0, 3, 6), graph=graph, reference=LoopReference)


# -- grouped convolutions (ConvNeXt's depthwise Conv2D(groups=C)) ---------------------------------


@pytest.mark.parametrize(
    "layer, shape, graph",
    [
        (lambda: L.Conv2D(6, 7, padding="same", groups=6), (8, 8, 6), False),
        (lambda: L.Conv2D(4, 3, strides=2, groups=2, activation="relu"), (9, 9, 6), True),
        (lambda: L.Conv2D(6, 3, dilation_rate=2, padding="same", groups=3), (8, 8, 6), False),
        (lambda: L.Conv1D(6, 3, padding="causal", groups=2), (10, 4), True),
        (lambda: L.Conv3D(4, 2, groups=2), (4, 4, 4, 4), False),
    ],
    ids=["depthwise-like", "strided", "dilated", "conv1d-causal", "conv3d"],
)
def test_grouped_conv(layer, shape, graph):
    keras.utils.set_random_seed(41)
    r = rng(42)
    inp = keras.Input(shape)
    h = L.Conv1D(shape[-1], 1)(inp) if len(shape) == 2 else inp  # a non-grouped neighbour
    h = layer()(h)
    out = L.Dense(3)(L.Flatten()(h))
    model = keras.Model(inp, out)
    x = (r.normal(size=(5, *shape)) * r.uniform(0.2, 3.0, (5,) + (1,) * len(shape)))
    check(model, x.astype("float32"), r.integers(0, 3, 5), reference=LoopReference, graph=graph)


def test_grouped_conv_xla():
    keras.utils.set_random_seed(43)
    r = rng(44)
    inp = keras.Input((8, 8, 4))
    h = L.Conv2D(4, 5, padding="same", groups=4)(inp)
    h = L.Conv2D(8, 3, groups=2)(h)
    model = _compile(keras.Model(inp, L.Dense(3)(L.GlobalAveragePooling2D()(h))))
    x = r.normal(size=(5, 8, 8, 4)).astype("float32")
    y = r.integers(0, 3, 5)
    ref, magnitude = loop_sums(model, (x, y, None))
    # per example: the 25-tap and 3x3x2 convolutions, 36 pooled positions, 8 features; casts
    assert_ghost_sums(model, (x, y, None), ref, magnitude, 25 + 18 + 36 + 8 + 2, jit=True)


# -- keras-hub DeiT's embeddings (class and distillation tokens, position table) ------------------


@pytest.mark.parametrize("jit", [None, False, True], ids=["eager", "graph", "xla"])
def test_deit_embeddings(jit):
    from keras_hub.src.models.deit.deit_layers import DeiTEmbeddings

    keras.utils.set_random_seed(46)
    inp = keras.Input((8, 8, 3))
    emb = DeiTEmbeddings(image_size=(8, 8), patch_size=(4, 4), hidden_dim=6)
    h = L.Dense(4, activation="tanh")(emb(inp))
    model = _compile(keras.Model(inp, L.Dense(3)(L.Flatten()(h))))
    for v in (emb.class_token, emb.distillation_token):  # zeros at init: make them matter
        v.assign(rng(47).normal(size=v.shape).astype("float32"))
    r = rng(48)
    x = r.normal(size=(5, 8, 8, 3)).astype("float32")
    y = r.integers(0, 3, 5)
    ref, magnitude = loop_sums(model, (x, y, None))
    # per example: the 4 x 4 x 3 patch convolution + bias, the position add, the Dense's 6, the
    # head's 24 flattened features, log-softmax 3; doubled for the backward pass; the kernel's
    # sum over 4 patches; casts
    terms = 2 * (49 + 1 + 6 + 24 + 3) + 4 + 2
    assert_ghost_sums(model, (x, y, None), ref, magnitude, terms, jit=jit)


# -- keras-hub T5's relative attention bias (one table, its bias reused by the later layers) -----


@pytest.mark.parametrize("jit", [None, False, True], ids=["eager", "graph", "xla"])
def test_tiny_t5_backbone_has_no_fallback(jit):
    keras.utils.set_random_seed(51)
    backbone = keras_hub.models.T5Backbone(
        vocabulary_size=30,
        num_layers=2,
        num_heads=2,
        hidden_dim=8,
        intermediate_dim=16,
        key_value_dim=4,
        dropout=0.0,
    )
    pooled = L.GlobalAveragePooling1D()(backbone.output["decoder_sequence_output"])
    model = _compile(keras.Model(backbone.input, L.Dense(3)(pooled)))
    r = rng(52)
    mask = np.ones((4, 6), "int32")
    mask[1, 4:] = 0
    x = {
        "encoder_token_ids": r.integers(1, 30, (4, 6)).astype("int32"),
        "encoder_padding_mask": mask,
        "decoder_token_ids": r.integers(1, 30, (4, 6)).astype("int32"),
        "decoder_padding_mask": mask[::-1].copy(),
    }
    y = r.integers(0, 3, 4)
    ref, magnitude = loop_sums(model, (x, y, None))
    tables = [v for v in model.trainable_variables if "embeddings" in v.path and v.shape[-1] == 2]
    assert len(tables) == 2  # the encoder's and the decoder's relative attention bias tables
    # per example, per layer: norm 8 + 3, projections 8, scores 4, softmax 6, values 6, output 8,
    # norm 8 + 3, MLP 8 + 16; two encoder and two decoder layers (with cross-attention);
    # doubled for the backward pass; the tables' sums over the 36 query/key pairs; casts
    layer_terms = 11 + 8 + 4 + 6 + 6 + 8 + 11 + 24
    terms = 2 * (6 * layer_terms + 11 + 6 + 8 + 3) + 36 + 2
    assert_ghost_sums(model, (x, y, None), ref, magnitude, terms, jit=jit)


# -- keras-hub PaliGemma's ViT embeddings (a [1, P] position lookup broadcast over the batch) -----


@pytest.mark.parametrize("jit", [None, False, True], ids=["eager", "graph", "xla"])
def test_pali_gemma_vit_embeddings(jit):
    from keras_hub.src.models.pali_gemma.pali_gemma_vit import PaliGemmaVitEmbeddings

    keras.utils.set_random_seed(49)
    inp = keras.Input((8, 8, 3))
    emb = PaliGemmaVitEmbeddings(image_size=8, patch_size=4, hidden_dim=6)
    h = L.Dense(4, activation="tanh")(emb(inp))
    model = _compile(keras.Model(inp, L.Dense(3)(L.Flatten()(h))))
    r = rng(50)
    x = r.normal(size=(5, 8, 8, 3)).astype("float32")
    y = r.integers(0, 3, 5)
    ref, magnitude = loop_sums(model, (x, y, None))
    # per example: the 4 x 4 x 3 patch convolution + bias, the position add, the Dense's 6, the
    # head's 16 flattened features, log-softmax 3; doubled for the backward pass; the kernel's
    # sum over 4 patches; casts
    terms = 2 * (49 + 1 + 6 + 16 + 3) + 4 + 2
    assert_ghost_sums(model, (x, y, None), ref, magnitude, terms, jit=jit)


def test_pali_gemma_vit_embeddings_with_other_ids_fall_back():
    from keras_hub.src.models.pali_gemma.pali_gemma_vit import PaliGemmaVitEmbeddings

    from tf_dp.gradients.ghost.embeddings import pali_gemma_vit_embeddings_supports

    emb = PaliGemmaVitEmbeddings(image_size=8, patch_size=4, hidden_dim=6)
    assert pali_gemma_vit_embeddings_supports(emb) is None
    emb.position_ids = keras.ops.convert_to_tensor([[1, 0, 2, 3]])
    assert "position ids other than 0 .. 3" in pali_gemma_vit_embeddings_supports(emb)
