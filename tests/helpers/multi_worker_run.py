"""One worker of a 2-worker MultiWorkerMirroredStrategy cluster on localhost; prints a JSON report.

Usage: multi_worker_run.py INDEX PORT0,PORT1 OUT.json [MODE SIGMA [PHASE]]. Each worker trains the
same private model with ``fit`` on its own shard's seeded Poisson batches (PHASE ``users``: of
users, ``USERS`` users with ``K`` records at most per batch, sharded by user; ``truncated`` /
``balls_in_bins``: its share of one global selection drawn from a shared seed); the report holds the
sampler's first two passes drawn outside fit, the batches fit drew, the weights before and after,
and the ledger.
"""

import dataclasses
import json
import os
import sys

index, ports, out_path = int(sys.argv[1]), sys.argv[2].split(","), sys.argv[3]
mode = sys.argv[4] if len(sys.argv) > 4 else "vectorized"
sigma = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
phase = sys.argv[6] if len(sys.argv) > 6 else "train"
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"localhost:{p}" for p in ports]},
    "task": {"type": "worker", "index": index},
})
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402

import tf_dp  # noqa: E402

N, Q, STEPS, CLIP, SEED = 200, 0.05, 3, 0.3, 11
USERS, K = 40, 2  # phase "users": user of record i = USER_OF[i], at most K records per user
USER_OF = np.random.default_rng(5).integers(0, USERS, N)


def data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(N, 12)).astype("float32"), rng.integers(0, 3, N).astype("int32")


TRUNCATED_Q, TRUNCATED_B = 0.1, 16  # phase "truncated": P[Binomial(200, 0.1) > 16] = 0.78


def batches(x, y):
    if phase == "truncated":  # one global truncated sample per step, shared seed, shares
        return tf_dp.data.truncated_poisson_batches(
            x, y, sampling_probability=TRUNCATED_Q, max_batch_size=TRUNCATED_B,
            steps_per_epoch=STEPS, seed=SEED, num_shards=2, shard_index=index)
    if phase == "balls_in_bins":  # one shared assignment per pass into STEPS batches
        return tf_dp.data.balls_in_bins_batches(
            x, y, num_batches=STEPS, seed=SEED, num_shards=2, shard_index=index)
    users = dict(user_ids=USER_OF, max_records_per_user=K) if phase == "users" else {}
    return tf_dp.data.poisson_batches(
        x, y, sampling_probability=Q * 4 if users else Q, steps_per_epoch=STEPS,
        seed=SEED + index, num_shards=2, shard_index=index, **users)


def build():
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=CLIP, noise_multiplier=sigma, learning_rate=0.5,
                gradient_mode=mode),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class Crash(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("simulated crash")


def backup_and_restore():
    """Two epochs with tf_dp's BackupAndRestore, killed before the second, then resumed."""
    x, y = data()
    backup = os.path.join(os.path.dirname(out_path), f"backup{index}")
    model = build()
    try:
        model.fit(batches(x, y), epochs=2, verbose=0,
                  callbacks=[tf_dp.keras.callbacks.BackupAndRestore(backup), Crash()])
    except RuntimeError:
        pass
    crashed_at = int(model.optimizer.iterations.numpy())
    # The crashed "process" ends: its ledger's journal (one writer at a time) is released.
    del model
    resumed = build()  # a new process would start from scratch like this
    resumed.fit(batches(x, y), epochs=2, verbose=0,
                callbacks=[tf_dp.keras.callbacks.BackupAndRestore(backup)])
    entries = resumed.optimizer.ledger.samples()
    report = {
        "index": index,
        "crashed_at": crashed_at,
        "iterations": int(resumed.optimizer.iterations.numpy()),
        "after": [v.numpy().tolist() for v in resumed.trainable_variables],
        "ledger": [[e.sampling.population_size, e.sampling.selection_probability,
                    e.sampling.policy] for e in entries],
    }
    with open(out_path, "w") as f:
        json.dump(report, f)


def main():
    with open(out_path, "w") as f:
        json.dump(report(), f)


def selections():
    """Phase ``selections``: the ``truncated`` then the ``balls_in_bins`` run in one cluster."""
    global phase
    out = {}
    for phase in ("truncated", "balls_in_bins"):
        out[phase] = report()
    with open(out_path, "w") as f:
        json.dump(out, f)


def report():
    x, y = data()
    keras.utils.set_random_seed(0)  # before any sampling: the samplers then draw as in fit
    sampler = batches(x, y)
    drawn = [[t.numpy().tolist() for t in b] for b in sampler.dataset]
    second = [[t.numpy().tolist() for t in b] for b in sampler.dataset]
    again = [[t.numpy().tolist() for t in b] for b in batches(x, y).dataset]
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((12,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=CLIP, noise_multiplier=sigma, learning_rate=0.5,
                gradient_mode=mode),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"])
    before = [v.numpy().tolist() for v in model.trainable_variables]
    # Every batch the sampler produces during fit, in order (Keras draws one pass to build the
    # model before training, then iterates again).
    seen = []

    def record(bx, by, bw):
        def append(a, b, c):
            seen.append([a.numpy().tolist(), b.numpy().tolist(), c.numpy().tolist()])
            return 0

        done = tf.py_function(append, [bx, by, bw], tf.int32)
        with tf.control_dependencies([done]):
            return tf.identity(bx), by, bw

    fit_batches = batches(x, y)
    fit_batches = dataclasses.replace(fit_batches, dataset=fit_batches.dataset.map(record))
    history = model.fit(fit_batches, epochs=1, verbose=0)
    after = [v.numpy().tolist() for v in model.trainable_variables]
    entries = model.optimizer.ledger.samples()
    return {
        "index": index,
        "batches": drawn,
        "second_pass": second,
        "seen": seen,
        "same_batches_when_redrawn": drawn == again,
        "before": before,
        "after": after,
        "loss": history.history["loss"],
        "iterations": int(model.optimizer.iterations.numpy()),
        "ledger": [[e.sampling.population_size, e.sampling.selection_probability,
                    e.sampling.policy, e.queries[0].l2_sensitivity, e.queries[0].noise_stddev,
                    e.sampling.unit, e.sampling.records_per_unit]
                   for e in entries],
        "bounds": [e.sampling.max_batch_size for e in entries],
        "pass_starts": [e.sampling.pass_start for e in entries],
    }


if phase == "backup":
    backup_and_restore()
elif phase == "selections":
    selections()
else:
    main()
