"""The per-layer choice between Gram ("ghost") norms and materialised per-example gradients on
the reference CNN, measured: the bench's train step with the library's choice
(``tf_dp.gradients.ghost.factors._use_ghost``), with every convolution materialised, and with
every convolution on the Gram route.

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
from tf_dp.gradients.ghost import factors  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps", type=int, default=4)
    a = ap.parse_args()
    library = factors._use_ghost
    variants = {
        "nonprivate": None,
        "auto (library's choice)": library,
        "auto, every conv materialised": lambda f: False,
        "auto, every conv by Gram norms": lambda f: True,
    }
    ds = st.dataset("cnn", a.batch_size)
    runs = {}
    try:
        for name, choice in variants.items():
            if choice is not None:
                factors._use_ghost = choice
            model = st.build("cnn", "nonprivate" if choice is None else "auto", a.batch_size)
            st.warm_up(model, ds, 3)  # traced here, with this variant's choice
            runs[name] = (model.train_function, iter(ds))
    finally:
        factors._use_ghost = library
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
        print(f"B={a.batch_size} {name:<32} wall {w * 1e3:7.2f} ms ({w / w0:.2f}x)  "
              f"cpu {c * 1e3:7.2f} ms ({c / c0:.2f}x)")


if __name__ == "__main__":
    main()
