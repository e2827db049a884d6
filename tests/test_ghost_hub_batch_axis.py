"""Ghost rules for keras-hub blocks that flatten the examples into axis 0 (issue 35): Mixtral's and
GPT-OSS's mixture-of-experts blocks (router and expert bank on ``[B*T, d]`` tokens), GPT-OSS's
attention sinks, and Swin's window attention (``[B*nW, w*w, C]`` windows). Their rules run the
block with the examples kept on axis 0 (``tf_dp/gradients/ghost/moe.py``,
``window_attention.py``), so nothing is folded back from ``B*k`` rows.

Each tiny model (random init, built from its config class) is checked against per-example
gradients from a ``GradientTape`` loop over the examples (``LoopReference``): the per-example norms,
and the sum clipped at 0.8 times the median norm (some examples clipped, some not), in eager mode,
in a ``tf.function`` and under XLA (Swin's by default, the others' with ``--conformance-full``:
minutes of XLA compilation); the plan must put every variable on a rule (mode ``"ghost"``).
The rules' forward passes must also reproduce the blocks' own outputs, and a configuration a rule
does not reproduce is refused (the per-example fallback stays).
"""

from __future__ import annotations

import keras
import keras_hub
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import norm_terms, tolerance
from tests.test_ghost import LoopReference, RecordingQuery, _compile, rng
from tf_dp.gradients.ghost import GhostClipper, make_plan
from tf_dp.gradients.ghost.rules import find_rule
from tf_dp.keras.losses import PerExampleLoss

L = keras.layers
MODES = [None, False, True]
IDS = ["eager", "graph", "xla"]


def _text_model(backbone):
    pooled = L.GlobalAveragePooling1D()(backbone.output)
    return _compile(keras.Model(backbone.input, L.Dense(3)(pooled)))


def _text_data(seed, n=4, t=6, vocab=30):
    r = rng(seed)
    x = {
        "token_ids": r.integers(1, vocab, (n, t)).astype("int32"),
        "padding_mask": np.ones((n, t), "int32"),
    }
    return x, r.integers(0, 3, n)


def mixtral():
    keras.utils.set_random_seed(61)
    backbone = keras_hub.models.MixtralBackbone(
        vocabulary_size=30, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=12, num_experts=3, top_k=2,
    )
    return _text_model(backbone), _text_data(62)


def gpt_oss():
    keras.utils.set_random_seed(63)
    backbone = keras_hub.models.GptOssBackbone(
        vocabulary_size=30, num_layers=1, num_query_heads=2, num_key_value_heads=1,
        hidden_dim=8, intermediate_dim=12, num_experts=3, top_k=2, head_dim=4,
    )
    return _text_model(backbone), _text_data(64)


def qwen3_5():
    keras.utils.set_random_seed(67)
    backbone = keras_hub.models.Qwen3_5Backbone(
        vocabulary_size=30, num_layers=1, num_query_heads=2, num_key_value_heads=1, head_dim=4,
        hidden_dim=8, intermediate_dim=12, layer_types=["linear_attention"],
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=4,
        linear_value_head_dim=4, linear_conv_kernel_dim=3,
    )
    model, (x, y) = _text_model(backbone), _text_data(68)
    x["padding_mask"][1, 4:] = 0  # a padded example: the mask reaches the recurrence
    return model, (x, y)


def swin(window=2, depth=2):
    keras.utils.set_random_seed(65)
    backbone = keras_hub.models.SwinTransformerBackbone(
        image_shape=(8, 8, 3), patch_size=2, embed_dim=8, depths=[depth], num_heads=[2],
        window_size=window, mlp_ratio=2.0, drop_path=0.0,  # no random per-example masks
    )
    pooled = L.GlobalAveragePooling1D()(backbone.output)
    model = _compile(keras.Model(backbone.input, L.Dense(3)(pooled)))
    r = rng(66)
    return model, (r.normal(size=(4, 8, 8, 3)).astype("float32"), r.integers(0, 3, 4))


