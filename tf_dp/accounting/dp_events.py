"""A ledger as a dp_accounting ``DpEvent``: analyse a tf_dp run with any dp_accounting accountant.

:func:`ledger_to_dp_event` describes what the ledger records with the mechanisms tf_dp's own
accountants analyse (the composable units of :mod:`tf_dp.accounting.ledger_analysis`):

* a run of ``count`` identical Poisson steps -> ``SelfComposedDpEvent(PoissonSampledDpEvent(q,
  GaussianDpEvent(z)), count)`` (``z`` the effective noise multiplier; ``q = 1``: the Gaussian);
* shuffled fixed-size batches -> per epoch (counted per pass, :func:`shuffle_epoch_runs`) one
  ``GaussianDpEvent(z / 2)``: replace-one adjacency, sensitivity ``2C``, no amplification;
* tree-aggregation steps -> per epoch window the worst tree as one ``GaussianDpEvent`` with the
  tree's effective noise multiplier (:mod:`tf_dp.accounting.tree`);
* truncated Poisson steps -> ``TruncatedSubsampledGaussianDpEvent(n, q, B, z)`` (dp_accounting's
  analysis of the same mechanism, a replace-one bound on the truncated component: at least
  tf_dp's own figure);
* balls-in-bins steps -> per epoch one ``GaussianDpEvent(z)`` (add/remove, no amplification);
* non-private steps -> ``NonPrivateDpEvent``; steps that touch no record -> nothing;
* JL steps have no dp_accounting equivalent: refused with a ``ValueError``.

The Gaussian events for shuffle and tree steps carry tf_dp's replace-one reduction (half the
noise multiplier), so any add/remove accountant of dp_accounting gives the same bound tf_dp gives.
``dp_accounting`` is an optional dependency (``pip install tf_dp[accounting]``), imported here
only when a conversion is asked for.

Example::

    import dp_accounting
    from tf_dp.accounting.dp_events import ledger_to_dp_event
    accountant = dp_accounting.pld.PLDAccountant()
    accountant.compose(ledger_to_dp_event("run.ledger.json"))
    accountant.get_epsilon(1e-5)
"""

from __future__ import annotations

import math

from tf_dp.accounting.ledger_analysis import composable_units
from tf_dp.ledger.ledger_file import as_runs

__all__ = ["ledger_to_dp_event"]


def _dp_accounting():
    try:
        import dp_accounting
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "ledger_to_dp_event needs the optional dependency dp_accounting: "
            "pip install 'tf_dp[accounting]'"
        ) from e
    return dp_accounting


def ledger_to_dp_event(ledger):
    """The dp_accounting ``DpEvent`` equivalent to ``ledger`` (path, ``PrivacyLedger``, list of
    ``SampleEntry`` or runs ``[(entry, count), ...]``).

    Raises:
      ValueError: the ledger has JL steps (no dp_accounting event describes the JL mechanism).

    Example: ``ledger_to_dp_event(model.optimizer.ledger)``.
    """
    dpa = _dp_accounting()
    runs = as_runs(ledger)
    units, non_private, _ = composable_units(runs)
    if any(u.r is not None for u in units):
        raise ValueError(
            "ledger_to_dp_event: the ledger has JL steps (jl_projections set); dp_accounting has "
            "no event for the JL mechanism; analyse it with tf_dp.accounting.compute_epsilon("
            "..., accountant='pld')"
        )
    events = []
    if non_private:
        events.append(dpa.NonPrivateDpEvent())
    for u in units:
        if math.isinf(u.z):
            continue
        event = dpa.GaussianDpEvent(u.z)
        if u.policy == "truncated_poisson":
            event = dpa.TruncatedSubsampledGaussianDpEvent(
                int(u.population_size), u.q, int(u.max_batch_size), u.z)
        elif u.q < 1.0:
            event = dpa.PoissonSampledDpEvent(u.q, event)
        events.append(event if u.count == 1 else dpa.SelfComposedDpEvent(event, int(u.count)))
    if not events:
        return dpa.NoOpDpEvent()
    return events[0] if len(events) == 1 else dpa.ComposedDpEvent(events)
