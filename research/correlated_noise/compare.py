"""DP-SGD, BandMF, BLT and the DP-FTRL tree at equal certified epsilon, on two tasks.

Two tasks (``--task``), each a linear classifier from zero on fixed features, trained with six
noise mechanisms at the same epsilon (delta = 1e-5) by one engine (``train``):

* ``fashion_mnist`` (default): the setting of ``research/utility_fashion_mnist`` (scattering
  features with group normalisation, clip 0.1, momentum 0.9, learning rate 16);
* ``text``: text classification through ``tf_dp.data.load_imdb_or_fortunes``: IMDb where it can
  be downloaded, else (offline, as here) Debian's fortunes, four topics, labelled as the fallback.
  Features: a bag of words (which of the ``TEXT_NUM_WORDS`` = 2,000 most frequent words occur),
  scaled to unit L2 norm; the vocabulary is counted on the training texts (see the loader's
  privacy note). Clip 0.1, momentum 0.9, learning rate 8 (tuned for DP-SGD on ``--validation``).

Mechanisms:

* ``dpsgd_poisson``: DP-SGD on Poisson batches (expected size n / b), amplification by
  subsampling, noise calibrated by tf_dp's PLD accountant (certified);
* ``dpsgd_cyclic``: DP-SGD on fixed batches in a fixed order: the data (shuffled once) cut into
  ``b`` batches, one epoch = the ``b`` batches in order, so every record takes part once every
  ``b`` steps (``k = epochs`` times);
* ``bandmf``: the same batches with banded correlated noise (``tf_dp.keras.DPKerasMFOptimizer``):
  ``C`` the square root of the prefix-sum matrix (Toeplitz, ``C[t, t-j] = binom(2j, j) / 4^j``)
  cut to ``b`` bands;
* ``blt``: the same batches with BLT noise of ``d`` buffers, its ``omega`` and ``theta``
  optimised here for this run (L-BFGS on the sensitivity times the prefix sums' noise
  ``||A C^{-1}||_F``, from a fit to the square root's inverse);
* ``bandmf_amplified``: amplified BandMF (Choquette-Choo et al. 2023): the data cut into
  ``amp_bands`` parts, step ``t`` a Poisson sample of part ``t mod amp_bands`` at rate
  ``q = batch * amp_bands / n`` (``tf_dp.data.cyclic_poisson_batches``), the optimised
  ``amp_bands``-banded strategy, noise from ``DPKerasMFOptimizer.for_target_epsilon`` and
  epsilon from the ledger (tf_dp's amplified BandMF PLD accounting);
* ``dpftrl_tree``: the same batches with DP-FTRL's tree aggregation
  (``tf_dp.keras.DPKerasFTRLOptimizer``, a new tree every epoch): ``C`` the block diagonal of one
  ``tf_dp.correlated.strategies.TreeStrategy(b)`` per epoch (a row per released node).

Accounting of the last three (no amplification): each is a Gaussian mechanism ``C x + Z`` (the
optimizer's noise ``C^{-1} Z`` is post-processing of it) whose L2 sensitivity under add/remove of
one record is ``Delta = clip * max_p ||C u_p||``, ``u_p`` the indicator of the steps of batch
``p`` (``p, p + b, p + 2b, ...``), computed exactly from the dense ``C`` (DP-SGD: ``C = I``,
``Delta = clip sqrt(k)``). Epsilon then follows exactly from the Gaussian mechanism's tradeoff with
``mu = Delta / (sigma clip)`` (Balle & Wang 2018: ``delta(eps) = Phi(-eps/mu + mu/2) -
e^eps Phi(-eps/mu - mu/2)``), and ``sigma`` is calibrated to the target epsilon. ``bandmf_amplified`` is accounted from its ledger instead, with amplification.

A seventh run, ``nonprivate`` (in ``--mechanisms``; by default for ``--task text``), trains the
same model on the same fixed batches with Keras's SGD (same momentum, no clipping, no noise,
learning rate ``--nonprivate_learning_rate``: text 3, tuned on the validation split; Fashion-MNIST
1.6, learning rate x clip, not tuned): the ceiling.

    python research/correlated_noise/compare.py                      # the table in README.md
    python research/correlated_noise/compare.py --task text --seeds 3  # the text table
    python research/correlated_noise/compare.py --quick              # smoke run, no files

Writes ``results.csv`` and ``accuracy.png`` (``--task text``: ``results_text.csv`` and
``accuracy_text.png``) beside this file (one row per training).
"""