#: per model: an upper count of the roundings on the longest path to one per-example gradient
#: entry (forward and backward: every reduction's length, 2 per elementwise step), see each entry
TERMS = {
    # embedding, norm 8 + 2, q/k/v 8, scores 4 + softmax 6, values 6, output 8, norm 8 + 2,
    # router 8 + softmax 3, experts 8 + 12 + mix 3, pooling 6, head 8 + log-softmax 3; doubled;
    # the experts' kernels sum over the 6 tokens; casts
    "mixtral": 2 * (10 + 8 + 10 + 6 + 8 + 10 + 11 + 23 + 6 + 11) + 6 + 2,
    # the same with the sinks (a 7th logit) and the experts' biases
    "gpt_oss": 2 * (10 + 8 + 11 + 6 + 8 + 10 + 11 + 25 + 6 + 11) + 6 + 2,
    # embedding, norm 8 + 2, projections 8, convolution 3, l2 norms 4, the delta-rule
    # recurrence over 6 tokens (4-wide states: 6 * (4 + 4)), gate 3, gated norm 4 + 2, output 8,
    # norm 8 + 2, MLP 8 + 12, pooling 6, head 8 + log-softmax 3; doubled; the kernels' sums
    # over the 6 tokens; casts
    "qwen3_5": 2 * (10 + 8 + 3 + 4 + 48 + 3 + 6 + 8 + 10 + 20 + 6 + 11) + 6 + 2,
    # patch convolution 12 + norm 8 + 2 per block: norm 10, qkv 8, scores 4 + bias + softmax 4,
    # values 4, proj 8, norm 10, MLP 8 + 16; two blocks; pooling 16, head 8 + log-softmax 3;
    # doubled; the table's sum over the 4 windows x its pairs, the kernels' over 16 tokens; casts
    "swin": 2 * (12 + 10 + 2 * (10 + 8 + 6 + 4 + 8 + 10 + 24) + 16 + 11) + 4 * 16 + 16 + 2,
}
MODELS = {"mixtral": mixtral, "gpt_oss": gpt_oss, "qwen3_5": qwen3_5, "swin": swin}


def _spec(t):
    return tf.TensorSpec(t.shape, tf.as_dtype(t.dtype))


def norms_and_clipped_sum_vs_loop(model, data, jit, terms):
    """Ghost per-example norms and clipped sum (eager when ``jit`` is None, else a
    ``tf.function``, XLA if ``jit``) vs a ``GradientTape`` loop;
    returns the clipper."""
    x, y = data
    loss_fn = PerExampleLoss(model)
    variables = model.trainable_variables
    per_ex, _, _ = LoopReference().per_example_gradients(loss_fn, (x, y, None), variables)
    per_ex = [np.asarray(g, np.float64) for g in per_ex]
    n = len(y)
    norms = np.sqrt(sum((g.reshape(n, -1) ** 2).sum(1) for g in per_ex))
    clip = 0.8 * float(np.median(norms))
    weights = np.minimum(1.0, clip / norms)
    want = [np.tensordot(weights, g, axes=1) for g in per_ex]
    ghost = GhostClipper()
    query = RecordingQuery(clip, 0.0)
    params = query.derive_sample_params(query.initial_global_state())

    def step(x, y):
        out = ghost.clipped_sum(loss_fn, (x, y, None), variables, query, params)
        return out.norms, out.clipped_sum

    if jit is not None:
        spec = (tf.nest.map_structure(_spec, x), tf.TensorSpec([len(y)], tf.int64))
        step = tf.function(step, jit_compile=jit, input_signature=spec)
    got_norms, got = step(tf.nest.map_structure(tf.constant, x), tf.constant(y, tf.int64))
    assert ghost.mode == "ghost", ghost.description
    # a per-example gradient entry's roundings (``terms``), then the squared norm over every
    # parameter; scale: the largest norm (norms), the sum of the clipped norms (sums)
    params_n = sum(int(np.prod(v.shape)) for v in variables)
    np.testing.assert_allclose(
        np.asarray(got_norms), norms, rtol=0,
        atol=tolerance("float32", terms + norm_terms(params_n), float(norms.max())),
    )
    atol = tolerance("float32", terms + norm_terms(params_n) + n,
                     float(np.sum(np.minimum(norms, clip))))
    assert (weights < 1).any() and (weights == 1).any()
    for v, a, b in zip(variables, got, want):
        np.testing.assert_allclose(np.asarray(a), b, rtol=0, atol=atol, err_msg=v.path)
    return ghost


