"""Epsilon of each batch selection at equal noise: Poisson, truncated Poisson, balls-in-bins,
shuffle (the table of docs/data.md and research/batch_selection/README.md).

Every figure comes from tf_dp's accountants reading a ledger of the steps the selection records
(``compute_epsilon``, ``pld``), except the balls-in-bins row's estimate, which is the Monte Carlo
ESTIMATE of ``balls_in_bins_estimate`` (not a proven bound), printed with its confidence.

Run: ``python research/batch_selection/epsilon_table.py`` (about a minute on 2 cores; ``--quick``
uses fewer Monte Carlo samples and steps). ``--setting chua2025``: the setting of the example
that ships with Chua et al. 2025's accounting code (google-research
``dpsgd_batch_sampler_accounting``: noise multiplier 0.35, T = 1000 steps, one epoch), here with
n = 1,000,000 examples (expected batch 1000) and delta = 1e-5 (the authors tabulate delta at
fixed epsilons instead).
"""

from __future__ import annotations

import argparse
import math

from tf_dp.accounting import balls_in_bins_estimate, compute_epsilon
from tf_dp.data.truncated_poisson import default_truncation_size
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent


def _entry(n, q, policy, z, b=None, start=False):
    return SampleEntry(SamplingEvent(n, q, policy, pass_start=start, max_batch_size=b),
                       (SumQueryEvent(1.0, z),))


def _passes(n, q, policy, z, steps_per_epoch, epochs):
    """The ledger of ``epochs`` fit epochs of ``steps_per_epoch`` steps (each starts a pass)."""
    return [(_entry(n, q, policy, z, start=True), 1),
            (_entry(n, q, policy, z), steps_per_epoch - 1)] * epochs


def rows(n=60000, batch=256, z=1.0, epochs=5, delta=1e-5, samples=200_000, seed=0):
    """``[(selection, epsilon, how), ...]`` at one setting."""
    q = batch / n
    t = math.ceil(n / batch)  # steps of one epoch (shuffle, balls-in-bins); Poisson runs as many
    steps = t * epochs
    out = []
    eps = compute_epsilon([(_entry(n, q, "poisson", z), steps)], delta, "pld").epsilon
    out.append(("Poisson (poisson_batches)", eps, "certified (PLD)"))
    for p in (1e-6, 1e-4):
        b = default_truncation_size(n, q, p)
        runs = [(_entry(n, q, "truncated_poisson", z, b=b), steps)]
        eps = compute_epsilon(runs, delta, "pld").epsilon
        out.append((f"truncated Poisson, B = {b} (P[overflow] = {p:g}/step)", eps,
                    "certified (PLD)"))
    est = balls_in_bins_estimate(z, t, epochs, delta, samples=samples, seed=seed)
    out.append(("balls-in-bins: estimate", est.epsilon,
                f"ESTIMATE (Monte Carlo, {samples} samples, {est.confidence:.0%} confidence)"))
    eps = compute_epsilon(_passes(n, 1 / t, "balls_in_bins", z, t, epochs), delta,
                          "pld").epsilon
    out.append(("balls-in-bins: guarantee", eps, "certified (no amplification, add/remove)"))
    eps = compute_epsilon(_passes(n, q, "shuffle", z, t, epochs), delta, "pld").epsilon
    out.append(("shuffle (in-memory arrays, shuffled_passes)", eps,
                "certified (no amplification, replace-one)"))
    return out


#: The settings of the table: ``reference`` (docs/data.md) and ``chua2025`` (see the docstring).
SETTINGS = {
    "reference": {},
    "chua2025": {"n": 1_000_000, "batch": 1000, "z": 0.35, "epochs": 1},
}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples (a smoke run)")
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="reference")
    args = parser.parse_args(argv)
    kw = dict(SETTINGS[args.setting])
    if args.quick:
        kw.update(samples=20_000, epochs=1)
    table = rows(**kw)
    print("| selection | epsilon | what the number is |")
    print("| --- | --- | --- |")
    for name, eps, how in table:
        print(f"| {name} | {eps:.3f} | {how} |")
    return table


if __name__ == "__main__":
    main()
