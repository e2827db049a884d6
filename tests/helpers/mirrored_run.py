"""Runs private training on 2 logical CPU devices with MirroredStrategy; prints a JSON report.

A separate process: logical devices must be configured before TensorFlow starts.
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras  # noqa: E402

import tf_dp  # noqa: E402

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def build(strategy, mode, clip, sigma):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)]))
        kwargs = {"num_microbatches": 8} if mode == "microbatch" else {}
        if ":" in mode:  # "ghost:P": clipped in physical batches of at most P per replica
            mode, size = mode.split(":")
            kwargs["max_physical_batch_size"] = int(size)
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=clip, noise_multiplier=sigma, gradient_mode=mode,
                learning_rate=1.0, **kwargs),
            loss=LOSS)
    return model


def update(model, x, y, **fit):
    before = [w.numpy() for w in model.trainable_weights]
    model.fit(x, y, verbose=0, **fit)
    return [w.numpy() - b for w, b in zip(model.trainable_weights, before)]


def main(mode):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 64)).astype("float32")
    y = rng.integers(0, 4, 32)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    report = {}
    # 1. Noise 0: the distributed clipped sum equals the one-device one.
    if mode != "microbatch":  # microbatches are random groups: no two runs share them
        ref = update(build(one, mode, 0.3, 0.0), x, y, batch_size=32, shuffle=False)
        dist = update(build(mirrored, mode, 0.3, 0.0), x, y, batch_size=32, shuffle=False)
        report["max_abs_diff"] = max(float(np.max(np.abs(a - b))) for a, b in zip(ref, dist))
        report["max_abs_update"] = max(float(np.max(np.abs(b))) for b in ref)
    # 2. Zero-weight rows only: the update is the noise alone, divided by the number of records:
    # 32 examples, or 8 microbatches per replica (16 in all).
    records = 16.0 if mode == "microbatch" else 32.0
    model = build(mirrored, mode, 0.5, 2.0)
    noises = []
    for _ in range(5):
        delta = update(model, x, y, batch_size=32, shuffle=False,
                       sample_weight=np.zeros(32, np.float32))
        noises.extend((-records * d).ravel() for d in delta)
    noise = np.concatenate(noises)
    report["noise_count"] = int(noise.size)
    report["noise_var"] = float(np.var(noise))
    report["expected_var"] = (0.5 * 2.0) ** 2
    report["in_sync"] = all(
        bool(np.array_equal(v.value.values[0].numpy(), v.value.values[1].numpy()))
        for v in model.trainable_variables)
    entries = model.optimizer.ledger.samples()
    report["ledger"] = [[e.sampling.population_size, e.sampling.selection_probability,
                         e.sampling.policy, e.queries[0].l2_sensitivity,
                         e.queries[0].noise_stddev] for e in entries]
    # 3. Poisson batches split across the replicas: one sampling event per global step.
    model = build(mirrored, mode, 1.0, 1.0)
    xs = rng.normal(size=(400, 64)).astype("float32")
    ys = rng.integers(0, 4, 400)
    batches = tf_dp.data.poisson_batches(xs, ys, sampling_probability=0.05)
    journal = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"tf_dp_journal_{os.getpid()}.jsonl")
    model.optimizer.ledger.attach_journal(journal)
    model.fit(batches, epochs=2, verbose=0)
    report["journal_is_ledger"] = (
        tf_dp.ledger.read_journal(journal) == model.optimizer.ledger.samples())
    model.optimizer.ledger.detach_journal()
    os.remove(journal)
    report["poisson_steps"] = int(model.optimizer.iterations.numpy())
    report["poisson_ledger"] = sorted({(e.sampling.population_size, e.sampling.selection_probability,
                                        e.sampling.policy) for e in model.optimizer.ledger.samples()})
    report["poisson_recorded"] = model.optimizer.ledger.num_samples
    report["description"] = getattr(model.optimizer.gradient_clipper, "description", None)
    print("REPORT " + json.dumps(report))


def build_adaptive(strategy, sigma, count_stddev):
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((64,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(4)]))
        query = tf_dp.QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=0.05, noise_multiplier=sigma, target_unclipped_quantile=0.5,
            learning_rate=0.1, clipped_count_stddev=count_stddev, expected_num_records=32)
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query,
                                                                learning_rate=1.0), loss=LOSS)
    return model, query


def main_adaptive():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32 * 3, 64)).astype("float32")
    y = rng.integers(0, 4, 32 * 3)
    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    one = tf.distribute.OneDeviceStrategy("/cpu:0")
    report = {}
    # 1. (Almost) no noise: 3 steps on 2 replicas give the one-device weights and clips, so the
    # count was all-reduced before the clip update (16 records a replica against m = 32 would
    # move the clip differently).
    runs = {}
    for name, strategy in (("one", one), ("mirrored", mirrored)):
        model, query = build_adaptive(strategy, 0.0, 1e-6)
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
        runs[name] = ([w.numpy() for w in model.trainable_weights],
                      [e.queries[0].l2_sensitivity for e in model.optimizer.ledger.samples()]
                      + [float(query.l2_norm_clip.numpy())])
    report["weights_diff"] = max(float(np.max(np.abs(a - b)))
                                 for a, b in zip(runs["one"][0], runs["mirrored"][0]))
    report["clips"] = {k: v[1] for k, v in runs.items()}
    # 2. Zero-weight rows only: no record counts, so b_hat = noise / m + 1/2 and the clip moves by
    # exp(-eta * noise / m): the count noise of each step is read back from the ledger's clips.
    steps = 300
    xs = np.tile(x[:32], (steps, 1))
    ys = np.tile(y[:32], steps)
    model, query = build_adaptive(mirrored, 0.0, 2.0)
    model.fit(xs, ys, batch_size=32, shuffle=False, verbose=0,
              sample_weight=np.zeros(len(xs), np.float32))
    entries = model.optimizer.ledger.samples()
    clips = [e.queries[0].l2_sensitivity for e in entries] + [float(query.l2_norm_clip.numpy())]
    report["count_noise"] = [-32 / 0.1 * float(np.log(b / a)) for a, b in zip(clips, clips[1:])]
    report["count_queries"] = sorted({(e.queries[1].l2_sensitivity, e.queries[1].noise_stddev)
                                      for e in entries})
    report["steps"] = len(entries)
    replicas = query.l2_norm_clip.values if hasattr(query.l2_norm_clip, "values") else None
    report["clip_replicas_equal"] = (
        replicas is None or len({float(v.numpy()) for v in replicas}) == 1)
    print("REPORT " + json.dumps(report))


if __name__ == "__main__":
    main_adaptive() if sys.argv[1] == "adaptive" else main(sys.argv[1])
