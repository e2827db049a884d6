"""PLD accountant: closed-form Gaussian curve, dp_accounting's PLD, pessimism, mixtures."""

import math

import numpy as np
import pytest
import dp_accounting
from scipy import stats

from tf_dp.accounting import pld

# Stated error of the PLD accountant relative to an exact value (documented in docs/accounting.md).
STATED_REL_ERROR = 0.005


def _analytic_gaussian_delta(eps, mu):
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


@pytest.mark.parametrize("sigma,steps", [(1.0, 1), (2.0, 10), (0.8, 3)])
def test_gaussian_q1_matches_closed_form(sigma, steps):
    mech = [(pld.SubsampledGaussian(1.0, sigma), steps)]
    mu = math.sqrt(steps) / sigma  # composition of Gaussians is Gaussian
    for eps in (0.5, 1.0, 3.0):
        d = pld.pld_delta(mech, eps)
        exact = _analytic_gaussian_delta(eps, mu)
        assert d >= exact * (1 - 1e-9)  # pessimistic
        assert d == pytest.approx(exact, rel=1e-3)


def _ref_eps(q, sigma, steps, delta):
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [(0.01, 1.0, 1000, 1e-5), (0.004, 1.1, 3000, 1e-5), (0.01, 4.0, 10000, 1e-5),
     (0.1, 0.8, 100, 1e-6), (0.02, 2.0, 500, 1e-3)],
)
def test_pld_matches_dp_accounting(q, sigma, steps, delta):
    eps = pld.pld_epsilon([(pld.SubsampledGaussian(q, sigma), steps)], delta)
    ref = _ref_eps(q, sigma, steps, delta)
    assert eps == pytest.approx(ref, rel=0.01)
    assert eps >= ref * (1 - STATED_REL_ERROR)


def test_heterogeneous_equals_split_composition():
    a, b = pld.SubsampledGaussian(0.01, 1.0), pld.SubsampledGaussian(0.02, 2.0)
    e1 = pld.pld_epsilon([(a, 300), (b, 200)], 1e-5)
    e2 = pld.pld_epsilon([(a, 100), (b, 200), (a, 200)], 1e-5)
    assert e1 == pytest.approx(e2, rel=1e-6)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.01, dp_accounting.GaussianDpEvent(1.0)), 300)
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(2.0)), 200)
    assert e1 == pytest.approx(acc.get_epsilon(1e-5), rel=0.01)


def test_discretisation_is_pessimistic_per_grid():
    m = pld.SubsampledGaussian(0.05, 1.0)
    for direction in pld.DIRECTIONS:
        d = pld.discretize(m, direction, 1e-3)
        assert d.pmf.sum() + d.inf_mass == pytest.approx(1.0, abs=1e-9)
        eps = np.linspace(0.0, 3.0, 37)
        exact = m.hockey_stick(eps, direction)
        disc = np.array([d.delta(e) for e in eps])
        assert np.all(disc >= exact - 1e-12)
        assert np.max(disc - exact) < 1e-3


def test_noise_zero_gives_infinite_epsilon():
    assert pld.pld_epsilon([(pld.SubsampledGaussian(0.01, 0.0), 10)], 1e-5) == math.inf


def test_mixture_of_identical_components_equals_component():
    m = pld.SubsampledGaussian(0.01, 1.0)
    mix = pld.Mixture((m, m), (0.5, 0.5))
    assert pld.pld_epsilon([(mix, 100)], 1e-5, h=1e-4) == pytest.approx(
        pld.pld_epsilon([(m, 100)], 1e-5, h=1e-4), rel=1e-6)


def test_mixture_inf_mass_is_kept():
    m = pld.SubsampledGaussian(0.01, 1.0)
    mix = pld.Mixture((m,), (1 - 1e-4,), inf_mass=1e-4)
    assert pld.pld_delta([(mix, 10)], 50.0) >= 1e-3 * 0.99  # never dropped
    assert pld.pld_epsilon([(mix, 10)], 1e-4) == math.inf


