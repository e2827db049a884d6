"""A declared shuffle batch under MirroredStrategy on 2 logical CPU devices: global batches of
the declared size train; global batches twice the declared size (each replica's share equal to
the declared size) are refused before anything is recorded or applied. Prints REPORT as JSON.

Usage: python mirrored_shuffle_batch.py (TensorFlow must not have started)."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.engine import Sampling  # noqa: E402

N, DECLARED_B = 32, 4
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 6)).astype("float32")
Y = rng.integers(0, 3, N)


def run(global_batch):
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = tf_dp.keras.make_private(
            keras.Sequential([keras.Input((6,)), keras.layers.Dense(3)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = model.get_weights()
    model.optimizer.set_sampling(Sampling(N, DECLARED_B / N, policy="shuffle"))
    data = tf.data.Dataset.from_tensor_slices((X, Y)).batch(global_batch, drop_remainder=True)
    error = None
    try:
        model.fit(data, epochs=1, verbose=0)
    except (ValueError, tf.errors.InvalidArgumentError) as e:
        error = str(e)
    changed = any(not np.array_equal(a, b) for a, b in zip(model.get_weights(), before))
    return {
        "error": error,
        "ledger": model.optimizer.ledger.num_samples,
        "iterations": int(model.optimizer.iterations.numpy()),
        "changed": changed,
    }


print("REPORT " + json.dumps({"declared": run(DECLARED_B), "twice": run(2 * DECLARED_B)}))
