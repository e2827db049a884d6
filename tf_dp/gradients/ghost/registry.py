"""The per-layer norm-rule registry: an object mapping layer classes to their ghost norm rules.

This module holds no rule: each layer family has its own module (``dense.py``, ``conv.py``,
``embeddings.py``, ``normalization.py``, ``recurrent.py``) whose rule functions carry the
:func:`norm_rule` decorator, and :mod:`tf_dp.gradients.ghost.rules` builds the default registry
from those modules. Decorating marks a function; it registers nothing by itself, so importing a
family module has no side effect and no module imports the registry's users.

A *norm rule* has the signature ``rule(layer, inputs, grad_output) -> [(variable, factor), ...]``
(see :mod:`tf_dp.gradients.ghost.rules` for the contract).

Example:

>>> import keras
>>> from tf_dp.gradients.ghost.registry import LayerRuleRegistry, norm_rule
>>> @norm_rule(keras.layers.Dense)
... def my_dense_rule(layer, inputs, grad_output):
...     return []
>>> registry = LayerRuleRegistry()
>>> registry.add_rules([my_dense_rule])
>>> registry.find(keras.layers.Dense(2))[0].rule is my_dense_rule
True
>>> registry.find(keras.layers.Conv1D(2, 3))[1]
'no norm rule registered for Conv1D'
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

import keras

NormRule = Callable[[Any, Any, Any], Sequence[tuple[Any, Any]]]

#: the attribute :func:`norm_rule` sets on a rule function: a tuple of (layer_class, options)
RULE_MARK = "ghost_norm_rule_for"


@dataclasses.dataclass(frozen=True)
class RuleEntry:
    """One layer class's rule and its options (see :meth:`LayerRuleRegistry.register`)."""

    layer_class: type
    rule: NormRule
    supports: Optional[Callable[[Any], Optional[str]]] = None
    split_activation: bool = False
    #: optional ``forward(layer, call, args, kwargs, watch) -> (outputs, context)``: runs the
    #: layer's forward pass in place of ``call`` during the recorded pass, passing every tensor
    #: whose gradient the rule needs through ``watch`` (which returns it) right after creating it;
    #: the rule then receives ``context`` as ``inputs`` and the list of those tensors' gradients
    #: as ``grad_output`` (in ``watch`` order). Used by the recurrent rules.
    forward: Optional[Callable[..., Any]] = None
    #: optional ``variables(layer) -> [variable]``: the variables the rule covers when they are
    #: owned by sublayers (an LSTM's cell owns its kernels); default: the layer's own variables.
    variables: Optional[Callable[[Any], list]] = None


def norm_rule(
    *layer_classes: Optional[type],
    supports: Optional[Callable[[Any], Optional[str]]] = None,
    split_activation: bool = False,
    forward: Optional[Callable[..., Any]] = None,
    variables: Optional[Callable[[Any], list]] = None,
) -> Callable[[NormRule], NormRule]:
    """Decorator marking a function as the norm rule of ``layer_classes`` (``None`` entries, e.g.
    a layer class this Keras version lacks, are skipped). The options are those of
    :meth:`LayerRuleRegistry.register`; :meth:`LayerRuleRegistry.add_rules` registers the marked
    function. A function may be decorated several times (different options per class).

    Example:

    >>> import keras
    >>> @norm_rule(keras.layers.Conv1D, keras.layers.Conv2D, split_activation=True)
    ... def conv_like_rule(layer, inputs, grad_output):
    ...     return []
    >>> [c.__name__ for c, _ in conv_like_rule.ghost_norm_rule_for]
    ['Conv1D', 'Conv2D']
    """
    options = dict(
        supports=supports, split_activation=split_activation, forward=forward, variables=variables
    )

    def mark(rule: NormRule) -> NormRule:
        if not callable(rule):
            raise TypeError(f"norm_rule decorates callables, got {rule!r}")
        marks = tuple((c, options) for c in layer_classes if c is not None)
        setattr(rule, RULE_MARK, getattr(rule, RULE_MARK, ()) + marks)
        return rule

    return mark


