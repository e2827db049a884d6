"""Seed 002, "Improving gradient perturbation with momentum and decreasing clip" (2019).

DP-SGD on Fashion-MNIST at a fixed budget (epsilon = 2, delta = 1e-5), training until the
accountant says the budget is spent (``tf_dp.keras.PrivacyBudget``, the paper's Algorithm 1 loop):

* Figure 2: DP-SGD, + momentum 0.6, + decreasing clip, + both;
* Figure 3: momentum coefficients 0, 0.3, 0.6, 0.7, 0.9 (constant clip).

As in the paper: sampling probability q = 0.01 (Poisson), learning rate 0.02, initial clip C = 12,
the noise stddev ``sigma = C * sigma~`` with ``sigma~`` the smallest noise multiplier (to 0.01)
that runs the *target* number of epochs within the budget at the constant clip; the decreasing
clip ``C_t = C / min(2, 1 + t/T)`` (``tf_dp.keras.schedules.DecreasingClip``, ``T`` = target steps)
keeps the noise stddev fixed (``noise_stddev=``), so each later step costs less and training runs
longer.  Accountant: the moments accountant (the paper's).  The model is the paper's CNN (conv
5x5x10, conv 5x5x20, each with 2x2 max pooling, dense 50, dense 10).

    python research/momentum_clip_2019/train.py                    # all runs, results.csv/.png
    python research/momentum_clip_2019/train.py --runs sgd,both     # some runs only
    python research/momentum_clip_2019/train.py --quick             # tiny smoke run (tests)

Validation accuracy is measured on Fashion-MNIST's 10,000 test images after every epoch (100
steps); no hyperparameter was tuned on them.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))

#: name -> (momentum, decreasing clip)
RUNS = {
    "sgd": (0.0, False),           # DP-SGD (Fig. 2) = momentum 0 (Fig. 3)
    "momentum": (0.6, False),      # + momentum 0.6 (Fig. 2) = momentum 0.6 (Fig. 3)
    "clip": (0.0, True),           # + decreasing clip (Fig. 2)
    "both": (0.6, True),           # + both (Fig. 2)
    "momentum_0.3": (0.3, False),  # Fig. 3
    "momentum_0.7": (0.7, False),  # Fig. 3
    "momentum_0.9": (0.9, False),  # Fig. 3
}
FIGURE2 = ("sgd", "momentum", "clip", "both")
FIGURE3 = ("sgd", "momentum_0.3", "momentum", "momentum_0.7", "momentum_0.9")


def load_data(train_size=None, val_size=None):
    import numpy as np

    from tf_dp.data import DEBIAN_FASHION_MNIST_DIR, load_fashion_mnist_idx

    (x, y), (xt, yt) = load_fashion_mnist_idx(DEBIAN_FASHION_MNIST_DIR)
    if train_size:  # None or 0: all
        x, y = x[:train_size], y[:train_size]
    if val_size:
        xt, yt = xt[:val_size], yt[:val_size]
    prep = lambda a: (a.astype(np.float32) / 255.0)[..., None]  # noqa: E731
    return (prep(x), y.astype(np.int32)), (prep(xt), yt.astype(np.int32))


def build_model():
    import keras

    return keras.Sequential([
        keras.Input((28, 28, 1)),
        keras.layers.Conv2D(10, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(20, 5, activation="relu"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Flatten(),
        keras.layers.Dense(50, activation="relu"),
        keras.layers.Dense(10),
    ], name="seed002_cnn")


def calibrate(n, batch, target_steps, epsilon, delta, accountant):
    """Smallest sigma~ on the 0.01 grid with epsilon(target_steps) <= epsilon (the paper's rule)."""
    from tf_dp.accounting import calibrate_noise_multiplier, dp_sgd_epsilon

    s = calibrate_noise_multiplier(epsilon, delta, n, batch, steps=target_steps,
                                   accountant=accountant)
    s = math.floor(s * 100) / 100
    while dp_sgd_epsilon(n, batch, s, delta, steps=target_steps,
                         accountant=accountant).epsilon > epsilon:
        s = round(s + 0.01, 2)
    return s


def train_one(name, data, args, sigma_tilde, seed):
    import keras

    import tf_dp
    from tf_dp.accounting import compute_epsilon

    momentum, decreasing = RUNS[name]
    (x, y), (xv, yv) = data
    q = args.q
    target_steps = int(round(args.target_epochs / q))
    keras.utils.set_random_seed(seed)  # same initial weights for every run of one seed
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q)
    clip = (tf_dp.keras.schedules.DecreasingClip(args.clip, target_steps) if decreasing
            else args.clip)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_stddev=args.clip * sigma_tilde, learning_rate=args.lr,
        momentum=momentum)
    model = tf_dp.keras.make_private(build_model())
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    budget = tf_dp.keras.PrivacyBudget(args.epsilon, args.delta, accountant=args.accountant,
                                       verbose=False)
    curve = []

    class Validate(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            _, acc = model.evaluate(xv, yv, batch_size=2000, verbose=0)
            steps = opt.ledger.num_samples
            curve.append({"run": name, "seed": seed, "epoch": epoch + 1, "steps": steps,
                          "val_accuracy": float(acc)})
            print(f"  {name} seed {seed} epoch {epoch + 1:3d} steps {steps:5d} "
                  f"val acc {acc:.4f} ({time.time() - start:.0f} s)", flush=True)

    start = time.time()
    model.fit(batches, epochs=args.max_epochs,
              callbacks=[budget, Validate()], verbose=0)
    elapsed = time.time() - start
    steps = opt.ledger.num_samples
    eps = compute_epsilon(opt.ledger, args.delta, accountant=args.accountant).epsilon
    if curve and curve[-1]["steps"] != steps:  # stopped mid-epoch: validate the final model
        _, acc = model.evaluate(xv, yv, batch_size=2000, verbose=0)
        curve.append({"run": name, "seed": seed, "epoch": round(steps * q, 2), "steps": steps,
                      "val_accuracy": float(acc)})
    for c in curve:
        c["epsilon_final"] = eps
    summary = {"run": name, "seed": seed, "momentum": momentum, "decreasing_clip": decreasing,
               "sigma_tilde": sigma_tilde, "noise_stddev": args.clip * sigma_tilde,
               "steps": steps, "epochs": steps * q, "epsilon": eps,
               "final_val_accuracy": curve[-1]["val_accuracy"],
               "best_val_accuracy": max(c["val_accuracy"] for c in curve),
               "budget_stopped": budget.stopped, "seconds": elapsed,
               "ledger": opt.ledger, "next_entry": opt.next_sample_entry(0)}
    print(f"{name} seed {seed}: {steps} steps ({steps * q:.1f} epochs), eps {eps:.4f}, final val "
          f"acc {summary['final_val_accuracy']:.4f}, {elapsed:.0f} s", flush=True)
    return summary, curve


def plot(summaries, curves, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    labels = {"sgd": "DP-SGD", "momentum": "+ momentum 0.6", "clip": "+ decreasing clip",
              "both": "+ both", "momentum_0.3": "c = 0.3", "momentum_0.7": "c = 0.7",
              "momentum_0.9": "c = 0.9"}
    fig3_labels = dict(labels, sgd="c = 0", momentum="c = 0.6")
    for ax, runs, lab, title in ((axes[0], FIGURE2, labels, "Figure 2: momentum and clip"),
                                 (axes[1], FIGURE3, fig3_labels, "Figure 3: momentum coefficient")):
        for i, name in enumerate(runs):
            rows = [c for c in curves if c["run"] == name]
            if not rows:
                continue
            seeds = sorted({c["seed"] for c in rows})
            by_epoch = {}
            for c in rows:
                by_epoch.setdefault(c["epoch"], []).append(c["val_accuracy"])
            ep = sorted(e for e, v in by_epoch.items() if len(v) == len(seeds))
            mean = [np.mean(by_epoch[e]) for e in ep]
            ax.plot(ep, mean, "-", color=f"C{i}", label=f"{lab[name]}")
        ax.set_xlabel("epoch (100 steps)")
        ax.set_ylabel("validation accuracy")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="lower right")
    fig.suptitle("Fashion-MNIST, (2, 1e-5)-DP, training stops when the budget is spent "
                 f"(mean of {len({s['seed'] for s in summaries})} seed(s))", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default=",".join(RUNS), help="comma-separated run names")
    p.add_argument("--seeds", default="0", help="comma-separated seeds (weights init)")
    p.add_argument("--epsilon", type=float, default=2.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--q", type=float, default=0.01)
    p.add_argument("--lr", type=float, default=0.02)
    p.add_argument("--clip", type=float, default=12.0)
    p.add_argument("--target_epochs", type=float, default=5.0,
                   help="epochs the constant-clip run may take (sets sigma~)")
    p.add_argument("--max_epochs", type=int, default=100)
    p.add_argument("--accountant", default="moments")
    p.add_argument("--train_size", type=int, default=20000,
                   help="first N training images (0: all 60000)")
    p.add_argument("--val_size", type=int, default=None)
    p.add_argument("--quick", action="store_true",
                   help="2000 training / 500 validation examples, q = 0.05, target 10 steps, "
                        "runs sgd and both, no files")
    p.add_argument("--out_dir", default=HERE)
    p.add_argument("--replot", action="store_true",
                   help="redraw results.png from curves.csv and results.csv, no training")
    args = p.parse_args(argv)
    if args.replot:
        with open(os.path.join(args.out_dir, "curves.csv")) as f:
            curves = [dict(r, seed=int(r["seed"]), epoch=float(r["epoch"]),
                           val_accuracy=float(r["val_accuracy"])) for r in csv.DictReader(f)]
        with open(os.path.join(args.out_dir, "results.csv")) as f:
            summaries = [dict(r, seed=int(r["seed"])) for r in csv.DictReader(f)]
        plot(summaries, curves, os.path.join(args.out_dir, "results.png"))
        return None
    if args.quick:
        args.train_size, args.val_size, args.target_epochs, args.q = 2000, 500, 0.5, 0.05
        if args.runs == ",".join(RUNS):
            args.runs = "sgd,both"
    data = load_data(args.train_size, args.val_size)
    n = len(data[0][0])
    batch = int(round(args.q * n))
    target_steps = int(round(args.target_epochs / args.q))
    sigma_tilde = calibrate(n, batch, target_steps, args.epsilon, args.delta, args.accountant)
    print(f"n = {n}, q = {args.q}, target {target_steps} steps -> sigma~ = {sigma_tilde} "
          f"(noise stddev {args.clip * sigma_tilde:.2f}), {args.accountant} accountant", flush=True)
    summaries, curves = [], []
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in args.runs.split(","):
            s, c = train_one(name, data, args, sigma_tilde, seed)
            summaries.append(s)
            curves.extend(c)
    if not args.quick:
        os.makedirs(args.out_dir, exist_ok=True)
        with open(os.path.join(args.out_dir, "curves.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(curves[0]))
            w.writeheader()
            w.writerows(curves)
        cols = ["run", "seed", "momentum", "decreasing_clip", "sigma_tilde", "noise_stddev",
                "steps", "epochs", "epsilon", "final_val_accuracy", "best_val_accuracy",
                "budget_stopped", "seconds"]
        with open(os.path.join(args.out_dir, "results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
            w.writeheader()
            w.writerows(summaries)
        with open(os.path.join(args.out_dir, "config.json"), "w") as f:
            json.dump({k: v for k, v in vars(args).items() if k != "out_dir"}, f, indent=1)
        plot(summaries, curves, os.path.join(args.out_dir, "results.png"))
    return {"sigma_tilde": sigma_tilde, "n": n, "batch": batch, "target_steps": target_steps,
            "summaries": summaries, "curves": curves, "args": args}


if __name__ == "__main__":
    main()