from __future__ import annotations

import argparse
import csv
import functools
import importlib.util
import math
import os
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))  # this checkout's tf_dp

import numpy as np  # noqa: E402
from scipy import optimize, special, stats  # noqa: E402

MECHANISMS = ("dpsgd_poisson", "dpsgd_cyclic", "bandmf", "blt", "dpftrl_tree", "bandmf_amplified")

#: Per-task defaults (command-line options left unset take these) and output files.
TASKS = {
    "fashion_mnist": dict(
        parts=8, epochs=40, bands=8, amp_bands=4, learning_rate=16.0, l2_norm_clip=0.1,
        nonprivate_learning_rate=1.6, mechanisms=",".join(MECHANISMS), holdout=1 / 6, csv="results.csv", png="accuracy.png",
        title="Fashion-MNIST, scattering features + linear"),
    "text": dict(
        parts=8, epochs=40, bands=8, amp_bands=4, learning_rate=8.0, l2_norm_clip=0.1,
        nonprivate_learning_rate=3.0, mechanisms=",".join(MECHANISMS + ("nonprivate",)),
        holdout=0.2,
        csv="results_text.csv", png="accuracy_text.png", title="{data}: bag of words + linear"),
}
TEXT_NUM_WORDS, TEXT_MAXLEN = 2000, 400


def _scatternet():
    path = os.path.join(os.path.dirname(HERE), "utility_fashion_mnist", "train_scatternet.py")
    spec = importlib.util.spec_from_file_location("train_scatternet", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- strategies ------------------------------------------------------------------------------------


def sqrt_coefficients(n: int) -> np.ndarray:
    """``r_j = binom(2j, j) / 4^j``, the Toeplitz square root of the prefix-sum matrix."""
    j = np.arange(n)
    return np.exp(special.gammaln(2 * j + 1) - 2 * special.gammaln(j + 1) - j * math.log(4))


def banded_sqrt(n: int, bands: int):
    """``(coef [n, bands], C [n, n])`` of the banded square-root strategy."""
    r = sqrt_coefficients(bands)
    coef = np.tile(r, (n, 1))
    for t in range(min(n, bands)):
        coef[t, t + 1:] = 0.0
    c = np.zeros((n, n))
    for j in range(bands):
        c += np.diag(np.full(n - j, r[j]), -j) if j < n else 0
    return coef, c


def _blt_inverse(omega, theta, n):
    col = np.r_[1.0, (theta[None, :] ** (np.arange(n - 1)[:, None])) @ omega]
    return sum(np.diag(np.full(n - lag, col[lag]), -lag) for lag in range(n))


@functools.lru_cache(maxsize=None)
def blt_fit(n: int, buffers: int, parts: int):
    """``(omega, theta, C [n, n])``: a BLT (``C^{-1}`` Toeplitz with first column ``1, sum_i
    omega_i theta_i^(k-1)``) chosen for this run: starting from a least-squares fit to the inverse
    square root's coefficients (decay rates ``theta`` spread on a log scale), ``omega`` and
    ``theta`` are optimised (L-BFGS) for the quantity the comparison fixes: the sensitivity under
    this run's participation (``parts`` apart) times the prefix sums' noise, ``||A C^{-1}||_F``."""
    target = np.cumprod((np.arange(1, n) - 1.5) / np.arange(1, n))  # sqrt(1 - x), lags >= 1
    theta0 = 1.0 - np.geomspace(0.5, 2.0 / n, buffers)
    basis = theta0[None, :] ** (np.arange(n - 1)[:, None])
    omega0 = np.linalg.lstsq(basis, target, rcond=None)[0]
    prefix = np.tril(np.ones((n, n)))

    def unpack(v):
        return v[:buffers], 0.9999 / (1.0 + np.exp(-v[buffers:]))  # |theta| < 1

    def loss(v):
        omega, theta = unpack(v)
        c_inv = _blt_inverse(omega, theta, n)
        c = np.linalg.inv(c_inv)
        return sensitivity(c, parts) * np.linalg.norm(prefix @ c_inv)

    theta0 = np.minimum(theta0, 0.999)
    v0 = np.r_[omega0, np.log(theta0 / (0.9999 - theta0))]
    v = optimize.minimize(loss, v0, method="L-BFGS-B", options={"maxiter": 200}).x
    omega, theta = unpack(v)
    return omega, theta, np.linalg.inv(_blt_inverse(omega, theta, n))


def sensitivity(c: np.ndarray, parts: int) -> float:
    """``max_p ||C u_p||`` with ``u_p`` the indicator of steps ``p, p + parts, ...`` (``C``: a
    row per release, a column per step)."""
    n = c.shape[1]
    return max(float(np.linalg.norm(c[:, p::parts].sum(axis=1))) for p in range(min(parts, n)))


# -- the Gaussian mechanism's epsilon ----------------------------------------------------------


def gaussian_delta(eps: float, mu: float) -> float:
    return float(stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2))


