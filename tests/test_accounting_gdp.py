"""GDP (CLT): Table 1 of Bu et al. 2019, closed-form Gaussian curve, noise reduction."""

import math

import pytest
from scipy import stats

from tf_dp.accounting import gdp, rdp

P = 256 / 60000
TABLE1 = [
    (1.3, 15, 0.23, 0.83),
    (1.1, 60, 0.57, 2.32),
    (0.7, 45, 1.13, 5.07),
    (0.6, 62, 2.00, 9.98),
    (0.55, 68, 2.76, 14.98),
    (0.5, 100, 4.78, 31.12),
]


@pytest.mark.parametrize("sigma,epochs,mu,eps_clt", TABLE1)
def test_table1_mu_and_eps_clt(sigma, epochs, mu, eps_clt):
    m = gdp.mu_poisson(P, sigma, epochs / P)
    assert abs(m - mu) <= 0.006
    assert abs(gdp.epsilon_from_mu(1e-5, m) - eps_clt) <= 0.006


def _balle_wang_delta(eps, sigma):
    # Analytic Gaussian mechanism (Balle & Wang 2018, Thm 8), sensitivity 1.
    a, b = 1 / (2 * sigma) - eps * sigma, -1 / (2 * sigma) - eps * sigma
    return stats.norm.cdf(a) - math.exp(eps) * stats.norm.cdf(b)


@pytest.mark.parametrize("sigma", [0.5, 1.0, 3.0])
def test_gaussian_q1_closed_form(sigma):
    for eps in (0.0, 0.5, 2.0, 6.0):
        assert gdp.delta_from_mu(eps, 1 / sigma) == pytest.approx(
            _balle_wang_delta(eps, sigma), rel=1e-9, abs=1e-300)


def test_epsilon_inverts_delta():
    for mu in (0.1, 0.57, 2.0, 5.0):
        e = gdp.epsilon_from_mu(1e-5, mu)
        assert gdp.delta_from_mu(e, mu) == pytest.approx(1e-5, rel=1e-6)


def test_uniform_mu_formula():
    s, q, T = 1.1, 0.01, 10000
    inner = math.exp(s**-2) * stats.norm.cdf(1.5 / s) + 3 * stats.norm.cdf(-0.5 / s) - 2
    assert gdp.mu_uniform(q, s, T) == pytest.approx(math.sqrt(2) * q * math.sqrt(T * inner))


def test_noise_reduction_eq_3_3_3_4():
    sigma, T = 1.1, int(60 / P)
    st = gdp.reduced_noise(P, sigma, T, 1e-5)
    assert st < sigma
    # The CLT guarantee at the reduced noise equals the moments accountant's at sigma.
    eps_ma = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS,
                                  rdp.rdp_poisson_gaussian(P, sigma) * T, 1e-5, "moments")[0]
    assert gdp.epsilon_from_mu(1e-5, gdp.mu_poisson(P, st, T)) == pytest.approx(eps_ma, rel=1e-6)


def test_validation():
    with pytest.raises(ValueError, match="delta"):
        gdp.epsilon_from_mu(1.0, 0.5)
    with pytest.raises(ValueError, match="noise_multiplier"):
        gdp.mu_poisson(0.1, 0.0, 10)
    with pytest.raises(ValueError, match="mu"):
        gdp.delta_from_mu(1.0, -1.0)


def test_mu_squared_adds_the_steps_mu_in_squares():
    # Eq. (3.1) per group of steps, squared and summed; q = 1 is the exact Gaussian composition
    assert gdp.mu_squared([0.01], [1.1], [500]) == pytest.approx(
        gdp.mu_poisson(0.01, 1.1, 500) ** 2, rel=1e-12)
    both = gdp.mu_squared([0.01, 0.02], [1.1, 0.9], [500, 30])
    assert both == pytest.approx(gdp.mu_poisson(0.01, 1.1, 500) ** 2
                                 + gdp.mu_poisson(0.02, 0.9, 30) ** 2, rel=1e-12)
    assert gdp.mu_squared([1.0], [2.0], [8]) == pytest.approx(8 / 4.0)
    assert gdp.mu_squared([0.01, 1.0], [1.0, 0.0], [1, 1]) == math.inf
    assert gdp.mu_squared([], [], []) == 0.0
