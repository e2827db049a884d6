"""Abadi et al. 2016, "Deep learning with differential privacy": epsilon against epochs.

The paper's headline comparison (Sec. 3.1 and its figure of epsilon over epochs): DP-SGD with
sampling ratio ``q = L/N = 0.01``, noise multiplier ``sigma = 4`` and ``delta = 1e-5`` run for
``T = 10000`` steps (100 epochs) is about ``(1.26, 1e-5)``-DP by the moments accountant but only
``(9.34, 1e-5)``-DP by the strong composition theorem.  This script recomputes both with
``tf_dp.accounting`` for every epoch count up to 100, together with the two accountants that came
later (RDP with the Canonne-Kamath-Steinke conversion, and the PLD accountant), and the mu-GDP CLT
approximation for reference.

    python research/abadi_2016/epsilon_vs_epochs.py            # epsilon_vs_epochs.csv / .png
    python research/abadi_2016/epsilon_vs_epochs.py --quick    # a few epoch counts, no files

Only ``q`` and the step count matter; ``N = 60000`` and lot size 600 give ``q = 0.01`` exactly.
"""

from __future__ import annotations

import argparse
import csv
import os
import time

from tf_dp.accounting import dp_sgd_epsilon, dp_sgd_strong_composition_epsilon

N, LOT, SIGMA, DELTA = 60000, 600, 4.0, 1e-5
Q = LOT / N
STEPS_PER_EPOCH = N // LOT  # 100
PAPER = {"moments": 1.26, "strong_composition": 9.34}  # at T = 10000 steps (100 epochs)
ACCOUNTANTS = ("moments", "rdp", "pld", "gdp")
HERE = os.path.dirname(os.path.abspath(__file__))


def epsilon_row(epochs: int) -> dict:
    """Epsilon of every accountant after ``epochs`` epochs of 100 steps each."""
    steps = epochs * STEPS_PER_EPOCH
    row = {"epochs": epochs, "steps": steps}
    for name in ACCOUNTANTS:
        row[name] = dp_sgd_epsilon(N, LOT, SIGMA, DELTA, steps=steps, accountant=name).epsilon
    row["strong_composition"] = dp_sgd_strong_composition_epsilon(Q, SIGMA, steps, DELTA)
    return row


def compute(epoch_list) -> list[dict]:
    return [epsilon_row(e) for e in epoch_list]


COLUMNS = ("epochs", "steps", "moments", "rdp", "pld", "gdp", "strong_composition")


def write_csv(rows, path):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{r[k]:.6g}" if isinstance(r[k], float) else r[k]) for k in COLUMNS})


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [r["epochs"] for r in rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    styles = {
        "strong_composition": ("strong composition (paper's baseline)", "k--"),
        "moments": ("moments accountant (Abadi et al.)", "C0-"),
        "rdp": ("RDP, tight conversion", "C1-"),
        "pld": ("PLD (certified, tightest)", "C2-"),
        "gdp": ("mu-GDP CLT (approximation)", "C3:"),
    }
    for key, (label, style) in styles.items():
        ax.plot(epochs, [r[key] for r in rows], style, label=label)
    ax.plot([100], [PAPER["moments"]], "C0o", mfc="none", ms=9, label="paper: 1.26 (moments)")
    ax.plot([100], [PAPER["strong_composition"]], "ko", mfc="none", ms=9,
            label="paper: 9.34 (strong comp.)")
    ax.set_xlabel("epochs (100 steps each)")
    ax.set_ylabel("epsilon at delta = 1e-5")
    ax.set_yscale("log")
    ax.set_title("DP-SGD, q = 0.01, sigma = 4")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a few epoch counts, no files")
    parser.add_argument("--out_dir", default=HERE)
    args = parser.parse_args(argv)
    start = time.time()
    epoch_list = [1, 10, 50, 100] if args.quick else list(range(1, 101))
    rows = compute(epoch_list)
    last = rows[-1]
    print(f"{'epochs':>6} {'moments':>8} {'rdp':>8} {'pld':>8} {'gdp':>8} {'strong':>8}")
    for r in rows if args.quick else [r for r in rows if r["epochs"] in (1, 10, 25, 50, 75, 100)]:
        print(f"{r['epochs']:>6} {r['moments']:8.3f} {r['rdp']:8.3f} {r['pld']:8.3f} "
              f"{r['gdp']:8.3f} {r['strong_composition']:8.3f}")
    print(f"T = 10000: moments {last['moments']:.2f} (paper {PAPER['moments']}), strong composition "
          f"{last['strong_composition']:.2f} (paper {PAPER['strong_composition']})")
    if not args.quick:
        os.makedirs(args.out_dir, exist_ok=True)
        write_csv(rows, os.path.join(args.out_dir, "epsilon_vs_epochs.csv"))
        plot(rows, os.path.join(args.out_dir, "epsilon_vs_epochs.png"))
    print(f"({time.time() - start:.1f} s)")
    return rows


if __name__ == "__main__":
    main()
