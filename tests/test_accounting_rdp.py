"""RDP / moments accountant: dp_accounting oracle, Abadi et al. 2016's 1.26, Table 1 of Bu et al. 2019."""


import numpy as np
import pytest
from dp_accounting.rdp import rdp_privacy_accountant as ref_rdp
import dp_accounting

from tf_dp.accounting import rdp

REF_ORDERS = tuple(float(a) for a in ref_rdp.DEFAULT_RDP_ORDERS)


def _ref_epsilon(q, sigma, steps, delta, orders=REF_ORDERS):
    acc = dp_accounting.rdp.RdpAccountant(orders=list(orders))
    event = dp_accounting.GaussianDpEvent(sigma)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, steps)
    return acc.get_epsilon_and_optimal_order(delta)


@pytest.mark.parametrize("q", [1e-3, 0.004, 0.01, 1.0])
@pytest.mark.parametrize("sigma", [0.6, 1.1, 4.0])
def test_rdp_epsilon_matches_dp_accounting(q, sigma):
    for steps in (10, 1000, 100000):
        for delta in (1e-5, 1e-8):
            curve = rdp.rdp_poisson_gaussian(q, sigma, REF_ORDERS) * steps
            eps, order = rdp.epsilon_from_rdp(REF_ORDERS, curve, delta)
            ref_eps, ref_order = _ref_epsilon(q, sigma, steps, delta)
            assert eps == pytest.approx(ref_eps, rel=1e-6), (q, sigma, steps, delta)


def test_rdp_curve_matches_reference_integer_orders():
    orders = tuple(float(a) for a in range(2, 200))
    for q, s in [(0.01, 1.0), (1e-4, 0.5), (0.2, 2.0)]:
        mine = rdp.rdp_poisson_gaussian(q, s, orders)
        ref = ref_rdp._compute_rdp_poisson_subsampled_gaussian(q, s, orders)
        np.testing.assert_allclose(mine, ref, rtol=1e-9)


def test_gaussian_rdp_closed_form():
    orders = (1.5, 2.0, 10.0, 64.5)
    np.testing.assert_allclose(rdp.rdp_gaussian(2.0, orders), np.array(orders) / 8.0, rtol=1e-12)


def test_stable_extreme_regimes():
    # tiny q, huge sigma, 1e6 steps: finite, small, positive
    c = rdp.rdp_poisson_gaussian(1e-6, 50.0) * 1e6
    eps, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, c, 1e-5)
    assert 0 <= eps < 0.01
    c = rdp.rdp_poisson_gaussian(0.001, 0.3)
    assert np.all(np.isfinite(c) | (c == np.inf)) and np.all(c >= 0)


def test_abadi_moments_reproduces_1_26():
    """Abadi et al. 2016 Sec. 3.1: q=0.01, sigma=4, T=10000, delta=1e-5 -> eps ~= 1.26 (moments)."""
    for orders in (rdp.MOMENTS_ORDERS, rdp.DEFAULT_ORDERS):
        c = rdp.rdp_poisson_gaussian(0.01, 4.0, orders) * 10000
        eps, order = rdp.epsilon_from_rdp(orders, c, 1e-5, conversion="moments")
        assert abs(eps - 1.26) < 0.005
        assert float(order).is_integer()  # lambda = order - 1 integer, <= 32
    # The tighter conversion is strictly better.
    eps_rdp, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, c, 1e-5)
    assert eps_rdp < eps - 0.1


def test_moments_delta_is_tail_bound():
    orders = rdp.MOMENTS_ORDERS
    c = rdp.rdp_poisson_gaussian(0.01, 4.0, orders) * 10000
    d, order = rdp.delta_from_rdp(orders, c, 1.26, conversion="moments")
    lam = np.array(orders) - 1
    direct = np.min(np.exp(lam * c - lam * 1.26))  # min_lambda exp(alpha(lambda) - lambda eps)
    assert d == pytest.approx(direct, rel=1e-9)
    assert d == pytest.approx(1e-5, rel=0.1)


