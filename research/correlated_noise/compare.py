"""DP-SGD, BandMF and BLT noise at equal certified epsilon on Fashion-MNIST (scattering features).

The setting of ``research/utility_fashion_mnist`` (scattering features with group normalisation, a
linear classifier, clip 0.1, momentum 0.9), trained with four noise mechanisms at the same
epsilon (delta = 1e-5):

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

    python research/correlated_noise/compare.py                      # the table in README.md
    python research/correlated_noise/compare.py --quick              # smoke run, no files

Writes ``results.csv`` beside this file (one row per training).
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


# -- training ------------------------------------------------------------------------------------


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
    model = tf_dp.keras.DPSequential(
        [keras.Input((x.shape[1],)), keras.layers.Dense(10, kernel_initializer="zeros")])
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
    _, acc = model.evaluate(xt, yt, batch_size=2000, verbose=0)
    row = {"mechanism": mechanism, "target_epsilon": target, "epsilon": round(eps, 4),
           "seed": seed, "accuracy": float(acc), "noise_multiplier": sigma,
           "sensitivity": delta_sens, "parts": parts, "batch": batch, "steps": steps,
           "bands": {"bandmf": args.bands, "bandmf_amplified": args.amp_bands}.get(mechanism),
           "buffers": args.buffers if mechanism == "blt" else None,
           "learning_rate": args.learning_rate, "seconds": round(time.time() - start, 1)}
    print(f"{mechanism} eps {eps:.3f} (target {target}) seed {seed}: acc {acc:.4f}, "
          f"sigma {sigma:.3f}", flush=True)
    return row


def plot(csv_path=os.path.join(HERE, "results.csv"), png=os.path.join(HERE, "accuracy.png")):
    """Test accuracy against epsilon, one line per mechanism (mean over seeds, seeds as dots)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker  # noqa: F401  (matplotlib.ticker.NullFormatter)

    with open(csv_path) as f:
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
    ax.set_xscale("log")
    ax.set_xticks([1, 3, 8], ["1", "3", "8"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("epsilon (delta = 1e-5)")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title("Fashion-MNIST, scattering features + linear")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mechanisms", default=",".join(MECHANISMS))
    p.add_argument("--epsilons", default="1,3,8")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--parts", type=int, default=8, help="b: batches per epoch (n / b each)")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--bands", type=int, default=8)
    p.add_argument("--buffers", type=int, default=4)
    p.add_argument("--workload", default="prefix", choices=("prefix", "momentum"),
                   help="bandmf_amplified: the workload its strategy is optimised for")
    p.add_argument("--amp_bands", type=int, default=4,
                   help="bandmf_amplified: bands = cyclic Poisson parts (rate batch * b / n)")
    p.add_argument("--learning_rate", type=float, default=16.0)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--l2_norm_clip", type=float, default=0.1)
    p.add_argument("--validation", action="store_true",
                   help="train on the first 50,000 training images, evaluate on the last 10,000")
    p.add_argument("--quick", action="store_true", help="3000 / 1000 images, 3 epochs, no files")
    p.add_argument("--plot", action="store_true", help="only draw accuracy.png from results.csv")
    p.add_argument("--append", action="store_true",
                   help="keep results.csv's rows of the other mechanisms (replace these ones)")
    args = p.parse_args(argv)
    if args.plot:
        return plot()
    sn = _scatternet()
    if args.quick:
        (x, y), (xt, yt) = sn.load(3000, 1000)
        args.epochs, args.seeds = 3, 1
    else:
        (x, y), (xt, yt) = sn.load()
    if args.validation:
        (x, y), (xt, yt) = (x[:50000], y[:50000]), (x[50000:], y[50000:])
    feats = tuple(sn.features(a, True) for a in (x, xt))
    rows = []
    for target in [float(e) for e in args.epsilons.split(",")]:
        for mechanism in args.mechanisms.split(","):
            for seed in range(args.seeds):
                rows.append(train(mechanism, feats, (y, yt), args, seed, target))
    if not (args.quick or args.validation):
        if args.append and os.path.exists(os.path.join(HERE, "results.csv")):
            ran = set(args.mechanisms.split(","))
            with open(os.path.join(HERE, "results.csv"), newline="") as f:
                kept = [r for r in csv.DictReader(f) if r["mechanism"] not in ran]
            rows = kept + rows
        with open(os.path.join(HERE, "results.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        plot()
    return rows


if __name__ == "__main__":
    main()
