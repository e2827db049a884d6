"""How tight are the audits? White-box Dirac canaries, every iterate visible, DP-SGD through fit.

For certified epsilon 2, 4 and 8 (RDP, delta = 1e-5, 10 steps; the noise multiplier is solved
for), trains ``--trainings`` private models with ``--canaries`` canaries each and prints the
audited bounds and their ratio to the certified epsilon. Full batch (q = 1) and Poisson (q = 0.5).

    python -m research.auditing.tightness                 # the README's table
    python -m research.auditing.tightness --quick         # smoke run
"""

from __future__ import annotations

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from scipy import optimize  # noqa: E402

import tf_dp.keras  # noqa: E402
from tf_dp.accounting import dp_sgd_epsilon  # noqa: E402
from tf_dp.auditing import audit_dp_sgd  # noqa: E402

DELTA, STEPS, N = 1e-5, 10, 64


def noise_for(epsilon: float, q: float) -> float:
    """Noise multiplier whose certified (RDP) epsilon over STEPS steps is ``epsilon``."""
    def gap(z):
        return dp_sgd_epsilon(N, q * N, z, DELTA, steps=STEPS).epsilon - epsilon
    return optimize.brentq(gap, 0.3, 100.0, xtol=1e-4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--canaries", type=int, default=1000)
    parser.add_argument("--trainings", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.canaries, args.trainings = 200, 1
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    print("| q | certified eps (rdp) | sigma | score | one-run | many-run (CP) | GDP bound -> eps "
          "| best / certified | trainings x canaries | minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for q in (1.0, 0.5):
        for target in (2.0, 4.0, 8.0):
            z = noise_for(target, q)
            start = time.time()
            report = audit_dp_sgd(
                model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
                optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
                    l2_norm_clip=1.0, noise_multiplier=z, learning_rate=0.1,
                    gradient_mode="vectorized"),
                x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                sampling_probability=q, steps=STEPS, num_canaries=args.canaries,
                trainings=args.trainings, delta=DELTA, seed=int(target * 10 + q * 100))
            cert = report.certified.epsilon
            one, many, gdp = report.one_run.epsilon, report.many_run.epsilon, \
                report.gdp_bound.epsilon
            print(f"| {q:g} | {cert:.2f} | {z:.3f} | {report.score} | {one:.2f} ({one / cert:.2f}x) | {many:.2f} "
                  f"({many / cert:.2f}x) | mu >= {report.gdp_bound.mu:.3f} -> {gdp:.2f} "
                  f"({gdp / cert:.2f}x) | {max(one, many, gdp) / cert:.2f}x | {args.trainings} x "
                  f"{args.canaries} | {(time.time() - start) / 60:.1f} |", flush=True)


if __name__ == "__main__":
    main()
