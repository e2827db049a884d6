"""What the DP noise costs on this machine, and what the ghost step costs without it.

    python -m research.ghost.noise_floor            # both parts
    python -m research.ghost.noise_floor --part ops  # CPU/wall ms of the sampler's pieces
    python -m research.ghost.noise_floor --part step --model mlp

``ops``: for the MLP's 670k parameters, the CPU and wall time of Philox words from TF's kernel, of
the Box-Muller transform as TF graph ops and under XLA (``jit_compile=True``), of
``tf.random.Generator.normal`` and of ``tf_dp``'s sampler (``add_gaussian_noise_structure``).
Every function returns its full output, so XLA cannot drop work.

``step``: non-private, ghost, and ghost with the query's noise replaced by nothing (patched, for
measurement only), interleaved in one process like ``bench.step_time``.

Measured on a 2-core CPU without GPU (TF 2.21, Keras 3.15, other processes paused; CPU time is
summed over threads), MLP sizes:

- Philox words (670k): 3.2-3.5 ms CPU, 2.1-2.4 ms wall; under XLA 8.5 ms CPU.
- Box-Muller transform (335k pairs) in TF graph ops: 4.8-4.9 ms CPU; under XLA 7.4-12.3 ms
  (XLA's CPU code for log/sin/cos is slower than Eigen's vectorised kernels).
- ``tf.random.Generator.normal``: 9.9-10.2 ms CPU. tf_dp's sampler: 8.2-8.7 ms CPU, 5.3-5.5 wall.
- Step ratios, ghost without noise / with noise: MLP 1.17-1.27x / 1.53-1.67x; CNN 1.51-1.69x /
  1.55-1.79x (several runs; the noise is most of the MLP's overhead and little of the CNN's).
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
    from tf_dp.dp_query import noise

    n = sum(math.prod(s) for s in SHAPES)
    h = n // 2
    gen = noise.make_generator(1)
    words = gen.uniform_full_int([3, h], tf.uint32)
    values = [tf.Variable(tf.zeros(s)) for s in SHAPES]
    sd = tf.constant(1.1)

    def transform():
        return noise.box_muller(words, tf.float32, sd)

    cases = {
        f"Philox words ({n})": (lambda: gen.uniform_full_int([n], tf.uint32), False),
        "Philox words, XLA": (lambda: gen.uniform_full_int([n], tf.uint32), True),
        f"Box-Muller transform ({h} pairs)": (transform, False),
        "Box-Muller transform, XLA": (transform, True),
        "tf.random.Generator.normal": (lambda: gen.normal([n]), False),
        "tf_dp add_gaussian_noise_structure": (
            lambda: noise.add_gaussian_noise_structure(gen, [v.read_value() for v in values], sd),
            False,
        ),
    }
    for name, (fn, xla) in cases.items():
        cpu, wall = _time(tf.function(fn, jit_compile=xla), reps=10 if xla else 60)
        print(f"{name:40s} cpu {cpu:7.2f} ms  wall {wall:7.2f} ms")


def part_step(model_name: str, rounds: int = 4) -> None:
    import tf_dp.dp_query.gaussian_query as gq
    from bench import step_time as st

    from bench.models import DEFAULT_BATCH

    batch = DEFAULT_BATCH[model_name]
    ds = st.dataset(model_name, batch)
    models, iters = {}, {}
    original = gq.add_gaussian_noise_structure
    try:
        for mode in ("nonprivate", "ghost", "ghost without noise"):
            if mode == "ghost without noise":
                gq.add_gaussian_noise_structure = lambda generator, values, stddevs: values
            models[mode] = st.build(model_name, mode.split()[0], batch)
            st.warm_up(models[mode], ds, 5)
            iters[mode] = iter(ds)
    finally:
        gq.add_gaussian_noise_structure = original
    wall: dict[str, list[float]] = {m: [] for m in models}
    for _ in range(rounds):
        for mode, model in models.items():
            st._sync(model.train_function(iters[mode]))
            for _ in range(10):
                t0 = time.perf_counter()
                st._sync(model.train_function(iters[mode]))
                wall[mode].append(time.perf_counter() - t0)
    base = statistics.median(wall["nonprivate"])
    for mode, w in wall.items():
        print(f"{model_name} {mode:22s} {statistics.median(w) * 1e3:6.1f} ms  "
              f"{statistics.median(w) / base:.2f}x")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--part", choices=["ops", "step", "both"], default="both")
    from bench.models import MODELS

    ap.add_argument("--model", choices=MODELS, default=None, help="a bench.models model")
    a = ap.parse_args()
    if a.part in ("ops", "both"):
        part_ops()
    if a.part in ("step", "both"):
        for m in [a.model] if a.model else ["mlp", "cnn"]:
            part_step(m)


if __name__ == "__main__":
    main()
