"""Ablation: the ghost step with the noise replaced (zeros / other samplers), same process.

    python -m research.ghost.ablate --model mlp

Each variant is traced with ``tf_dp.dp_query.gaussian_query.add_gaussian_noise`` patched, so it
measures how much of the DP step the noise costs. Research only: the variants without noise are
not private.
"""
import argparse
import contextlib
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

from bench import step_time as st  # noqa: E402
from tf_dp.dp_query import gaussian_query as gq  # noqa: E402


@contextlib.contextmanager
def patched(fn):
    old = gq.add_gaussian_noise_structure
    if fn is not None:
        gq.add_gaussian_noise_structure = fn
    try:
        yield
    finally:
        gq.add_gaussian_noise_structure = old


def no_noise(generator, values, stddev):
    return values


def tf_normal(generator, values, stddev):
    """TensorFlow's own sampler for comparison: ``Generator.normal`` per leaf."""
    return tf.nest.map_structure(
        lambda v: v + generator.normal(tf.shape(v), stddev=stddev, dtype=v.dtype), values)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    ds = st.dataset(a.model, a.batch_size)
    variants = {"nonprivate": ("nonprivate", None), "ghost": ("ghost", None),
                "ghost-no-noise": ("ghost", no_noise),
                "ghost-tf-normal": ("ghost", tf_normal)}
    fns = {}
    for name, (mode, patch) in variants.items():
        model = st.build(a.model, mode, a.batch_size)
        with patched(patch):
            st.warm_up(model, ds, 3)
        fns[name] = (model.train_function, iter(ds))
    times = {k: [] for k in fns}
    cpu = {k: [] for k in fns}
    for _ in range(a.rounds):
        for name, (fn, it) in fns.items():
            st._sync(fn(it))
            for _ in range(a.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                st._sync(fn(it))
                times[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    base = statistics.median(times["nonprivate"])
    for name, ts in times.items():
        m = statistics.median(ts)
        c = statistics.median(cpu[name])
        print(f"{name:16s} {1000 * m:7.2f} ms  {m / base:5.2f}x  cpu {1000 * c:7.2f} ms")


if __name__ == "__main__":
    main()