class LayerRuleRegistry:
    """Layer classes -> :class:`RuleEntry`; a rule applies to subclasses that keep ``call``.

    ``lazy`` maps a module-name prefix (e.g. ``"keras_hub"``) to ``loader(registry)``, called
    once, the first time a layer class from such a module is looked up (so that building the
    registry never imports that package).

    Example:

    >>> import keras
    >>> registry = LayerRuleRegistry()
    >>> registry.register(keras.layers.Dense, lambda layer, inputs, g: [])
    >>> [c.__name__ for c in registry.layer_classes()]
    ['Dense']
    """

    def __init__(self, lazy: Optional[dict[str, Callable[["LayerRuleRegistry"], None]]] = None):
        self._entries: dict[type, RuleEntry] = {}
        self._containers: set = set()
        self._lazy = dict(lazy or {})

    def _load_lazy(self, cls: type) -> None:
        for prefix in [p for p in self._lazy if cls.__module__.startswith(p)]:
            self._lazy.pop(prefix)(self)

    def register_container(self, layer_class: type) -> None:
        """Declares that ``layer_class`` only *calls* its sublayers (never reads their variables
        directly, e.g. keras-hub's ``TokenAndPositionEmbedding``). A sublayer that it and the
        model both track (``backbone.token_embedding``) is then planned by the sublayer's own
        rule, not as a possibly tied weight of the whole model. Applies to subclasses that keep
        ``call``.

        Example:

        >>> import keras
        >>> registry = LayerRuleRegistry()
        >>> registry.register_container(keras.layers.Wrapper)
        >>> registry.is_container(keras.layers.Wrapper(keras.layers.Dense(2)))
        True
        """
        if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
            raise TypeError(
                f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}"
            )
        self._containers.add(layer_class)

    def is_container(self, layer: Any) -> bool:
        """True when ``layer``'s class (or a base whose ``call`` it keeps) was declared with
        :meth:`register_container`."""
        cls = type(layer)
        self._load_lazy(cls)
        for base in cls.__mro__:
            if base in self._containers:
                return getattr(cls, "call", None) is getattr(base, "call", None)
        return False

    def register(
        self,
        layer_class: type,
        rule: NormRule,
        *,
        supports: Optional[Callable[[Any], Optional[str]]] = None,
        split_activation: bool = False,
        forward: Optional[Callable[..., Any]] = None,
        variables: Optional[Callable[[Any], list]] = None,
    ) -> None:
        """Registers ``rule`` for ``layer_class`` (replacing any rule it had).

        Args:
          layer_class: a ``keras.layers.Layer`` subclass. The rule also applies to its subclasses
            that do not override ``call``.
          rule: ``rule(layer, inputs, grad_output) -> [(variable, factor), ...]``.
          supports: optional ``supports(layer) -> None | reason``; a layer it refuses (e.g. a
            configuration the rule does not handle) falls back to vectorized per-example
            gradients.
          split_activation: the layer has an ``activation`` attribute applied last in ``call``;
            the ghost clipper runs ``call`` with ``activation=None`` and applies the activation
            itself, so ``grad_output`` is the gradient before the activation.
          forward: optional replacement forward pass for the recorded pass (see ``RuleEntry``);
            the rule is then called with the context it returns and the gradients of what it
            watched.
          variables: optional ``variables(layer)`` listing the variables the rule covers, for
            layers whose variables are owned by sublayers (recurrent layers and their cells).
        """
        if not (isinstance(layer_class, type) and issubclass(layer_class, keras.layers.Layer)):
            raise TypeError(
                f"layer_class must be a keras.layers.Layer subclass, got {layer_class!r}"
            )
        if not callable(rule):
            raise TypeError(f"rule must be callable, got {rule!r}")
        self._entries[layer_class] = RuleEntry(
            layer_class, rule, supports, bool(split_activation), forward, variables
        )

    def add_rules(self, rules: Iterable[Any]) -> None:
        """Registers every function in ``rules`` marked by :func:`norm_rule`, for each class it
        was marked with (unmarked items are skipped, so a module's namespace can be passed)."""
        for rule in rules:
            for layer_class, options in getattr(rule, RULE_MARK, ()):
                self.register(layer_class, rule, **options)

    def unregister(self, layer_class: type) -> None:
        """Removes ``layer_class``'s rule (no error when it has none)."""
        self._entries.pop(layer_class, None)

    def layer_classes(self) -> tuple[type, ...]:
        """The registered layer classes, in registration order."""
        return tuple(self._entries)

    def find(self, layer: Any) -> tuple[Optional[RuleEntry], Optional[str]]:
        """The rule entry for ``layer`` (or None, with the reason)."""
        cls = type(layer)
        self._load_lazy(cls)
        for base in cls.__mro__:
            entry = self._entries.get(base)
            if entry is None:
                continue
            if base is not cls and getattr(cls, "call", None) is not getattr(base, "call", None):
                return None, f"{cls.__name__} overrides call() of {base.__name__}"
            if entry.supports is not None:
                reason = entry.supports(layer)
                if reason is not None:
                    return None, reason
            return entry, None
        return None, f"no norm rule registered for {cls.__name__}"