def test_stable_to_refinement():
    m = [(pld.SubsampledGaussian(0.01, 1.0), 2000)]
    e1, e2 = pld.pld_epsilon(m, 1e-5, h=2e-4), pld.pld_epsilon(m, 1e-5, h=1e-4)
    assert e2 <= e1 * (1 + 1e-6)
    assert e1 == pytest.approx(e2, rel=1e-3)


def test_validation():
    with pytest.raises(ValueError, match="q"):
        pld.SubsampledGaussian(1.2, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        pld.SubsampledGaussian(0.1, -1.0)
    with pytest.raises(ValueError, match="delta"):
        pld.pld_epsilon([(pld.SubsampledGaussian(0.1, 1.0), 1)], 1.0)
    with pytest.raises(ValueError, match="count"):
        pld.pld_epsilon([(pld.SubsampledGaussian(0.1, 1.0), 0)], 1e-5)
    with pytest.raises(ValueError, match="weights"):
        pld.Mixture((pld.SubsampledGaussian(0.1, 1.0),), (0.5,))


def _distinct_steps(seed, k):
    rng = np.random.default_rng(seed)
    return [(pld.SubsampledGaussian(float(rng.uniform(0.02, 0.1)), float(rng.uniform(0.8, 1.6))), 1)
            for _ in range(k)]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_distinct_steps_match_dp_accounting_within_the_discretisation(seed):
    # Both accountants discretise pessimistically: each step's loss is over-stated by at most one
    # grid interval, so after k steps each epsilon lies in [exact, exact + k * interval]. Hence
    # ours - dp_accounting's lies in [-k * h_ref, k * h] (never below by more than k * h_ref).
    k, delta, h, h_ref = 10, 1e-5, 1e-3, 1e-3
    mechs = _distinct_steps(seed, k)
    eps = pld.pld_epsilon(mechs, delta, h=h)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=h_ref)
    for m, _ in mechs:
        acc.compose(dp_accounting.PoissonSampledDpEvent(m.q, dp_accounting.GaussianDpEvent(
            m.noise_multiplier)))
    ref = acc.get_epsilon(delta)
    assert ref - k * h_ref <= eps <= ref + k * h
    # the order of distinct steps does not matter (composition is commutative)
    assert pld.pld_epsilon(mechs[::-1], delta, h=h) == pytest.approx(eps, abs=k * h)


def test_discretisation_evaluates_the_mechanism_only_where_mass_is_kept(monkeypatch):
    # The grid is narrowed to where the loss has mass above the truncation level before the
    # hockey-stick curve is evaluated: evaluated points are within 2x of the points kept (a
    # range of 10 standard deviations would evaluate about 2.5x-5x as many).
    calls = []
    for name in ("hockey_stick", "complement"):
        method = getattr(pld.SubsampledGaussian, name)
        monkeypatch.setattr(pld.SubsampledGaussian, name,
                            lambda self, eps, d, _m=method: calls.append(np.size(eps))
                            or _m(self, eps, d))
    for z in (0.8, 1.0, 1.5):
        for direction in pld.DIRECTIONS:
            calls.clear()
            kept = pld.discretize(pld.SubsampledGaussian(256 / 60000, z), direction, 4e-4)
            assert sum(calls) <= 2 * kept.pmf.size


@pytest.mark.parametrize("seed", [0, 1])
def test_distinct_runs_with_counts_match_dp_accounting(seed):
    # Distinct mechanisms run 1 to 12 times each (several share a count): the same bracket as
    # above, with k the total number of steps, against dp_accounting composing event by event.
    rng = np.random.default_rng(seed)
    mechs = [(m, int(rng.integers(1, 13))) for m, _ in _distinct_steps(seed, 8)]
    k, delta, h = sum(c for _, c in mechs), 1e-5, 1e-3
    eps = pld.pld_epsilon(mechs, delta, h=h)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=h)
    for m, c in mechs:
        acc.compose(dp_accounting.PoissonSampledDpEvent(
            m.q, dp_accounting.GaussianDpEvent(m.noise_multiplier)), c)
    ref = acc.get_epsilon(delta)
    assert ref - k * h <= eps <= ref + k * h


