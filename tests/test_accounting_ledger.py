"""Ledger analysis, ordering sanity, calibration and the strong-composition baseline."""

import math
import random

import pytest

from tf_dp import accounting as acc
from tf_dp.accounting import gdp, rdp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import LedgerFileError, write_ledger_file


def _entry(q=0.01, noise=1.0, sens=1.0, n=10000, policy="poisson", mech="gaussian", r=None):
    return SampleEntry(SamplingEvent(n, q, policy), (SumQueryEvent(sens, noise, mech, r),))


def test_ledger_file_and_list_agree(tmp_path):
    entries = [_entry()] * 100 + [_entry(q=0.02, noise=2.0)] * 60
    path = tmp_path / "run.json"
    write_ledger_file(path, entries)
    for name in acc.ACCOUNTANTS:
        a = acc.compute_epsilon(entries, 1e-5, name)
        b = acc.compute_epsilon(str(path), 1e-5, name)
        assert a.epsilon == b.epsilon and a.accountant == name and b.steps == 160


def test_rdp_heterogeneous_is_sum_of_curves():
    entries = [_entry()] * 500 + [_entry(q=0.02, noise=2.0)] * 300
    curve = 500 * rdp.rdp_poisson_gaussian(0.01, 1.0) + 300 * rdp.rdp_poisson_gaussian(0.02, 2.0)
    assert acc.compute_epsilon(entries, 1e-5).epsilon == pytest.approx(
        rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, 1e-5)[0], rel=1e-12)


def test_effective_noise_mcmahan_eq1():
    e = SampleEntry(SamplingEvent(100, 0.1),
                    (SumQueryEvent(1.0, 2.0), SumQueryEvent(2.0, 2.0)))
    assert acc.effective_noise_multipliers([e]) == [pytest.approx(1 / math.sqrt(0.25 + 1.0))]
    r = acc.compute_epsilon([e] * 100, 1e-5)
    direct = rdp.rdp_poisson_gaussian(0.1, 1 / math.sqrt(1.25)) * 100
    assert r.epsilon == pytest.approx(rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, direct, 1e-5)[0])


def test_non_private_gives_infinite_epsilon():
    entries = [_entry()] * 10 + [_entry(noise=0.0)]
    for name in acc.ACCOUNTANTS:
        r = acc.compute_epsilon(entries, 1e-5, name)
        assert r.epsilon == math.inf and "infinite" in str(r)
    assert acc.compute_delta(entries, 1.0).delta == 1.0


def test_shuffle_counts_epochs_without_amplification():
    # 250 steps of q = 0.01 -> ceil(2.5) = 3 epochs of the full-batch Gaussian mechanism, under
    # replace-one adjacency (fixed dataset size): sensitivity 2C, i.e. noise multiplier 1/2.
    entries = [_entry(policy="shuffle")] * 250
    r = acc.compute_epsilon(entries, 1e-5, "rdp")
    expected = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, rdp.rdp_gaussian(0.5) * 3, 1e-5)[0]
    assert r.epsilon == pytest.approx(expected, rel=1e-12)
    assert "NO amplification" in r.assumptions and "replace-one" in r.assumptions
    g = acc.compute_epsilon(entries, 1e-5, "gdp")
    assert g.mu == pytest.approx(2.0 * math.sqrt(3.0)) and g.certified
    p = acc.compute_epsilon(entries, 1e-5, "pld")
    assert p.epsilon == pytest.approx(gdp.epsilon_from_mu(1e-5, 2.0 * math.sqrt(3.0)), rel=2e-3)
    assert p.epsilon >= gdp.epsilon_from_mu(1e-5, math.sqrt(3.0)) * (1 - 1e-9)


def test_gdp_labelled_approximation():
    r = acc.compute_epsilon([_entry()] * 100, 1e-5, "gdp")
    assert not r.certified and "APPROXIMATION" in str(r) and r.mu is not None
    for name in ("rdp", "moments", "pld"):
        assert acc.compute_epsilon([_entry()] * 100, 1e-5, name).certified


def test_jl_ledger_uses_pld_and_refuses_others():
    entries = [_entry(mech="jl", r=64)] * 100
    r = acc.compute_epsilon(entries, 1e-5, "pld")
    exact = acc.compute_epsilon([_entry()] * 100, 1e-5, "pld")
    assert math.isfinite(r.epsilon) and r.epsilon >= exact.epsilon * 0.99
    assert "JL" in r.assumptions
    for name in ("rdp", "moments", "gdp"):
        with pytest.raises(ValueError, match="pld"):
            acc.compute_epsilon(entries, 1e-5, name)


