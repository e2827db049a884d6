"""The project's reference models: every benchmark and research script times these, so
figures are comparable across them and with other libraries (``docs/architecture.md``, "How speed
is measured").

- ``cnn``: the CNN of Bu et al. 2019 -- Conv 16x8x8 stride 2 same, max-pool 2 stride 1,
  Conv 32x4x4 stride 2 valid, max-pool 2 stride 1, Dense 32, Dense 10; 28x28x1 input.
- ``mlp``: 784-512-512-10.
- ``lstm``: Embedding 8000x64 on sequences of 150 tokens, bidirectional LSTM 64, Dense 64,
  Dense 2.
- ``transformer``: token + position embeddings (vocabulary 8000, width 128, sequences of 128),
  2 encoder blocks (MultiHeadAttention with 4 heads of 32, residual + LayerNormalization,
  feed-forward 256 relu -> 128, residual + LayerNormalization; post-norm as in Vaswani et al.
  2017, no dropout), mean pool over positions, Dense 2.

Fine-tuning models (``docs/finetuning.md``; random weights, built from configs: no download):

- ``bert``: keras-hub ``BertTextClassifier`` on a ``BertBackbone`` (vocabulary 8000, 2 layers,
  4 heads, width 128, feed-forward 512, sequences of 128, dropout 0.1), 2 classes; full
  fine-tuning (every variable trains).
- ``gpt2_lora``: keras-hub ``GPT2CausalLM`` on a ``GPT2Backbone`` (vocabulary 8000, 2 layers,
  4 heads, width 128, feed-forward 512, sequences of 128) with ``backbone.enable_lora(8)``:
  the LoRA factors of the query/value projections train (and the biases keras-hub leaves
  trainable); next-token targets ``[B, T]``.
- ``resnet_gn``: a ResNet-style CNN for 32x32x3 images (stem Conv 16, three stages of two basic
  residual blocks with 16/32/64 channels, stride 2 between stages, global average pool, Dense
  10) built with BatchNormalization and converted by ``tf_dp.keras.fix_for_dp`` (groups
  ``gcd(32, channels)``): every BatchNormalization becomes a GroupNormalization.

Each entry builds a fresh model (weight-identical for a given seed) and a synthetic batch of the
right shapes. Losses are logits + sparse categorical cross-entropy.

Example::

    from bench.models import build_model, make_batch
    model = build_model("cnn", seed=0)
    x, y = make_batch("cnn", batch_size=256, seed=0)
"""

from __future__ import annotations

import keras
import numpy as np

MODELS = ("cnn", "mlp", "lstm", "transformer", "bert", "gpt2_lora", "resnet_gn")
DEFAULT_BATCH = {
    "cnn": 256, "mlp": 256, "lstm": 64, "transformer": 64, "bert": 32, "gpt2_lora": 16,
    "resnet_gn": 64,
}
LSTM_VOCAB = 8000
LSTM_SEQ = 150
TRANSFORMER_VOCAB = 8000
TRANSFORMER_SEQ = 128
TRANSFORMER_DIM = 128


class TokenAndPositionEmbedding(keras.layers.Layer):
    """``token_embedding(ids) + position_embedding(0..T-1)``; both are ``Embedding`` layers (the
    positions are looked up with ids ``[B, T]`` so that each example's rows are its own)."""

    def __init__(self, vocab: int, seq_len: int, dim: int, **kwargs):
        super().__init__(**kwargs)
        self.vocab, self.seq_len, self.dim = vocab, seq_len, dim
        self.token = keras.layers.Embedding(vocab, dim)
        self.position = keras.layers.Embedding(seq_len, dim)

    def build(self, input_shape):
        self.token.build(input_shape)
        self.position.build(input_shape)

    def call(self, ids):
        steps = keras.ops.shape(ids)[-1]
        positions = keras.ops.broadcast_to(keras.ops.arange(steps), keras.ops.shape(ids))
        return self.token(ids) + self.position(positions)

    def compute_output_shape(self, input_shape):
        return tuple(input_shape) + (self.dim,)

    def get_config(self):
        return {**super().get_config(), "vocab": self.vocab, "seq_len": self.seq_len, "dim": self.dim}


