"""Private training under ``tf.distribute.MirroredStrategy()`` with ONE replica (the default on a
machine with one GPU or none); prints a JSON report (``REPORT {...}``).

A separate process: the test hides any GPU (``CUDA_VISIBLE_DEVICES=""``) before TensorFlow
starts, so ``MirroredStrategy()`` has exactly one replica (the CPU). Usage::

    python mirrored_one_replica.py fit      # Model.fit vs no strategy; Poisson batches
"""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import keras  # noqa: E402

import tf_dp  # noqa: E402

N, B, EPOCHS = 96, 16, 2
LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def build(strategy, seed, sigma=1.1):
    scope = strategy.scope() if strategy is not None else tf.init_scope()
    with scope:
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((8,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=sigma, learning_rate=0.1, noise_seed=seed),
            loss=LOSS)
    return model


def ledger_rows(model):
    return [[e.sampling.population_size, e.sampling.selection_probability, e.sampling.policy,
             e.queries[0].l2_sensitivity, e.queries[0].noise_stddev]
            for e in model.optimizer.ledger.samples()]


def main_fit():
    x, y = data()
    strategy = tf.distribute.MirroredStrategy()
    report = {"replicas": int(strategy.num_replicas_in_sync)}
    runs = {}
    for name, s in (("none", None), ("mirrored", strategy)):
        # noise 0: TF's tf.random.Generator keys its stream by the replica under any strategy,
        # so seeded noise values differ from a no-strategy run (not their law)
        model = build(s, seed=3, sigma=0.0)
        init = np.concatenate([np.ravel(w) for w in model.get_weights()])
        model.fit(x, y, batch_size=B, epochs=EPOCHS, shuffle=False, verbose=0)
        runs[name] = model
        report[f"{name}_steps"] = int(model.optimizer.iterations.numpy())
        report[f"{name}_ledger"] = ledger_rows(model)
        report[f"{name}_update"] = float(np.max(np.abs(
            np.concatenate([np.ravel(w) for w in model.get_weights()]) - init)))
    report["weights_diff"] = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(runs["none"].get_weights(), runs["mirrored"].get_weights()))
    # Poisson batches (the repro): one sampling event per global step
    model = build(strategy, seed=None)
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=B / N), epochs=EPOCHS,
              verbose=0)
    report["poisson_steps"] = int(model.optimizer.iterations.numpy())
    report["poisson_recorded"] = model.optimizer.ledger.num_samples
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main_fit()
