"""Step time and peak memory of an embedding model: non-private vs DP with dense noise vs
DP-AdaFEST (sparse noise on privately selected rows).

``python -m bench.sparse_embedding --rows 1000000 --dim 32 --batch 256 --length 20 --repeats 20``

Model: Embedding(rows, dim) -> mean over the sequence -> Dense(1), logistic loss, SGD. All three
steps are ``tf.function``s in one process, timed interleaved (medians and spread of
``--repeats`` rounds after warm-up). Both DP steps clip jointly at C = 1 (table rows by
:mod:`tf_dp.gradients.embedding_rows`, the Dense layer by its closed-form per-example norm);
``dense`` adds N(0, (1.1 C)^2) to every coordinate of the table and applies a dense update,
``sparse`` selects rows (contribution bound 1, selection noise 3, threshold 5) and adds noise
on the selected rows only (a ``tf.IndexedSlices`` update).

Peak memory: each mode in its own fresh subprocess (``--repeats_memory`` of them, interleaved,
median reported), so no mode reuses memory another freed; 5 steps run after the model is built
(the first traces). ``step_tensor_peak_mb``: TensorFlow's CPU allocator's peak during the steps
(``tf.config.experimental.get_memory_info("CPU:0")`` after ``reset_memory_stats``) minus the
tensors live before them (the table): what the steps allocate at once. The process's resident
memory cannot show it: TensorFlow keeps freed CPU buffers (the table initialiser's temporaries)
and the steps reuse them, so ``VmHWM`` above the built model's RSS (``step_rss_peak_mb``, from
``/proc/self/status`` after resetting the high-water mark through ``/proc/self/clear_refs``)
under-counts a step's allocations. ``vmhwm_mb`` is the process's whole high-water mark
(TensorFlow and the table included).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

MODES = ("nonprivate", "dense", "sparse")


def build(rows, dim, batch, length, seed=0):
    import keras
    import numpy as np
    import tensorflow as tf

    from tf_dp.dp_query.partition_selection import make_generator
    from tf_dp.gradients import embedding_rows as er

    keras.utils.set_random_seed(seed)
    emb = keras.layers.Embedding(rows, dim)
    dense = keras.layers.Dense(1)
    emb.build((None, length))
    dense.build((None, dim))
    rng = np.random.default_rng(seed)
    # power-law ids (Zipf-like), as in recommendation data
    ids = tf.constant(np.minimum(rng.zipf(1.2, size=(batch, length)) - 1, rows - 1), tf.int32)
    y = tf.constant(rng.integers(0, 2, (batch, 1)).astype(np.float32))
    gen = make_generator(seed)
    lr, clip, z = 0.1, 1.0, 1.1
    table = emb.embeddings

    def losses_from(e):
        h = tf.reduce_mean(e, axis=1)
        logits = dense(h)
        return tf.reshape(tf.nn.sigmoid_cross_entropy_with_logits(y, logits), [-1]), h, logits

    @tf.function
    def nonprivate():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(losses_from(emb(ids))[0])
        grads = tape.gradient(loss, [table] + dense.trainable_variables)
        for v, g in zip([table] + dense.trainable_variables, grads):
            if isinstance(g, tf.IndexedSlices):
                v.value.scatter_sub(tf.IndexedSlices(lr * g.values, g.indices, g.dense_shape))
            else:
                v.assign_sub(lr * g)

    def clipped():
        with tf.GradientTape() as tape:
            e = emb(ids)
            tape.watch(e)
            losses, h, logits = losses_from(e)
            total = tf.reduce_sum(losses)
        ge, gl = tape.gradient(total, [e, logits])
        rows_ = er.embedding_rows(ids, ge)
        sq_emb = er.squared_norms(rows_, batch)
        gl = tf.reshape(gl, [-1])  # per-example dL_i/dlogit_i: Dense per-example norm closed form
        sq_dense = gl**2 * (tf.reduce_sum(h**2, 1) + 1.0)
        w = tf.minimum(1.0, clip / tf.sqrt(sq_emb + sq_dense + 1e-30))
        kernel = tf.reduce_sum((w * gl)[:, None] * h, 0)[:, None]
        bias = tf.reduce_sum(w * gl, keepdims=True)
        return rows_, w, kernel, bias

    def apply_dense_part(kernel, bias):
        dense.kernel.assign_sub(lr / batch * (kernel + tf.random.normal(kernel.shape) * z * clip))
        dense.bias.assign_sub(lr / batch * (bias + tf.random.normal(bias.shape) * z * clip))

    @tf.function
    def dense_dp():
        rows_, w, kernel, bias = clipped()
        g = tf.math.unsorted_segment_sum(rows_.values * tf.gather(w, rows_.example)[:, None],
                                         tf.where(rows_.valid, rows_.row, 0), rows)
        noise = tf.reshape(gen.normal([rows * dim]), [rows, dim]) * (z * clip)
        table.assign_sub(lr / batch * (g + noise))
        apply_dense_part(kernel, bias)

    @tf.function
    def sparse_dp():
        rows_, w, kernel, bias = clipped()
        up = er.adafest_update(gen, rows_, w, ids, rows, 1.0, 5.0, 3.0, z * clip)
        table.value.scatter_sub(tf.IndexedSlices(lr / batch * up.values, up.indices, up.dense_shape))
        apply_dense_part(kernel, bias)

    return {"nonprivate": nonprivate, "dense": dense_dp, "sparse": sparse_dp}


def build_keras(rows, dim, batch, length, seed=0):
    """The same three modes through ``model.fit``'s train step (``train_on_batch``): plain Keras
    SGD; ``make_private`` with DP SGD (dense table noise); the same with
    ``sparse_embeddings=SparseEmbeddingConfig(5.0, 3.0)``."""
    import keras
    import numpy as np

    import tf_dp

    rng = np.random.default_rng(seed)
    ids = np.minimum(rng.zipf(1.2, size=(batch, length)) - 1, rows - 1).astype(np.int32)
    y = rng.integers(0, 2, (batch, 1)).astype(np.float32)
    loss = keras.losses.BinaryCrossentropy(from_logits=True)

    def model():
        keras.utils.set_random_seed(seed)
        inp = keras.Input((length,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(rows, dim)(inp))
        return keras.Model(inp, keras.layers.Dense(1)(h))

    plain = model()
    plain.compile(optimizer=keras.optimizers.SGD(0.1), loss=loss, jit_compile=False)
    out = {"nonprivate": plain}
    for mode, sparse in (("dense", None),
                         ("sparse", tf_dp.keras.SparseEmbeddingConfig(5.0, 3.0))):
        m = tf_dp.keras.make_private(model())
        m.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1,
            sparse_embeddings=sparse), loss=loss, jit_compile=False)
        m.optimizer.set_sampling(population_size=100 * batch, selection_probability=0.01,
                                 sampling_policy="poisson")
        out[mode] = m
    return {k: (lambda m=m: m.train_on_batch(ids, y)) for k, m in out.items()}


def _status_mb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return float(line.split()[1]) / 1024.0
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory(args, mode):
    """VmHWM (MB) of a fresh process that builds the model and runs 5 steps of ``mode`` (or, for
    ``mode='build'``, none)."""
    cmd = [sys.executable, "-m", "bench.sparse_embedding", "--rows", str(args.rows), "--dim",
           str(args.dim), "--batch", str(args.batch), "--length", str(args.length),
           "--_memory_of", mode]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--length", type=int, default=20)
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--no_memory", action="store_true")
    p.add_argument("--no_timing", action="store_true")
    p.add_argument("--keras", action="store_true",
                   help="time the modes through Keras's train step (make_private) instead")
    p.add_argument("--repeats_memory", type=int, default=3)
    p.add_argument("--_memory_of", default=None)
    args = p.parse_args(argv)
    if args._memory_of:
        import tensorflow as tf

        step = build(args.rows, args.dim, args.batch, args.length)[args._memory_of]
        before = _status_mb("VmRSS")
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        live = tf.config.experimental.get_memory_info("CPU:0")["current"]
        tf.config.experimental.reset_memory_stats("CPU:0")
        for _ in range(5):
            step()
        peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
        hwm = _status_mb("VmHWM")
        print(json.dumps({"step_tensor_peak_mb": (peak - live) / 2**20,
                          "step_rss_peak_mb": hwm - before, "vmhwm_mb": hwm}))
        return None
    result = {"rows": args.rows, "dim": args.dim, "batch": args.batch, "length": args.length}
    if not args.no_memory:  # first, each mode in its own process (interleaved repeats)
        got = {m: [] for m in MODES}
        for _ in range(args.repeats_memory):
            for m in MODES:
                got[m].append(memory(args, m))
        for m in MODES:
            result[m] = {k: statistics.median(g[k] for g in got[m]) for k in got[m][0]}
            result[m]["step_tensor_peak_all_mb"] = [g["step_tensor_peak_mb"] for g in got[m]]
    if args.no_timing:
        print(json.dumps(result, indent=1))
        return result
    steps = (build_keras if args.keras else build)(args.rows, args.dim, args.batch, args.length)
    for f in steps.values():  # warm-up (tracing)
        f()
        f()
    times = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for m in MODES:
            t0 = time.perf_counter()
            steps[m]()
            times[m].append(time.perf_counter() - t0)
    base = statistics.median(times["nonprivate"])
    for m in MODES:
        ts = sorted(times[m])
        result.setdefault(m, {})
        result[m].update({"median_ms": 1e3 * statistics.median(ts),
                          "p10_ms": 1e3 * ts[len(ts) // 10],
                          "p90_ms": 1e3 * ts[(9 * len(ts)) // 10],
                          "ratio": statistics.median(ts) / base})
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