#: XLA compilations that take 8-70 s each on one core (Qwen3.5's chunked delta rule unrolls 63
#: steps): opt-in with ``--conformance-full``, like the conformance sweep; Swin's runs by default
_SLOW_XLA = pytest.mark.conformance_full
CASES = [
    pytest.param(name, jit, id=f"{name}-{mode}",
                 marks=[_SLOW_XLA] if jit and name != "swin" else [])
    for name in sorted(MODELS)
    for jit, mode in zip(MODES, IDS)
]


@pytest.mark.parametrize("name, jit", CASES)
def test_norms_and_clipped_sum_match_the_loop(name, jit):
    model, data = MODELS[name]()
    norms_and_clipped_sum_vs_loop(model, data, jit, TERMS[name])


def _blocks(model, class_name):
    from tf_dp import _compat

    return [la for la in _compat.flatten_layers(model) if type(la).__name__ == class_name]


@pytest.mark.parametrize(
    "name, class_name",
    [("mixtral", "MixtralSparseMoeBlock"), ("gpt_oss", "GptOssSparseMoeBlock"),
     ("gpt_oss", "GptOssAttention"), ("qwen3_5", "Qwen3_5GatedDeltaNet"),
     ("swin", "SwinTransformerBlock")],
)
def test_rule_forward_reproduces_the_block(name, class_name):
    """The rule's forward computes the block's own outputs (the function trained is the one the
    model computes), for every block of that class (Swin: a plain and a shifted-window block)."""
    model, (x, _) = MODELS[name]()
    blocks = _blocks(model, class_name)
    assert blocks
    seen = {}

    def record(layer, orig):
        def call(*args, **kwargs):
            out = orig(*args, **kwargs)
            entry, reason = find_rule(layer)
            assert entry is not None, reason
            mine, _ = entry.forward(layer, orig, args, kwargs, lambda t: tf.convert_to_tensor(t))
            seen[layer.name] = (out, mine)
            return out
        return call

    for layer in blocks:
        object.__setattr__(layer, "call", record(layer, layer.call))
    try:
        model(tf.nest.map_structure(tf.constant, x), training=False)
    finally:
        for layer in blocks:
            object.__delattr__(layer, "call")
    assert len(seen) == len(blocks)
    for out, mine in seen.values():
        for a, b in zip(tf.nest.flatten(out), tf.nest.flatten(mine)):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape
            # the same products in another order: a few dozen roundings of values of size |a|
            np.testing.assert_allclose(b, a, rtol=0, atol=tolerance("float32", 64, np.abs(a).max()))


def test_swin_with_padded_windows_is_refused_and_falls_back():
    """Windows that do not tile the feature map (keras-hub pads it) are not reproduced by the
    rule: refused, and the block's attention keeps the per-example fallback."""
    model, _ = swin(window=3, depth=1)  # 4 x 4 patches, 3 x 3 windows: padded to 6 x 6
    block = _blocks(model, "SwinTransformerBlock")[0]
    entry, reason = find_rule(block)
    assert entry is None and "padding" in reason, reason
    plan = make_plan(model, model.trainable_variables)
    assert plan.mode == "mixed"
    fallback = [v.path for _, _, vs in plan.local for v in vs]
    assert any("relative_position_bias_table" in p for p in fallback), fallback


