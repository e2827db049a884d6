"""JL mechanism accounting (Bu et al. 2020, Lemma 4.3 / Thm 4.1) through the PLD mixture hook."""

import math

import numpy as np
import pytest
from scipy import stats

from tf_dp.accounting import jl, pld

Q, SIGMA, STEPS, DELTA = 0.01, 1.0, 200, 1e-5


@pytest.fixture(scope="module")
def exact_eps():
    return pld.pld_epsilon([(pld.SubsampledGaussian(Q, SIGMA), STEPS)], DELTA, h=1e-3,
                           loss_cap=jl.JL_LOSS_CAP)


def test_large_r_approaches_exact_clipping(exact_eps):
    e64 = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 64)
    e1024 = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 1024)
    assert math.isfinite(e64) and math.isfinite(e1024)
    assert exact_eps < e1024 < e64  # JL never better than exact clipping here; converges
    assert e1024 == pytest.approx(exact_eps, rel=0.05)


def test_small_r_is_worse(exact_eps):
    e1 = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 1)
    e16 = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 16)
    assert e1 > e16 > exact_eps
    assert math.isfinite(e16)


def test_r1_heavy_tail_is_not_dropped():
    """For r=1, P(Z_1 > z) ~ sqrt(2/pi)/z: the probability that some step samples the record and
    draws a scale so large that the loss exceeds the cap lower-bounds delta; the accountant must
    report at least that (independent computation from the chi-square law)."""
    z_cap = SIGMA * math.sqrt(2 * jl.JL_LOSS_CAP) * 2.0  # shift z/sigma: loss >> cap w.h.p.
    p_tail = stats.chi2.cdf(1.0 / z_cap**2, 1)
    lower = 1 - (1 - Q * p_tail * 0.5) ** STEPS
    assert jl.jl_delta(Q, SIGMA, STEPS, 20.0, 1) >= lower


def test_finite_and_stable_to_refinement():
    e_a = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 16, num_bins=200)
    e_b = jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 16, num_bins=400, h=1e-3)
    assert math.isfinite(e_a) and math.isfinite(e_b)
    assert e_a == pytest.approx(e_b, rel=0.05)


def test_mixture_weights_are_exact_bin_probabilities():
    m = jl.jl_mechanism(Q, SIGMA, 4)
    w = np.asarray(m.weights)
    assert w.sum() + m.inf_mass == pytest.approx(1.0, abs=1e-12)
    # noise multipliers are non-increasing-scale representatives: sigma / z_upper
    s = [c.noise_multiplier for c in m.components]
    assert s[-1] == 0.0 and all(a >= b for a, b in zip(s[:-1], s[1:]))


def test_validation():
    with pytest.raises(ValueError, match="jl_projections"):
        jl.jl_epsilon(Q, SIGMA, STEPS, DELTA, 0)
    with pytest.raises(ValueError, match="steps"):
        jl.jl_epsilon(Q, SIGMA, 0, DELTA, 4)
