"""Trains small reference models a few DP steps with a fixed noise seed; writes weights + ledger.

Run it on two versions of tf_dp and compare the outputs: the same seed and data must give the
same weights and ledger (to 1e-6) in every gradient mode.

    PYTHONPATH=<tree> python research/engine_equivalence.py --out /tmp/a.npz
    python research/engine_equivalence.py --compare /tmp/a.npz /tmp/b.npz
"""

from __future__ import annotations

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

MODES = ("vectorized", "ghost", "microbatch", "jl")


def _model(name: str):
    import keras

    keras.utils.set_random_seed(0)
    if name == "cnn":
        layers = [
            keras.Input((12, 12, 1)),
            keras.layers.Conv2D(4, 4, strides=2, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2, 1),
            keras.layers.Conv2D(8, 2, strides=2, padding="valid", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(3),
        ]
    elif name in ("mlp", "mlpreg"):
        reg = keras.regularizers.L2(0.01) if name == "mlpreg" else None
        layers = [
            keras.Input((20,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=reg),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(3, kernel_regularizer=reg),
        ]
    else:  # bilstm
        layers = [
            keras.Input((6,), dtype="int32"),
            keras.layers.Embedding(30, 4),
            keras.layers.Bidirectional(keras.layers.LSTM(4, unroll=True)),
            keras.layers.Dense(4, activation="relu"),
            keras.layers.Dense(3),
        ]
    return keras.Sequential(layers)


def _data(name: str):
    rng = np.random.default_rng(1)
    n = 32
    if name == "cnn":
        x = rng.normal(size=(n, 12, 12, 1)).astype("float32")
    elif name in ("mlp", "mlpreg"):
        x = rng.normal(size=(n, 20)).astype("float32")
    else:
        x = rng.integers(1, 30, size=(n, 6)).astype("int32")
    return x, rng.integers(0, 3, size=n)


def run(name: str, mode: str) -> dict[str, np.ndarray]:
    import keras

    import tf_dp

    model = tf_dp.keras.make_private(_model(name))
    extra = {"num_microbatches": 4} if mode == "microbatch" else {}
    if mode == "jl":
        extra = {"jl_projections": 2}
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.7, learning_rate=0.1, gradient_mode=mode,
        noise_seed=7, **extra)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = _data(name)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
    samples, queries = opt.ledger.tables()
    out = {f"w{i}": np.asarray(w) for i, w in enumerate(model.get_weights())}
    out["ledger_samples"] = np.asarray(samples, np.float64)
    out["ledger_queries"] = np.asarray(queries, np.float64)
    return out


def _max_diff(a: np.ndarray, b: np.ndarray) -> float:
    """Largest absolute difference; NaN in the same place in both (empty ledger cells) is equal,
    NaN in one only is infinite."""
    if a.shape != b.shape:
        return float("inf")
    if not a.size:
        return 0.0
    same_nan = np.isnan(a) & np.isnan(b)
    if np.any(np.isnan(a) ^ np.isnan(b)):
        return float("inf")
    return float(np.max(np.where(same_nan, 0.0, np.abs(a - b))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out")
    parser.add_argument("--compare", nargs=2)
    parser.add_argument("--models", default="cnn,mlp,mlpreg,bilstm")
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args()
    if args.compare:
        a, b = (np.load(p) for p in args.compare)
        keys = sorted({k.split("/")[0] + "/" + k.split("/")[1] for k in a.files})
        for key in keys:
            names = [k for k in a.files if k.startswith(key + "/")]
            diff = max(_max_diff(a[k], b[k]) for k in names)
            print(f"{key:20s} max |diff| = {diff:.3g}")
        return
    out = {}
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for k, v in run(name, mode).items():
                out[f"{name}/{mode}/{k}"] = v
            print(name, mode, "done", flush=True)
    np.savez(args.out, **out)


if __name__ == "__main__":
    main()