def test_ordering_and_monotonicity_random_settings():
    rng = random.Random(0)
    for _ in range(4):
        q = rng.choice([0.001, 0.004, 0.01, 0.03])
        s = rng.uniform(0.7, 3.0)
        T = rng.choice([100, 1000, 5000])
        d = rng.choice([1e-5, 1e-6])
        kw = dict(steps=T)
        n = 100000
        b = int(q * n)
        e = {a: acc.dp_sgd_epsilon(n, b, s, d, accountant=a, **kw).epsilon
             for a in ("moments", "rdp", "pld")}
        assert all(math.isfinite(v) for v in e.values())
        assert e["moments"] >= e["rdp"] >= e["pld"]
        rdp_more_noise = acc.dp_sgd_epsilon(n, b, s * 1.2, d, **kw).epsilon
        rdp_more_steps = acc.dp_sgd_epsilon(n, b, s, d, steps=T * 2).epsilon
        rdp_more_q = acc.dp_sgd_epsilon(n, b * 2, s, d, **kw).epsilon
        assert rdp_more_noise < e["rdp"] < min(rdp_more_steps, rdp_more_q)
        pld_more_noise = acc.dp_sgd_epsilon(n, b, s * 1.2, d, accountant="pld", **kw).epsilon
        assert pld_more_noise < e["pld"]


def test_compute_delta_inverts_epsilon():
    entries = [_entry()] * 200
    for name in ("rdp", "moments", "gdp", "pld"):
        r = acc.compute_epsilon(entries, 1e-5, name)
        d = acc.compute_delta(entries, r.epsilon, name).delta
        assert d <= 1e-5 * 1.01 and d >= 1e-5 * 0.5


def test_microbatches_halve_effective_noise():
    a = acc.dp_sgd_epsilon(60000, 256, 2.2, 1e-5, epochs=5, microbatch_size=16)
    b = acc.dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=5)
    assert a.epsilon == pytest.approx(b.epsilon, rel=1e-12)


def test_calibration_roundtrip_and_unreachable():
    for name in ("rdp", "moments", "gdp"):
        s = acc.calibrate_noise_multiplier(2.0, 1e-5, 60000, 256, epochs=10, accountant=name)
        e = acc.dp_sgd_epsilon(60000, 256, s, 1e-5, epochs=10, accountant=name).epsilon
        assert e <= 2.0 and e >= 1.95
    s = acc.calibrate_noise_multiplier(2.0, 1e-5, 10000, 100, steps=100, accountant="pld",
                                       rtol=1e-2)
    assert acc.dp_sgd_epsilon(10000, 100, s, 1e-5, steps=100, accountant="pld").epsilon <= 2.0
    with pytest.raises(ValueError, match="unreachable"):
        acc.calibrate_noise_multiplier(1e-6, 1e-10, 100, 100, epochs=10000)


def test_strong_composition_abadi_baseline():
    e = acc.dp_sgd_strong_composition_epsilon(0.01, 4.0, 10000, 1e-5)
    assert e == pytest.approx(9.34, rel=0.01)
    eps, d = acc.strong_composition(0.1, 1e-6, 100, 1e-5)
    assert eps == pytest.approx(math.sqrt(200 * math.log(1e5)) * 0.1 + 100 * 0.1 * math.expm1(0.1))
    assert d == pytest.approx(1e-4 + 1e-5)


def test_validation_messages():
    with pytest.raises(ValueError, match="delta"):
        acc.compute_epsilon([_entry()], 0.0)
    with pytest.raises(ValueError, match="accountant"):
        acc.compute_epsilon([_entry()], 1e-5, "foo")
    with pytest.raises(ValueError, match="batch_size"):
        acc.dp_sgd_entries(100, 200, 1.0, steps=10)
    with pytest.raises(ValueError, match="N"):
        acc.dp_sgd_entries(0, 1, 1.0, steps=10)
    with pytest.raises(ValueError, match="epochs"):
        acc.dp_sgd_entries(100, 10, 1.0)
    with pytest.raises(LedgerFileError):
        acc.compute_epsilon("/nonexistent/ledger.json", 1e-5)


def test_result_str_is_plain_words():
    r = acc.compute_epsilon([_entry()] * 100, 1e-5, "rdp")
    s = str(r)
    assert "proven upper bound" in s and "Poisson" in s and "order" in s
    assert r.to_dict()["order"] == r.order


def test_statement_no_bound_after_infinite_epsilon_and_counts_float_queries():
    # noise 0: no guarantee, so no line may call the (infinite) epsilon a proven bound
    r = acc.compute_epsilon([_entry(noise=0.0)] * 10, 1e-5, "rdp")
    s = str(r)
    assert math.isinf(r.epsilon) and "infinite" in s
    assert "proven upper bound" not in s and "APPROXIMATION" not in s
    # one sum query per step: "the sum query", not "some queries"
    s = str(acc.compute_epsilon([_entry()] * 100, 1e-5, "rdp"))
    assert "floating-point noise on the sum query" in s and "some queries" not in s
    # two distinct queries per step, both continuous: "every noised query"
    two = SampleEntry(SamplingEvent(10000, 0.01, "poisson"),
                      (SumQueryEvent(1.0, 1.0, "gaussian"), SumQueryEvent(1.0, 2.0, "gaussian")))
    s = str(acc.compute_epsilon([two] * 100, 1e-5, "rdp"))
    assert "floating-point noise on every noised query" in s
