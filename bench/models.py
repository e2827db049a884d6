"""The project's reference models: every benchmark and research script times these three, so
figures are comparable across them and with other libraries (``docs/architecture.md``, "How speed
is measured").

- ``cnn``: the CNN of Bu et al. 2019 -- Conv 16x8x8 stride 2 same, max-pool 2 stride 1,
  Conv 32x4x4 stride 2 valid, max-pool 2 stride 1, Dense 32, Dense 10; 28x28x1 input.
- ``mlp``: 784-512-512-10.
- ``lstm``: Embedding 8000x64 on sequences of 150 tokens, bidirectional LSTM 64, Dense 64,
  Dense 2.

Each entry builds a fresh (unbuilt-weight-identical for a given seed) ``keras.Sequential`` and a
synthetic batch of the right shapes. Losses are logits + sparse categorical cross-entropy.

Example::

    from bench.models import build_model, make_batch
    model = build_model("cnn", seed=0)
    x, y = make_batch("cnn", batch_size=256, seed=0)
"""

from __future__ import annotations

import keras
import numpy as np

MODELS = ("cnn", "mlp", "lstm")
DEFAULT_BATCH = {"cnn": 256, "mlp": 256, "lstm": 64}
LSTM_VOCAB = 8000
LSTM_SEQ = 150


def build_model(name: str, seed: int = 0) -> keras.Sequential:
    """A fresh reference model (weights fixed by ``seed``)."""
    keras.utils.set_random_seed(seed)
    layers = keras.layers
    if name == "cnn":
        return keras.Sequential(
            [
                keras.Input((28, 28, 1)),
                layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
                layers.MaxPooling2D(2, 1),
                layers.Conv2D(32, 4, strides=2, padding="valid", activation="relu"),
                layers.MaxPooling2D(2, 1),
                layers.Flatten(),
                layers.Dense(32, activation="relu"),
                layers.Dense(10),
            ],
            name="bu2019_cnn",
        )
    if name == "mlp":
        return keras.Sequential(
            [
                keras.Input((784,)),
                layers.Dense(512, activation="relu"),
                layers.Dense(512, activation="relu"),
                layers.Dense(10),
            ],
            name="mlp_784_512_512_10",
        )
    if name == "lstm":
        return keras.Sequential(
            [
                keras.Input((LSTM_SEQ,), dtype="int32"),
                layers.Embedding(LSTM_VOCAB, 64),
                layers.Bidirectional(layers.LSTM(64)),
                layers.Dense(64, activation="relu"),
                layers.Dense(2),
            ],
            name="bilstm",
        )
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def make_batch(name: str, batch_size: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic batch ``(x, y)`` for the reference model ``name``."""
    rng = np.random.default_rng(seed)
    if name == "cnn":
        x = rng.random((batch_size, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, batch_size)
    elif name == "mlp":
        x = rng.random((batch_size, 784), dtype=np.float32)
        y = rng.integers(0, 10, batch_size)
    elif name == "lstm":
        x = rng.integers(0, LSTM_VOCAB, (batch_size, LSTM_SEQ)).astype(np.int32)
        y = rng.integers(0, 2, batch_size)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return x, y.astype(np.int32)