def test_moe_block_with_router_jitter_is_refused():
    """Mixtral's router jitter noise (random factors on the flattened tokens) is not reproduced:
    refused; a subclass overriding ``call`` is refused by the registry."""
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralSparseMoeBlock

    block = MixtralSparseMoeBlock(hidden_dim=8, intermediate_dim=12, num_experts=3,
                                  router_jitter_noise=0.1)
    block.build((None, 6, 8))
    entry, reason = find_rule(block)
    assert entry is None and "jitter" in reason, reason

    class Other(MixtralSparseMoeBlock):
        def call(self, hidden_states, attention_mask=None, training=False):
            return super().call(hidden_states, attention_mask, training)

    other = Other(hidden_dim=8, intermediate_dim=12, num_experts=3)
    other.build((None, 6, 8))
    assert find_rule(other)[0] is None


def test_gpt_oss_and_delta_net_refuse_what_their_forward_does_not_reproduce():
    """A subclass of GPT-OSS's MoE block that keeps ``call`` (so the registry would apply the
    rule) is refused, and so is a Qwen3.5 gated delta net whose output norm is not keras-hub's
    gated RMS norm (the forward applies that norm's own call to the unflattened rows)."""
    from keras_hub.src.models.gpt_oss.gpt_oss_decoder import GptOssSparseMoeBlock
    from keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net import Qwen3_5GatedDeltaNet

    class Renamed(GptOssSparseMoeBlock):
        pass

    block = Renamed(hidden_dim=8, intermediate_dim=12, num_experts=3)
    block.build((None, 6, 8))
    entry, reason = find_rule(block)
    assert entry is None and "not keras-hub's own GptOssSparseMoeBlock" in reason, reason
    plain = GptOssSparseMoeBlock(hidden_dim=8, intermediate_dim=12, num_experts=3)
    plain.build((None, 6, 8))
    assert find_rule(plain)[0] is not None

    net = Qwen3_5GatedDeltaNet(8, 2, 2, 4, 4, linear_conv_kernel_dim=3)
    net.build((None, 6, 8))
    assert find_rule(net)[0] is not None
    object.__setattr__(net, "norm", L.LayerNormalization())
    entry, reason = find_rule(net)
    assert entry is None and "Qwen3_5RMSNormGated" in reason, reason


def test_add_loss_of_a_block_on_the_per_layer_fallback_is_refused_not_dropped():
    """Mixtral's router adds a load-balancing loss with ``add_loss``, which DP training refuses.
    With the MoE rule removed, the block is clipped by the per-layer fallback, whose work after
    the model's forward pass left ``model.losses`` without that term: the step used to train
    without it. The count is taken right after the forward pass (``PerExampleLoss``), so the
    step is refused and nothing is applied or recorded."""
    import tf_dp.keras as dpk
    from keras_hub.src.models.mixtral.mixtral_decoder import MixtralSparseMoeBlock

    from tf_dp.gradients.ghost import moe
    from tf_dp.gradients.ghost.rules import default_registry

    model, (x, y) = mixtral()
    model(x, training=True)
    assert len(model.losses) == 1  # the router's auxiliary loss
    registry = default_registry()
    block = next(layer for layer in model._flatten_layers()
                 if isinstance(layer, MixtralSparseMoeBlock))
    assert registry.find(block)[0] is not None  # (loads keras-hub's rules)
    options = next(o for _, name, o in moe.registrations() if name == "MixtralSparseMoeBlock")
    registry.unregister(MixtralSparseMoeBlock)
    try:
        private = dpk.make_private(model)
        private.compile(
            optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0,
                                              gradient_mode="auto"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        w0 = [v.numpy() for v in private.trainable_variables]
        with pytest.raises(NotImplementedError, match="add_loss"):
            private.fit(x, y, batch_size=2, epochs=1, verbose=0)
        for a, b in zip(private.trainable_variables, w0):
            np.testing.assert_array_equal(a.numpy(), b)
        assert private.optimizer.ledger.num_samples == 0
    finally:
        registry.register(MixtralSparseMoeBlock, options.pop("rule"), **options)
    assert registry.find(block)[0] is not None
