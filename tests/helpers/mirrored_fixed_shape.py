"""The fixed-shape batch selections (truncated Poisson, balls-in-bins) under MirroredStrategy on 2
logical CPU devices: the same seeded batches train a model on 2 replicas and a copy on one
device (noise 0); prints REPORT as JSON with both models' weights and ledgers.

Usage: python mirrored_fixed_shape.py (TensorFlow must not have started)."""

import dataclasses
import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

N = 300
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 8)).astype("float32")
Y = rng.integers(0, 3, N)


def sampled(kind):
    if kind == "truncated_poisson":
        return tf_dp.data.truncated_poisson_batches(X, Y, sampling_probability=0.05, seed=3)
    return tf_dp.data.balls_in_bins_batches(X, Y, batch_size=20, seed=3)


FIXED = {}


def batches(kind):
    """The sampler's object with one drawn pass frozen in its dataset (every pass of a sampler
    draws afresh; both runs must see the same batches): the claim and the fit path are the
    sampler's own."""
    if kind not in FIXED:
        b = sampled(kind)
        drawn = list(b.dataset.as_numpy_iterator())
        parts = [np.stack([d[i] for d in drawn]) for i in range(3)]
        FIXED[kind] = dataclasses.replace(
            b, dataset=tf.data.Dataset.from_tensor_slices(tuple(parts)))
    return FIXED[kind]


def train(kind, strategy):
    with strategy.scope():
        keras.utils.set_random_seed(1)
        model = tf_dp.keras.make_private(keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=1.0),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    init = [w.tolist() for w in model.get_weights()]
    model.fit(batches(kind), epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    return {
        "init": init,
        "weights": [w.tolist() for w in model.get_weights()],
        "ledger": len(entries),
        "iterations": int(model.optimizer.iterations.numpy()),
        "policies": sorted({e.sampling.policy for e in entries}),
        "max_batch_size": sorted({e.sampling.max_batch_size or 0 for e in entries}),
        "replicas": strategy.num_replicas_in_sync,
    }


report = {}
for kind in ("truncated_poisson", "balls_in_bins"):
    report[kind] = {
        "mirrored": train(kind, tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])),
        "one": train(kind, tf.distribute.get_strategy()),
        "steps_per_epoch": batches(kind).steps_per_epoch,
        "b": batches(kind).max_batch_size,
    }
print("REPORT " + json.dumps(report))
