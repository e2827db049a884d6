"""DP-SGD on scattering features of Fashion-MNIST: a linear classifier at epsilon <= 3.

The setting of Tramer & Boneh 2021 ("Differentially private learning needs better features (or
much more data)"), re-implemented with tf_dp: fixed scattering features (``scattering.py``: J = 2,
L = 8, 81 x 7 x 7 per image), per-example group normalisation (27 groups), and a linear
classifier trained with DP-SGD (momentum) on Poisson-sampled batches. The features and the
normalisation of one image depend on that image only, so they cost no privacy; all the privacy
is spent by the DP-SGD steps, recorded in the optimizer's ledger.

Runs (``--runs``), all at the same budget (epsilon <= 3 at delta = 1e-5), the noise multiplier
calibrated for the planned steps by a certified accountant:

* ``scatter_linear``: scattering features, no normalisation (noise calibrated by RDP);
* ``scatter_gn_linear``: + group normalisation;
* ``scatter_gn_linear_pld``: + the noise calibrated by the PLD accountant instead of RDP (PLD's
  tighter certified bound allows less noise for the same epsilon);
* ``scatter_gn_linear_pld_ema``: + an exponential moving average of the iterates (momentum 0.9,
  post-processing, so free) used for evaluation.

Hyperparameters (batch, epochs, learning rate, clip) were chosen with ``--validation``: training on
the first 50,000 training images and evaluating on the last 10,000, never on the test set.

    python research/utility_fashion_mnist/train_scatternet.py             # about 6 min on 2 CPU cores
    python research/utility_fashion_mnist/train_scatternet.py --quick     # smoke run (tests), no files

Writes ``scatternet_results.csv`` and, for the last run, ``out/scatternet.keras`` and
``out/scatternet_ledger.json`` beside this file. Anyone can re-evaluate the test accuracy of the
saved model (``evaluate_saved``) and recompute epsilon from the saved ledger.
"""

from __future__ import annotations

import argparse
import csv
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

HERE = os.path.dirname(os.path.abspath(__file__))
#: run name -> (group normalisation, accountant that calibrates the noise, EMA of the iterates)
RUNS = {
    "scatter_linear": (False, "rdp", False),
    "scatter_gn_linear": (True, "rdp", False),
    "scatter_gn_linear_pld": (True, "pld", False),
    "scatter_gn_linear_pld_ema": (True, "pld", True),
}


def _scattering():
    sys.path.insert(0, HERE)
    import scattering

    return scattering


def features(images, normalise):
    """Flattened scattering features of uint8 ``images`` (group-normalised if ``normalise``)."""
    f = _scattering().scattering_features(images.astype("float32") / 255.0)
    return flat(f, normalise)


def flat(f, normalise):
    if normalise:
        f = _scattering().group_normalize(f)
    return f.reshape(len(f), -1)


def load(train_size=None, test_size=None):
    from tf_dp.data import DEBIAN_FASHION_MNIST_DIR, load_fashion_mnist_idx

    (x, y), (xt, yt) = load_fashion_mnist_idx(DEBIAN_FASHION_MNIST_DIR)
    if train_size:
        x, y = x[:train_size], y[:train_size]
    if test_size:
        xt, yt = xt[:test_size], yt[:test_size]
    return (x, y.astype("int32")), (xt, yt.astype("int32"))


