"""Fits a tiny model a few DP steps in the microbatch and JL modes; prints the weights (JSON).

Run twice, in two processes, by ``tests/test_seeded_runs.py``: with the same ``noise_seed``
the weights must be the same bit for bit. Usage::

    python seeded_fit.py

Each report maps a configuration (``<mode>:<context>:<seed>``) to the flat weights after
training (``mirrored``: on 2 logical CPU devices under ``MirroredStrategy``); then
the two replicas' microbatch assignments of one step (a second line, ``REPLICAS``).
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

import tf_dp  # noqa: E402


def fit(mode, seed, strategy=None, run_eagerly=False, jit_compile=False):
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
        extra = {"num_microbatches": 4} if mode == "microbatch" else {"jl_projections": 2}
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=0.5, noise_multiplier=0.5, learning_rate=0.5, gradient_mode=mode,
                noise_seed=seed, **extra),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            run_eagerly=run_eagerly, jit_compile=jit_compile)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    return np.concatenate([np.ravel(w) for w in model.get_weights()]).tolist()


def replica_assignments():
    """Each replica's microbatch assignment of 4000 examples at step 3 (seed 7)."""
    clipper = tf_dp.gradients.MicrobatchClipper(4, seed=7)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    ids = strategy.run(tf.function(lambda: clipper.assignment(4000, tf.constant(3, tf.int64))))
    return [t.numpy().tolist() for t in strategy.experimental_local_results(ids)]


def main():
    report = {}
    for mode in ("microbatch", "jl"):
        report[f"{mode}:eager:7"] = fit(mode, 7, run_eagerly=True)
        report[f"{mode}:graph:7"] = fit(mode, 7)
        report[f"{mode}:xla:7"] = fit(mode, 7, jit_compile=True)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    report["microbatch:mirrored:7"] = fit("microbatch", 7, strategy)
    print("REPORT " + json.dumps(report), flush=True)
    print("REPLICAS " + json.dumps(replica_assignments()))


if __name__ == "__main__":
    # 2 logical devices for MirroredStrategy, before TensorFlow starts (the other fits use one)
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    main()