P = 256 / 60000
# Table 1 of Bu et al. 2019: sigma, epochs, mu, eps_CLT, eps_MA (delta = 1e-5)
TABLE1 = [
    (1.3, 15, 0.23, 0.83, 1.19),
    (1.1, 60, 0.57, 2.32, 3.01),
    (0.7, 45, 1.13, 5.07, 7.10),
    (0.6, 62, 2.00, 9.98, 13.27),
    (0.55, 68, 2.76, 14.98, 18.72),
    (0.5, 100, 4.78, 31.12, 32.40),
]


@pytest.mark.parametrize("sigma,epochs,mu,eps_clt,eps_ma", TABLE1[:3])
def test_table1_moments_column(sigma, epochs, mu, eps_clt, eps_ma):
    """The eps_MA column is reproduced (to its printed precision) for the first three rows."""
    steps = epochs / P
    c = rdp.rdp_poisson_gaussian(P, sigma) * steps
    eps, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, c, 1e-5, conversion="moments")
    assert abs(eps - eps_ma) <= 0.006


def test_validation():
    with pytest.raises(ValueError, match="q"):
        rdp.rdp_poisson_gaussian(1.5, 1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        rdp.rdp_poisson_gaussian(0.1, -1.0)
    with pytest.raises(ValueError, match="orders"):
        rdp.rdp_poisson_gaussian(0.1, 1.0, [1.0])
    with pytest.raises(ValueError, match="delta"):
        rdp.epsilon_from_rdp([2.0], [1.0], 0.0)
    with pytest.raises(ValueError, match="conversion"):
        rdp.epsilon_from_rdp([2.0], [1.0], 1e-5, conversion="x")


def _true_rdp(q, s, a):
    """R(a) of the Poisson-subsampled Gaussian by numerical integration (independent of the
    series): A_a = int mu0^(1-a) mu^a dx."""
    import math

    from scipy import integrate, stats

    def integrand(x):
        l0 = stats.norm.logpdf(x, 0, s)
        l1 = stats.norm.logpdf(x, 1, s)
        return math.exp((1 - a) * l0 + a * np.logaddexp(math.log1p(-q) + l0, math.log(q) + l1))

    val, _ = integrate.quad(integrand, -40 * s, 40 * s + 1, limit=500, epsabs=0, epsrel=1e-12,
                            points=[0.0, 1.0])
    return math.log(val) / (a - 1)


@pytest.mark.parametrize("q,s", [(0.5, 50.0), (0.66, 4.39), (0.0925, 0.6), (0.504, 0.853),
                                 (0.0332, 9.59), (1e-4, 0.5), (0.01, 1.1)])
def test_fractional_orders_are_certified_and_no_looser_than_the_series(q, s):
    """Every fractional order is an upper bound on the true divergence (numerical integral), and
    never above dp_accounting's series (the chord between integer orders, by convexity of the log
    moment, is used where it is lower; slowly converging series end with a certified tail)."""
    orders = (1.05, 1.5, 1.95, 2.5, 5.5)
    mine = rdp.rdp_poisson_gaussian(q, s, orders)
    for a, r in zip(orders, mine):
        true = _true_rdp(q, s, a)
        assert np.isfinite(r)
        assert r >= true * (1 - 1e-7), (q, s, a, r, true)
        if q < 0.2:  # dp_accounting's series converges in reasonable time here
            ref = ref_rdp._compute_rdp_poisson_subsampled_gaussian(q, s, [a])[0]
            assert r <= ref * (1 + 1e-3), (q, s, a, r, ref)


def _edge_units(rng, n):
    q = np.concatenate([10 ** rng.uniform(-6, -0.5, n), [1.0, 1e-9, 0.999]])
    z = np.concatenate([10 ** rng.uniform(np.log10(0.5), np.log10(50), n), [0.7, 0.5, 3.0]])
    counts = rng.integers(1, 2000, q.size).astype(float)
    return q, z, counts


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("conversion", ["rdp", "moments"])
def test_pruned_orders_give_the_full_order_set_optimum(seed, conversion):
    """rdp_epsilon / rdp_delta evaluate only the orders whose convexity lower bound can beat the
    best so far; the answer equals the minimum over all orders of the full composed curve,
    which is itself checked against the per-step curves summed one by one."""
    rng = np.random.default_rng(seed)
    q, z, counts = _edge_units(rng, 6)
    orders = rdp.DEFAULT_ORDERS
    full = rdp.rdp_curve(q, z, counts, orders)
    summed = sum(c * rdp.rdp_poisson_gaussian(float(a), float(b), orders)
                 for a, b, c in zip(q, z, counts))
    np.testing.assert_allclose(full, summed, rtol=1e-12)
    for delta in (1e-5, 1e-9):
        eps_full, order_full = rdp.epsilon_from_rdp(orders, full, delta, conversion)
        eps, order = rdp.rdp_epsilon(q, z, counts, delta, orders, conversion)
        assert eps == pytest.approx(eps_full, rel=1e-12) and order == order_full
    for epsilon in (0.5, 4.0):
        d_full, _ = rdp.delta_from_rdp(orders, full, epsilon, conversion)
        d, _ = rdp.rdp_delta(q, z, counts, epsilon, orders, conversion)
        assert d == pytest.approx(d_full, rel=1e-9)


def test_distinct_steps_match_dp_accounting():
    """Many distinct Poisson Gaussian steps: same epsilon as dp_accounting's RdpAccountant on the
    same events and orders (its series agrees with ours where it converges)."""
    rng = np.random.default_rng(3)
    q = rng.uniform(0.001, 0.05, 40)
    z = rng.uniform(0.6, 3.0, 40)
    acc = dp_accounting.rdp.RdpAccountant(orders=list(REF_ORDERS))
    for a, b in zip(q, z):
        acc.compose(dp_accounting.PoissonSampledDpEvent(
            float(a), dp_accounting.GaussianDpEvent(float(b))))
    ref_eps, ref_order = acc.get_epsilon_and_optimal_order(1e-5)
    eps, order = rdp.rdp_epsilon(q, z, np.ones(40), 1e-5, REF_ORDERS)
    assert eps == pytest.approx(ref_eps, rel=1e-6) and order == ref_order


def test_composed_rdp_grows_like_dp_accounting():
    # steps added a few at a time (distinct noise each), epsilon asked with and without further
    # steps, against dp_accounting's RDP accountant on the same steps listed at once
    import dp_accounting

    from tf_dp.accounting.rdp import DEFAULT_ORDERS, ComposedRdp

    rng = np.random.default_rng(5)
    acc = ComposedRdp(1e-5)
    steps = []
    for _ in range(3):
        new = [(float(rng.choice([0.01, 0.1])), float(rng.uniform(0.7, 2.0)))
               for _ in range(int(rng.integers(1, 6)))]
        acc.add([q for q, _ in new], [z for _, z in new], [1] * len(new))
        steps += new
        for extra in ([], [(0.1, 0.9, 7)]):
            ref = dp_accounting.rdp.RdpAccountant(list(DEFAULT_ORDERS))
            for q, z in steps:
                ref.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)))
            for q, z, k in extra:
                ref.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), k)
            eps = acc.epsilon(*zip(*extra)) if extra else acc.epsilon()
            assert eps == pytest.approx(ref.get_epsilon(1e-5), rel=1e-6)


