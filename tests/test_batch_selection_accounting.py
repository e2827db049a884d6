"""Accounting of truncated Poisson and balls-in-bins batches, against independent references.

* truncated Poisson: the split ``(w, a)`` against direct sums of binomial probabilities; the PLD
  against the same mixture built from dp_accounting's PLD primitives (bracketed by its pessimistic
  and optimistic discretisations), and at most dp_accounting's
  ``TruncatedSubsampledGaussianDpEvent`` (a looser, replace-one analysis of the same mechanism); RDP against dp_accounting's RDP of the
  components; the ledger and its file keep ``B``.
* balls-in-bins: the certified bound equals the closed-form Gaussian composition over the epochs
  the ledger's passes hold; the Monte Carlo estimate matches the exact Gaussian for ``T = 1`` and a
  plain (untilted) Monte Carlo estimate of the same pair for ``T > 1``, and is labelled an estimate.
"""

from __future__ import annotations

import math

import dp_accounting
import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as dpa_pld
from dp_accounting.rdp import rdp_privacy_accountant as dpa_rdp
from scipy import optimize, special, stats

from tf_dp.accounting import (
    balls_in_bins_estimate,
    balls_in_bins_ledger_estimate,
    compute_delta,
    compute_epsilon,
)
from tf_dp.accounting import rdp as tf_rdp
from tf_dp.accounting import truncated
from tf_dp.accounting.balls_in_bins import _delta_stats, _draw
from tf_dp.accounting.dp_events import ledger_to_dp_event
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import read_ledger_runs, write_ledger_runs

DELTA = 1e-5
#: tf_dp's PLD is pessimistic and, at its default grid, within 0.5% above the exact epsilon
#: (tf_dp.accounting.pld module docstring); dp_accounting's pessimistic PLD at h = 1e-4 likewise.
PLD_REL = 5e-3


def _entry(n, q, policy, z, b=None, start=False):
    return SampleEntry(
        SamplingEvent(n, q, policy, pass_start=start, max_batch_size=b),
        (SumQueryEvent(1.0, z),),
    )


# -- truncated Poisson --------------------------------------------------------------------------


@pytest.mark.parametrize("n,q,b", [(1000, 0.05, 40), (1000, 0.05, 60), (200, 0.3, 50)])
@pytest.mark.parametrize("neighbour", ["smaller", "larger"])
def test_truncation_split_matches_direct_binomial_sums(n, q, b, neighbour):
    m = n - 1 if neighbour == "smaller" else n
    k = np.arange(b, m + 1)
    pmf = stats.binom.pmf(k, m, q)
    w_ref = pmf.sum()
    a_ref = (pmf * q * b / (k + 1)).sum() / w_ref  # q E[B / (K + 1) | K >= B]
    w, a = truncated.truncation_split(n, q, b, neighbour)
    # float64 sums of <= 1000 positive terms: relative error far below 1e-10
    assert w == pytest.approx(w_ref, rel=1e-9)
    assert a == pytest.approx(a_ref, rel=1e-9)
    assert a <= q * b / (b + 1) + 1e-15


def test_no_truncation_possible_is_plain_poisson():
    assert truncated.truncation_split(100, 0.1, 100, "smaller") == (0.0, 0.0)
    plain = compute_epsilon([(_entry(100, 0.1, "poisson", 1.0), 300)], DELTA, "pld").epsilon
    # B = n + 1 others can never fill: identical mechanism, identical figure
    cut = compute_epsilon([(_entry(100, 0.1, "truncated_poisson", 1.0, b=100), 300)], DELTA,
                          "pld").epsilon
    assert truncated.truncation_split(100, 0.1, 100, "larger")[0] > 0  # the larger neighbour can
    assert cut >= plain


