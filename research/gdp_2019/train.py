"""Bu et al. 2019, training side, on Fashion-MNIST (MNIST is not on this machine).

Two experiments with the paper's CNN (``tutorials/mnist_dpsgd_tutorial_keras.py: build_cnn``),
DP-SGD (NoisySGD, Algorithm 1) with a constant learning rate, Poisson sampling with
``p = 256 / 60000``:

* ``table1``: the six training rows of Table 1 (learning rate, clip ``R``, ``sigma``, epochs as
  printed). One run per row (the paper averages 10). Each row's epsilon is computed from the
  ledger of the run with the CLT (``gdp``), the moments accountant, RDP and PLD.
* ``noise``: Sec. 4.2 / Figure 4 (top), accuracy at equal epsilon after 20 epochs:
  ``sigma = 1.3`` (moments accountant epsilon ``eps_MA``); the CLT-reduced ``sigma~`` of
  Eqs. 3.3-3.4 (same epsilon by the CLT, *not* certified); and the ``sigma`` the certified PLD
  accountant calibrates to the same ``eps_MA`` (the certified version of the reduction).

No hyperparameter is tuned here (all are the paper's), so the test set is only evaluated, never
searched over.

    python research/gdp_2019/train.py                       # both experiments (about 55 min on 2 CPU cores)
    python research/gdp_2019/train.py --part noise          # Figure 4 (top) only
    python research/gdp_2019/train.py --part table1 --rows 1,2,3
    python research/gdp_2019/train.py --quick               # smoke run (tests): tiny data, 1 epoch, no files

Writes, beside this file, ``train_table1.csv`` (one row per Table 1 row), ``train_noise.csv``
(one row per noise level), ``train_curves.csv`` (test accuracy after every epoch of every run) and
``train_noise.png``. The noise experiment runs first, then the Table 1 rows; rows are appended as runs finish, so a
partial run leaves its finished rows.
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BATCH, DELTA = 256, 1e-5
ACCOUNTANTS = ("gdp", "moments", "rdp", "pld")


def _accounting_module():
    spec = importlib.util.spec_from_file_location(
        "gdp_2019_accounting", os.path.join(HERE, "accounting.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _shared():  # once: the tutorial it loads defines absl flags
    spec = importlib.util.spec_from_file_location(
        "research_fashion_mnist", os.path.join(ROOT, "research", "fashion_mnist.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_run(label, data, eta, clip, sigma, epochs, seed, noise_seed=None):
    """One DP-SGD run; returns (summary row, per-epoch curve)."""
    import keras

    import tf_dp
    from tf_dp.accounting import compute_epsilon

    (x, y), (xt, yt) = data
    keras.utils.set_random_seed(seed)
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=sigma,
                                          learning_rate=eta, noise_seed=noise_seed)
    model = tf_dp.keras.make_private(_shared().tutorial_cnn())
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=BATCH / len(x), seed=seed)
    curve = []

    class Evaluate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            _, acc = model.evaluate(xt, yt, batch_size=2000, verbose=0)
            curve.append({"run": label, "sigma": sigma, "epoch": epoch + 1,
                          "test_accuracy": float(acc)})
            print(f"  {label}: epoch {epoch + 1} test acc {acc:.4f}", flush=True)

    start = time.time()
    model.fit(batches, epochs=epochs, callbacks=[Evaluate()], verbose=0)
    row = {"run": label, "eta": eta, "clip": clip, "sigma": sigma, "epochs": epochs,
           "steps": opt.ledger.num_samples, "test_accuracy": curve[-1]["test_accuracy"],
           "best_test_accuracy": max(c["test_accuracy"] for c in curve),
           "seconds": round(time.time() - start, 1)}
    for name in ACCOUNTANTS:
        r = compute_epsilon(opt.ledger, DELTA, accountant=name)
        row[f"eps_{name}"] = r.epsilon
        if name == "gdp":
            row["mu"] = r.mu
    print(f"{label}: sigma {sigma:.4f}, {row['steps']} steps, test acc "
          f"{row['test_accuracy']:.4f}, eps CLT {row['eps_gdp']:.3f} / MA "
          f"{row['eps_moments']:.3f} / RDP {row['eps_rdp']:.3f} / PLD {row['eps_pld']:.3f}, "
          f"{row['seconds']:.0f} s", flush=True)
    return row, curve


def _append(path, rows):
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        if new:
            w.writeheader()
        w.writerows(rows)


def noise_levels(epochs):
    """sigma = 1.3, the CLT's sigma~ and the PLD-calibrated sigma at the same eps_MA."""
    from tf_dp.accounting import calibrate_noise_multiplier, dp_sgd_epsilon, dp_sgd_run, gdp

    sigma = 1.3
    _, steps = dp_sgd_run(60000, BATCH, sigma, epochs=epochs)
    eps_ma = dp_sgd_epsilon(60000, BATCH, sigma, DELTA, steps=steps,
                            accountant="moments").epsilon
    return eps_ma, [
        ("sigma (moments accountant)", sigma),
        ("sigma~ (CLT, Eq. 3.3-3.4)", gdp.reduced_noise(BATCH / 60000, sigma, steps, DELTA)),
        ("sigma calibrated by PLD (certified)",
         calibrate_noise_multiplier(eps_ma, DELTA, 60000, BATCH, steps=steps, accountant="pld")),
    ]


