"""One private step on R logical CPU devices (MirroredStrategy) for padded Poisson batches of
several sizes; prints REPORT {size: max |weight change|} as JSON.

Usage: python mirrored_any_batch_size.py R gradient_mode (TensorFlow must not have started)."""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

REPLICAS, MODE = int(sys.argv[1]), sys.argv[2]
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * REPLICAS)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.keras import DPKerasSGDOptimizer, make_private  # noqa: E402

N = 40
rng = np.random.default_rng(0)
X = rng.normal(size=(N, 20)).astype("float32")
Y = rng.integers(0, 5, N)
INIT = [w.copy() for w in keras.Sequential(
    [keras.Input((20,)), keras.layers.Dense(8, "tanh"), keras.layers.Dense(5)]).get_weights()]


def one_step(max_batch_size, strategy):
    with strategy.scope():
        model = make_private(keras.Sequential(
            [keras.Input((20,)), keras.layers.Dense(8, "tanh"), keras.layers.Dense(5)]))
        model.set_weights(INIT)
        model.compile(
            optimizer=DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=0.0,
                                          learning_rate=0.5, gradient_mode=MODE),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # q = 0.1: about 4 records a step, padded to each size
    batches = tf_dp.data.poisson_batches(X, Y, sampling_probability=0.1, steps_per_epoch=1,
                                         max_batch_size=max_batch_size, seed=7)
    model.fit(batches, epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 1
    return model.get_weights()


mirrored = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(REPLICAS)])
report = {}
for size in (5, 6, 7, 9):
    report[size] = max(float(np.max(np.abs(u - v))) for u, v in zip(one_step(size, mirrored), INIT))
print("REPORT " + json.dumps(report))
