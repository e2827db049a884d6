"""Seconds to compute epsilon for 1e5 Poisson-subsampled Gaussian steps with RDP and PLD.

Run: ``python bench/accounting_time.py [--steps 100000] [--q 0.01] [--sigma 1.0] [--delta 1e-5]``

Each accountant is timed from a fresh cache (first call), in this process. Goals:
RDP < 1 s, PLD < 10 s on the 2-core reference machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tf_dp import accounting  # noqa: E402
from tf_dp.accounting import rdp  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=100000)
    ap.add_argument("--q", type=float, default=0.01)
    ap.add_argument("--sigma", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    a = ap.parse_args()
    n = 1_000_000
    batch = int(round(a.q * n))
    print(f"{a.steps} Poisson-subsampled Gaussian steps, q={batch / n}, sigma={a.sigma}, "
          f"delta={a.delta}")
    for name in ("rdp", "pld"):
        rdp._rdp_cached.cache_clear()
        t0 = time.perf_counter()
        res = accounting.dp_sgd_epsilon(n, batch, a.sigma, a.delta, steps=a.steps,
                                        accountant=name)
        dt = time.perf_counter() - t0
        print(f"{name:>4}: epsilon = {res.epsilon:.5f}   seconds = {dt:.3f}")


if __name__ == "__main__":
    main()