def gaussian_epsilon(mu: float, delta: float) -> float:
    if gaussian_delta(0.0, mu) <= delta:
        return 0.0
    return float(optimize.brentq(lambda e: gaussian_delta(e, mu) - delta, 0.0, 500.0, xtol=1e-12))


def mu_for(epsilon: float, delta: float) -> float:
    """The largest ``mu`` whose Gaussian mechanism is ``(epsilon, delta)``-DP (a little below)."""
    mu = optimize.brentq(lambda m: gaussian_delta(epsilon, m) - delta, 1e-6, 100.0, xtol=1e-12)
    return mu * (1 - 1e-9)


# -- tasks ---------------------------------------------------------------------------------------


def load_fashion_mnist(quick, augment=None):
    """``((x, y), (xt, yt), name)``: scattering features of Fashion-MNIST (3000 / 1000 images if
    ``quick``). ``augment``: each image's features and those of fixed transforms of it, stacked
    as ``[N, V, D]`` (labels ``[N, V]``): ``"flip"`` its mirror image (V = 2), ``"shift"`` the
    image moved by one pixel up, down, left and right (V = 5, zeros shifted in)."""
    sn = _scatternet()
    (x, y), (xt, yt) = sn.load(3000, 1000) if quick else sn.load()
    if augment is None:
        return (sn.features(x, True), y), (sn.features(xt, True), yt), "fashion_mnist"

    def shifted(images, dy, dx):
        out = np.zeros_like(images)
        h, w = images.shape[1:3]
        out[:, max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = \
            images[:, max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
        return out

    def views(images):
        if augment == "flip":
            moved = [images[:, :, ::-1]]
        else:
            moved = [shifted(images, dy, dx) for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1))]
        return np.stack([sn.features(v, True) for v in [images] + moved], 1)

    def labels(v, lab):
        return np.repeat(lab[:, None], v.shape[1], 1)

    f, ft = views(x), views(xt)
    return (f, labels(f, y)), (ft, labels(ft, yt)), "fashion_mnist"


def bag_of_words(ids: np.ndarray, num_words: int) -> np.ndarray:
    """``[N, num_words]``: 1 for each word index that occurs in the row (padding 0 left out),
    rows scaled to unit L2 norm."""
    f = np.zeros((len(ids), num_words), np.float32)
    f[np.repeat(np.arange(len(ids)), ids.shape[1]), ids.ravel()] = 1.0
    f[:, 0] = 0.0
    return f / np.maximum(np.linalg.norm(f, axis=1, keepdims=True), 1e-12)


