"""What the DP noise costs on this machine: CPU and wall time of the Gaussian sampler's pieces.

    python -m research.ghost.noise_floor

For the MLP's 670k parameters, the CPU and wall time of Philox words from TF's kernel, of the
Box-Muller transform as TF graph ops and under XLA (``jit_compile=True``), of
``tf.random.Generator.normal`` and of ``tf_dp``'s sampler (``add_gaussian_noise_structure``) with
TensorFlow ops and with its native op (``tf_dp/dp_query/native``).
Every function returns its full output, so XLA cannot drop work. The measured figures and the
step-level measurements (ghost step with and without noise) are in ``research/ghost/README.md``.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf  # noqa: E402

SHAPES = [(784, 512), (512,), (512, 512), (512,), (512, 10), (10,)]


def _time(fn, reps: int = 60) -> tuple[float, float]:
    for _ in range(5):
        _ = fn()
    cpu, wall = [], []
    for _ in range(reps):
        c0, w0 = time.process_time(), time.perf_counter()
        out = fn()
        for t in tf.nest.flatten(out):
            t[:1].numpy()
        cpu.append(time.process_time() - c0)
        wall.append(time.perf_counter() - w0)
    return statistics.median(cpu) * 1e3, statistics.median(wall) * 1e3


def part_ops() -> None:
    from tf_dp.dp_query import native, noise

    n = sum(math.prod(s) for s in SHAPES)
    h = n // 2
    gen = noise.make_generator(1)
    words = gen.uniform_full_int([3, h], tf.uint32)
    values = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    sd = tf.constant(1.1)

    def transform():
        return noise.box_muller(words, tf.float32, sd)

    def sampler(use_native):
        def draw():  # the switch is read while tracing
            native.set_enabled(use_native)
            try:
                return noise.add_gaussian_noise_structure(gen, [v.read_value() for v in values], sd)
            finally:
                native.set_enabled(None)
        return draw

    cases = {
        f"Philox words ({n})": (lambda: gen.uniform_full_int([n], tf.uint32), False),
        "Philox words, XLA": (lambda: gen.uniform_full_int([n], tf.uint32), True),
        f"Box-Muller transform ({h} pairs)": (transform, False),
        "Box-Muller transform, XLA": (transform, True),
        "tf.random.Generator.normal": (lambda: gen.normal([n]), False),
        "tf_dp add_gaussian_noise_structure, TF ops": (sampler(False), False),
        "tf_dp add_gaussian_noise_structure, native": (sampler(True), False),
    }
    for name, (fn, xla) in cases.items():
        cpu, wall = _time(tf.function(fn, jit_compile=xla), reps=10 if xla else 60)
        print(f"{name:40s} cpu {cpu:7.2f} ms  wall {wall:7.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.parse_args()
    part_ops()


if __name__ == "__main__":
    main()
