"""Which layers with trainable weights have no ghost norm rule (and so fall back to per-example
gradients): every ``keras.layers`` class that builds in a minimal model, and every layer class
inside keras-hub backbones built from tiny configs.

Usage: python research/ghost/rule_coverage.py
"""

from __future__ import annotations

import collections
import inspect

import keras

from tf_dp.gradients.ghost.rules import find_rule, is_container

# minimal constructions: layer -> (args, kwargs, input shape without batch)
KERAS = {
    "Dense": ((4,), {}, (5,)),
    "EinsumDense": (("ab,bc->ac",), {"output_shape": 4}, (5,)),
    "Embedding": ((10, 4), {}, (3,)),
    "Conv1D": ((4, 3), {}, (8, 3)),
    "Conv2D": ((4, 3), {}, (8, 8, 3)),
    "Conv3D": ((4, 3), {}, (6, 6, 6, 3)),
    "Conv1DTranspose": ((4, 3), {}, (8, 3)),
    "Conv2DTranspose": ((4, 3), {}, (8, 8, 3)),
    "Conv3DTranspose": ((4, 3), {}, (6, 6, 6, 3)),
    "DepthwiseConv1D": ((3,), {}, (8, 3)),
    "DepthwiseConv2D": ((3,), {}, (8, 8, 3)),
    "SeparableConv1D": ((4, 3), {}, (8, 3)),
    "SeparableConv2D": ((4, 3), {}, (8, 8, 3)),
    "LayerNormalization": ((), {}, (5,)),
    "BatchNormalization": ((), {}, (5,)),
    "GroupNormalization": ((), {"groups": 1}, (5,)),
    "RMSNormalization": ((), {}, (5,)),
    "UnitNormalization": ((), {}, (5,)),
    "PReLU": ((), {}, (5,)),
    "MultiHeadAttention": ((2, 4), {}, None),
    "GroupedQueryAttention": ((4, 2, 1), {}, None),
    "LSTM": ((4,), {}, (3, 5)),
    "GRU": ((4,), {}, (3, 5)),
    "SimpleRNN": ((4,), {}, (3, 5)),
    "ConvLSTM1D": ((4, 3), {}, (3, 8, 2)),
    "ConvLSTM2D": ((4, 3), {}, (3, 8, 8, 2)),
    "Bidirectional": None,
    "ReversibleEmbedding": ((10, 4), {}, (3,)),
}


def status(layer):
    if is_container(layer):
        return "container"
    entry, reason = find_rule(layer)
    return "rule" if entry is not None else f"FALLBACK ({reason})"


def keras_layers():
    out = {}
    for name, spec in KERAS.items():
        cls = getattr(keras.layers, name, None)
        if cls is None or spec is None:
            continue
        args, kwargs, shape = spec
        layer = cls(*args, **kwargs)
        out[name] = status(layer)
    return out


def keras_hub_layers():
    import keras_hub

    seen = collections.defaultdict(set)
    for name, cls in sorted(vars(keras_hub.models).items()):
        if (
            not (inspect.isclass(cls) and name.endswith("Backbone"))
            or name == "Backbone"
        ):
            continue
        try:
            backbone = _tiny(cls)
        except Exception as e:  # noqa: BLE001 - a survey: record and go on
            seen["<unbuilt>"].add(f"{name}: {type(e).__name__}")
            continue
        for layer in backbone._flatten_layers(include_self=False, recursive=True):
            if not layer._trainable_variables:
                continue
            seen[
                f"{type(layer).__module__}.{type(layer).__name__} = {status(layer)}"
            ].add(name)
    return seen


TINY = dict(
    vocabulary_size=50,
    num_layers=1,
    num_heads=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=8,
    intermediate_dim=16,
    max_sequence_length=16,
    head_dim=4,
)


def _tiny(cls):
    params = inspect.signature(cls.__init__).parameters
    kwargs = {k: v for k, v in TINY.items() if k in params}
    missing = [
        k
        for k, p in params.items()
        if k not in ("self", "kwargs", "dtype")
        and p.default is inspect._empty
        and k not in kwargs
    ]
    if missing:
        raise TypeError(f"needs {missing}")
    return cls(**kwargs)


if __name__ == "__main__":
    for name, s in keras_layers().items():
        print(f"keras.layers.{name}: {s}")
    for key, models in sorted(keras_hub_layers().items()):
        print(f"{key}: {sorted(models)}")