def load_text(quick):
    """``((x, y), (xt, yt), name)``: bag-of-words features of IMDb, or of the fortunes (the
    fallback, named so)."""
    import tf_dp

    (x, y), (xt, yt), name, _ = tf_dp.data.load_imdb_or_fortunes(TEXT_NUM_WORDS, TEXT_MAXLEN)
    print(f"DATA: {name}: {len(x)} training and {len(xt)} test texts", flush=True)
    return (bag_of_words(x, TEXT_NUM_WORDS), y), (bag_of_words(xt, TEXT_NUM_WORDS), yt), name


LOADERS = {"fashion_mnist": load_fashion_mnist, "text": load_text}


# -- training ------------------------------------------------------------------------------------


def _linear(labels):
    import keras

    return keras.layers.Dense(int(labels.max()) + 1, kernel_initializer="zeros")


def _accuracy(model, xt, yt):
    """Test accuracy; with augmented views (``xt [N, V, D]``) the logits of an image's views are
    averaged (post-processing of the trained model: no privacy cost)."""
    if xt.ndim == 2:
        return float(model.evaluate(xt, yt, batch_size=2000, verbose=0)[1])
    logits = model.predict(xt, batch_size=2000, verbose=0).mean(axis=1)
    return float(np.mean(logits.argmax(-1) == yt[:, 0]))


def train_nonprivate(feats, labels, args, seed):
    """The ceiling: the same model, data order and batches, Keras's SGD (no clipping, no noise)."""
    import keras

    (x, xt), (y, yt) = feats, labels
    batch = len(x) // args.parts
    n = batch * args.parts
    order = np.random.default_rng(seed).permutation(n)
    x, y = x[:n][order], y[:n][order]
    keras.utils.set_random_seed(seed)
    lr = args.nonprivate_learning_rate
    model = keras.Sequential([keras.Input(x.shape[1:]), _linear(yt)])
    model.compile(optimizer=keras.optimizers.SGD(learning_rate=lr, momentum=args.momentum),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    start = time.time()
    model.fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=0)
    acc = _accuracy(model, xt, yt)
    print(f"nonprivate seed {seed}: acc {acc:.4f}", flush=True)
    return {"mechanism": "nonprivate", "target_epsilon": math.inf, "epsilon": math.inf,
            "seed": seed, "accuracy": float(acc), "noise_multiplier": 0.0, "sensitivity": None,
            "parts": args.parts, "batch": batch, "steps": args.parts * args.epochs,
            "bands": None, "buffers": None, "learning_rate": lr,
            "seconds": round(time.time() - start, 1), "data": args.data_name}


