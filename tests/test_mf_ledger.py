"""The matrix-factorization ledger event: epsilon recomputed from a saved ledger file, against
independent computations (C built by loops from the strategy's parameters, a brute-force
enumeration of participation patterns, the Gaussian mechanism's closed form, dp_accounting's PLD
of Poisson-subsampled Gaussians for b = 1, i.e. DP-SGD)."""

from __future__ import annotations

import itertools
import json
import math

import dp_accounting
import numpy as np
import pytest
from scipy import optimize, stats

from tf_dp.accounting.matrix_factorization import mf_epsilon_from_ledger, mf_matrix_from_config
from tf_dp.ledger import PrivacyLedger, SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.events import MF_METADATA_KEY, MatrixFactorizationEvent
from tf_dp.ledger.ledger_file import write_ledger_runs

DELTA = 1e-5
#: tf_dp's and dp_accounting's PLDs are pessimistic and within 0.5% of the exact epsilon here
PLD_REL = 5e-3


def _loop_c(config, n):
    """C by loops from the parameters (the definitions in MatrixFactorizationEvent's docstring)."""
    if config["kind"] == "banded":
        coef = config["coefficients"]
        c = np.zeros((n, n))
        for t in range(n):
            for j in range(len(coef)):
                if t - j >= 0:
                    c[t, t - j] = coef[j]
        return c
    inv = np.eye(n)
    for t in range(n):
        for s in range(t):
            inv[t, s] = sum(o * th ** (t - s - 1) for o, th in zip(config["omega"], config["theta"]))
    return np.linalg.inv(inv)


def _gaussian_epsilon(mu, delta):
    """Balle & Wang 2018 Thm. 8: the epsilon of N(0,1) vs N(mu,1) at delta, by bisection."""
    def d(eps):
        return (stats.norm.cdf(-eps / mu + mu / 2)
                - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta)
    return optimize.brentq(d, 0.0, 500.0, xtol=1e-14)


def _enumerated_sensitivity(c, period):
    """max ||C u|| over every 0/1 vector u whose ones are at least ``period`` steps apart."""
    n = c.shape[0]
    best = 0.0
    for u in itertools.product((0, 1), repeat=n):
        ones = np.flatnonzero(u)
        if len(ones) and (np.diff(ones) >= period).all():
            best = max(best, float(np.linalg.norm(c @ np.asarray(u, float))))
    return best


def _save(path, runs, event):
    write_ledger_runs(path, runs, metadata={MF_METADATA_KEY: event.to_dict()})


def _runs(n, sampling, clip):
    return [(SampleEntry(sampling, (SumQueryEvent(clip, 0.0),)), n)]


def test_event_round_trips_through_json_and_names_bad_arguments():
    e = MatrixFactorizationEvent({"kind": "blt", "omega": [0.3, 0.1], "theta": [0.8, 0.2],
                                  "num_steps": 50}, 1.5, 0.7, "cyclic_poisson", period=5,
                                 sampling_probability=0.1)
    assert MatrixFactorizationEvent.from_dict(json.loads(json.dumps(e.to_dict()))) == e
    for kwargs, name in [({"noise_multiplier": -1.0}, "noise_multiplier"),
                         ({"l2_norm_clip": 0.0}, "l2_norm_clip"),
                         ({"participation": "shuffle"}, "participation"),
                         ({"participation": "periodic", "period": 0}, "period"),
                         ({"participation": "cyclic_poisson", "period": 2,
                           "sampling_probability": 1.5}, "sampling_probability")]:
        args = {"strategy": {"kind": "banded", "coefficients": [1.0], "num_steps": 3},
                "noise_multiplier": 1.0, "l2_norm_clip": 1.0, **kwargs}
        with pytest.raises(ValueError, match=name):
            MatrixFactorizationEvent(**args)


