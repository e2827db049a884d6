"""``tf_dp.keras.validate_for_dp`` / ``fix_for_dp``: BatchNormalization -> GroupNormalization.

Checked against direct counts and the original model's own weights: every offending layer is
reported; the fixed model has plain GroupNormalization layers with the documented group counts,
every other weight equal to the original's and BN's gamma/beta copied; the ghost plan covers the
GroupNormalization layers with their rule (no per-example fallback); the clipped sum equals a
per-example loop's; functional models whose BatchNormalization receives a mask are rebuilt.
"""

import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest

import tf_dp
from tests.test_ghost import LoopReference, check, rng
from tf_dp.gradients import make_clipper
from tf_dp.gradients.ghost import GhostClipper

L = keras.layers
A = keras.applications


def _randomize_bn(model, r):
    """Gives every BN layer non-default gamma/beta/statistics, so copying them is observable."""
    for layer in model._flatten_layers(include_self=False):
        if isinstance(layer, L.BatchNormalization):
            for v in layer.weights:
                v.assign(r.uniform(0.5, 1.5, v.shape).astype("float32"))


def _bn_layers(model):
    return [la for la in model._flatten_layers(include_self=False)
            if isinstance(la, L.BatchNormalization)]


def _fallback_layers(strategy):
    desc = strategy.description
    return desc[desc.index("(layers: ") + 9 : -1].split(", ") if "(layers: " in desc else []


APPS = {
    "ResNet50": lambda: A.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10),
    "MobileNetV3Small": lambda: A.MobileNetV3Small(
        weights=None, input_shape=(32, 32, 3), classes=10),
    "EfficientNetB0": lambda: A.EfficientNetB0(weights=None, input_shape=(32, 32, 3), classes=10),
}


@pytest.mark.parametrize("name", sorted(APPS))
def test_applications_fixed_weights_kept_and_group_norm_rule_used(name):
    r = rng(0)
    model = APPS[name]()
    _randomize_bn(model, r)
    bn = _bn_layers(model)
    assert bn
    with pytest.raises(ValueError, match="mix the examples"):
        tf_dp.keras.make_private(APPS[name]())
    report = tf_dp.keras.validate_for_dp(model)
    assert not report.ok
    assert [i.layer for i in report.issues] == [la.name for la in bn]  # every one, in order
    fixed, report = tf_dp.keras.fix_for_dp(model)
    assert report.ok and len(report.issues) == len(bn)
    assert "moving_mean" in report.not_transferred[0]
    assert not _bn_layers(fixed)
    for old in model._flatten_layers(include_self=False):
        new = fixed.get_layer(old.name)
        if isinstance(old, L.BatchNormalization):
            assert type(new) is L.GroupNormalization  # plain: the registered rule applies
            channels = old.gamma.shape[0]
            assert new.groups == math.gcd(32, channels)
            assert new.epsilon == old.epsilon
            np.testing.assert_array_equal(new.gamma.numpy(), old.gamma.numpy())
            np.testing.assert_array_equal(new.beta.numpy(), old.beta.numpy())
        else:
            assert type(new) is type(old)
            old_w, new_w = old.get_weights(), new.get_weights()
            assert len(old_w) == len(new_w), old.name
            for a, b in zip(old_w, new_w):
                np.testing.assert_array_equal(a, b, err_msg=old.name)
            assert new.trainable == old.trainable
    strategy = make_clipper("auto", model=fixed)
    assert isinstance(strategy, GhostClipper)
    gn_names = {la.name for la in bn}
    fallback = _fallback_layers(strategy)
    assert not gn_names & set(fallback), strategy.description
    if name == "ResNet50":
        assert strategy.description == "ghost"
    else:  # only the depthwise convolutions (no ghost rule) fall back
        assert all(isinstance(fixed.get_layer(n), L.DepthwiseConv2D) for n in fallback)


def test_every_kind_of_offence_reported():
    inp = keras.Input((4, 3), batch_size=2)
    h = L.LSTM(4, stateful=True, return_sequences=True, name="lstm")(inp)
    h = L.BatchNormalization(name="bn1")(h)
    h = L.Dense(4, activity_regularizer="l2", name="reg")(h)
    h = L.BatchNormalization(name="bn2")(h)
    model = keras.Model(inp, h)
    report = tf_dp.keras.validate_for_dp(model)
    found = {i.layer: i for i in report.issues}
    assert set(found) == {"lstm", "bn1", "reg", "bn2"}
    assert found["bn1"].fix == "replaced by GroupNormalization(groups=4)"
    assert "stateful=False" in found["lstm"].fix
    assert "activity_regularizer" in found["reg"].fix
    assert not report.ok
    fixed, report = tf_dp.keras.fix_for_dp(model)
    assert not report.ok  # the LSTM and the regularizer are left to the user
    assert not _bn_layers(fixed)
    assert "4 offending layer(s)" in str(report)


def test_functional_model_with_mask():
    """A BatchNormalization fed a masked sequence (clone_model alone fails on ``mask``)."""
    r = rng(3)
    inp = keras.Input((6,), dtype="int32")
    h = L.Embedding(20, 8, mask_zero=True)(inp)
    h = L.BatchNormalization()(h)  # receives the Embedding's mask
    h = L.Dense(8, activation="tanh")(h)
    h = L.GlobalAveragePooling1D()(h)
    model = keras.Model(inp, L.Dense(3)(h))
    with pytest.raises(TypeError, match="mask"):  # what a plain swap does
        keras.models.clone_model(
            model,
            clone_function=lambda la: L.GroupNormalization(groups=2)
            if isinstance(la, L.BatchNormalization) else la.__class__.from_config(la.get_config()),
        )
    fixed, report = tf_dp.keras.fix_for_dp(model, groups=2)
    assert report.ok and [i.fix for i in report.issues] == ["replaced by GroupNormalization(groups=2)"]
    x = r.integers(1, 20, (6, 6)).astype("int32")
    x[0, 3:] = 0
    x[4, 1:] = 0
    y = r.integers(0, 3, 6)
    check(fixed, x, y, reference=LoopReference)


