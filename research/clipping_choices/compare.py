"""Fixed, adaptive and automatic clipping on the tutorial model, at equal privacy.

The reference CNN of the tutorials (Bu et al. 2019) on Fashion-MNIST, DP-SGD with learning rate
0.5, Poisson sampling with expected batch 256, for ``--epochs`` epochs. Every run has the same
effective noise multiplier ``z_eff = 1.1`` per step, so the same epsilon (computed from each run's
ledger):

* ``fixed C=...``: ``GaussianSumQuery`` (``l2_norm_clip=C, noise_multiplier=1.1``) at several
  clips, i.e. what a clip sweep would find;
* ``adaptive``: ``QuantileAdaptiveClipSumQuery`` (Andrew et al. 2021) starting from ``C_0 = 0.1``,
  target quantile 0.5, ``eta = 0.2``, count noise ``sigma_b = m / 20``, sum noise multiplier from
  ``sum_noise_multiplier_for(1.1, sigma_b)`` so that both queries together give ``z_eff = 1.1``;
* ``automatic``: ``AutomaticClipSumQuery`` (Bu et al. 2022), ``C = 1``, ``gamma = 0.01``.

Nothing is tuned on the test set: every setting is fixed above and all are reported.

    python research/clipping_choices/compare.py            # 5 epochs per run (about 6 min on 2 CPU cores)
    python research/clipping_choices/compare.py --quick    # smoke run (tests): tiny data, 1 epoch, no files

Writes ``results.csv`` (one row per run) and ``curves.csv`` (test accuracy after every epoch)
beside this file.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BATCH, DELTA, Z_EFF, LEARNING_RATE = 256, 1e-5, 1.1, 0.5
FIXED_CLIPS = (0.1, 1.5, 10.0)  # 1.5: the tutorial's default


@functools.lru_cache(maxsize=None)
def _shared():  # once: the tutorial it loads defines absl flags
    spec = importlib.util.spec_from_file_location(
        "research_fashion_mnist", os.path.join(ROOT, "research", "fashion_mnist.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def optimizers():
    """(label, factory) for every run; a factory returns (optimizer, clip at the end of training
    as a zero-argument callable)."""
    import tf_dp

    def fixed(c):
        opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=c, noise_multiplier=Z_EFF,
                                              learning_rate=LEARNING_RATE)
        return opt, lambda: c

    runs = [(f"fixed C={c:g}", functools.partial(fixed, c)) for c in FIXED_CLIPS]

    def adaptive():
        sigma_b = BATCH / 20
        query = tf_dp.QuantileAdaptiveClipSumQuery(
            initial_l2_norm_clip=0.1,
            noise_multiplier=tf_dp.dp_query.sum_noise_multiplier_for(Z_EFF, sigma_b),
            target_unclipped_quantile=0.5, learning_rate=0.2, clipped_count_stddev=sigma_b,
            expected_num_records=BATCH)
        opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=LEARNING_RATE)
        return opt, lambda: float(query.l2_norm_clip.numpy())

    def automatic():
        query = tf_dp.AutomaticClipSumQuery(l2_norm_clip=1.0, stddev=Z_EFF * 1.0, gamma=0.01)
        opt = tf_dp.keras.DPKerasSGDOptimizer(dp_sum_query=query, learning_rate=LEARNING_RATE)
        return opt, lambda: 1.0

    return runs + [("adaptive (q=0.5, C0=0.1)", adaptive), ("automatic (C=1)", automatic)]


def train_run(label, make_optimizer, data, epochs, seed):
    import keras

    import tf_dp
    from tf_dp.accounting import compute_epsilon

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    opt, final_clip = make_optimizer()
    model = tf_dp.keras.make_private(_shared().tutorial_cnn())
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    curve = []

    class Evaluate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            _, acc = model.evaluate(xt, yt, batch_size=2000, verbose=0)
            curve.append({"run": label, "epoch": epoch + 1, "test_accuracy": float(acc)})
            print(f"  {label}: epoch {epoch + 1} test acc {acc:.4f}", flush=True)

    start = time.time()
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=BATCH / len(x), seed=seed),
              epochs=epochs, callbacks=[Evaluate()], verbose=0)
    row = {"run": label, "epochs": epochs, "steps": opt.ledger.num_samples,
           "test_accuracy": curve[-1]["test_accuracy"],
           "final_clip": final_clip(),
           "seconds": round(time.time() - start, 1)}
    for name in ("rdp", "pld"):
        row[f"eps_{name}"] = compute_epsilon(opt.ledger, DELTA, accountant=name).epsilon
    print(f"{label}: test acc {row['test_accuracy']:.4f}, eps RDP {row['eps_rdp']:.3f} / PLD "
          f"{row['eps_pld']:.3f}, clip at the end {row['final_clip']:.3g}, {row['seconds']:.0f} s",
          flush=True)
    return row, curve


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true",
                   help="3000 training / 1000 test images, 1 epoch, no files")
    p.add_argument("--out_dir", default=HERE)
    args = p.parse_args(argv)
    data = _shared().load(3000, 1000) if args.quick else _shared().load()
    epochs = 1 if args.quick else args.epochs
    rows, curves = [], []
    for label, make in optimizers():
        row, curve = train_run(label, make, data, epochs, args.seed)
        rows.append(row)
        curves.extend(curve)
    if not args.quick:
        for name, items in (("results.csv", rows), ("curves.csv", curves)):
            with open(os.path.join(args.out_dir, name), "w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=list(items[0]))
                w.writeheader()
                w.writerows(items)
    return rows


if __name__ == "__main__":
    main()
