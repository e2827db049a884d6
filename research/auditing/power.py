"""Does the audit catch a broken DP optimizer? Planted defects under threat_model="white_box_gradient".

Runs ``audit_dp_sgd`` (4-input linear model, DPKerasSGDOptimizer clip 1, noise multiplier 2,
Poisson rate 0.5, 10 steps, RDP certificate at delta = 1e-5, 95% confidence) on a correct
optimizer and on five broken ones whose ledger records the configured values: no noise, noise /
10, no clipping, clip 10x the recorded, sampling rate 2x the recorded (the same plants as
tests/test_audit_power.py). Prints one markdown row per run: flagged or not, the certified-profile
test, the assumption-free lower bound, and the power calculation.

    python -m research.auditing.power                                   # 1 training x 4000
    python -m research.auditing.power --trainings 3                     # the README's larger run
    python -m research.auditing.power --only "none (correct run)" --seeds 20      # false alarms
    python -m research.auditing.power --noise_divisor 1.88 --only "noise / 1.88" --seeds 20
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

import tf_dp.data  # noqa: E402
import tf_dp.engine.step  # noqa: E402
import tf_dp.keras  # noqa: E402
from tf_dp.auditing import audit_dp_sgd  # noqa: E402
from tf_dp.dp_query.gaussian_query import GaussianSumQuery  # noqa: E402

NOISE, Q, STEPS, DELTA = 2.0, 0.5, 10, 1e-5


def broken_query(noise_scale=1.0, clip_scale=1.0, clip=True):
    """The engine's Gaussian query with a defect; what it records is untouched."""

    class Broken(GaussianSumQuery):
        def get_noised_result(self, sample_state, global_state):
            scaled = global_state._replace(stddev=global_state.stddev * noise_scale)
            result, _ = super().get_noised_result(sample_state, scaled)
            return result, global_state

        def clip_weights(self, params, squared_norms):
            if not clip:
                return tf.nest.map_structure(lambda s: tf.ones_like(s, tf.float32), squared_norms)
            return super().clip_weights(params * clip_scale, squared_norms)

    return Broken


def double_sampling(original):
    def broken(x, y=None, sampling_probability=None, **kw):
        batches = original(x, y, sampling_probability=min(1.0, 2 * sampling_probability), **kw)
        return dataclasses.replace(
            batches, tf_dp_sampling=(batches.tf_dp_sampling[0], sampling_probability))

    return broken


DEFECTS = {
    "none (correct run)": {},
    "no noise": {"noise_scale": 0.0},
    "noise / 10": {"noise_scale": 0.1},
    "no clipping": {"clip": False},
    "clip 10x the recorded": {"clip_scale": 10.0},
    "sampling 2x the recorded": None,
}


def run(defect: str, canaries: int, trainings: int, seed: int):
    query, batches = tf_dp.engine.step.GaussianSumQuery, tf_dp.data.poisson_batches
    try:
        if DEFECTS[defect] is None:
            tf_dp.data.poisson_batches = double_sampling(batches)
        elif DEFECTS[defect]:
            tf_dp.engine.step.GaussianSumQuery = broken_query(**DEFECTS[defect])
        rng = np.random.default_rng(0)
        x = rng.normal(size=(64, 4)).astype("float32")
        y = (x[:, 0] > 0).astype("int32")
        return audit_dp_sgd(
            model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
            optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=NOISE, learning_rate=0.1,
                gradient_mode="vectorized"),
            x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            sampling_probability=Q, steps=STEPS, num_canaries=canaries, trainings=trainings,
            delta=DELTA, threat_model="white_box_gradient", seed=seed)
    finally:
        tf_dp.engine.step.GaussianSumQuery, tf_dp.data.poisson_batches = query, batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--canaries", type=int, default=4000)
    parser.add_argument("--trainings", type=int, default=1)
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--only", action="append", default=None,
                        help="run only this defect (repeatable); default: all")
    parser.add_argument("--noise_divisor", type=float, default=None,
                        help="add the defect 'noise / X' (e.g. the power calculation's factor)")
    args = parser.parse_args()
    if args.noise_divisor is not None:
        DEFECTS[f"noise / {args.noise_divisor:g}"] = {"noise_scale": 1.0 / args.noise_divisor}
    flagged = {}
    print("| defect | seed | violation | certified-profile test | lower bound (one-run / "
          "many-run) | certified | smallest detected (p = 0.9) | minutes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for defect in [d for d in DEFECTS if args.only is None or d in args.only]:
        for seed in range(args.seeds):
            start = time.time()
            r = run(defect, args.canaries, args.trainings, seed)
            p, w = r.profile, r.power
            print(f"| {defect} | {seed} | {r.violation} | eps >= {p.epsilon:.2f} vs "
                  f"{p.certified_epsilon:.2f} at delta {p.delta:.2g} (TPR >= {p.tpr_low:.3f}, "
                  f"FPR <= {p.fpr_high:.3g}) | {r.one_run.epsilon:.2f} / {r.many_run.epsilon:.2f}"
                  f" | {r.certified.epsilon:.2f} | noise / {w.noise_factor:.2f} (eps "
                  f"{w.epsilon:.2f}) | {(time.time() - start) / 60:.1f} |", flush=True)
            flagged.setdefault(defect, []).append(r.violation)
    for defect, flags in flagged.items():
        print(f"\n{defect}: flagged in {sum(flags)} of {len(flags)} runs")


if __name__ == "__main__":
    main()