def _random_units_and_orders(seed):
    rng = np.random.default_rng(seed)
    q = 10 ** rng.uniform(-4, np.log10(0.03), 4)
    s = rng.uniform(0.6, 5.0, 4)
    orders = np.unique(np.round(np.concatenate(
        [1.0 + rng.uniform(0.02, 12.0, 16), rng.integers(2, 70, 6).astype(float)]), 3))
    return q, s, orders


@pytest.mark.parametrize("seed", [0, 1])
def test_all_orders_at_once_equal_one_order_at_a_time_and_dp_accounting(seed):
    """R(a) of several units at many (random) orders in one evaluation equals the same units
    evaluated one order at a time, the closed-form binomial sum at integer orders (exact
    integers, Python floats) and dp_accounting's RDP (its series, where it converges)."""
    import math

    q, s, orders = _random_units_and_orders(seed)
    together = rdp._rdp_matrix(q, s, orders)
    one_by_one = np.stack([rdp._rdp_matrix(q, s, np.array([a]))[:, 0] for a in orders], axis=1)
    np.testing.assert_allclose(together, one_by_one, rtol=1e-9)
    for i, (qi, si) in enumerate(zip(q, s)):
        ref = np.asarray(ref_rdp._compute_rdp_poisson_subsampled_gaussian(qi, si, orders))
        # fractional orders: a certified series (tail bound <= 1e-7 of log A_a added); tiny
        # divergences: log A_a is a log of sums near 1, exact to double round-off (~1e-15)
        np.testing.assert_allclose(together[i], ref, rtol=1e-6, atol=1e-14)
        for j, a in enumerate(orders):
            if a.is_integer():
                a = int(a)
                total = math.fsum(math.comb(a, k) * (1 - qi) ** (a - k) * qi ** k
                                  * math.exp((k * k - k) / (2 * si * si)) for k in range(a + 1))
                assert together[i, j] == pytest.approx(math.log(total) / (a - 1), rel=1e-9)
                assert together[i, j] == pytest.approx(ref[j], rel=1e-9)


