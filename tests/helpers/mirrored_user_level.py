"""User-level training on 2 logical CPU devices (MirroredStrategy) vs one device, noise 0.

Prints ``REPORT {json}``: the largest weight difference after the same seeded user-level batches,
the largest update, and the ledger's sampling claims. Usage: mirrored_user_level.py MODE
"""

import json
import sys

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()]
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
import tf_dp.keras as dpk  # noqa: E402

mode = sys.argv[1]
rng = np.random.default_rng(0)
x = rng.normal(size=(90, 6)).astype(np.float32)
y = rng.integers(0, 3, 90).astype(np.int32)
user_ids = rng.permutation(np.arange(90) % 25)  # 25 users with 3 or 4 records


def train(strategy):
    with strategy.scope():
        keras.utils.set_random_seed(4)
        model = dpk.make_private(keras.Sequential(
            [keras.Input((6,)), keras.layers.Dense(5, activation="tanh"), keras.layers.Dense(3)]))
        opt = dpk.DPKerasSGDOptimizer(l2_norm_clip=0.3, noise_multiplier=0.0, learning_rate=0.5,
                                      gradient_mode=mode)
        model.compile(optimizer=opt,
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = [w.copy() for w in model.get_weights()]
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=0.3, user_ids=user_ids,
                                         max_records_per_user=3, steps_per_epoch=4, seed=11)
    model.fit(batches, epochs=1, verbose=0)
    claims = sorted({(e.sampling.population_size, e.sampling.selection_probability,
                      e.sampling.origin, e.sampling.unit, e.sampling.records_per_unit,
                      e.queries[0].l2_sensitivity) for e in opt.ledger.samples()})
    return model.get_weights(), start, claims, opt.ledger.num_samples


one, start, claims_one, steps_one = train(tf.distribute.OneDeviceStrategy("/cpu:0"))
two, _, claims_two, steps_two = train(tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]))
print("REPORT " + json.dumps({
    "max_abs_diff": max(float(np.max(np.abs(a - b))) for a, b in zip(one, two)),
    "max_abs_update": max(float(np.max(np.abs(a - b))) for a, b in zip(one, start)),
    "claims": [list(c) for c in claims_two], "claims_one": [list(c) for c in claims_one],
    "steps": [steps_one, steps_two],
}))
