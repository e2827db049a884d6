"""The ghost norm-rule registry: an object apart from the rules, filled from one module per layer
family whose rule functions carry ``@norm_rule``; the old gradient-strategy names still resolve."""

from __future__ import annotations

import warnings

import keras
import pytest

import tf_dp.gradients as gradients
from tf_dp.gradients.ghost import conv, dense, embeddings, normalization, recurrent, rules
from tf_dp.gradients.ghost.registry import LayerRuleRegistry, norm_rule

L = keras.layers


def test_each_built_in_rule_lives_in_the_module_named_after_its_family():
    expected = [
        (L.Dense(2), dense),
        (L.EinsumDense("ab,bc->ac", 2), dense),
        (L.Conv1D(2, 3), conv),
        (L.Conv2D(2, 3), conv),
        (L.Embedding(5, 2), embeddings),
        (L.LayerNormalization(), normalization),
        (L.GroupNormalization(groups=2), normalization),
        (L.LSTM(2), recurrent),
        (L.GRU(2), recurrent),
        (L.SimpleRNN(2), recurrent),
    ]
    registry = rules.new_registry()
    for layer, module in expected:
        entry, reason = registry.find(layer)
        assert reason is None, reason
        assert entry.rule.__module__ == module.__name__, type(layer).__name__


def test_marking_a_rule_registers_nothing_until_a_registry_collects_it():
    class Scale(L.Layer):
        pass

    before = rules.registered_layer_classes()

    @norm_rule(Scale, None, split_activation=True)  # None (a class this Keras lacks) is skipped
    def scale_rule(layer, inputs, grad_output):
        return []

    assert rules.registered_layer_classes() == before
    registry = LayerRuleRegistry()
    registry.add_rules([scale_rule, "not a rule", len])
    assert registry.layer_classes() == (Scale,)
    entry, reason = registry.find(Scale())
    assert reason is None and entry.rule is scale_rule and entry.split_activation
    # a subclass that overrides call() does not inherit the rule
    sub = type("SubScale", (Scale,), {"call": lambda self, x: x})
    assert registry.find(sub())[1] == "SubScale overrides call() of Scale"
    registry.unregister(Scale)
    assert registry.find(Scale())[0] is None


def test_registries_are_independent_objects():
    fresh = LayerRuleRegistry()
    assert fresh.layer_classes() == ()
    assert fresh.find(L.Dense(2)) == (None, "no norm rule registered for Dense")
    assert rules.find_rule(L.Dense(2))[0] is not None
    with pytest.raises(TypeError, match="layer_class must be a keras.layers.Layer subclass"):
        fresh.register(int, lambda *a: [])
    with pytest.raises(TypeError, match="rule must be callable"):
        fresh.register(L.Dense, "no")


def test_lazy_loader_runs_once_for_its_module_prefix():
    calls = []
    registry = LayerRuleRegistry(lazy={"keras.src.layers.core": calls.append})
    registry.find(L.Dense(2))
    registry.find(L.Dense(3))
    assert calls == [registry]


@pytest.mark.parametrize("old, new", sorted(gradients.DEPRECATED.items()))
def test_old_strategy_names_are_deprecated_aliases(old, new):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        value = getattr(gradients, old)
    assert value is getattr(gradients, new)
    assert [w.category for w in caught] == [DeprecationWarning]
    assert new in str(caught[0].message) and "tf.distribute" in str(caught[0].message)


def test_new_clipper_names_are_the_public_ones():
    assert {"GradientClipper", "make_clipper", "GhostClipper", "JLClipper"} <= set(
        gradients.__all__
    )
    assert not {n for n in gradients.__all__ if "Strategy" in n or "strategy" in n}
    clipper = gradients.make_clipper(
        "auto", model=keras.Sequential([keras.Input((3,)), L.Dense(2)])
    )
    assert isinstance(clipper, gradients.GhostClipper)
