"""Ledger -> dp_accounting DpEvent: dp_accounting's accountants on the event give tf_dp's epsilon."""

import dp_accounting
import pytest

from tf_dp.accounting import compute_epsilon, rdp
from tf_dp.accounting.dp_events import ledger_to_dp_event
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent


def _entry(n, q, noise, policy="poisson", clip=1.0, mechanism="gaussian", pass_start=False,
           **kw):
    return SampleEntry(SamplingEvent(n, q, policy, pass_start=pass_start),
                       (SumQueryEvent(clip, noise * clip, mechanism, **kw),))


def _poisson_ledger():
    # a clip schedule with a fixed noise stddev: every step a different noise multiplier
    steps = [_entry(10000, 0.01, 1.0 + 0.01 * t) for t in range(30)]
    return steps + [_entry(10000, 0.02, 2.0)] * 200 + [_entry(10000, 1.0, 5.0)] * 3


def _shuffle_ledger():
    # n = 100, b = 10: 10 steps per epoch; two fit calls (passes) of 25 and 7 steps
    first = [_entry(100, 0.1, 3.0, "shuffle", pass_start=(t == 0)) for t in range(25)]
    second = [_entry(100, 0.1, 3.0, "shuffle", pass_start=(t == 0)) for t in range(7)]
    return first + second


def _tree_ledger():
    # shuffled batches with a tree restarted every epoch (10 steps), 3 epochs
    return [_entry(100, 0.1, 4.0, "shuffle", mechanism="tree", pass_start=(t == 0),
                   tree_step=t % 10) for t in range(30)]


LEDGERS = {"poisson": _poisson_ledger, "shuffle": _shuffle_ledger, "tree": _tree_ledger,
           "mixed": lambda: _poisson_ledger() + _shuffle_ledger()}


@pytest.mark.parametrize("name", sorted(LEDGERS))
def test_dp_accounting_rdp_on_the_event_gives_tf_dp_epsilon(name):
    entries = LEDGERS[name]()
    acc = dp_accounting.rdp.RdpAccountant(orders=list(rdp.DEFAULT_ORDERS))
    acc.compose(ledger_to_dp_event(entries))
    for delta in (1e-5, 1e-8):
        ours = compute_epsilon(entries, delta, "rdp").epsilon
        assert ours == pytest.approx(acc.get_epsilon(delta), rel=1e-6), name


@pytest.mark.parametrize("name", ["poisson", "shuffle", "tree"])
def test_dp_accounting_pld_on_the_event_gives_tf_dp_epsilon(name):
    entries = LEDGERS[name]()
    if name == "poisson":  # fewer distinct steps: PLD composition of each costs ~0.5 s
        entries = [e for e in entries if e.sampling.selection_probability != 0.01]
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(ledger_to_dp_event(entries))
    ours = compute_epsilon(entries, 1e-5, "pld").epsilon
    # both are pessimistic discretisations of the same mechanisms on a 1e-4 grid
    assert ours == pytest.approx(acc.get_epsilon(1e-5), rel=2e-3), name


def test_runs_are_self_composed_and_non_private_steps_are_kept():
    event = ledger_to_dp_event([_entry(1000, 0.01, 1.0)] * 5)
    assert event == dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 5)
    event = ledger_to_dp_event([_entry(1000, 0.01, 0.0), _entry(1000, 0.01, 1.0)])
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(event)
    assert acc.get_epsilon(1e-5) == float("inf")


def test_jl_steps_are_refused_with_a_clear_error():
    jl = SampleEntry(SamplingEvent(1000, 0.01, "poisson"),
                     (SumQueryEvent(1.0, 1.0, "jl", jl_projections=4),))
    with pytest.raises(ValueError, match="JL steps.*accountant='pld'"):
        ledger_to_dp_event([jl])
