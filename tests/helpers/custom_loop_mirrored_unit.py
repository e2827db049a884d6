"""A DPTrainStep traced for example-level clipping under MirroredStrategy (2 logical CPU devices),
run in a tf.function after the sampling became user-level (k=4): the error, whether weights,
optimizer step and ledger stayed as they were, then a new tf.function's step. (XLA is not run
here: TensorFlow does not compile one function over variables on two CPU devices.)"""

import json

import tensorflow as tf

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration(), tf.config.LogicalDeviceConfiguration()])

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dp  # noqa: E402
from tf_dp.engine import Sampling  # noqa: E402

rng = np.random.default_rng(0)
x, y = rng.normal(size=(8, 5)).astype("float32") * 3.0, rng.integers(0, 3, size=8)
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
batch = next(iter(strategy.experimental_distribute_dataset(
    tf.data.Dataset.from_tensor_slices((x, y)).batch(8))))


def units(opt):
    return [[e.sampling.unit, e.sampling.records_per_unit] for e in opt.ledger.samples()]


def run():
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)])
        opt = tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=0.5, noise_seed=5)
        dp_step = tf_dp.keras.DPTrainStep(
            model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            sampling=Sampling(16, 0.5))
        opt.build(model.trainable_variables)

    def make():
        return tf.function(lambda b: strategy.run(dp_step, args=b))

    train = make()
    train(batch)
    dp_step.flush()
    weights, steps = model.get_weights(), int(opt.iterations.numpy())
    opt.set_sampling(Sampling(4, 0.5, unit="user", records_per_unit=4))
    error = ""
    try:
        train(batch)
        dp_step.flush()
    except (tf.errors.InvalidArgumentError, ValueError) as e:
        error = str(e)
    unchanged = all(np.array_equal(a, b) for a, b in zip(model.get_weights(), weights)) and (
        int(opt.iterations.numpy()) == steps)
    out = {"error": error, "unchanged": unchanged, "units_after_error": units(opt),
           "iterations": int(opt.iterations.numpy())}
    rebuilt = make()
    rebuilt(batch)
    dp_step.flush()
    out["units_after_rebuild"] = units(opt)
    out["moved_after_rebuild"] = max(
        float(np.max(np.abs(a - b))) for a, b in zip(model.get_weights(), weights))
    return out


print("REPORT " + json.dumps({"replicas": strategy.num_replicas_in_sync, **run()}))