def test_runs_sharing_a_count_are_composed_once_then_raised(monkeypatch):
    # k distinct mechanisms run r times each: one balanced composition of the k steps (k - 1
    # convolutions) then about 2 log2(r) for the power, instead of a self-composition per
    # mechanism (about k * 2 log2(r) convolutions).
    k, r = 40, 100
    mechs = [(pld.SubsampledGaussian(0.01, 1.0 + i / 100), r) for i in range(k)]
    calls = []
    compose = pld.DiscretePLD.compose
    monkeypatch.setattr(pld.DiscretePLD, "compose",
                        lambda self, other: calls.append(1) or compose(self, other))
    pld.compose_mechanisms(mechs, "remove", h=1e-3)
    assert len(calls) <= (k - 1) + 2 * r.bit_length()


def test_self_compose_equals_the_composition_of_identical_steps():
    # DiscretePLD.self_compose (repeated squaring of one distribution) and compose_mechanisms
    # (which raises groups to their counts together) give the same distribution.
    m = pld.SubsampledGaussian(0.02, 1.1)
    for count in (1, 6, 37):
        direct = pld.discretize(m, "remove", 1e-3).self_compose(count)
        grouped = pld.compose_mechanisms([(m, count)], "remove", h=1e-3)
        for eps in (0.0, 0.5, 1.5):
            assert direct.delta(eps) == pytest.approx(grouped.delta(eps), rel=1e-9, abs=1e-15)
    with pytest.raises(ValueError, match="count"):
        pld.discretize(m, "remove", 1e-3).self_compose(0)


def _reference_groups(mechs, tolerance):
    """Slow reference of merge_close_noise: for each q, the smallest unassigned sigma starts a
    group and takes every sigma within its width (the width written out from the rule)."""
    out = {}
    for q in sorted({m.q for m, _ in mechs}):
        left = sorted((m.noise_multiplier, c) for m, c in mechs if m.q == q)
        while left:
            s0 = left[0][0]
            r = tolerance * s0 * s0 * (1.0 - math.exp(-1.0 / (s0 * s0)))
            inside = [(s, c) for s, c in left if s <= s0 * (1.0 + r)]
            left = left[len(inside):]
            out[(q, s0)] = sum(c for _, c in inside)
    return out


def test_merge_close_noise_groups_as_the_rule_says():
    rng = np.random.default_rng(3)
    mechs = [(pld.SubsampledGaussian(float(q), float(s)), int(c)) for q, s, c in zip(
        rng.choice([0.01, 0.02], 3000), np.round(rng.uniform(0.4, 3.0, 3000), 4),
        rng.integers(1, 50, 3000))]
    mix = pld.Mixture((pld.SubsampledGaussian(0.01, 1.0), pld.SubsampledGaussian(0.01, 2.0)),
                      (0.5, 0.5))
    merged = pld.merge_close_noise(mechs + [(mix, 7)], tolerance=1e-3)
    assert merged[-1] == (mix, 7)  # other mechanisms untouched
    got = {(m.q, m.noise_multiplier): c for m, c in merged[:-1]}
    assert len(got) == len(merged) - 1
    assert got == _reference_groups(mechs, 1e-3)
    assert sum(got.values()) == sum(c for _, c in mechs)
    assert len(got) < 2000  # the rule merges here (3000 values -> 1786 groups)
    assert pld.merge_close_noise(mechs, tolerance=0.0) == mechs
    # one value per q, and values farther apart than the width, stay as given
    apart = [(pld.SubsampledGaussian(0.01, 1.0), 3), (pld.SubsampledGaussian(0.01, 1.01), 2),
             (pld.SubsampledGaussian(0.02, 1.0), 5)]
    assert sorted(pld.merge_close_noise(apart), key=str) == sorted(apart, key=str)
    for bad in (-1e-3, 0.5, "1e-3"):
        with pytest.raises(ValueError, match=r"merge_tolerance must be in \[0, 0.01\]"):
            pld.merge_close_noise(apart, tolerance=bad)


