"""A DPTrainStep custom loop under MirroredStrategy on 2 logical CPU devices, noise 0."""

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402

N, B = 24, 8
rng = np.random.default_rng(0)
x, y = rng.normal(size=(N, 5)).astype("float32"), rng.integers(0, 3, size=N)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=0.1, noise_seed=5)
    dp_step = tf_dp.keras.DPTrainStep(
        model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling=tf_dp.engine.Sampling(N, B / N, policy="shuffle"))
    opt.build(model.trainable_variables)


@tf.function
def train(batch):
    return strategy.run(dp_step, args=batch)


data = tf.data.Dataset.from_tensor_slices((x, y)).batch(B)
dp_step.start_pass()
for batch in strategy.experimental_distribute_dataset(data):
    train(batch)
    dp_step.flush()
print("REPORT " + json.dumps({
    "replicas": strategy.num_replicas_in_sync,
    "steps": int(opt.iterations.numpy()),
    "recorded": opt.ledger.num_samples,
    "weights": [w.tolist() for w in model.get_weights()],
}))
