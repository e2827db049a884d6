"""Which models DP training can take: layers that mix examples, activity regularizers, stateful
recurrent layers are refused, naming the layers.

Example::

    check_model_is_dp_compatible(model)  # ValueError: 3 layers mix the examples ...
"""

from __future__ import annotations

import keras

from tf_dp import _compat


#: Layers that mix examples of a batch: per-example gradients are not defined for them.
_MIXING_LAYERS = (keras.layers.BatchNormalization,)

#: How many offending layers a refusal names (then: "and N more").
_NAMED_LAYERS = 5


def _names(layers: list[keras.layers.Layer]) -> str:
    shown = ", ".join(repr(layer.name) for layer in layers[:_NAMED_LAYERS])
    more = len(layers) - _NAMED_LAYERS
    return shown + (f" and {more} more" if more > 0 else "")


def _all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    layers = _compat.flatten_layers(model, include_self=False)
    if layers is not None:
        return layers
    out, stack = [], list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        out.append(layer)
        stack.extend(getattr(layer, "layers", []))
    return out


def incompatible_layers(model: keras.Model) -> dict[str, list[keras.layers.Layer]]:
    """Every layer that ``check_model_is_dp_compatible`` refuses, by kind (``"mixes_examples"``,
    ``"activity_regularizer"``, ``"stateful"``); ``tf_dp.keras.validate_for_dp`` reports them."""
    layers = _all_layers(model)
    return {
        "mixes_examples": [layer for layer in layers if isinstance(layer, _MIXING_LAYERS)],
        "activity_regularizer": [
            layer for layer in layers if getattr(layer, "activity_regularizer", None)
        ],
        "stateful": [layer for layer in layers if getattr(layer, "stateful", False) is True],
    }


def check_model_is_dp_compatible(model: keras.Model) -> None:
    """Raises ValueError naming the layers that DP training cannot support.

    Refused: layers that mix the examples of a batch (``BatchNormalization``), activity
    regularizers (a loss on activations bypasses clipping) and stateful recurrent layers (a
    record's output depends on the records of the previous batch). Each kind names its layers
    (the first five, then how many more). Other layers that mix examples are found at ``fit`` by
    the probe of ``tf_dp/keras/batch_mixing.py``.

    Example::

        check_model_is_dp_compatible(model)  # ValueError: 3 layers mix the examples ...
    """
    found = incompatible_layers(model)
    mixing = found["mixes_examples"]
    if mixing:
        kinds = sorted({type(layer).__name__ for layer in mixing})
        raise ValueError(
            f"{len(mixing)} layer(s) mix the examples of a batch ({', '.join(kinds)}): "
            f"{_names(mixing)}; per-example gradients (and DP-SGD's guarantee) are undefined "
            "with them: use keras.layers.GroupNormalization or keras.layers.LayerNormalization "
            "instead (tf_dp.keras.fix_for_dp(model) swaps in GroupNormalization)"
        )
    regularized = found["activity_regularizer"]
    if regularized:
        raise ValueError(
            f"{len(regularized)} layer(s) have an activity_regularizer, a loss term that depends "
            f"on the batch and would bypass clipping: {_names(regularized)}; remove it for DP "
            "training"
        )
    stateful = found["stateful"]
    if stateful:
        raise ValueError(
            f"{len(stateful)} stateful recurrent layer(s): {_names(stateful)}; a stateful layer "
            "carries its state from one batch to the next, so a record's output and gradient "
            "depend on other records and per-example clipping does not bound its influence: "
            "use stateful=False for DP training"
        )
