"""The default norm-rule registry: the built-in rules of every layer-family module.

A *norm rule* tells the ghost clipper how the per-example gradient of each of a layer's variables
factors into things the forward and backward passes already computed. Signature::

    def rule(layer, inputs, grad_output) -> Sequence[tuple[variable, factor]]

- ``layer``: the layer instance (a ``keras.layers.Layer``);
- ``inputs``: the first positional argument its ``call`` received in this call (as received:
  the ghost clipper records every call, so a layer used twice is seen twice);
- ``grad_output``: the gradient of the batch's summed per-example losses with respect to the
  output of ``call`` -- taken *before* the layer's ``activation`` when the rule was registered with
  ``split_activation=True`` (Dense, EinsumDense, Conv). Row ``b`` is example ``b``'s gradient;
  sample weights and masks are already in it.
- returns, for each of the layer's variables that the rule covers, a factor from
  :mod:`tf_dp.gradients.ghost.factors`: ``Outer(a, g)`` (gradient ``sum_t a_t g_t^T``),
  ``Rows(ids, g, num_rows)`` (embedding tables) or ``PerExample(grads)`` (materialised, for small
  variables). The clipper derives the per-example norms, the cross terms between several calls,
  and the clipped sum from these factors. A rule must return a factor for every trainable
  variable of its layer: the clipper raises a ``ValueError`` naming the variables a rule left
  out. (A layer whose class has no rule, or whose ``supports`` refuses it, is not an error: all its
  variables get per-example gradients from the vectorized fallback.)

Each layer family's rules live in a module named after it, marked with
:func:`~tf_dp.gradients.ghost.registry.norm_rule`: ``dense.py`` (``Dense``, ``EinsumDense``, with
``lora.py`` for LoRA; ``MultiHeadAttention`` owns no variables itself: its four projections are
``EinsumDense`` layers), ``conv.py`` (``Conv1D/2D/3D``, ``DepthwiseConv1D/2D``,
``SeparableConv1D/2D``, ``Conv1DTranspose/2DTranspose/3DTranspose``), ``activations.py``
(``PReLU``), ``embeddings.py`` (``Embedding``, ``ReversibleEmbedding``), ``normalization.py``
(``LayerNormalization``, ``GroupNormalization``, ``RMSNormalization``), ``recurrent.py``
(``LSTM``, ``GRU``, ``SimpleRNN``, which use the optional ``forward`` and ``variables`` hooks),
and ``keras_hub_rules.py`` (loaded the first time a keras-hub layer is met).
:func:`default_registry` collects them into one
:class:`~tf_dp.gradients.ghost.registry.LayerRuleRegistry`; :func:`register_layer_norm_rule` adds
a user's rule to it.

Example (a layer computing ``x * scale`` elementwise, ``scale`` of shape ``[d]``)::

    from tf_dp.gradients.ghost import PerExample, register_layer_norm_rule

    def scale_rule(layer, inputs, grad_output):
        per_example = tf.reduce_sum(tf.reshape(inputs * grad_output, [tf.shape(inputs)[0], -1,
                                                                      layer.scale.shape[0]]), 1)
        return [(layer.scale, PerExample(per_example))]

    register_layer_norm_rule(MyScale, scale_rule)
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from tf_dp.gradients.ghost import activations, conv, dense, embeddings, normalization, recurrent
from tf_dp.gradients.ghost.registry import LayerRuleRegistry, NormRule, RuleEntry

__all__ = [
    "NormRule",
    "RuleEntry",
    "default_registry",
    "find_rule",
    "register_layer_norm_rule",
    "registered_layer_classes",
    "unregister_layer_norm_rule",
]

FAMILIES = (dense, conv, embeddings, normalization, recurrent, activations)


def _load_keras_hub_rules(registry: LayerRuleRegistry) -> None:
    from tf_dp.gradients.ghost import keras_hub_rules

    keras_hub_rules.register(registry)


def new_registry() -> LayerRuleRegistry:
    """A fresh registry holding the built-in rules of every layer family (keras-hub's on first
    use)."""
    registry = LayerRuleRegistry(lazy={"keras_hub": _load_keras_hub_rules})
    for module in FAMILIES:
        registry.add_rules(vars(module).values())
    return registry


_DEFAULT: list[LayerRuleRegistry] = []


def default_registry() -> LayerRuleRegistry:
    """The registry the ghost clipper uses (built on first call from the family modules)."""
    if not _DEFAULT:
        _DEFAULT.append(new_registry())
    return _DEFAULT[0]


def register_layer_norm_rule(
    layer_class: type,
    rule: NormRule,
    *,
    supports: Optional[Callable[[Any], Optional[str]]] = None,
    split_activation: bool = False,
    forward: Optional[Callable[..., Any]] = None,
    variables: Optional[Callable[[Any], list]] = None,
) -> None:
    """Registers ``rule`` (see the module docstring) for ``layer_class`` in the default registry;
    the arguments are those of :meth:`LayerRuleRegistry.register`."""
    default_registry().register(
        layer_class,
        rule,
        supports=supports,
        split_activation=split_activation,
        forward=forward,
        variables=variables,
    )


def unregister_layer_norm_rule(layer_class: type) -> None:
    """Removes ``layer_class``'s rule from the default registry."""
    default_registry().unregister(layer_class)


def registered_layer_classes() -> tuple[type, ...]:
    """The layer classes the default registry has a rule for."""
    return default_registry().layer_classes()


def is_container(layer: Any) -> bool:
    """True when the default registry knows ``layer`` only calls its sublayers
    (:meth:`LayerRuleRegistry.register_container`)."""
    return default_registry().is_container(layer)


def find_rule(layer: Any) -> tuple[Optional[RuleEntry], Optional[str]]:
    """The default registry's rule entry for ``layer`` (or None, with the reason)."""
    return default_registry().find(layer)