def test_orders_share_the_blocks_of_series_terms(monkeypatch):
    """The fractional series of all orders runs in one loop of blocks of terms: as many blocks
    as the slowest order alone needs, not the sum over orders (each block evaluates the certified
    tail bound once)."""
    q, s = np.array([0.05]), np.array([1.0])
    orders = np.array([1.05, 1.5, 2.5, 3.3, 4.1, 4.7, 5.5, 6.5, 8.1, 10.5])
    calls = []
    original = rdp._log_tail_bound
    monkeypatch.setattr(rdp, "_log_tail_bound", lambda *a: calls.append(1) or original(*a))

    def blocks(o):
        calls.clear()
        rdp._rdp_matrix(q, s, np.asarray(o, float))
        return len(calls)

    singles = [blocks([a]) for a in orders]
    assert sum(singles) > max(singles)
    assert blocks(orders) == max(singles)


def test_composed_rdp_prefetch_looks_up_announced_steps_and_recomputes_others(monkeypatch):
    # Steps announced ahead (one evaluation for all of them) are asked about and added one at a
    # time; a step that was not announced (a wrong prediction) is evaluated on its own. Epsilon
    # equals rdp_epsilon on all the steps at once, and the announced steps cost far fewer
    # _rdp_matrix calls than one per step.
    from tf_dp.accounting import rdp

    calls = [0]
    original = rdp._rdp_matrix

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    acc = rdp.ComposedRdp(1e-5)
    acc.add([0.01], [1.0], [100])
    acc.epsilon()
    z = [1.0 + i / 200 for i in range(40)]
    monkeypatch.setattr(rdp, "_rdp_matrix", counted)
    acc.prefetch([0.01] * 40, z)
    steps = [(0.01, 1.0, 100)]
    for i, zi in enumerate(z):
        if i == 20:
            zi = 3.0  # not announced
        eps = acc.epsilon([0.01], [zi], [1])
        monkeypatch.setattr(rdp, "_rdp_matrix", original)
        ref = rdp.rdp_epsilon(*zip(*steps, (0.01, zi, 1)), 1e-5)[0]
        monkeypatch.setattr(rdp, "_rdp_matrix", counted)
        assert eps == pytest.approx(ref, rel=1e-9)
        acc.add([0.01], [zi], [1])
        steps.append((0.01, zi, 1))
    assert calls[0] <= 40 // 4
