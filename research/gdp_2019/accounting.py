"""Bu, Dong, Long & Su 2019, "Deep learning with Gaussian differential privacy": the accounting.

Three things, all computed by ``tf_dp.accounting`` (no training, about a minute):

1. **Table 1** (MNIST, ``p = 256/60000``, ``delta = 1e-5``): for each ``(sigma, epochs)`` the CLT
   parameter ``mu`` (their Eq. (3.1)), ``eps_CLT`` (Eq. (3.2) inverted) and the moments
   accountant's ``eps_MA``, next to the paper's printed values, plus the two certified accountants
   the paper did not have (RDP with the tight conversion, and PLD).  -> ``table1.csv``
2. **Tradeoff curves** (their Figure 3): for each Table 1 row, the CLT curve ``G_mu``, the certified
   PLD curve of the same run, and the single ``(eps_MA, 1e-5)`` pair; the lower panels show
   ``G_mu - f_PLD`` (type I error on a log scale): where it is positive the CLT claims more privacy than is proven (the CLT is
   optimistic).  -> ``tradeoff.png``, ``tradeoff_gap.csv``
3. **Noise reduction** (Eqs. (3.3)-(3.4), Sec. 4.2 / Figure 4): the ``sigma~ < sigma`` whose CLT
   guarantee equals the moments accountant's at ``sigma`` (paper: ``sigma = 1.3 -> 1.06`` for
   ``(1.34, 1e-5)`` at epoch 20), and what each accountant certifies for ``sigma~``.
   -> ``noise_reduction.csv``

    python research/gdp_2019/accounting.py            # writes the files above
    python research/gdp_2019/accounting.py --quick    # table with gdp/moments only, no files
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time

import numpy as np

from tf_dp.accounting import (
    SubsampledGaussian,
    dp_sgd_epsilon,
    gaussian_tradeoff,
    gdp,
    pld_tradeoff,
    tradeoff_from_epsilon_delta,
)
from tf_dp.accounting.tradeoff import min_total_error

N, BATCH, DELTA = 60000, 256, 1e-5
Q = BATCH / N
HERE = os.path.dirname(os.path.abspath(__file__))

#: Table 1 of Bu et al. 2019: (eta, R, sigma, epochs, MNIST test accuracy %, mu, eps_CLT, eps_MA).
TABLE1 = [
    (0.25, 1.5, 1.3, 15, 95.0, 0.23, 0.83, 1.19),
    (0.15, 1.0, 1.1, 60, 96.6, 0.57, 2.32, 3.01),
    (0.25, 1.5, 0.7, 45, 97.0, 1.13, 5.07, 7.10),
    (0.25, 1.5, 0.6, 62, 97.6, 2.00, 9.98, 13.27),
    (0.25, 1.5, 0.55, 68, 97.8, 2.76, 14.98, 18.72),
    (0.25, 1.5, 0.5, 100, 98.0, 4.78, 31.12, 32.40),
]

#: Sec. 4.2 / Figure 4 (top): sigma = 1.3 and the reduced sigma~ = 1.06 both give (1.34, 1e-5)-DP at
#: epoch 20 (moments accountant and CLT respectively).
NOISE_REDUCTION = {"sigma": 1.3, "epochs": 20, "paper_sigma_tilde": 1.06, "paper_eps": 1.34}


def paper_steps(epochs: float) -> int:
    """The paper's step count, ``T = ceil(epochs / p)`` (tf_dp's samplers run ``round(1 / p)``
    steps per epoch: ``dp_sgd_run(..., epochs=...)`` counts those)."""
    return math.ceil(epochs * N / BATCH)


def table1(accountants=("gdp", "moments", "rdp", "pld")) -> list[dict]:
    rows = []
    for eta, clip, sigma, epochs, acc, p_mu, p_clt, p_ma in TABLE1:
        row = {"sigma": sigma, "epochs": epochs, "paper_mu": p_mu, "paper_eps_clt": p_clt,
               "paper_eps_ma": p_ma, "paper_accuracy_mnist": acc}
        for name in accountants:
            r = dp_sgd_epsilon(N, BATCH, sigma, DELTA, steps=paper_steps(epochs),
                               accountant=name)
            row["steps"] = r.steps
            if name == "gdp":
                row["mu"] = r.mu
                row["eps_clt"] = r.epsilon
            elif name == "moments":
                row["eps_ma"] = r.epsilon
            else:
                row[f"eps_{name}"] = r.epsilon
        rows.append(row)
    return rows


def noise_reduction(accountants=("moments", "rdp", "pld", "gdp")) -> dict:
    s, epochs = NOISE_REDUCTION["sigma"], NOISE_REDUCTION["epochs"]
    steps = paper_steps(epochs)
    s_tilde = gdp.reduced_noise(Q, s, steps, DELTA)
    out = {"sigma": s, "epochs": epochs, "steps": steps, "sigma_tilde": s_tilde,
           "paper_sigma_tilde": NOISE_REDUCTION["paper_sigma_tilde"],
           "paper_eps": NOISE_REDUCTION["paper_eps"]}
    for name in accountants:
        out[f"eps_{name}_sigma"] = dp_sgd_epsilon(N, BATCH, s, DELTA, steps=steps,
                                                  accountant=name).epsilon
        out[f"eps_{name}_sigma_tilde"] = dp_sgd_epsilon(N, BATCH, s_tilde, DELTA, steps=steps,
                                                        accountant=name).epsilon
    return out


def tradeoff_curves(rows, alpha, h=None) -> list[dict]:
    """G_mu, the certified PLD curve and the (eps_MA, delta) curve for each Table 1 row."""
    curves = []
    for row in rows:
        mech = [(SubsampledGaussian(Q, row["sigma"]), row["steps"])]
        f_pld = pld_tradeoff(mech, alpha, h=h)
        g = gaussian_tradeoff(alpha, row["mu"])
        f_ma = tradeoff_from_epsilon_delta(alpha, [row["eps_ma"]], [DELTA])
        gap = g - f_pld
        # The curves are symmetric (f = f^-1), so look at alpha <= 0.5 only.
        optimistic = alpha[(gap > 1e-6) & (alpha <= 0.5)]
        curves.append({"row": row, "pld": f_pld, "clt": g, "ma": f_ma, "gap": gap,
                       "max_gap": float(gap.max()), "alpha_at_max_gap": float(alpha[gap.argmax()]),
                       "optimistic_from": float(optimistic.min()) if optimistic.size else math.nan,
                       "optimistic_to": float(optimistic.max()) if optimistic.size else math.nan,
                       "min_error_clt": min_total_error(alpha, g),
                       "min_error_pld": min_total_error(alpha, f_pld),
                       "min_error_ma": min_total_error(alpha, f_ma)})
    return curves


def plot_tradeoff(curves, alpha, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(curves), figsize=(3.0 * len(curves), 6.4),
                             gridspec_kw={"height_ratios": [3, 2]})
    for i, c in enumerate(curves):
        r = c["row"]
        ax = axes[0, i]
        ax.plot(alpha, 1 - alpha, ":", color="gray", lw=0.8)
        ax.plot(alpha, c["clt"], "C3-", lw=1.2, label=f"CLT G_mu, mu={r['mu']:.2f}")
        ax.plot(alpha, c["pld"], "C0--", lw=1.2, label="PLD (certified)")
        ax.plot(alpha, c["ma"], "C2-", lw=1.0, label=f"MA ({r['eps_ma']:.2f}, 1e-5)")
        ax.set_title(f"sigma={r['sigma']}, {r['epochs']} epochs", fontsize=9)
        ax.set_aspect("equal")
        ax.set_xlabel("type I error", fontsize=8)
        if i == 0:
            ax.set_ylabel("type II error", fontsize=8)
        ax.legend(fontsize=6, loc="upper right")
        ax.tick_params(labelsize=7)
        ax2 = axes[1, i]
        ax2.axhline(0, color="gray", lw=0.6)
        ax2.plot(alpha, c["gap"], "C3-", lw=1.0)
        ax2.fill_between(alpha, 0, c["gap"], where=c["gap"] > 0, color="C3", alpha=0.3,
                         label="CLT optimistic")
        ax2.set_xscale("log")
        ax2.set_xlim(1e-6, 1)
        ax2.set_xlabel("type I error (log)", fontsize=8)
        if i == 0:
            ax2.set_ylabel("G_mu - f_PLD", fontsize=8)
            ax2.legend(fontsize=6)
        ax2.tick_params(labelsize=7)
    fig.suptitle("Bu et al. 2019 Table 1 runs: CLT approximation vs certified PLD tradeoff curve "
                 "(p = 256/60000)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_csv(path, rows, columns):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in columns})


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="Table 1 with the gdp and moments accountants and the noise "
                             "reduction only; no files")
    parser.add_argument("--out_dir", default=HERE)
    args = parser.parse_args(argv)
    start = time.time()
    accountants = ("gdp", "moments") if args.quick else ("gdp", "moments", "rdp", "pld")
    rows = table1(accountants)
    print("Table 1 (delta = 1e-5): tf_dp / paper")
    print(f"{'sigma':>5} {'ep':>4} {'steps':>6} | {'mu':>11} | {'eps_CLT':>13} | {'eps_MA':>13}"
          + ("" if args.quick else f" | {'rdp':>6} {'pld':>6}"))
    for r in rows:
        line = (f"{r['sigma']:5.2f} {r['epochs']:4d} {r['steps']:6d} | {r['mu']:5.2f} "
                f"{r['paper_mu']:5.2f} | {r['eps_clt']:6.2f} {r['paper_eps_clt']:6.2f} | "
                f"{r['eps_ma']:6.2f} {r['paper_eps_ma']:6.2f}")
        if not args.quick:
            line += f" | {r['eps_rdp']:6.2f} {r['eps_pld']:6.2f}"
        print(line)
    nr = noise_reduction(("moments", "gdp") if args.quick else ("moments", "rdp", "pld", "gdp"))
    print(f"Noise reduction (Eqs. 3.3-3.4), sigma = {nr['sigma']}, {nr['epochs']} epochs: "
          f"sigma~ = {nr['sigma_tilde']:.3f} (paper {nr['paper_sigma_tilde']}); eps_MA(sigma) = "
          f"{nr['eps_moments_sigma']:.3f}, eps_CLT(sigma~) = {nr['eps_gdp_sigma_tilde']:.3f} "
          f"(paper {nr['paper_eps']})")
    result = {"table1": rows, "noise_reduction": nr}
    if not args.quick:
        for k in ("rdp", "pld"):
            print(f"  certified eps for sigma~ with {k}: {nr[f'eps_{k}_sigma_tilde']:.3f} "
                  f"(for sigma: {nr[f'eps_{k}_sigma']:.3f})")
        alpha = np.concatenate([np.logspace(-7, -2, 300, endpoint=False),
                                np.linspace(0.01, 1.0, 991)])
        curves = tradeoff_curves(rows, alpha)
        for c in curves:
            r = c["row"]
            print(f"sigma={r['sigma']:<5} max(G_mu - f_PLD) = {c['max_gap']:.2e} at alpha = "
                  f"{c['alpha_at_max_gap']:.1e}; CLT optimistic (gap > 1e-6) for alpha in "
                  f"[{c['optimistic_from']:.1e}, {c['optimistic_to']:.1e}]; min(alpha+beta): CLT {c['min_error_clt']:.3f}, "
                  f"PLD {c['min_error_pld']:.3f}, MA {c['min_error_ma']:.3f}")
        os.makedirs(args.out_dir, exist_ok=True)
        write_csv(os.path.join(args.out_dir, "table1.csv"), rows,
                  ["sigma", "epochs", "steps", "mu", "paper_mu", "eps_clt", "paper_eps_clt",
                   "eps_ma", "paper_eps_ma", "eps_rdp", "eps_pld", "paper_accuracy_mnist"])
        gap_rows = [dict(sigma=c["row"]["sigma"], epochs=c["row"]["epochs"], mu=c["row"]["mu"],
                         max_gap=c["max_gap"], alpha_at_max_gap=c["alpha_at_max_gap"],
                         clt_optimistic_alpha_from=c["optimistic_from"],
                         clt_optimistic_alpha_to=c["optimistic_to"],
                         min_error_clt=c["min_error_clt"], min_error_pld=c["min_error_pld"],
                         min_error_ma=c["min_error_ma"]) for c in curves]
        write_csv(os.path.join(args.out_dir, "tradeoff_gap.csv"), gap_rows, list(gap_rows[0]))
        write_csv(os.path.join(args.out_dir, "noise_reduction.csv"), [nr], list(nr))
        plot_tradeoff(curves, alpha, os.path.join(args.out_dir, "tradeoff.png"))
        result["curves"] = curves
    print(f"({time.time() - start:.0f} s)")
    return result


if __name__ == "__main__":
    main()