@pytest.mark.parametrize("config,n", [
    ({"kind": "banded", "coefficients": [1.0, -0.4, 0.25], "num_steps": 6}, 9),  # continued
    ({"kind": "blt", "omega": [0.5, -0.2], "theta": [0.7, 0.1], "num_steps": 8}, 8),
])
def test_c_from_config_matches_loops(config, n):
    want = _loop_c(config, n)
    # solve of a unit-lower-triangular matrix with entries <= 1: a few n roundings of 2^-52
    assert np.abs(mf_matrix_from_config(config, n) - want).max() <= 16 * n * 2.0**-52


def test_bandmf_b1_from_saved_ledger_is_dp_sgd_per_dp_accounting(tmp_path):
    n, z, q, clip = 300, 1.1, 0.02, 0.8
    event = MatrixFactorizationEvent({"kind": "banded", "coefficients": [1.0], "num_steps": n},
                                     z, clip, "cyclic_poisson", period=1, sampling_probability=q)
    smp = SamplingEvent(10000, q, "cyclic_poisson", origin="sampled", num_parts=1)
    _save(tmp_path / "l.json", _runs(n, smp, clip), event)
    res = mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), n)
    assert res.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=2 * PLD_REL)


def test_banded_amplified_from_saved_ledger_per_dp_accounting(tmp_path):
    n, b, z, q = 40, 4, 1.3, 0.1
    coef = [1.0, 0.5, 0.3, 0.2]
    event = MatrixFactorizationEvent({"kind": "banded", "coefficients": coef, "num_steps": n},
                                     z, 1.0, "cyclic_poisson", period=b, sampling_probability=q)
    smp = SamplingEvent(1000, q, "cyclic_poisson", origin="sampled", num_parts=b)
    _save(tmp_path / "l.json", _runs(n, smp, 1.0), event)
    res = mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)
    col = math.sqrt(sum(x * x for x in coef))  # a full column of the banded Toeplitz C
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z / col)),
                math.ceil(n / b))
    assert res.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=2 * PLD_REL)


@pytest.mark.parametrize("config,period", [
    ({"kind": "banded", "coefficients": [1.0, 0.6, 0.3], "num_steps": 12}, 4),
    ({"kind": "blt", "omega": [-0.3], "theta": [0.5], "num_steps": 12}, 3),  # C >= 0
])
def test_periodic_from_privacy_ledger_save_matches_enumeration(tmp_path, config, period):
    n, z = 12, 2.5
    ledger = PrivacyLedger()
    # cyclic Poisson over `period` parts: a record can take part every `period` steps
    smp = SamplingEvent(1000, 0.01, "cyclic_poisson", num_parts=period)
    ledger.restore_runs(_runs(n, smp, 1.0))
    event = MatrixFactorizationEvent(config, z, 1.0, "periodic", period=period)
    ledger.save(tmp_path / "l.json", metadata={MF_METADATA_KEY: event.to_dict()})
    res = mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)
    sens = _enumerated_sensitivity(_loop_c(config, n), period)
    # mf_sensitivity is exact when C^T C >= 0 (true for both), else an upper bound
    assert res.exact_sensitivity
    assert res.sensitivity == pytest.approx(sens, rel=64 * n * 2.0**-52)
    assert res.epsilon == pytest.approx(_gaussian_epsilon(sens / z, DELTA), rel=1e-9)
    # the ledger loads back with the same steps (the event lives in the file's metadata)
    assert sum(c for _, c in PrivacyLedger.load(tmp_path / "l.json").runs()) == n


def test_refusals(tmp_path):
    event = MatrixFactorizationEvent({"kind": "banded", "coefficients": [1.0, 0.5],
                                      "num_steps": 10}, 1.0, 1.0, "cyclic_poisson", period=2,
                                     sampling_probability=0.1)
    write_ledger_runs(tmp_path / "none.json", _runs(10, SamplingEvent(100, 0.1), 1.0))
    with pytest.raises(ValueError, match="no matrix-factorization event"):
        mf_epsilon_from_ledger(tmp_path / "none.json", DELTA)
    _save(tmp_path / "poisson.json", _runs(10, SamplingEvent(100, 0.1), 1.0), event)
    with pytest.raises(ValueError, match="cyclic Poisson"):
        mf_epsilon_from_ledger(tmp_path / "poisson.json", DELTA)
    smp = SamplingEvent(100, 0.1, "cyclic_poisson", num_parts=2)
    _save(tmp_path / "clip.json", _runs(10, smp, 2.0), event)
    with pytest.raises(ValueError, match="l2_sensitivity"):
        mf_epsilon_from_ledger(tmp_path / "clip.json", DELTA)


