"""Find what stops a Keras model from training privately, and replace BatchNormalization.

- :func:`validate_for_dp` lists every offending layer (the checks of
  ``check_model_is_dp_compatible``: layers that mix the examples of a batch, activity
  regularizers, stateful recurrent layers), with what :func:`fix_for_dp` does about each.
- :func:`fix_for_dp` returns a copy of a Sequential or functional model (``keras.applications``
  backbones included, nested models too) in which every ``BatchNormalization`` is a plain
  ``keras.layers.GroupNormalization``, so the ghost strategy's GroupNormalization rule covers it.

What is kept and what is not:

- Every other layer is rebuilt from its config and gets the original's weights (trainable and
  not: a ``Normalization`` layer's mean and variance too); frozen layers stay frozen.
- A BatchNormalization's ``gamma`` and ``beta`` are copied into the GroupNormalization's (with
  ``copy_affine=True``, the default); its moving mean and variance are dropped: GroupNormalization
  normalises each example by its own statistics over groups of channels, so batch statistics have
  no counterpart. A pretrained backbone's activations therefore change; fine-tune it (the BN
  layers' replacements are trainable unless the BatchNormalization was frozen).
- GroupNormalization takes no ``mask``: where a BatchNormalization used a mask to leave padded
  positions out of its statistics, the replacement includes them.
- ``epsilon``, ``center``, ``scale``, the regularizers and constraints of gamma and beta, the
  channel axis, the dtype policy and the layer name are kept; ``momentum`` has no counterpart.
- Activity regularizers and stateful layers are reported, not changed (removing them changes
  what the model computes: do it in the model's code).

Example::

    base = keras.applications.ResNet50(weights=None, input_shape=(32, 32, 3), classes=10)
    print(tf_dp.keras.validate_for_dp(base))      # 53 BatchNormalization layers mix examples
    model, report = tf_dp.keras.fix_for_dp(base, groups=32)
    model = tf_dp.keras.make_private(model)       # accepted; "auto" runs the GroupNorm rule
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import keras

from tf_dp import _compat
from tf_dp.keras.compatibility import incompatible_layers

#: What each kind of offence is, for the report.
Functional = _compat.functional_class()

_PROBLEMS = {
    "mixes_examples": "mixes the examples of a batch (per-example gradients undefined)",
    "activity_regularizer": "has an activity_regularizer (a batch-dependent loss term)",
    "stateful": "is stateful (a record's output depends on earlier batches)",
}

_NOT_FIXED = {
    "activity_regularizer": "not changed: remove the activity_regularizer",
    "stateful": "not changed: use stateful=False",
}

GroupsArg = int | Callable[[int], int]


@dataclasses.dataclass(frozen=True)
class LayerIssue:
    """One offending layer: its name, class, what is wrong and what ``fix_for_dp`` does."""

    layer: str
    layer_class: str
    problem: str
    fix: str


@dataclasses.dataclass(frozen=True)
class DPCompatibilityReport:
    """What stops a model from training privately (``issues``) and what a fix did not transfer.

    ``ok`` is True when no issue is left after the fix (or none was found); ``str(report)`` is a
    table with one line per offending layer.
    """

    issues: tuple[LayerIssue, ...]
    not_transferred: tuple[str, ...] = ()
    fixed: bool = False

    @property
    def ok(self) -> bool:
        if not self.fixed:
            return not self.issues
        return all(issue.fix.startswith("replaced") for issue in self.issues)

    def __str__(self) -> str:
        if not self.issues:
            return "no layer stops DP training"
        verb = "fixed" if self.fixed else "fix"
        lines = [f"{len(self.issues)} offending layer(s):"]
        lines += [f"  {i.layer} ({i.layer_class}) {i.problem}; {verb}: {i.fix}" for i in self.issues]
        lines += [f"not transferred: {t}" for t in self.not_transferred]
        return "\n".join(lines)


def _channels(layer: keras.layers.BatchNormalization) -> int:
    return int(layer.gamma.shape[0] if layer.gamma is not None else layer.moving_mean.shape[0])


def _groups_for(layer: keras.layers.BatchNormalization, groups: GroupsArg) -> int:
    channels = _channels(layer)
    n = math.gcd(groups, channels) if isinstance(groups, int) else int(groups(channels))
    if n < 1 or channels % n:
        raise ValueError(
            f"groups gave {n} groups for layer {layer.name!r} with {channels} channels; "
            "the number of groups must be a positive divisor of the channel count"
        )
    return n


def _axis(layer: keras.layers.BatchNormalization) -> int:
    axis = layer.axis
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise ValueError(
                f"layer {layer.name!r} normalises over axes {list(axis)}; GroupNormalization "
                "takes one channel axis, so fix_for_dp cannot replace it"
            )
        axis = axis[0]
    return int(axis)


def _group_norm_for(layer: keras.layers.BatchNormalization, groups: GroupsArg):
    return keras.layers.GroupNormalization(
        groups=_groups_for(layer, groups),
        axis=_axis(layer),
        epsilon=layer.epsilon,
        center=layer.center,
        scale=layer.scale,
        beta_regularizer=layer.beta_regularizer,
        gamma_regularizer=layer.gamma_regularizer,
        beta_constraint=layer.beta_constraint,
        gamma_constraint=layer.gamma_constraint,
        trainable=layer.trainable,
        dtype=layer.dtype_policy,
        name=layer.name,
    )


def _fix_text(layer: keras.layers.Layer, kind: str, groups: GroupsArg) -> str:
    if kind != "mixes_examples":
        return _NOT_FIXED[kind]
    if isinstance(layer, keras.layers.BatchNormalization):
        return f"replaced by GroupNormalization(groups={_groups_for(layer, groups)})"
    return "not changed: no replacement known"


def _report(model: keras.Model, groups: GroupsArg, fixed: bool, not_transferred=()):
    issues = []
    for kind, layers in incompatible_layers(model).items():
        for layer in layers:
            fix = _fix_text(layer, kind, groups)
            issues.append(LayerIssue(layer.name, type(layer).__name__, _PROBLEMS[kind], fix))
    return DPCompatibilityReport(tuple(issues), tuple(not_transferred), fixed)


def _check_groups(groups: GroupsArg) -> None:
    if isinstance(groups, bool) or not (
        (isinstance(groups, int) and groups >= 1) or callable(groups)
    ):
        raise ValueError(
            "groups must be an int >= 1 (each layer uses gcd(groups, channels) groups) or a "
            f"callable channels -> groups, got {groups!r}"
        )


def validate_for_dp(model: keras.Model, groups: GroupsArg = 32) -> DPCompatibilityReport:
    """Every layer that stops ``model`` from training privately, and what ``fix_for_dp`` would do.

    Args:
      model: any Keras model.
      groups: as in :func:`fix_for_dp` (used to describe the replacements).

    Returns:
      A :class:`DPCompatibilityReport`; ``report.ok`` is True when nothing is in the way.

    Example::

        report = tf_dp.keras.validate_for_dp(keras.applications.MobileNetV3Small(weights=None))
        print(report)            # one line per BatchNormalization layer
    """
    if not isinstance(model, keras.layers.Layer):  # a keras.Model is a Layer
        raise TypeError(f"model must be a Keras model (keras.Model), got {type(model).__name__}")
    _check_groups(groups)
    return _report(model, groups, fixed=False)


def _call(layer, *args, **kwargs):
    if isinstance(layer, keras.layers.GroupNormalization):
        kwargs.pop("mask", None)  # BatchNormalization.call takes these, GroupNormalization not
        kwargs.pop("training", None)
    return layer(*args, **kwargs)


def _rebuild(model: keras.Model, groups: GroupsArg, pairs: list) -> keras.Model:
    """``clone_model`` with BN -> GN, nested Sequential/functional models rebuilt the same way,
    the inputs' names kept (models with named or dict inputs are fed by name)."""

    def clone(layer):
        if isinstance(layer, (keras.Sequential, Functional)):
            return _rebuild(layer, groups, pairs)
        if isinstance(layer, keras.layers.BatchNormalization):
            new = _group_norm_for(layer, groups)
        else:
            new = layer.__class__.from_config(layer.get_config())
        pairs.append((layer, new))
        return new

    if isinstance(model, keras.Sequential):  # Sequential calls GroupNormalization without mask
        return keras.models.clone_model(model, clone_function=clone)
    names = {id(la.output): la.name for la in model.layers if isinstance(la, keras.layers.InputLayer)}
    inputs = keras.tree.map_structure(
        lambda t: keras.Input(
            batch_shape=t.shape, dtype=t.dtype, sparse=t.sparse, name=names.get(id(t))
        ),
        model.input,
    )
    return keras.models.clone_model(
        model, input_tensors=inputs, clone_function=clone, call_function=_call
    )