def _dpa_mixture_epsilon(n, q, b, z, steps, pessimistic):
    """The same decomposition built from dp_accounting's PLD primitives (independent code):
    w and a from direct binomial sums, add/remove pairs, worse of the two neighbours."""
    worst = 0.0
    for m in (n - 1, n):
        k = np.arange(b, m + 1)
        pmf = stats.binom.pmf(k, m, q)
        w = pmf.sum()
        a = (pmf * q * b / (k + 1)).sum() / w
        plain = dpa_pld.from_gaussian_mechanism(z, sampling_prob=q,
                                                pessimistic_estimate=pessimistic,
                                                value_discretization_interval=1e-4)
        swapped = dpa_pld.from_gaussian_mechanism(z / 2, sampling_prob=a,
                                                  pessimistic_estimate=pessimistic,
                                                  value_discretization_interval=1e-4)
        pld = swapped.compute_mixture(plain, w).self_compose(steps)
        worst = max(worst, pld.get_epsilon_for_delta(DELTA))
    return worst


@pytest.mark.parametrize("n,q,b,z,steps", [
    (1000, 0.05, 60, 1.0, 200),    # heavy truncation (w ~ 0.08)
    (1000, 0.05, 70, 1.2, 300),    # moderate (w ~ 2e-3)
])
def test_truncated_pld_matches_dp_accounting_mixture_and_is_below_its_event(n, q, b, z, steps):
    ours = compute_epsilon([(_entry(n, q, "truncated_poisson", z, b=b), steps)], DELTA, "pld")
    assert ours.certified and "truncated Poisson" in ours.assumptions
    upper = _dpa_mixture_epsilon(n, q, b, z, steps, pessimistic=True)
    lower = _dpa_mixture_epsilon(n, q, b, z, steps, pessimistic=False)
    assert lower <= upper
    # a certified bound is at least the exact value (>= the optimistic estimate, up to the
    # optimistic grid's own rounding) and within the stated discretisation slack above it
    assert ours.epsilon >= lower * (1 - PLD_REL)
    assert ours.epsilon <= upper * (1 + PLD_REL)
    # dp_accounting's own event bounds the swapped component by replace-one (looser)
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(n, q, b, z), steps)
    assert ours.epsilon <= acc.get_epsilon(DELTA) * (1 + PLD_REL)
    poisson = compute_epsilon([(_entry(n, q, "poisson", z), steps)], DELTA, "pld").epsilon
    assert ours.epsilon > poisson  # truncation is charged


def test_truncation_far_in_the_tail_costs_next_to_nothing_and_matches_the_event():
    n, q, z, steps = 60000, 256 / 60000, 1.0, 1000
    b = 376  # P[Binomial(n, q) > B] < 1e-12
    ours = compute_epsilon([(_entry(n, q, "truncated_poisson", z, b=b), steps)], DELTA, "pld")
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(n, q, b, z), steps)
    assert ours.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=PLD_REL)


def test_truncated_rdp_matches_dp_accounting_component_curves():
    n, q, b, z, steps = 1000, 0.05, 60, 1.0, 200
    orders = np.asarray(tf_rdp.DEFAULT_ORDERS, dtype=np.float64)
    worst = 0.0
    for m in (n - 1, n):
        k = np.arange(b, m + 1)
        pmf = stats.binom.pmf(k, m, q)
        w = pmf.sum()
        a = (pmf * q * b / (k + 1)).sum() / w
        r_plain = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(q, z, orders)
        r_swap = dpa_rdp._compute_rdp_poisson_subsampled_gaussian(a, z / 2, orders)
        mix = special.logsumexp(
            [(orders - 1) * r_plain, (orders - 1) * r_swap], axis=0, b=[[1 - w], [w]]
        ) / (orders - 1)
        eps, _ = dpa_rdp.compute_epsilon(orders, steps * mix, DELTA)
        worst = max(worst, eps)
    ours = compute_epsilon([(_entry(n, q, "truncated_poisson", z, b=b), steps)], DELTA, "rdp")
    # same curves and the same (Canonne-Kamath-Steinke) conversion: agreement to float64
    # round-off of the series (relative 1e-9 per order, 1e-6 after the conversion's log)
    assert ours.epsilon == pytest.approx(worst, rel=1e-6)
    pld_eps = compute_epsilon([(_entry(n, q, "truncated_poisson", z, b=b), steps)], DELTA,
                              "pld").epsilon
    assert ours.epsilon >= pld_eps * (1 - PLD_REL)  # both certified; RDP is the looser


