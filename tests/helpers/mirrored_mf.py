"""DPKerasMFOptimizer under MirroredStrategy on 2 logical CPU devices: zero gradients, a banded
strategy; reports the noise released at each step (read back from the weights), whether the
replicas' weights agree, and the noise state kept. Prints REPORT as JSON.

Usage: python mirrored_mf.py (TensorFlow must not have started)."""

import json
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from tf_dp.keras import make_private  # noqa: E402
from tf_dp.keras.mf import DPKerasMFOptimizer  # noqa: E402


class Banded:
    coef = np.array([[1.5, 0.0, 0.0]] + [[1.5, 0.4, -0.2]] * 7)


STEPS, BATCH = 6, 8
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
with strategy.scope():
    model = make_private(
        keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros")]
        )
    )
    opt = DPKerasMFOptimizer(
        learning_rate=1.0, l2_norm_clip=1.0, noise_multiplier=1.0, strategy=Banded()
    )
    model.compile(optimizer=opt, loss="mse")


class Weights(keras.callbacks.Callback):
    seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.get_weights()[0].reshape(-1).astype(np.float64))


x = np.zeros((STEPS * BATCH, 4), "float32")
y = np.zeros((STEPS * BATCH, 3), "float32")
model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[Weights()])
flat = [np.zeros(12)] + Weights.seen
released = [(-BATCH * (b - a)).tolist() for a, b in zip(flat[:-1], flat[1:])]
kernel = model.trainable_variables[0]
values = [v.numpy() for v in kernel.value.values] if hasattr(kernel.value, "values") else []
in_sync = len(values) == 2 and bool(np.array_equal(values[0], values[1]))
state = opt.engine.global_state
buffers = tf.nest.flatten(state.buffers)[0]
print(
    "REPORT "
    + json.dumps(
        {
            "released": released,
            "buffers": buffers.numpy().reshape(buffers.shape[0], -1).tolist(),
            "mf_step": int(state.step.numpy()),
            "in_sync": in_sync,
            "batch": BATCH,
            "max_weight": np.max(np.abs(np.stack(flat)), axis=0).tolist(),
        }
    )
)