def train(name, feats, labels, args, out_prefix=None):
    import keras

    import tf_dp
    from tf_dp.accounting import calibrate_noise_multiplier, compute_epsilon

    (x, xt), (y, yt) = feats, labels
    n = len(x)
    q = args.batch_size / n
    steps_per_epoch = int(round(1 / q))
    steps = steps_per_epoch * args.epochs
    _, accountant, ema = RUNS[name]
    sigma = calibrate_noise_multiplier(args.target_epsilon, args.delta, n, args.batch_size,
                                       steps=steps, accountant=accountant)
    keras.utils.set_random_seed(args.seed)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=args.l2_norm_clip, noise_multiplier=sigma, learning_rate=args.learning_rate,
        momentum=args.momentum, use_ema=ema, ema_momentum=args.ema_momentum)
    model = tf_dp.keras.DPSequential([keras.Input((x.shape[1],)),
                                      keras.layers.Dense(10, kernel_initializer="zeros")],
                                     name=name)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    start = time.time()
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=q), epochs=args.epochs,
              verbose=0)
    seconds = time.time() - start
    _, acc = model.evaluate(xt, yt, batch_size=2000, verbose=0)  # EMA weights when use_ema
    row = {"run": name, "evaluated_on": "validation" if args.validation else "test",
           "accuracy": float(acc), "calibrated_by": accountant, "noise_multiplier": sigma,
           "l2_norm_clip": args.l2_norm_clip, "batch_size": args.batch_size,
           "epochs": args.epochs, "steps": opt.ledger.num_samples,
           "learning_rate": args.learning_rate, "momentum": args.momentum,
           "ema_momentum": args.ema_momentum if ema else None, "seconds": round(seconds, 1)}
    for acc_name in ("rdp", "pld"):
        row[f"eps_{acc_name}"] = compute_epsilon(opt.ledger, args.delta,
                                                 accountant=acc_name).epsilon
    print(f"{name}: {row['evaluated_on']} acc {acc:.4f}, eps RDP {row['eps_rdp']:.3f} / PLD {row['eps_pld']:.3f}"
          f" (sigma {sigma:.4f}, {row['steps']} steps), {seconds:.0f} s", flush=True)
    if out_prefix:
        model.save(out_prefix + ".keras")
        opt.ledger.save(out_prefix + "_ledger.json")
    return row


def evaluate_saved(model_path=os.path.join(HERE, "out", "scatternet.keras")):
    """Test accuracy of the saved model on the Fashion-MNIST test set (features recomputed)."""
    import keras

    import tf_dp.keras  # noqa: F401  (registers DPSequential and the DP optimizer)

    _, (xt, yt) = load()
    model = keras.models.load_model(model_path)
    return float(model.evaluate(features(xt, True), yt, batch_size=2000, verbose=0)[1])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--target_epsilon", type=float, default=3.0)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--batch_size", type=int, default=8192)
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--learning_rate", type=float, default=16.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--l2_norm_clip", type=float, default=0.1)
    p.add_argument("--ema_momentum", type=float, default=0.9)
    p.add_argument("--seed", type=int, default=0, help="weight initialisation")
    p.add_argument("--repeats", type=int, default=3,
                   help="independent trainings per run (fresh DP noise and sampling each time)")
    p.add_argument("--validation", action="store_true",
                   help="train on the first 50,000 training images, evaluate on the last 10,000 "
                        "(hyperparameter choice without the test set); no files")
    p.add_argument("--quick", action="store_true",
                   help="3000 training / 1000 test images, batch 500, 3 epochs, no files")
    p.add_argument("--out_dir", default=HERE)
    args = p.parse_args(argv)
    if args.quick:
        (x, y), (xt, yt) = load(3000, 1000)
        args.batch_size, args.epochs = 500, 3
    else:
        (x, y), (xt, yt) = load()
    if args.validation:
        (x, y), (xt, yt) = (x[:50000], y[:50000]), (x[50000:], y[50000:])
    runs = args.runs.split(",")
    unknown = set(runs) - set(RUNS)
    if unknown:
        raise ValueError(f"--runs must name runs among {RUNS}, got {sorted(unknown)}")
    start = time.time()
    raw = [_scattering().scattering_features(a.astype("float32") / 255.0) for a in (x, xt)]
    cache = {norm: tuple(flat(f, norm) for f in raw) for norm in {RUNS[r][0] for r in runs}}
    print(f"features: {time.time() - start:.0f} s", flush=True)
    rows = []
    repeats = 1 if args.quick else args.repeats
    for i, name in enumerate(runs):
        for r in range(repeats):
            prefix = None
            if not (args.quick or args.validation) and i == len(runs) - 1 and r == repeats - 1:
                os.makedirs(os.path.join(args.out_dir, "out"), exist_ok=True)
                prefix = os.path.join(args.out_dir, "out", "scatternet")
            row = train(name, cache[RUNS[name][0]], (y, yt), args, prefix)
            rows.append({"repeat": r, **row})
    if not (args.quick or args.validation):
        with open(os.path.join(args.out_dir, "scatternet_results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return rows


if __name__ == "__main__":
    main()