def train(mechanism, feats, labels, args, seed, target):
    import keras

    import tf_dp
    from tf_dp.accounting import calibrate_noise_multiplier, compute_epsilon

    (x, xt), (y, yt) = feats, labels
    n, parts = len(x), args.parts
    batch = n // parts
    x, y = x[: batch * parts], y[: batch * parts]
    n = len(x)
    steps = parts * args.epochs
    rng = np.random.default_rng(seed)
    order = rng.permutation(n)  # the fixed order (shuffled once)
    x, y = x[order], y[order]
    keras.utils.set_random_seed(seed)
    common = dict(l2_norm_clip=args.l2_norm_clip, learning_rate=args.learning_rate,
                  momentum=args.momentum)
    if args.ema:
        common.update(use_ema=True, ema_momentum=args.ema)
    mu = mu_for(target, args.delta)
    strategy, delta_sens = None, None
    q = None
    if mechanism == "dpsgd_poisson":
        sigma = calibrate_noise_multiplier(target, args.delta, n, batch, steps=steps,
                                           accountant="pld")
        opt = tf_dp.keras.DPKerasSGDOptimizer(noise_multiplier=sigma, **common)
    elif mechanism == "bandmf_amplified":  # cyclic Poisson over `amp_bands` parts, same batch
        from tf_dp.correlated.strategies import BandedStrategy

        q = batch * args.amp_bands / n
        strategy = BandedStrategy.optimize(num_steps=steps, bands=args.amp_bands,
                                           workload=args.workload, momentum=args.momentum)
        opt = tf_dp.keras.DPKerasMFOptimizer.for_target_epsilon(
            target, args.delta, strategy=strategy, sampling_probability=q, **common)
        sigma = opt.noise_multiplier
    else:
        if mechanism == "dpsgd_cyclic":
            c = np.eye(steps)
        elif mechanism == "bandmf":
            coef, c = banded_sqrt(steps, args.bands)
            strategy = type("Banded", (), {"coef": coef})()
        elif mechanism == "blt":
            omega, theta, c = blt_fit(steps, args.buffers, parts)
            strategy = type("BLT", (), {"omega": omega, "theta": theta})()
        else:  # one tree per epoch of `parts` steps
            from tf_dp.correlated.strategies import TreeStrategy

            c = np.kron(np.eye(args.epochs), TreeStrategy(parts).matrix())
        delta_sens = sensitivity(c, parts)
        sigma = delta_sens / mu
        if mechanism == "dpftrl_tree":
            opt = tf_dp.keras.DPKerasFTRLOptimizer(noise_multiplier=sigma, **common)
        elif strategy is None:
            opt = tf_dp.keras.DPKerasSGDOptimizer(noise_multiplier=sigma, **common)
        else:
            opt = tf_dp.keras.DPKerasMFOptimizer(noise_multiplier=sigma, strategy=strategy,
                                                 **common)
    model = tf_dp.keras.DPSequential([keras.Input(x.shape[1:]), _linear(yt)])
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    start = time.time()
    if mechanism == "dpsgd_poisson":
        model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=batch / n),
                  epochs=args.epochs, verbose=0)
        eps = compute_epsilon(opt.ledger, args.delta, accountant="pld").epsilon
    elif mechanism == "bandmf_amplified":
        model.fit(tf_dp.data.cyclic_poisson_batches(x, y, num_parts=args.amp_bands,
                                                    sampling_probability=q),
                  epochs=steps // args.amp_bands, verbose=0)  # an epoch: one step per part
        eps = compute_epsilon(opt.ledger, args.delta, accountant="pld").epsilon
    else:
        model.fit(x, y, batch_size=batch, epochs=args.epochs, shuffle=False, verbose=0)
        eps = gaussian_epsilon(delta_sens / sigma, args.delta)
    acc = _accuracy(model, xt, yt)
    row = {"mechanism": mechanism, "target_epsilon": target, "epsilon": round(eps, 4),
           "seed": seed, "accuracy": float(acc), "noise_multiplier": sigma,
           "sensitivity": delta_sens, "parts": parts, "batch": batch, "steps": steps,
           "bands": {"bandmf": args.bands, "bandmf_amplified": args.amp_bands}.get(mechanism),
           "buffers": args.buffers if mechanism == "blt" else None,
           "learning_rate": args.learning_rate, "ema": args.ema, "augment": args.augment,
           "seconds": round(time.time() - start, 1), "data": args.data_name}
    print(f"{mechanism} eps {eps:.3f} (target {target}) seed {seed}: acc {acc:.4f}, "
          f"sigma {sigma:.3f}", flush=True)
    return row


def plot(task="fashion_mnist"):
    """Test accuracy against epsilon, one line per mechanism (mean over seeds, seeds as dots), the
    non-private ceiling (if run) as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.NullFormatter)

    with open(os.path.join(HERE, TASKS[task]["csv"])) as f:
        rows = list(csv.DictReader(f))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for mechanism in MECHANISMS:
        mine = [r for r in rows if r["mechanism"] == mechanism]
        eps = sorted({float(r["target_epsilon"]) for r in mine})
        if not eps:
            continue
        means = [np.mean([float(r["accuracy"]) for r in mine if float(r["target_epsilon"]) == e])
                 for e in eps]
        line, = ax.plot(eps, [100 * m for m in means], marker="o", label=mechanism)
        ax.scatter([float(r["target_epsilon"]) for r in mine],
                   [100 * float(r["accuracy"]) for r in mine], s=8, color=line.get_color())
    ceiling = [float(r["accuracy"]) for r in rows if r["mechanism"] == "nonprivate"]
    if ceiling:
        ax.axhline(100 * np.mean(ceiling), color="gray", linestyle="--", label="non-private")
    ax.set_xscale("log")
    ax.set_xticks([1, 3, 8], ["1", "3", "8"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    data = ", ".join(sorted({r.get("data") for r in rows} - {None, ""}))
    ax.set_title(TASKS[task]["title"].format(data=data), fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(HERE, TASKS[task]["png"]), dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--task", default="fashion_mnist", choices=tuple(TASKS),
                   help="options left unset take this task's values (TASKS)")
    p.add_argument("--mechanisms", help="comma-separated, of MECHANISMS and nonprivate")
    p.add_argument("--epsilons", default="1,3,8")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--parts", type=int, help="b: batches per epoch (n / b each)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--bands", type=int)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--workload", default="prefix", choices=("prefix", "momentum"),
                   help="bandmf_amplified: the workload its strategy is optimised for")
    p.add_argument("--amp_bands", type=int,
                   help="bandmf_amplified: bands = cyclic Poisson parts (rate batch * b / n)")
    p.add_argument("--learning_rate", type=float)
    p.add_argument("--nonprivate_learning_rate", type=float,
                   help="nonprivate: Keras SGD's learning rate")
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--l2_norm_clip", type=float)
    p.add_argument("--ema", type=float,
                   help="evaluate an exponential moving average of the iterates with this "
                   "momentum (Keras's use_ema; post-processing, no privacy cost)")
    p.add_argument("--augment", choices=("flip", "shift"),
                   help="fashion_mnist: train on each image and fixed transforms of it (flip: its "
                        "mirror image; shift: moved by one pixel in 4 directions); the per-example "
                        "gradient averages the views before clipping, the test logits average them")
    p.add_argument("--validation", action="store_true",
                   help="train on the first part of the training set, evaluate on the rest "
                   "(Fashion-MNIST: the last 10,000 images; text: the last 20%%)")
    p.add_argument("--quick", action="store_true",
                   help="3 epochs, one seed, no files (Fashion-MNIST: 3000 / 1000 images)")
    p.add_argument("--plot", action="store_true", help="only redraw the task's figure")
    p.add_argument("--append", action="store_true",
                   help="keep the CSV's rows of the other mechanisms (replace these ones)")
    args = p.parse_args(argv)
    task = TASKS[args.task]
    for key in ("mechanisms", "parts", "epochs", "bands", "amp_bands", "learning_rate",
                "l2_norm_clip", "nonprivate_learning_rate"):
        if getattr(args, key) is None:
            setattr(args, key, task[key])
    if args.plot:
        return plot(args.task)
    if args.quick:
        args.epochs, args.seeds = 3, 1
    if args.augment and args.task != "fashion_mnist":
        p.error("--augment applies to --task fashion_mnist")
    loader = LOADERS[args.task]
    (x, y), (xt, yt), args.data_name = (loader(args.quick, args.augment) if args.augment
                                        else loader(args.quick))
    if args.validation:
        cut = len(x) - int(round(task["holdout"] * len(x)))
        (x, y), (xt, yt) = (x[:cut], y[:cut]), (x[cut:], y[cut:])
    feats, labels = (x, xt), (y, yt)
    mechanisms = args.mechanisms.split(",")
    rows = [train_nonprivate(feats, labels, args, seed)
            for seed in range(args.seeds) if "nonprivate" in mechanisms]
    for target in [float(e) for e in args.epsilons.split(",")]:
        for mechanism in mechanisms:
            for seed in range(args.seeds if mechanism != "nonprivate" else 0):
                rows.append(train(mechanism, feats, labels, args, seed, target))
    if not (args.quick or args.validation):
        path = os.path.join(HERE, task["csv"])
        if args.append and os.path.exists(path):
            with open(path, newline="") as f:
                kept = [r for r in csv.DictReader(f) if r["mechanism"] not in mechanisms]
            rows = kept + rows
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[-1]))
            w.writeheader()
            w.writerows(rows)
        plot(args.task)
    return rows


if __name__ == "__main__":
    main()