def test_a_participation_claim_the_sampling_contradicts_is_refused(tmp_path):
    """Poisson draws let a record take part in any step: a 'periodic' (period > 1) or 'single'
    claim would understate the sensitivity (100 steps, 4 bands, z = 1.5: 6.4 instead of 255)."""
    cfg = {"kind": "banded", "coefficients": [1.0, 0.6, 0.3, 0.1], "num_steps": 40}
    n, z = 40, 1.5

    def eps(smp, participation, period=None):
        event = MatrixFactorizationEvent(cfg, z, 1.0, participation, period=period)
        _save(tmp_path / "l.json", _runs(n, smp, 1.0), event)
        return mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)

    poisson = SamplingEvent(1000, 0.1)
    for participation, period in (("periodic", 10), ("single", None)):
        with pytest.raises(ValueError, match="can take part in any step"):
            eps(poisson, participation, period)
    every = eps(poisson, "periodic", 1)  # every step: valid for any sampling
    assert every.sensitivity == pytest.approx(
        float(np.linalg.norm(_loop_c(cfg, n).sum(axis=1))), rel=1e-12)
    cyclic = SamplingEvent(1000, 0.1, "cyclic_poisson", num_parts=8)
    with pytest.raises(ValueError, match="period dividing 8"):
        eps(cyclic, "periodic", 3)
    assert eps(cyclic, "periodic", 4).epsilon >= eps(cyclic, "periodic", 8).epsilon
    shuffle = SamplingEvent(1000, 0.1, "shuffle")  # 10 steps an epoch
    with pytest.raises(ValueError, match="period 10, the epoch"):
        eps(shuffle, "periodic", 5)
    fixed_order = eps(shuffle, "periodic", 10)
    assert "the user's claim" in fixed_order.assumptions


# -- long runs: the accountants read C as a filter (O(n * bands)), never as an n x n matrix ------


def _no_dense(monkeypatch):
    from tf_dp.accounting import matrix_factorization as mf
    from tf_dp.accounting import matrix_sensitivity as ms

    def boom(*a, **k):
        raise AssertionError("an n x n matrix was built")

    monkeypatch.setattr(mf, "mf_matrix_from_config", boom)
    monkeypatch.setattr(mf, "_matrix", boom)
    monkeypatch.setattr(ms, "_matrix", boom)
    monkeypatch.setattr(mf.ToeplitzC, "matrix", boom)


def test_1e5_step_amplified_ledger_without_a_dense_c_per_dp_accounting(tmp_path, monkeypatch):
    n, b, z, q = 100_000, 8, 1.2, 0.01
    coef = [1.0, 0.45, 0.3, 0.22, 0.17, 0.13, 0.1, 0.08]
    event = MatrixFactorizationEvent({"kind": "banded", "coefficients": coef, "num_steps": n},
                                     z, 1.0, "cyclic_poisson", period=b, sampling_probability=q)
    smp = SamplingEvent(10**6, q, "cyclic_poisson", origin="sampled", num_parts=b)
    _save(tmp_path / "l.json", _runs(n, smp, 1.0), event)
    _no_dense(monkeypatch)
    res = mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)
    col = math.sqrt(sum(x * x for x in coef))
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z / col)),
                n // b)
    assert res.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=2 * PLD_REL)


