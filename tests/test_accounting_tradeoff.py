"""Tradeoff curves (tf_dp.accounting.tradeoff): certified PLD curve vs closed forms."""

import numpy as np
import pytest

from tf_dp.accounting import (
    SubsampledGaussian,
    gaussian_tradeoff,
    gdp,
    pld_delta,
    pld_delta_curve,
    pld_tradeoff,
    tradeoff_from_epsilon_delta,
)
from tf_dp.accounting.tradeoff import min_total_error

ALPHA = np.linspace(0.0, 1.0, 401)


def test_gaussian_mechanism_curve_is_g_mu_from_below():
    # One unsampled Gaussian step with sigma is exactly (1/sigma)-GDP.
    f = pld_tradeoff([(SubsampledGaussian(1.0, 2.0), 1)], ALPHA, h=1e-4)
    g = gaussian_tradeoff(ALPHA, 0.5)
    assert np.all(f <= g + 1e-12)  # certified: never above the exact curve
    assert np.max(g - f) < 1e-3


def test_epsilon_delta_lines_and_symmetry():
    f = tradeoff_from_epsilon_delta(ALPHA, [1.0], [0.0])
    assert f[0] == pytest.approx(1.0) and f[-1] == pytest.approx(0.0)
    # The (eps, 0) curve is symmetric: f(f(alpha)) = alpha.
    assert np.interp(np.interp(0.1, ALPHA, f), ALPHA, f) == pytest.approx(0.1, abs=1e-3)
    assert gaussian_tradeoff(ALPHA, 0.0) == pytest.approx(1.0 - ALPHA)


def test_delta_curve_matches_pld_delta_and_min_error():
    mech = [(SubsampledGaussian(256 / 60000, 1.1), 3000)]
    eps, deltas = pld_delta_curve(mech, epsilons=[0.5, 1.0], h=1e-3)
    assert deltas[1] == pytest.approx(pld_delta(mech, 1.0, h=1e-3), rel=1e-9)
    assert deltas[0] > deltas[1]
    f = pld_tradeoff(mech, ALPHA, h=1e-3)
    mu = gdp.mu_poisson(256 / 60000, 1.1, 3000)
    # Close to the CLT curve in the middle (the quantity Bu et al. quote).
    assert min_total_error(ALPHA, f) == pytest.approx(
        min_total_error(ALPHA, gaussian_tradeoff(ALPHA, mu)), abs=0.01)