@pytest.mark.parametrize("q, lo, hi, count", [
    (256 / 60000, 1.0, 2.0, 100),  # a clip schedule of a long run
    (0.01, 0.6, 0.8, 1),           # small noise: epsilon most sensitive to sigma
    (0.001, 5.0, 10.0, 50),        # large noise
])
def test_merged_noise_multipliers_bound_the_exact_epsilon_within_the_tolerance(q, lo, hi, count):
    # Rounding sigma down is domination (the sigma mechanism is the sigma_0 one plus independent
    # noise), so the merged epsilon is never below the exact one; the width keeps the rise under
    # the tolerance (1e-3 relative).
    n = 1000
    mechs = [(pld.SubsampledGaussian(q, lo + (hi - lo) * i / n), count) for i in range(n)]
    assert len(pld.merge_close_noise(mechs)) < 0.7 * n  # merged
    h = 1e-3  # one grid for both (a coarser one than the default, to keep the test short)
    exact = pld.pld_epsilon(mechs, 1e-5, h=h, merge_tolerance=0.0)
    merged = pld.pld_epsilon(mechs, 1e-5, h=h)
    assert exact * (1 - 1e-12) <= merged <= exact * (1 + pld.MERGE_TOLERANCE)
    d_exact = pld.pld_delta(mechs, exact, h=h, merge_tolerance=0.0)
    assert pld.pld_delta(mechs, exact, h=h) >= d_exact * (1 - 1e-12)


def test_a_schedule_of_close_values_discretises_one_mechanism_per_group(monkeypatch):
    # 1e4 values of sigma in [1, 2): about 860 groups, so 860 discretisations per direction
    # instead of 1e4 (the cost of a PLD over a long clip schedule)
    mechs = [(pld.SubsampledGaussian(256 / 60000, 1.0 + i / 1e4), 100) for i in range(10000)]
    groups = len(pld.merge_close_noise(mechs))
    assert groups < 1000
    calls = []
    discretize = pld.discretize
    monkeypatch.setattr(pld, "discretize", lambda *a, **k: calls.append(1) or discretize(*a, **k))
    pld.compose_mechanisms(mechs, "remove", h=2e-3)
    assert len(calls) == groups


def test_a_discretization_too_fine_for_memory_is_refused_before_allocating():
    import tracemalloc

    import tf_dp
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    m = pld.SubsampledGaussian(0.01, 1.0)
    lo, hi = m.loss_range("remove")
    # The grid at h = 1e-12 over this loss range: ~6e12 float64 values, some 44 TiB.
    assert (hi - lo) / 1e-12 * 8 > 40 * 2**40
    entry = SampleEntry(SamplingEvent(60000, 0.01), (SumQueryEvent(1.0, 1.0),))
    calls = [
        lambda: pld.pld_epsilon([(m, 1000)], 1e-5, h=1e-12),
        lambda: pld.pld_delta([(m, 1000)], 1.0, h=1e-12),
        lambda: pld.discretize(m, "remove", 1e-12),
        lambda: tf_dp.accounting.compute_epsilon([entry] * 10, 1e-5, "pld", discretization=1e-12),
    ]
    for call in calls:
        tracemalloc.start()
        try:
            with pytest.raises(ValueError, match=r"discretization \(h\) must be >= [0-9.e-]+") as e:
                call()
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 2**24, peak  # refused before any grid: under 16 MiB traced
        bound = float(str(e.value).split(">= ")[1].split(" ")[0])
        # the bound stated is the spacing whose grid over the loss range holds the cap
        assert bound == pytest.approx((hi - lo) / pld.MAX_GRID_POINTS, rel=1e-2)
    # A fine spacing within the bound is still accepted, and agrees with the default one to
    # within the coarser grid's discretisation error (one grid step per composed step at most).
    fine = pld.pld_epsilon([(m, 10)], 1e-5, h=1e-5)
    assert fine == pytest.approx(pld.pld_epsilon([(m, 10)], 1e-5, h=1e-4), abs=10 * 1e-4)
    with pytest.raises(TypeError, match=r"discretization \(h\)"):
        pld.pld_epsilon([(m, 10)], 1e-5, h="1e-4")
