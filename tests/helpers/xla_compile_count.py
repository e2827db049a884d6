"""Run by tests/test_ledger_flush.py in a subprocess with TensorFlow's compile log on
(``TF_CPP_VMODULE=device_compiler=2``): records 70 steps through the ledger's staging table
inside XLA-compiled calls (its 64 rows fill and are moved once), first by a bare compiled
recorder, then by ``model.fit`` of a private model (``jit_compile=True``,
``steps_per_execution=1``, microbatches). The parent counts the compiles in the log: each
function must be compiled once, whatever the number of rows staged when it is called."""

import sys

import keras
import numpy as np
import tensorflow as tf

import tf_dp

STEPS = 70

ledger = tf_dp.PrivacyLedger()
ledger.reserve(1)


@tf.function(jit_compile=True)
def bare_recorder(stddev):
    ledger.record_sampling(60000, 0.01, "poisson")
    ledger.record_sum_query(1.0, stddev)


for step in range(STEPS):
    bare_recorder(tf.constant(1.0 + step, tf.float64))
    ledger.flush()
assert ledger.num_samples == STEPS, ledger.num_samples
assert [e.queries[0].noise_stddev for e in ledger.samples()] == [1.0 + s for s in range(STEPS)]

rng = np.random.default_rng(0)
x = rng.normal(size=(STEPS * 8, 6)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
keras.utils.set_random_seed(0)
model = tf_dp.keras.make_private(keras.Sequential([
    keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]))
model.compile(
    optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, num_microbatches=4, learning_rate=0.1),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    jit_compile=True, steps_per_execution=1)
model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)
assert int(model.optimizer.iterations.numpy()) == STEPS
assert model.optimizer.ledger.num_samples == STEPS
print("DONE", file=sys.stderr, flush=True)