def test_truncated_compute_delta_inverts_compute_epsilon():
    runs = [(_entry(1000, 0.05, "truncated_poisson", 1.2, b=70), 300)]
    for acc in ("pld", "rdp"):
        eps = compute_epsilon(runs, DELTA, acc).epsilon
        d = compute_delta(runs, eps, acc).delta
        assert d <= DELTA * (1 + 1e-2)


def test_gdp_refuses_truncated_and_jl_truncated_is_refused():
    runs = [(_entry(1000, 0.05, "truncated_poisson", 1.0, b=60), 10)]
    with pytest.raises(ValueError, match="truncated_poisson.*'rdp' or 'pld'"):
        compute_epsilon(runs, DELTA, "gdp")
    jl = SampleEntry(SamplingEvent(1000, 0.05, "truncated_poisson", max_batch_size=60),
                     (SumQueryEvent(1.0, 1.0, "jl", jl_projections=2),))
    with pytest.raises(ValueError, match="JL.*truncated"):
        compute_epsilon([(jl, 10)], DELTA, "pld")


def test_sampling_event_requires_b_exactly_for_truncated_poisson():
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        SamplingEvent(100, 0.1, "truncated_poisson")
    with pytest.raises(ValueError, match="max_batch_size must be None unless"):
        SamplingEvent(100, 0.1, "poisson", max_batch_size=5)


def test_ledger_file_and_dp_event_keep_the_truncation(tmp_path):
    runs = [(_entry(1000, 0.05, "truncated_poisson", 1.0, b=60), 7),
            (_entry(500, 0.02, "balls_in_bins", 1.0, start=True), 1),
            (_entry(500, 0.02, "balls_in_bins", 1.0), 49)]
    path = tmp_path / "run.ledger.json"
    write_ledger_runs(path, runs)
    back = read_ledger_runs(path)
    assert back == runs
    assert back[0][0].sampling.max_batch_size == 60
    event = ledger_to_dp_event(runs)
    assert isinstance(event, dp_accounting.ComposedDpEvent)
    first = event.events[0].event
    assert isinstance(first, dp_accounting.TruncatedSubsampledGaussianDpEvent)
    assert (first.dataset_size, first.truncated_batch_size) == (1000, 60)
    # balls-in-bins: 50 steps of T = 50 from one pass start: one epoch, one Gaussian
    assert event.events[1] == dp_accounting.GaussianDpEvent(1.0)


def test_privacy_ledger_records_b_and_pass_starts():
    import tensorflow as tf

    from tf_dp.ledger import PrivacyLedger

    ledger = PrivacyLedger()
    ledger.record_sampling(1000, 0.05, "truncated_poisson", max_batch_size=60)
    ledger.record_sum_query(1.0, 1.0)
    ledger.record_sampling(500, 0.02, "balls_in_bins", pass_start=tf.constant(True))
    ledger.record_sum_query(1.0, 1.0)
    first, second = ledger.samples()
    assert (first.sampling.policy, first.sampling.max_batch_size) == ("truncated_poisson", 60)
    assert (second.sampling.policy, second.sampling.pass_start) == ("balls_in_bins", True)
    samples, queries = ledger.tables()
    restored = PrivacyLedger()
    restored.load_tables(samples, queries)
    assert restored.samples() == [first, second]
    with pytest.raises(ValueError, match="max_batch_size must be an integer >= 1"):
        PrivacyLedger().load_tables(samples[:, :7], queries)  # B lost: refused, never misread


