"""Hyperparameter accounting, noise calibration and the CLI for the fixed-shape batch selections
(truncated Poisson, balls-in-bins), checked against independent computations:

* balls-in-bins is certified as one full-batch Gaussian per epoch: ``E`` epochs at noise
  multiplier ``z`` are one Gaussian with ``mu = sqrt(E) / z``, whose exact ``delta(epsilon)`` is
  the closed form of Balle & Wang 2018 (Theorem 8); the calibrated noise is checked against the
  ``z`` solving that closed form.
* truncated Poisson with ``B = N`` never truncates: plain Poisson, number for number; at the
  default ``B`` the epsilon lies between Poisson's and dp_accounting's
  ``TruncatedSubsampledGaussianDpEvent`` (a looser analysis of the same mechanism).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import dp_accounting
import pytest
from scipy import optimize, stats

from tf_dp import accounting as acc
from tf_dp.data.truncated_poisson import default_truncation_size

N, BATCH, DELTA = 60000, 256, 1e-5
#: tf_dp's PLD is pessimistic and within 0.5% above the exact epsilon at its default grid
#: (tf_dp.accounting.pld module docstring); below it only by its root finder's tolerance.
PLD_REL = 5e-3
SOLVE_REL = 1e-7


def _gaussian_delta(eps: float, mu: float) -> float:
    """Exact delta(eps) of the Gaussian mechanism with sensitivity / noise = mu."""
    return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2)


def _gaussian_epsilon(mu: float, delta: float) -> float:
    return optimize.brentq(lambda e: _gaussian_delta(e, mu) - delta, 0.0, 500.0, xtol=1e-12)


@pytest.mark.parametrize("z,epochs", [(1.0, 5), (2.0, 3), (4.0, 20)])
def test_balls_in_bins_epsilon_is_the_gaussian_closed_form(z, epochs):
    res = acc.dp_sgd_epsilon(N, BATCH, z, DELTA, epochs=epochs, sampling="balls_in_bins",
                             accountant="pld")
    exact = _gaussian_epsilon(math.sqrt(epochs) / z, DELTA)
    assert exact * (1 - SOLVE_REL) <= res.epsilon <= exact * (1 + PLD_REL)
    assert res.steps == epochs * math.ceil(N / BATCH)
    rdp = acc.dp_sgd_epsilon(N, BATCH, z, DELTA, epochs=epochs, sampling="balls_in_bins")
    assert rdp.epsilon >= exact  # an upper bound, never below the exact value
    # dp_accounting's RDP of the same E Gaussians (independent code, same conversion family)
    ref = dp_accounting.rdp.RdpAccountant()
    ref.compose(dp_accounting.GaussianDpEvent(z), epochs)
    assert rdp.epsilon == pytest.approx(ref.get_epsilon(DELTA), rel=2e-2)


def test_balls_in_bins_counts_whole_epochs():
    per_epoch = math.ceil(N / BATCH)
    res = acc.dp_sgd_epsilon(N, BATCH, 1.0, DELTA, epochs=2.5, sampling="balls_in_bins",
                             accountant="pld")
    assert res.steps == 3 * per_epoch  # a partial epoch is charged as a whole one
    exact = _gaussian_epsilon(math.sqrt(3) / 1.0, DELTA)
    assert exact * (1 - SOLVE_REL) <= res.epsilon <= exact * (1 + PLD_REL)


@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_truncated_poisson_without_truncation_is_poisson(accountant):
    t = acc.dp_sgd_epsilon(N, BATCH, 1.0, DELTA, epochs=2, sampling="truncated_poisson",
                           max_batch_size=N, accountant=accountant)
    p = acc.dp_sgd_epsilon(N, BATCH, 1.0, DELTA, epochs=2, accountant=accountant)
    assert t.steps == p.steps
    assert t.epsilon == pytest.approx(p.epsilon, rel=1e-9)


def test_truncated_poisson_default_b_between_poisson_and_dp_accounting_event():
    b = default_truncation_size(N, BATCH / N)
    z, epochs = 1.0, 2
    t = acc.dp_sgd_epsilon(N, BATCH, z, DELTA, epochs=epochs, sampling="truncated_poisson",
                           max_batch_size=b, accountant="pld")
    p = acc.dp_sgd_epsilon(N, BATCH, z, DELTA, epochs=epochs, accountant="pld")
    ref = dp_accounting.pld.PLDAccountant()
    ref.compose(dp_accounting.TruncatedSubsampledGaussianDpEvent(N, BATCH / N, b, z), t.steps)
    assert p.epsilon <= t.epsilon <= ref.get_epsilon(DELTA) * (1 + PLD_REL)


@pytest.mark.parametrize("sampling", ["truncated_poisson", "balls_in_bins"])
@pytest.mark.parametrize("accountant", ["rdp", "pld"])
def test_calibration_meets_the_target_and_is_tight(sampling, accountant):
    kw = dict(epochs=3, sampling=sampling, accountant=accountant)
    if sampling == "truncated_poisson":
        kw["max_batch_size"] = default_truncation_size(N, BATCH / N)
    target, rtol = 3.0, 1e-3
    z = acc.calibrate_noise_multiplier(target, DELTA, N, BATCH, rtol=rtol, **kw)
    assert acc.dp_sgd_epsilon(N, BATCH, z, DELTA, **kw).epsilon <= target
    assert acc.dp_sgd_epsilon(N, BATCH, z * (1 - 2 * rtol), DELTA, **kw).epsilon > target


def test_balls_in_bins_calibration_matches_the_closed_form_noise():
    epochs, target = 4, 2.0
    z = acc.calibrate_noise_multiplier(target, DELTA, N, BATCH, epochs=epochs,
                                       sampling="balls_in_bins", accountant="pld")
    # the exact z: sqrt(E) / z is the mu whose exact epsilon at DELTA is the target
    mu = optimize.brentq(lambda m: _gaussian_epsilon(m, DELTA) - target, 0.1, 20.0, xtol=1e-12)
    z_exact = math.sqrt(epochs) / mu
    assert z_exact * (1 - SOLVE_REL) <= z <= z_exact * (1 + 2 * PLD_REL)


def test_bad_max_batch_size_is_named():
    with pytest.raises(ValueError, match="max_batch_size is required"):
        acc.dp_sgd_epsilon(N, BATCH, 1.0, DELTA, epochs=1, sampling="truncated_poisson")
    with pytest.raises(ValueError, match=r"max_batch_size must be in \[1, N=60000\]"):
        acc.dp_sgd_run(N, BATCH, 1.0, epochs=1, sampling="truncated_poisson",
                       max_batch_size=N + 1)
    with pytest.raises(ValueError, match="max_batch_size applies only"):
        acc.dp_sgd_run(N, BATCH, 1.0, epochs=1, max_batch_size=300)
    with pytest.raises(ValueError, match="sampling must be one of"):
        acc.dp_sgd_run(N, BATCH, 1.0, epochs=1, sampling="cyclic")


def _cli(module, *args):
    return subprocess.run([sys.executable, "-m", f"tf_dp.cli.{module}", *args],
                          capture_output=True, text=True, timeout=300)


BASE = [f"--N={N}", f"--batch_size={BATCH}", "--epochs=3", f"--delta={DELTA}"]


def test_cli_privacy_for_the_new_selections():
    p = _cli("compute_dp_sgd_privacy", *BASE, "--noise_multiplier=1.0",
             "--sampling=truncated_poisson", "--accountant=all", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    b = default_truncation_size(N, BATCH / N)  # the CLI's default B is the sampler's
    for name in ("rdp", "pld"):
        ref = acc.dp_sgd_epsilon(N, BATCH, 1.0, DELTA, epochs=3, sampling="truncated_poisson",
                                 max_batch_size=b, accountant=name)
        assert out[name]["epsilon"] == pytest.approx(ref.epsilon, rel=1e-9)
    assert out["gdp"]["epsilon"] is None and "truncated" in out["gdp"]["skipped"]
    p = _cli("compute_dp_sgd_privacy", *BASE, "--noise_multiplier=2.0",
             "--sampling=balls_in_bins", "--accountant=pld", "--format=json")
    assert p.returncode == 0, p.stderr
    exact = _gaussian_epsilon(math.sqrt(3) / 2.0, DELTA)
    assert exact * (1 - SOLVE_REL) <= json.loads(p.stdout)["pld"]["epsilon"] <= exact * (1 + PLD_REL)


def test_cli_noise_for_the_new_selections_and_clean_errors():
    p = _cli("compute_noise_from_budget", *BASE, "--epsilon=3", "--sampling=truncated_poisson",
             "--max_batch_size=320", "--accountant=all", "--format=json")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert "gdp" not in out
    for name in ("rdp", "moments", "pld"):
        z = out[name]["noise_multiplier"]
        ref = acc.dp_sgd_epsilon(N, BATCH, z, DELTA, epochs=3, sampling="truncated_poisson",
                                 max_batch_size=320, accountant=name)
        assert ref.epsilon <= 3.0
    p = _cli("compute_noise_from_budget", *BASE, "--epsilon=3", "--max_batch_size=320")
    assert p.returncode == 2 and "--max_batch_size applies only" in p.stderr
    p = _cli("compute_dp_sgd_privacy", *BASE, "--noise_multiplier=1", "--max_batch_size=0",
             "--sampling=truncated_poisson")
    assert p.returncode == 2 and "--max_batch_size must be an integer in [1, --N=60000]" in p.stderr


@pytest.mark.parametrize("n,b", [(1000, 64), (1000, 100), (999, 7), (1000, 300)])
def test_hyperparameter_runs_have_the_samplers_steps_per_epoch(n, b):
    import numpy as np

    from tf_dp.data import balls_in_bins_batches

    x, y = np.zeros((n, 1), np.float32), np.zeros(n, np.int32)
    batches = balls_in_bins_batches(x, y, batch_size=b, seed=0)
    entry, steps = acc.dp_sgd_run(n, b, 1.0, epochs=1, sampling="balls_in_bins")
    assert steps == batches.steps_per_epoch
    assert entry.sampling.selection_probability == batches.sampling_probability


def test_epochs_plan_the_steps_the_poisson_family_samplers_run():
    """dp_sgd_run(epochs=E) must count what the samplers run: E fit epochs of round(n / b)
    batches (n = 260, b = 100: 1 / q = 2.6, 3 batches an epoch, 30 in 10 epochs; the expected
    count ceil(E n / b) = 26 under-counts by 4 steps). Counted by iterating each sampler's
    dataset, and the calibrated noise must meet the target over the 30 steps that run."""
    import numpy as np

    from tf_dp import data

    n, b, epochs = 260, 100, 10
    x, y = np.zeros((n, 1), np.float32), np.zeros(n, np.int32)
    q = b / n
    samplers = [
        data.poisson_batches(x, y, sampling_probability=q, seed=0),
        data.poisson_sample(data.ArraySource(x, y), sampling_probability=q, seed=0),
        data.truncated_poisson_batches(x, y, sampling_probability=q, seed=0),
        data.truncated_poisson_sample(data.ArraySource(x, y), sampling_probability=q, seed=0),
    ]
    for s in samplers:
        ran = sum(sum(1 for _ in s.dataset) for _ in range(epochs))  # fit's epochs
        assert ran == 30
        _, planned = acc.dp_sgd_run(n, b, 1.0, epochs=epochs, sampling=s.sampling.policy,
                                    max_batch_size=s.sampling.max_batch_size)
        assert planned == ran
    target = 2.0
    z = acc.calibrate_noise_multiplier(target, DELTA, n, b, epochs=epochs)
    assert acc.dp_sgd_epsilon(n, b, z, DELTA, steps=30).epsilon <= target
