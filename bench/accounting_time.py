"""Seconds to compute epsilon for 1e5 Poisson-subsampled Gaussian steps with RDP and PLD.

Run: ``python bench/accounting_time.py [--steps 100000] [--q 0.01] [--sigma 1.0] [--delta 1e-5]``

``--ledger`` instead times the ledger at production scale: a 1e6-step ``PrivacyLedger``
(identical steps, then 1e4 distinct steps repeated 100 times) through ``restore_runs``,
``runs``, ``save``, then (that ledger dropped, as in a process that loads a ledger to analyse it)
``load`` and each accountant's epsilon on the loaded ledger, with dp_accounting's RDP accountant
on the same ledger (``ledger_to_dp_event``) side by side, and the growth of the peak RSS.
``--accountants rdp,gdp,pld`` picks the accountants. ``--ledger --cyclic`` times instead
1e6 steps cycling over the same 1e4 distinct values (``v0 .. v9999, v0 .. v9999, ...``: 1e6
runs of one step, as a cyclic clip or noise schedule records them). The peak RSS growth is
``ru_maxrss`` (the kernel's peak resident set size of this process) minus its value after
TensorFlow is imported: the most memory the ledger work ever held at once, both cases included.

``--distinct 10000`` times 1e4 all-distinct Poisson Gaussian steps (q = 256/60000, noise
multipliers 1.0, 1.0001, ...) with tf_dp's RDP and PLD and dp_accounting's RDP and PLD
accountants on the first ``--dpa-steps`` of the same events (dp_accounting costs about 0.25 s
(RDP) and 0.4 s (PLD, default interval 1e-4) per distinct step), its time scaled to all steps.

``--budget`` times ``PrivacyBudget``'s hooks (``on_train_batch_begin/end``, ``on_epoch_end``;
the callback's whole work) per step of a small Keras model with a ``DecreasingClip`` schedule
(every step distinct, the look-ahead checks "ledger + next step" at every batch) and with a fixed
clip, after ledger prefixes of 0, 1e4, 1e5 and 1e6 steps, with the first of ``--accountants``
(``--budget --accountants pld``; default ``rdp``; ``gdp`` is refused: a budget on these
Poisson-subsampled steps needs a certified accountant), far from the budget (target 1e9); with
``--near``, the target is the epsilon of the prefix plus 350 steps like the ones that run, so
the budget stops training after about 350 of the 400 steps, and the figures are per step that
ran.

Each accountant is timed on its first call in this process. Goals: RDP < 1 s,
PLD < 10 s for 1e5 identical steps on the 2-core reference machine.
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
    ap.add_argument("--ledger", action="store_true")
    ap.add_argument("--accountants", default="rdp,gdp")
    ap.add_argument("--cyclic", action="store_true")
    ap.add_argument("--distinct", type=int, default=0)
    ap.add_argument("--dpa-steps", type=int, default=100)
    ap.add_argument("--budget", action="store_true")
    ap.add_argument("--near", action="store_true",
                    help="--budget with the target the epsilon of the prefix plus 350 steps")
    a = ap.parse_args()
    if a.ledger:
        return ledger_scale(a.delta, a.accountants.split(","), a.cyclic)
    if a.distinct:
        return distinct_steps(a.distinct, a.dpa_steps, a.delta)
    if a.budget:
        accountant = a.accountants.split(",")[0] if a.accountants else "rdp"
        if accountant == "gdp":
            ap.error("--budget: PrivacyBudget refuses accountant 'gdp' on Poisson-subsampled "
                     "steps (the CLT epsilon is not a certified bound); --accountants must start "
                     "with rdp, moments or pld")
        return budget_overhead(a.delta, accountant, a.near)
    n = 1_000_000
    batch = int(round(a.q * n))
    print(f"{a.steps} Poisson-subsampled Gaussian steps, q={batch / n}, sigma={a.sigma}, "
          f"delta={a.delta}")
    for name in ("rdp", "pld"):
        t0 = time.perf_counter()
        res = accounting.dp_sgd_epsilon(n, batch, a.sigma, a.delta, steps=a.steps,
                                        accountant=name)
        dt = time.perf_counter() - t0
        print(f"{name:>4}: epsilon = {res.epsilon:.5f}   seconds = {dt:.3f}")


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"  {label:<28} {time.perf_counter() - t0:8.3f} s")
    return out


def ledger_scale(delta: float, accountants: list[str], cyclic: bool = False) -> None:
    import functools
    import gc
    import tempfile

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow  # noqa: F401 -- counted before the RSS baseline

    import tf_dp
    from tf_dp.accounting.dp_events import ledger_to_dp_event
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    try:
        import dp_accounting
    except ImportError:  # optional extra
        dp_accounting = None
    base = SamplingEvent(60000, 256 / 60000)
    values = [SampleEntry(base, (SumQueryEvent(1.0, 1.0 + i * 1e-4),)) for i in range(10**4)]
    cases = {
        "1e6 identical steps": [(SampleEntry(base, (SumQueryEvent(1.0, 1.1),)), 10**6)],
        "1e4 distinct x 100": [(v, 100) for v in values],
    }
    if cyclic:
        cases = {"1e4 distinct, cyclic (1e6 runs of 1)": [(values[j % 10**4], 1)
                                                          for j in range(10**6)]}
    start_rss = _peak_rss_mb()
    for name in list(cases):
        print(f"{name} (delta={delta}):")
        runs = cases.pop(name)
        ledger = tf_dp.PrivacyLedger()
        _timed("restore_runs", functools.partial(ledger.restore_runs, runs))
        del runs  # the bench's own list of runs is not kept
        _timed("runs()", ledger.runs)
        path = os.path.join(tempfile.mkdtemp(), "ledger.json")
        _timed("save", lambda: ledger.save(path))
        # one ledger alive at a time, as in a process that loads a ledger to analyse it: the
        # readers below run on the loaded ledger
        del ledger
        gc.collect()
        ledger = _timed("load", lambda: tf_dp.PrivacyLedger.load(path))
        for acc in accountants:
            res = _timed(f"tf_dp {acc} epsilon",
                         lambda: accounting.compute_epsilon(ledger, delta, acc))
            print(f"  {'':<28} epsilon = {res.epsilon:.5f}")
        if dp_accounting is not None:
            def dpa_rdp():
                acct = dp_accounting.rdp.RdpAccountant()
                acct.compose(ledger_to_dp_event(ledger))
                return acct.get_epsilon(delta)

            eps = _timed("dp_accounting rdp epsilon", dpa_rdp)
            print(f"  {'':<28} epsilon = {eps:.5f}")
        print(f"  peak RSS growth so far: {_peak_rss_mb() - start_rss:.0f} MB "
              f"(after importing TensorFlow: {start_rss:.0f} MB)")


def distinct_steps(k: int, dpa_steps: int, delta: float) -> None:
    """tf_dp's and dp_accounting's RDP and PLD on ``k`` all-distinct Poisson Gaussian steps."""
    from tf_dp.accounting import pld

    try:
        import dp_accounting
    except ImportError:  # optional extra
        dp_accounting = None
    q = 256 / 60000
    zs = [1.0 + i * 1e-4 for i in range(k)]
    print(f"{k} all-distinct Poisson Gaussian steps, q={q:.5f}, noise 1.0 ... {zs[-1]:.4f}, "
          f"delta={delta}")
    res = _timed("tf_dp rdp epsilon", lambda: rdp.rdp_epsilon([q] * k, zs, [1] * k, delta))
    print(f"  {'':<28} epsilon = {res[0]:.5f}")
    eps = _timed("tf_dp pld epsilon",
                 lambda: pld.pld_epsilon([(pld.SubsampledGaussian(q, z), 1) for z in zs], delta))
    print(f"  {'':<28} epsilon = {eps:.5f}")
    if dp_accounting is None:
        return

    def dpa(acct, zs_):
        for z in zs_:
            acct.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
        return acct.get_epsilon(delta)

    m = min(dpa_steps, k)
    for name, make in (("rdp", dp_accounting.rdp.RdpAccountant),
                       ("pld", dp_accounting.pld.PLDAccountant)):
        t0 = time.perf_counter()
        eps_m = dpa(make(), zs[:m])
        dt = time.perf_counter() - t0
        if name == "rdp":
            ours = rdp.rdp_epsilon([q] * m, zs[:m], [1] * m, delta)[0]
        else:
            ours = pld.pld_epsilon([(pld.SubsampledGaussian(q, z), 1) for z in zs[:m]], delta)
        print(f"  dp_accounting {name}, first {m} steps: {dt:.3f} s (epsilon {eps_m:.5f}; tf_dp "
              f"{ours:.5f}); scaled to {k} steps: {dt * k / m:.0f} s")


def budget_overhead(delta: float, accountant: str = "rdp", near: bool = False) -> None:
    """Seconds per step spent in PrivacyBudget's hooks after long ledger prefixes."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras
    import numpy as np

    import tf_dp
    from tf_dp.keras import callbacks as dp_callbacks
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    n, q, steps = 6000, 0.05, 400
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 16)).astype(np.float32)
    y = rng.integers(0, 2, size=n).astype(np.int32)
    print(f"PrivacyBudget({accountant!r}) hooks, {steps} steps of a Dense(2) model on Poisson "
          f"batches (q={q}), delta={delta}")
    for schedule in (True, False):
        for prefix in (10**4, 10**5) if near else (0, 10**4, 10**5, 10**6):
            keras.utils.set_random_seed(0)
            model = tf_dp.keras.make_private(keras.Sequential([keras.Input((16,)),
                                                               keras.layers.Dense(2)]))
            clip = tf_dp.keras.DecreasingClip(1.0, decay_steps=10**7) if schedule else 1.0
            model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=clip, noise_stddev=1.0, learning_rate=0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            if prefix:  # 1e4 distinct values (or one), repeated
                model.optimizer.ledger.restore_runs(
                    [(SampleEntry(SamplingEvent(n, q), (SumQueryEvent(1.0, 1.0 + i * 1e-4),)),
                      prefix // 10**4) for i in range(10**4)])
            target = 1e9
            if near:  # the epsilon of the prefix and about 350 more steps (clip ~1, noise 1)
                target = accounting.compute_epsilon(
                    [*model.optimizer.ledger.runs(),
                     (SampleEntry(SamplingEvent(n, q), (SumQueryEvent(1.0, 1.0),)), 350)],
                    delta, accountant).epsilon
            budget = dp_callbacks.PrivacyBudget(target, delta, accountant=accountant,
                                                verbose=False)
            spent: list = []  # seconds of each hook call
            for hook in ("on_train_begin", "on_train_batch_begin", "on_train_batch_end",
                         "on_epoch_end"):
                original = getattr(budget, hook)

                def timed(*args, _original=original, **kwargs):
                    t0 = time.perf_counter()
                    try:
                        return _original(*args, **kwargs)
                    finally:
                        spent.append(time.perf_counter() - t0)

                setattr(budget, hook, timed)
            data = tf_dp.data.poisson_batches(x, y, sampling_probability=q,
                                              steps_per_epoch=steps // 4, seed=0)
            t0 = time.perf_counter()
            model.fit(data, epochs=4, verbose=0, callbacks=[budget])
            total = time.perf_counter() - t0
            # the first two calls (on_train_begin, first batch) compose the prefix once
            first, rest = sum(spent[:2]), sum(spent[2:])
            ran = model.optimizer.ledger.num_samples - prefix
            if near:
                print(f"  {ran} steps ran before the budget stopped training")
                steps = ran
            print(f"  {'DecreasingClip' if schedule else 'fixed clip':<15} prefix {prefix:>8}: "
                  f"first check {first:6.3f} s, then {1000 * rest / steps:6.3f} ms/step; all "
                  f"{1000 * (first + rest) / steps:7.3f} ms/step (fit {1000 * total / steps:.2f} "
                  "ms/step)")


if __name__ == "__main__":
    main()
