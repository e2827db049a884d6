"""Times the pieces of a ghost DP step (clipped sum alone, noise+ledger, full step) vs non-private.

    python -m research.ghost.profile_step --model mlp
"""
import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import keras  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp  # noqa: E402
from bench.models import build_model, make_batch  # noqa: E402
from tf_dp.gradients import make_clipper  # noqa: E402
from tf_dp.keras.losses import PerExampleLoss  # noqa: E402


def bench(fn, n=30):
    for _ in range(3):
        fn()
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        tf.nest.map_structure(lambda t: t.numpy() if hasattr(t, "numpy") else t, out)
        ts.append(time.perf_counter() - t)
    return 1000 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--modes", default="ghost")
    a = ap.parse_args()
    x, y = make_batch(a.model, a.batch_size)
    x, y = tf.constant(x), tf.constant(y)
    model = build_model(a.model)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model.compile(loss=loss, optimizer=keras.optimizers.SGD(0.05))
    opt = keras.optimizers.SGD(0.05)
    vs = model.trainable_variables

    @tf.function
    def nonprivate():
        with tf.GradientTape() as tape:
            l = loss(y, model(x, training=True))
        g = tape.gradient(l, vs)
        opt.apply(g, vs)
        return l

    print("nonprivate fwd+bwd+apply", round(bench(nonprivate), 2))
    lf = PerExampleLoss(model)
    for mode in a.modes.split(","):
        s = make_clipper(mode, model=model)
        q = tf_dp.GaussianSumQuery(1.0, 1.1)
        gs = q.initial_global_state()

        @tf.function
        def clipped():
            p = q.derive_sample_params(gs)
            return s.clipped_sum(lf, (x, y, None), vs, q, p).clipped_sum

        @tf.function
        def full():
            p = q.derive_sample_params(gs)
            c = s.clipped_sum(lf, (x, y, None), vs, q, p).clipped_sum
            noised, _ = q.get_noised_result(c, gs)
            opt.apply([n / 256.0 for n in noised], vs)
            return noised[0][0, 0]

        @tf.function
        def noise_only():
            noised, _ = q.get_noised_result([tf.zeros_like(v) for v in vs], gs)
            return noised

        print(mode, "clipped_sum", round(bench(clipped), 2), "noise", round(bench(noise_only), 2),
              "clipped+noise+apply", round(bench(full), 2))


if __name__ == "__main__":
    main()
