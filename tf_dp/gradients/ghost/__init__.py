"""``gradient_mode="ghost"``: exact per-example clipping without per-example gradients.

Per-example gradient norms come from each layer's inputs and output gradients through a registry
of per-layer *norm rules* (Goodfellow 2015 for dense layers; Gram-matrix ghost norms for
sequences, Li et al. 2021; unfolded patches for convolutions; sparse rows for embeddings); the
clipped sum comes from the same quantities (book-keeping, Bu et al. 2022). Layers without a rule
fall back to vectorized per-example gradients of their own variables in the same step ("mixed").

Public API:

- :class:`GhostClipper` (registered as ``gradient_mode="ghost"``; ``gradient_mode="auto"`` uses it
  whenever at least one layer has a rule);
- :func:`register_layer_norm_rule` ``(layer_class, rule, *, supports=None, split_activation=False)``
  with ``rule(layer, inputs, grad_output) -> [(variable, factor), ...]``, adding a rule to the
  :func:`default_registry` (a :class:`LayerRuleRegistry`);
- the built-in rules, one module per layer family (``dense.py``, ``conv.py``, ``embeddings.py``,
  ``normalization.py``, ``recurrent.py``, ``lora.py``), each rule marked by :func:`norm_rule`;
- the factors :class:`Outer`, :class:`Rows`, :class:`PerExample`.

See ``docs/ghost.md``.
"""

from tf_dp.gradients.ghost.factors import Outer, PerExample, Rows
from tf_dp.gradients.ghost.rules import (
    find_rule,
    register_layer_norm_rule,
    registered_layer_classes,
    unregister_layer_norm_rule,
)
from tf_dp.gradients.ghost.clipper import GhostClipper, make_plan
from tf_dp.gradients.ghost.registry import LayerRuleRegistry, RuleEntry, norm_rule
from tf_dp.gradients.ghost.rules import default_registry

__all__ = [
    "GhostClipper",
    "LayerRuleRegistry",
    "RuleEntry",
    "default_registry",
    "norm_rule",
    "Outer",
    "PerExample",
    "Rows",
    "find_rule",
    "make_plan",
    "register_layer_norm_rule",
    "registered_layer_classes",
    "unregister_layer_norm_rule",
]