class TransformerBlock(keras.layers.Layer):
    """Post-norm encoder block: ``x = LN(x + MHA(x, x)); x = LN(x + FFN(x))``."""

    def __init__(self, dim: int, heads: int, ffn: int, **kwargs):
        super().__init__(**kwargs)
        self.dim, self.heads, self.ffn = dim, heads, ffn
        self.attention = keras.layers.MultiHeadAttention(heads, dim // heads)
        self.norm1 = keras.layers.LayerNormalization(epsilon=1e-6)
        self.ffn_in = keras.layers.Dense(ffn, activation="relu")
        self.ffn_out = keras.layers.Dense(dim)
        self.norm2 = keras.layers.LayerNormalization(epsilon=1e-6)

    def build(self, input_shape):
        self.attention.build(input_shape, input_shape)
        self.norm1.build(input_shape)
        self.ffn_in.build(input_shape)
        self.ffn_out.build(tuple(input_shape[:-1]) + (self.ffn,))
        self.norm2.build(input_shape)

    def call(self, x):
        x = self.norm1(x + self.attention(x, x))
        return self.norm2(x + self.ffn_out(self.ffn_in(x)))

    def compute_output_shape(self, input_shape):
        return input_shape

    def get_config(self):
        return {**super().get_config(), "dim": self.dim, "heads": self.heads, "ffn": self.ffn}


HUB_VOCAB = 8000
HUB_SEQ = 128


def _hub_config() -> dict:
    return dict(
        vocabulary_size=HUB_VOCAB, num_layers=2, num_heads=4, hidden_dim=128,
        intermediate_dim=512, max_sequence_length=HUB_SEQ,
    )


def _resnet_with_batchnorm() -> keras.Model:
    layers = keras.layers

    def conv_bn(x, channels, stride=1, relu=True):
        x = layers.Conv2D(channels, 3, strides=stride, padding="same", use_bias=False)(x)
        x = layers.BatchNormalization()(x)
        return layers.ReLU()(x) if relu else x

    inp = keras.Input((32, 32, 3))
    x = conv_bn(inp, 16)
    for stage, channels in enumerate((16, 32, 64)):
        for block in range(2):
            stride = 2 if stage > 0 and block == 0 else 1
            shortcut = x
            if stride != 1 or x.shape[-1] != channels:
                shortcut = layers.Conv2D(channels, 1, strides=stride, use_bias=False)(x)
                shortcut = layers.BatchNormalization()(shortcut)
            y = conv_bn(conv_bn(x, channels, stride), channels, relu=False)
            x = layers.ReLU()(layers.Add()([shortcut, y]))
    x = layers.GlobalAveragePooling2D()(x)
    return keras.Model(inp, layers.Dense(10)(x), name="resnet_bn")


def build_model(name: str, seed: int = 0) -> keras.Model:
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
    if name == "transformer":
        return keras.Sequential(
            [
                keras.Input((TRANSFORMER_SEQ,), dtype="int32"),
                TokenAndPositionEmbedding(TRANSFORMER_VOCAB, TRANSFORMER_SEQ, TRANSFORMER_DIM),
                TransformerBlock(TRANSFORMER_DIM, 4, 256),
                TransformerBlock(TRANSFORMER_DIM, 4, 256),
                layers.GlobalAveragePooling1D(),
                layers.Dense(2),
            ],
            name="transformer",
        )
    if name in ("bert", "gpt2_lora"):
        import keras_hub

        M = keras_hub.models
        if name == "bert":
            backbone = M.BertBackbone(**_hub_config(), dropout=0.1)
            return M.BertTextClassifier(backbone, num_classes=2, preprocessor=None)
        model = M.GPT2CausalLM(M.GPT2Backbone(**_hub_config(), dropout=0.0), preprocessor=None)
        model.backbone.enable_lora(8)
        return model
    if name == "resnet_gn":
        import tf_dp.keras

        model, _ = tf_dp.keras.fix_for_dp(_resnet_with_batchnorm())
        return model
    raise ValueError(f"model must be one of {MODELS}, got {name!r}")


def make_batch(name: str, batch_size: int, seed: int = 0) -> tuple[object, np.ndarray]:
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
    elif name == "transformer":
        x = rng.integers(0, TRANSFORMER_VOCAB, (batch_size, TRANSFORMER_SEQ)).astype(np.int32)
        y = rng.integers(0, 2, batch_size)
    elif name in ("bert", "gpt2_lora"):
        ids = rng.integers(1, HUB_VOCAB, (batch_size, HUB_SEQ)).astype(np.int32)
        x = {"token_ids": ids, "padding_mask": np.ones_like(ids, dtype=bool)}
        if name == "bert":
            x["segment_ids"] = np.zeros_like(ids)
            y = rng.integers(0, 2, batch_size)
        else:
            y = np.roll(ids, -1, axis=1)
    elif name == "resnet_gn":
        x = rng.random((batch_size, 32, 32, 3), dtype=np.float32)
        y = rng.integers(0, 10, batch_size)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {name!r}")
    return x, y.astype(np.int32)