@pytest.mark.parametrize("config", [
    {"kind": "banded", "coefficients": [1.0, 0.5, 0.25], "num_steps": 7},
    {"kind": "blt", "omega": [-0.2, -0.02], "theta": [0.6, 0.9], "num_steps": 7},
])
def test_1e5_step_periodic_ledger_without_a_dense_c_is_the_gaussian_of_c_u(
        tmp_path, monkeypatch, config):
    n, p, z = 100_000, 1000, 40.0
    event = MatrixFactorizationEvent(config, z, 1.0, "periodic", period=p)
    _save(tmp_path / "l.json", _runs(n, SamplingEvent(p * 100, 1 / p, "shuffle"), 1.0), event)
    # independent: C's column by its defining recurrence (banded: the coefficients; BLT: C C^{-1}
    # = I with C^{-1}'s column 1, sum_i omega_i theta_i^(k-1)), then C u_0 as a convolution
    m = 2000  # enough lags: C's column decays below 1e-30 (BLT) or ends (banded) well before
    if config["kind"] == "banded":
        col = np.r_[config["coefficients"], np.zeros(m - 3)]
    else:
        k = np.arange(1, m)
        inv = np.r_[1.0, sum(o * t ** (k - 1) for o, t in zip(config["omega"], config["theta"]))]
        col = np.zeros(m)
        for t in range(m):  # forward substitution of the lower-triangular Toeplitz C^{-1}
            col[t] = (1.0 if t == 0 else 0.0) - np.dot(inv[1 : t + 1], col[t - 1 :: -1][:t])
    assert np.all(col >= 0)  # C >= 0: the all-offset-0 pattern is the worst (exact sensitivity)
    u = np.zeros(n)
    u[::p] = 1.0
    sens = float(np.linalg.norm(np.convolve(col, u)[:n]))
    _no_dense(monkeypatch)
    res = mf_epsilon_from_ledger(tmp_path / "l.json", DELTA)
    assert res.exact_sensitivity
    assert res.sensitivity == pytest.approx(sens, rel=1e-9)
    assert res.epsilon == pytest.approx(_gaussian_epsilon(sens / z, DELTA), rel=1e-9)


@pytest.mark.parametrize("config", [
    {"kind": "banded", "coefficients": [1.0, 0.5, 0.25], "num_steps": 30},
    {"kind": "banded", "coefficients": [1.0, -0.9, 0.5], "num_steps": 30},  # C^T C < 0 somewhere
    {"kind": "blt", "omega": [-0.2, -0.02], "theta": [0.6, 0.9], "num_steps": 30},
    {"kind": "blt", "omega": [0.4], "theta": [-0.5], "num_steps": 30},  # C with negative entries
])
@pytest.mark.parametrize("period", [None, 1, 3, 7, 30])
def test_filter_sensitivity_equals_the_dense_one_on_small_n(config, period, monkeypatch):
    from tf_dp.accounting import matrix_factorization as mf
    from tf_dp.accounting import matrix_sensitivity as ms

    n = 30
    dense = _loop_c(config, n)
    want = mf.mf_sensitivity(dense, period)
    got = mf.mf_sensitivity(mf.ToeplitzC.from_config(config, n), period)
    assert got[1] == want[1] and got[0] == pytest.approx(want[0], rel=64 * n * 2.0**-52)
    if want[1]:  # where C^T C >= 0 on the pattern, the strategies' own max ||C u_j|| agrees
        assert from_config_sens(config, n, period) == pytest.approx(want[0], rel=64 * n * 2.0**-52)
    # above the dense limit, C with negative entries gets the ||(|C|) u|| bound: never below
    monkeypatch.setattr(ms, "_DENSE_BOUND_STEPS", 0)
    bound, exact = mf.mf_sensitivity(mf.ToeplitzC.from_config(config, n), period)
    assert (want[1] or not exact) and bound >= want[0] * (1 - 64 * n * 2.0**-52)
    if period is not None and n // period <= 12:  # and above every pattern, by enumeration
        brute = max(float(np.linalg.norm(dense[:, sub].sum(axis=1)))
                    for j in range(period) for k in range(1, len(range(j, n, period)) + 1)
                    for sub in map(list, itertools.combinations(range(j, n, period), k)))
        assert bound >= brute * (1 - 64 * n * 2.0**-52)


def from_config_sens(config, n, period):
    """The strategies' own sensitivity (max ||C u_j||), from their filter."""
    from tf_dp.correlated.strategies import from_config

    return from_config(dict(config, num_steps=n)).sensitivity(period)
