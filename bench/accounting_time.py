"""Seconds to compute epsilon for 1e5 Poisson-subsampled Gaussian steps with RDP and PLD.

Run: ``python bench/accounting_time.py [--steps 100000] [--q 0.01] [--sigma 1.0] [--delta 1e-5]``

``--ledger`` instead times the ledger at production scale: a 1e6-step ``PrivacyLedger``
(identical steps, then 1e4 distinct steps repeated 100 times) through ``restore_runs``,
``runs``, ``save``, ``load`` and each accountant's epsilon, with dp_accounting's RDP accountant on
the same ledger (``ledger_to_dp_event``) side by side, and the growth of the peak RSS.
``--accountants rdp,gdp,pld`` picks the accountants (PLD of 1e4 distinct steps is slow).

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
    ap.add_argument("--ledger", action="store_true")
    ap.add_argument("--accountants", default="rdp,gdp")
    a = ap.parse_args()
    if a.ledger:
        return ledger_scale(a.delta, a.accountants.split(","))
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


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _timed(label: str, fn):
    t0 = time.perf_counter()
    out = fn()
    print(f"  {label:<28} {time.perf_counter() - t0:8.3f} s")
    return out


def ledger_scale(delta: float, accountants: list[str]) -> None:
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
    cases = {
        "1e6 identical steps": [(SampleEntry(base, (SumQueryEvent(1.0, 1.1),)), 10**6)],
        "1e4 distinct x 100": [
            (SampleEntry(base, (SumQueryEvent(1.0, 1.0 + i * 1e-4),)), 100) for i in range(10**4)
        ],
    }
    start_rss = _peak_rss_mb()
    for name, runs in cases.items():
        print(f"{name} (delta={delta}):")
        ledger = tf_dp.PrivacyLedger()
        _timed("restore_runs", lambda: ledger.restore_runs(runs))
        _timed("runs()", ledger.runs)
        path = os.path.join(tempfile.mkdtemp(), "ledger.json")
        _timed("save", lambda: ledger.save(path))
        _timed("load", lambda: tf_dp.PrivacyLedger.load(path))
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


if __name__ == "__main__":
    main()