def plot_noise(curves, rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for row in rows:
        pts = [c for c in curves if c["run"] == row["run"]]
        ax.plot([c["epoch"] for c in pts], [100 * c["test_accuracy"] for c in pts], marker="o",
                ms=3, label=f"{row['run']}: {row['sigma']:.3f} (PLD eps {row['eps_pld']:.2f})")
    ax.set_xlabel("epoch")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST, Bu et al. 2019 CNN, equal eps_MA after 20 epochs")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", choices=("table1", "noise", "all"), default="all")
    p.add_argument("--rows", default="1,2,3,4,5,6", help="Table 1 rows to train (1-based)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise_seed", type=int, default=None,
                   help="fixed noise seed: tests only (voids the guarantee; the ledger says so)")
    p.add_argument("--quick", action="store_true",
                   help="3000 training / 1000 test images, 1 epoch, row 1 and sigma = 1.3 only, "
                        "no files")
    p.add_argument("--out_dir", default=HERE)
    args = p.parse_args(argv)

    table = _accounting_module().TABLE1
    data = _shared().load(3000, 1000) if args.quick else _shared().load()
    results = {"table1": [], "noise": []}
    curves_path = os.path.join(args.out_dir, "train_curves.csv")
    if args.part in ("noise", "all"):
        epochs = 20
        eps_ma, levels = noise_levels(epochs)
        curves = []
        for label, sigma in levels[:1] if args.quick else levels:
            row, curve = train_run(label, data, 0.25, 1.5, sigma, 1 if args.quick else epochs,
                                   args.seed, args.noise_seed)
            row["target_eps_ma"] = eps_ma
            results["noise"].append(row)
            curves.extend(curve)
            if not args.quick:
                _append(os.path.join(args.out_dir, "train_noise.csv"), [row])
                _append(curves_path, curve)
        if not args.quick:
            plot_noise(curves, results["noise"], os.path.join(args.out_dir, "train_noise.png"))
    if args.part in ("table1", "all"):
        rows = [1] if args.quick else [int(r) for r in args.rows.split(",")]
        for i in rows:
            eta, clip, sigma, epochs, acc, _, p_clt, p_ma = table[i - 1]
            row, curve = train_run(f"table1_row{i}", data, eta, clip, sigma,
                                   1 if args.quick else epochs, args.seed, args.noise_seed)
            row.update(paper_mnist_accuracy=acc, paper_eps_clt=p_clt, paper_eps_ma=p_ma)
            results["table1"].append(row)
            if not args.quick:
                _append(os.path.join(args.out_dir, "train_table1.csv"), [row])
                _append(curves_path, curve)
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