def _small_resnet_with_bn():
    inp = keras.Input((8, 8, 3))
    h = L.Conv2D(8, 3, padding="same")(inp)
    h = L.BatchNormalization()(h)
    h = L.Activation("relu")(h)
    s = L.Conv2D(8, 3, padding="same")(h)
    s = L.BatchNormalization()(s)
    h = L.Activation("relu")(L.Add()([h, s]))
    h = L.GlobalAveragePooling2D()(h)
    return keras.Model(inp, L.Dense(4)(h))


def test_clipped_sum_equals_per_example_loop():
    r = rng(4)
    model = _small_resnet_with_bn()
    _randomize_bn(model, r)
    fixed, _ = tf_dp.keras.fix_for_dp(model, groups=lambda channels: channels // 4)
    assert [la.groups for la in fixed.layers if isinstance(la, L.GroupNormalization)] == [2, 2]
    x = r.normal(size=(6, 8, 8, 3)).astype("float32")
    y = r.integers(0, 4, 6)
    check(fixed, x, y, reference=LoopReference)


def test_sequential_fixed_trains_privately_in_auto():
    r = rng(5)
    model = keras.Sequential([
        keras.Input((8, 8, 3)), L.Conv2D(8, 3), L.BatchNormalization(), L.ReLU(),
        L.GlobalAveragePooling2D(), L.Dense(4),
    ])
    fixed, report = tf_dp.keras.fix_for_dp(model, copy_affine=False)
    assert "gamma/beta" in report.not_transferred[0]
    gn = fixed.layers[1]
    assert type(gn) is L.GroupNormalization and gn.groups == 8
    np.testing.assert_array_equal(gn.gamma.numpy(), np.ones(8))
    private = tf_dp.keras.make_private(fixed)
    private.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = gn.gamma.numpy().copy()
    x = r.normal(size=(8, 8, 8, 3)).astype("float32")
    private.fit(x, r.integers(0, 4, 8), batch_size=4, epochs=1, verbose=0)
    assert private.optimizer.gradient_clipper.description == "ghost"
    assert private.optimizer.ledger.num_samples == 2
    assert not np.allclose(gn.gamma.numpy(), before)


def test_nested_models_frozen_layers_and_input_names_kept():
    """A frozen backbone (nested functional) and a nested Sequential block under a new head."""
    r = rng(6)
    backbone = _small_resnet_with_bn()
    backbone.trainable = False
    block = keras.Sequential([L.Dense(8), L.BatchNormalization(), L.ReLU()], name="block")
    inp = keras.Input((8, 8, 3), name="image")
    model = keras.Model(inp, L.Dense(2, name="head")(block(backbone(inp))))
    _randomize_bn(model, r)
    assert len(tf_dp.keras.validate_for_dp(model).issues) == 3
    fixed, report = tf_dp.keras.fix_for_dp(model)
    assert report.ok and not _bn_layers(fixed)
    assert fixed.input.name == "image" and fixed.layers[0].name == "image"
    x = r.normal(size=(3, 8, 8, 3)).astype("float32")
    # the frozen backbone minus its BN: the same conv layer (its weights copied) on the same input,
    # the same kernel: exact; a conv that lost its weights or kept a BN would differ by O(1)
    np.testing.assert_array_equal(fixed.layers[1].layers[1](x), backbone.layers[1](x))
    gn = [la for la in fixed._flatten_layers() if isinstance(la, L.GroupNormalization)]
    assert [la.trainable for la in gn] == [False, False, True]
    # Dense + GN of the block, the head: 6 trainable variables, none of the frozen backbone's
    assert len(fixed.trainable_variables) == 6
    strategy = make_clipper("auto", model=fixed)
    assert strategy.description == "ghost"


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"groups": 0}, "groups must be an int >= 1"),
        ({"groups": "8"}, "groups must be an int >= 1"),
        ({"groups": True}, "groups must be an int >= 1"),
        ({"groups": lambda c: 3}, "positive divisor of the channel count"),
    ],
)
def test_bad_arguments_fail_naming_them(kwargs, match):
    model = keras.Sequential([keras.Input((4,)), L.Dense(8), L.BatchNormalization()])
    with pytest.raises(ValueError, match=match):
        tf_dp.keras.fix_for_dp(model, **kwargs)


def test_copy_affine_must_be_bool():
    model = keras.Sequential([keras.Input((4,)), L.Dense(8), L.BatchNormalization()])
    with pytest.raises(TypeError, match="copy_affine must be True or False"):
        tf_dp.keras.fix_for_dp(model, copy_affine="yes")


def test_subclassed_model_refused():
    class Net(keras.Model):
        def __init__(self):
            super().__init__()
            self.bn = L.BatchNormalization()

        def call(self, x):
            return self.bn(x)

    net = Net()
    net(np.zeros((2, 3), "float32"))
    assert [i.layer_class for i in tf_dp.keras.validate_for_dp(net).issues] == [
        "BatchNormalization"
    ]
    with pytest.raises(TypeError, match="model must be a Sequential or functional"):
        tf_dp.keras.fix_for_dp(net)