# -- balls-in-bins ------------------------------------------------------------------------------


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with mu = sensitivity / sigma (Balle & Wang 2018):
    delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 - eps/mu)."""
    def f(eps):
        return (stats.norm.cdf(mu / 2 - eps / mu)
                - math.exp(eps) * stats.norm.cdf(-mu / 2 - eps / mu) - delta)
    return optimize.brentq(f, 0.0, 100.0, xtol=1e-12)


def test_balls_in_bins_certified_bound_is_one_gaussian_per_epoch():
    # three fit epochs (passes) of T = 20 steps each, plus a partial fourth pass of 5 steps
    n, t, z = 400, 20, 2.0
    start = _entry(n, 1 / t, "balls_in_bins", z, start=True)
    rest = _entry(n, 1 / t, "balls_in_bins", z)
    runs = [(start, 1), (rest, t - 1)] * 3 + [(start, 1), (rest, 4)]
    result = compute_epsilon(runs, DELTA, "pld")
    exact = _gaussian_epsilon(math.sqrt(4) / z, DELTA)  # 4 epochs: sensitivity C each
    assert result.certified and "balls-in-bins" in result.assumptions
    assert exact <= result.epsilon <= exact * (1 + PLD_REL)
    assert compute_epsilon(runs, DELTA, "gdp").certified  # q = 1 units: mu-GDP is exact
    shuffle = [(_entry(n, 1 / t, "shuffle", z, start=True), 1), (_entry(n, 1 / t, "shuffle", z),
                                                                 t - 1)] * 3
    # balls-in-bins is add/remove (sensitivity C); shuffle is charged replace-one (2C)
    assert result.epsilon < compute_epsilon(shuffle, DELTA, "pld").epsilon


def test_monte_carlo_estimate_matches_the_exact_gaussian_for_one_bin():
    est = balls_in_bins_estimate(1.0, 1, 5, DELTA, samples=50_000, seed=1)
    exact = _gaussian_epsilon(math.sqrt(5), DELTA)
    assert not est.certified
    assert est.certified_epsilon == pytest.approx(exact, rel=PLD_REL)
    # with T = 1 the importance weights are exact likelihood ratios of one Gaussian and the
    # estimate is the epsilon where the upper confidence limit reaches delta: within a few
    # percent of the exact value at 5e4 samples (relative standard error of delta ~1%, and
    # d log(delta) / d eps ~ 3 here: ~0.5% on epsilon per 1.6 standard errors)
    assert exact * 0.98 <= est.epsilon <= exact * 1.03
    text = str(est)
    assert text.startswith("ESTIMATE (Monte Carlo, not a proven bound)")
    assert "95% confidence" in text and "Certified bound" in text


@pytest.mark.parametrize("direction", ["remove", "add"])
def test_importance_sampling_agrees_with_plain_monte_carlo_of_the_pair(direction):
    """At a delta plain Monte Carlo resolves (about 1e-1), the tilted estimator's delta(eps)
    equals a plain draw of the pair within 5 combined standard errors: from
    P = (1/T) sum_j N(e_j, z^2 I) (the record in a random step) for the removal direction, from
    Q = N(0, z^2 I) for the addition direction."""
    z, t, e = 1.0, 10, 2
    eps = 1.0 if direction == "remove" else 0.1
    rng = np.random.default_rng(7)
    samples = 200_000
    x = rng.standard_normal((samples, e, t)) * z
    if direction == "remove":
        j = rng.integers(0, t, size=(samples, e))
        x[np.arange(samples)[:, None], np.arange(e)[None, :], j] += 1.0
    loss = (special.logsumexp((x - 0.5) / z**2, axis=-1) - math.log(t)).sum(axis=1)
    exponent = eps - loss if direction == "remove" else eps + loss
    y = np.clip(-np.expm1(exponent), 0.0, None)
    plain, plain_se = y.mean(), y.std(ddof=1) / math.sqrt(samples)
    g1, a, s = _draw(np.random.Generator(np.random.Philox(3)), 100_000, e, t, z)
    stats_ = _delta_stats(eps, g1, a, s, t, z, e)
    tilted, tilted_se = stats_[0 if direction == "remove" else 1]
    assert plain > 1e-2
    assert abs(tilted - plain) <= 5 * math.hypot(plain_se, tilted_se)


def test_estimate_from_a_ledger_counts_its_epochs_and_refuses_mixed_ledgers():
    t, z = 10, 1.0
    start = _entry(100, 1 / t, "balls_in_bins", z, start=True)
    rest = _entry(100, 1 / t, "balls_in_bins", z)
    est = balls_in_bins_ledger_estimate([(start, 1), (rest, t - 1)] * 2, DELTA,
                                        samples=20_000, seed=0)
    assert (est.steps_per_epoch, est.epochs) == (t, 2)
    with pytest.raises(ValueError, match="balls_in_bins steps only"):
        balls_in_bins_ledger_estimate([(_entry(100, 0.1, "poisson", z), 3)], DELTA)
