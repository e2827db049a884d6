"""Privacy of DP-SGD-JL versus the JL dimension r, against exact DP-SGD (Bu et al. 2020, Figure 8).

Settings of Figure 8: N=60000, B=256, sigma=1.3 and N=25000, B=64, sigma=0.5; epsilon at
delta=1e-5 after 1..5 epochs of Poisson-subsampled steps (q = B/N, steps = epochs * N/B). JL
steps use the accounting helper's JL accountant (``tf_dp.accounting.jl_epsilon``: Lemma 4.3 /
Theorem 4.1, PLD mixture over Z_r with pessimistic discretisation); exact DP-SGD uses the same PLD
accountant (``dp_sgd_epsilon(..., accountant="pld")``). Writes ``privacy_vs_r.csv`` and
``privacy_vs_r.png`` next to this file.

    python -m research.jl_2020.privacy_vs_r [--rs 1,2,4,8,16,32,64] [--epochs 1,2,3,4,5]
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import time

from tf_dp.accounting import dp_sgd_epsilon, jl_epsilon

SETTINGS = [
    {"n": 60000, "batch": 256, "sigma": 1.3},
    {"n": 25000, "batch": 64, "sigma": 0.5},
]
DELTA = 1e-5
HERE = os.path.dirname(os.path.abspath(__file__))


def rows(rs, epochs_list):
    for s in SETTINGS:
        q = s["batch"] / s["n"]
        for epochs in epochs_list:
            steps = int(round(epochs * s["n"] / s["batch"]))
            t0 = time.time()
            exact = dp_sgd_epsilon(
                s["n"], s["batch"], s["sigma"], DELTA, steps=steps, accountant="pld"
            ).epsilon
            yield {**s, "epochs": epochs, "steps": steps, "r": "exact", "epsilon": exact}
            for r in rs:
                eps = jl_epsilon(q, s["sigma"], steps, DELTA, r)
                yield {**s, "epochs": epochs, "steps": steps, "r": r, "epsilon": eps}
            print(f"  {s} epochs={epochs}: {time.time() - t0:.0f}s", flush=True)


def plot(path_csv, path_png):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path_csv) as f:
        data = list(csv.DictReader(f))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, s in zip(axes, SETTINGS):
        sel = [d for d in data if int(d["n"]) == s["n"]]
        labels = sorted({d["r"] for d in sel}, key=lambda r: (r == "exact", int(r) if r != "exact" else 0))
        for label in labels:
            pts = [(float(d["epochs"]), float(d["epsilon"])) for d in sel if d["r"] == label]
            pts = [(e, v) for e, v in pts if math.isfinite(v)]
            if not pts:
                continue
            style = dict(color="black", lw=2.5) if label == "exact" else {}
            ax.plot(*zip(*pts), marker="o", label="No JL (exact)" if label == "exact" else f"JL r={label}", **style)
        inf_rs = sorted({d["r"] for d in sel if d["r"] != "exact" and not math.isfinite(float(d["epsilon"]))}, key=int)
        if inf_rs:
            ax.text(0.02, 0.02, f"r = {', '.join(inf_rs)}: epsilon = inf (> 100) at every point",
                    transform=ax.transAxes, fontsize=8)
        ax.set_yscale("log")
        ax.set_xlabel("epochs")
        ax.set_ylabel(f"epsilon (delta={DELTA:g})")
        ax.set_title(f"N={s['n']}, B={s['batch']}, sigma={s['sigma']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("DP-SGD-JL privacy vs JL dimension (PLD accountant; cf. Bu et al. 2020, Fig. 8)")
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)


def main_plot_only():
    plot(os.path.join(HERE, "privacy_vs_r.csv"), os.path.join(HERE, "privacy_vs_r.png"))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rs", default="1,2,4,8,16,32,64")
    p.add_argument("--epochs", default="1,2,3,4,5")
    a = p.parse_args()
    rs = [int(r) for r in a.rs.split(",")]
    epochs = [float(e) for e in a.epochs.split(",")]
    path_csv = os.path.join(HERE, "privacy_vs_r.csv")
    with open(path_csv, "w", newline="") as f:
        w = csv.DictWriter(f, ["n", "batch", "sigma", "epochs", "steps", "r", "epsilon"])
        w.writeheader()
        for row in rows(rs, epochs):
            w.writerow(row)
            f.flush()
    plot(path_csv, os.path.join(HERE, "privacy_vs_r.png"))


if __name__ == "__main__":
    main()
