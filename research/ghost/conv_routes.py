"""The per-layer choice between Gram ("ghost") norms and materialised per-example gradients on
the reference CNN, measured: the bench's train step with the library's choice
(``tf_dp.gradients.ghost.factors.use_gram``; materialised kernels from the native
``TfDpConvKernelGrads``), the same choice with the materialised kernels from the patches instead,
with every convolution materialised, and with every convolution on the Gram route.

    python -m research.ghost.conv_routes --batch_size 256

Each variant is traced (so the choice is fixed) while the patch is in place, then all variants
run interleaved in one process: 6 rounds of 4 timed steps after one untimed step. Printed: the
median wall and CPU time per step (CPU summed over threads) and the ratios to the non-private
step. Research only; the figures are in ``bench/README.md`` ("Convolutions: Gram norms or
per-example gradients").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from bench import step_time as st  # noqa: E402
from tf_dp.gradients.ghost import conv, factors  # noqa: E402


def _set(use_gram, native_kernel) -> None:
    factors.use_gram = use_gram  # what factors._use_ghost asks
    conv.use_gram = use_gram     # what the convolution rule asks before its native kernel
    conv._native_kernel_grads = native_kernel


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    library = (factors.use_gram, conv._native_kernel_grads)
    no_native = lambda layer, x, g: None  # noqa: E731
    variants = {
        "nonprivate": None,
        "auto (library's choice)": library,
        "auto, choice, kernels from patches": (library[0], no_native),
        "auto, every conv materialised": (lambda t, c, d: False, library[1]),
        "auto, every conv by Gram norms": (lambda t, c, d: True, library[1]),
    }
    ds = st.dataset("cnn", a.batch_size)
    runs = {}
    try:
        for name, choice in variants.items():
            if choice is not None:
                _set(*choice)
            model = st.build("cnn", "nonprivate" if choice is None else "auto", a.batch_size)
            st.warm_up(model, ds, 3)  # traced here, with this variant's choice
            runs[name] = (model.train_function, iter(ds))
    finally:
        _set(*library)
    wall = {k: [] for k in runs}
    cpu = {k: [] for k in runs}
    for _ in range(a.rounds):
        for name, (fn, it) in runs.items():
            st._sync(fn(it))
            for _ in range(a.steps):
                t0, c0 = time.perf_counter(), time.process_time()
                st._sync(fn(it))
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.process_time() - c0)
    w0, c0 = statistics.median(wall["nonprivate"]), statistics.median(cpu["nonprivate"])
    for name in runs:
        w, c = statistics.median(wall[name]), statistics.median(cpu[name])
        print(f"B={a.batch_size} {name:<36} wall {w * 1e3:7.2f} ms ({w / w0:.2f}x)  "
              f"cpu {c * 1e3:7.2f} ms ({c / c0:.2f}x)")


if __name__ == "__main__":
    main()