def fix_for_dp(
    model: keras.Model, groups: GroupsArg = 32, copy_affine: bool = True
) -> tuple[keras.Model, DPCompatibilityReport]:
    """A copy of ``model`` with every BatchNormalization replaced by GroupNormalization.

    Args:
      model: a Sequential or functional model (nested models are handled; subclassed models
        cannot be rebuilt from their graph: replace their layers in their code).
      groups: an int ``g >= 1`` (each layer gets ``gcd(g, channels)`` groups, so 32 gives 32 groups
        to 64 channels and 8 to 24), or a callable ``channels -> groups`` returning a divisor.
      copy_affine: copy each BatchNormalization's ``gamma``/``beta`` into its replacement (else
        GroupNormalization's initial 1 and 0).

    Returns:
      ``(new_model, report)``: the new (uncompiled) model, whose other layers carry the
      original's weights, and the report of what was found, replaced and not transferred. The
      original model is not changed.

    Example::

        model, report = tf_dp.keras.fix_for_dp(
            keras.applications.EfficientNetB0(weights=None, input_shape=(32, 32, 3)), groups=8)
        print(report)
        model = tf_dp.keras.make_private(model)
    """
    _check_groups(groups)
    if not isinstance(copy_affine, bool):
        raise TypeError(f"copy_affine must be True or False, got {copy_affine!r}")
    if not isinstance(model, (keras.Sequential, Functional)):
        raise TypeError(
            f"model must be a Sequential or functional model to be rebuilt, got a subclassed "
            f"{type(model).__name__}: replace its BatchNormalization layers in its code"
        )
    pairs: list = []  # (original layer, its replacement)
    new_model = _rebuild(model, groups, pairs)
    for old, new in pairs:
        if isinstance(old, keras.layers.BatchNormalization):
            if copy_affine:
                for name in ("gamma", "beta"):
                    if getattr(old, name) is not None:
                        getattr(new, name).assign(getattr(old, name))
        elif getattr(old, "weights", None):  # a keras.ops operation in the graph has none
            new.set_weights(old.get_weights())
    not_transferred = []
    if any(isinstance(old, keras.layers.BatchNormalization) for old, _ in pairs):
        not_transferred.append(
            "BatchNormalization moving_mean/moving_variance (GroupNormalization uses each "
            "example's own statistics) and momentum"
            + ("" if copy_affine else "; gamma/beta (copy_affine=False)")
        )
    return new_model, _report(model, groups, fixed=True, not_transferred=not_transferred)
