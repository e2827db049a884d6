"""The audit catches broken DP optimizers (planted defects) and spares correct ones.

The documented configuration (docs/auditing.md, "An audit with power"): threat_model
"white_box_gradient", a 4-input linear model, DPKerasSGDOptimizer with clip 1 and noise multiplier
2, Poisson rate 0.5, 10 steps, 4000 canaries in one training, delta 1e-5, RDP certificate, 95%
confidence. Each defect is planted below the optimizer (the engine's Gaussian query, or the
sampler) while the ledger records the configured values, so only the audit can see it. The
numpy-only tests check the profile test's false-alarm rate and the power calculation by direct
simulation against the closed-form Gaussian-DP profile.
"""

import dataclasses
import json
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import optimize, stats  # noqa: E402

from tf_dp.auditing import profile  # noqa: E402

NOISE, Q, STEPS, CANARIES, DELTA = 2.0, 0.5, 10, 4000, 1e-5


# ---------------------------------------------------------------- the profile test (numpy)

def _gaussian_profile(mu, deltas):
    """eps(delta) of the mu-GDP mechanism, from the closed form delta(eps) (Dong et al. 2019,
    Corollary 2.13) inverted by root finding (independent of tf_dp.accounting)."""

    def delta_of(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(
            -eps / mu - mu / 2)

    out = []
    for d in deltas:
        out.append(0.0 if delta_of(0.0) <= d else optimize.brentq(
            lambda e, d=d: delta_of(e) - d, 0.0, 200.0, xtol=1e-12))
    return np.array(out)


def _flags(mu_true, mu_cert, n, seeds, thresholds, confidence=0.95):
    deltas = profile.profile_deltas(DELTA)
    cert = _gaussian_profile(mu_cert, deltas)
    flags = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        inc = rng.random(n) < 0.5
        scores = rng.normal(mu_true * inc, 1.0)
        flags.append(profile.profile_test(scores, inc, deltas, cert, confidence,
                                          thresholds=thresholds).violated)
    return np.array(flags)


def test_profile_test_false_alarm_rate_at_most_its_level_on_the_certified_mechanism():
    # the mechanism IS the certified one (mu = 1, exact profile): 400 audits at 95% may raise
    # at most ~5% false alarms; 400 x 5% = 20 with a 99.9% binomial upper quantile of 35
    thresholds = stats.norm.isf(list(profile.DEFAULT_FPR_LEVELS))
    flags = _flags(1.0, 1.0, 2000, range(400), thresholds)
    assert flags.sum() <= stats.binom.ppf(0.999, 400, 0.05)


def test_detection_probability_bound_is_met_by_simulation():
    # a mechanism the calculation says is detected w.p. >= 0.9: simulated detection rate over
    # 200 audits must not be below the 0.1% binomial quantile of 0.9
    deltas = profile.profile_deltas(DELTA)
    cert = _gaussian_profile(1.0, deltas)
    thresholds = stats.norm.isf(list(profile.DEFAULT_FPR_LEVELS))
    n = 2000
    mus = np.linspace(1.0, 3.0, 41)
    detected = [profile.detection_probability_bound(
        stats.norm.sf(thresholds - mu), stats.norm.sf(thresholds), n // 2, n // 2, deltas, cert,
        0.95) for mu in mus]
    assert not detected[0] and detected[-1]
    mu_star = mus[int(np.argmax(detected))]  # the smallest detected on the grid
    flags = _flags(mu_star, 1.0, n, range(1000, 1200), thresholds)
    assert flags.mean() >= stats.binom.ppf(0.001, 200, 0.9) / 200


def test_profile_test_names_bad_arguments():
    with pytest.raises(ValueError, match="thresholds"):
        profile.profile_test([0.0, 1.0], [True, False], [1e-5], [1.0], thresholds=[])
    with pytest.raises(ValueError, match="deltas"):
        profile.profile_test([0.0, 1.0], [True, False], [1.5], [1.0], thresholds=[0.5])
    with pytest.raises(ValueError, match="same length"):
        profile.profile_test([0.0, 1.0], [True, False], [1e-5, 1e-3], [1.0], thresholds=[0.5])


# ---------------------------------------------------------------- planted defects (Keras)

def _audit(seed=0, **kw):
    import keras

    import tf_dp.keras
    from tf_dp.auditing import audit_dp_sgd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    return audit_dp_sgd(
        model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=NOISE, learning_rate=0.1,
            gradient_mode="vectorized", noise_seed=seed),
        x=x, y=y, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling_probability=Q, steps=STEPS, num_canaries=CANARIES, delta=DELTA,
        threat_model="white_box_gradient", seed=seed, **kw)


def _broken_query(noise_scale=1.0, clip_scale=1.0, clip=True):
    """A Gaussian query that adds ``noise_scale`` x the recorded noise and clips at
    ``clip_scale`` x the recorded clip (or not at all); what it records is untouched."""
    from tf_dp.dp_query.gaussian_query import GaussianSumQuery

    class Broken(GaussianSumQuery):
        def get_noised_result(self, sample_state, global_state):
            scaled = global_state._replace(stddev=global_state.stddev * noise_scale)
            result, _ = super().get_noised_result(sample_state, scaled)
            return result, global_state

        def clip_weights(self, params, squared_norms):
            if not clip:
                import tensorflow as tf

                return tf.nest.map_structure(lambda s: tf.ones_like(s, tf.float32),
                                             squared_norms)
            return super().clip_weights(params * clip_scale, squared_norms)

    return Broken


def _double_sampling(monkeypatch):
    """Batches drawn at rate 2q while the sampling claim (hence the ledger) says q."""
    import tf_dp.data

    original = tf_dp.data.poisson_batches

    def broken(x, y=None, sampling_probability=None, **kw):
        batches = original(x, y, sampling_probability=min(1.0, 2 * sampling_probability), **kw)
        n = batches.tf_dp_sampling[0]
        return dataclasses.replace(batches, tf_dp_sampling=(n, sampling_probability))

    monkeypatch.setattr(tf_dp.data, "poisson_batches", broken)


DEFECTS = {
    "no noise": dict(noise_scale=0.0),
    "noise / 10": dict(noise_scale=0.1),
    "no clipping": dict(clip=False),
    "clip 10x the recorded": dict(clip_scale=10.0),
    "sampling 2x the recorded": None,
}


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_planted_defect_is_flagged_in_the_documented_configuration(defect, monkeypatch):
    import tf_dp.engine.step

    if DEFECTS[defect] is None:
        _double_sampling(monkeypatch)
    else:
        monkeypatch.setattr(tf_dp.engine.step, "GaussianSumQuery",
                            _broken_query(**DEFECTS[defect]))
    report = _audit()
    # the ledger still certifies the configured run (independent RDP figure via dp_accounting)
    import dp_accounting

    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(
        Q, dp_accounting.GaussianDpEvent(NOISE)), STEPS)
    assert report.certified.epsilon == pytest.approx(acc.get_epsilon(DELTA), rel=0.02)
    assert report.violation, f"{defect}:\n{report}"
    assert report.profile.violated
    assert report.confidence == pytest.approx(0.95, abs=1e-12)


def test_correct_runs_are_not_flagged_and_the_report_says_what_it_can_see(tmp_path):
    # 3 fixed seeds (deterministic: seeded canaries, sampling and noise); each run is falsely
    # flagged with probability <= 5%, and these seeds are not
    for seed in range(3):
        report = _audit(seed=seed)
        assert not report.violation, str(report)
    # the report states its confidence, threat model, power and every estimator's bound
    assert len(report.bounds) == 4
    assert all(b.confidence == pytest.approx(1 - 0.05 / 4) for b in report.bounds)
    power = report.power
    assert power.probability == 0.9 and 1.0 < power.noise_factor < 3.0
    assert power.epsilon > report.certified.epsilon
    assert power.noise_multiplier == pytest.approx(NOISE / power.noise_factor)
    text = str(report)
    for needle in ("white-box-gradient", "95%", "power:", "certified-profile test",
                   "cannot see", "one-run", "many-run", "GDP lower bound"):
        assert needle in text, needle
    path = tmp_path / "audit.json"
    report.save(str(path))
    saved = json.loads(path.read_text())
    assert saved["threat_model"] == "white_box_gradient" and saved["confidence"] == 0.95
    assert saved["smallest_detectable"]["noise_factor"] == power.noise_factor
    for key in ("one_run", "many_run", "gdp_bound", "profile_test"):
        assert "confidence" in saved[key], key
    assert "cannot see" in saved["sees"]
    # the CLI prints the report's power and what it can see beside a ledger analysis
    import subprocess
    import sys

    p = subprocess.run(
        [sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy", "--N=60000",
         "--batch_size=256", "--noise_multiplier=1.1", "--epochs=3", "--delta=1e-5",
         f"--audit_report={path}"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert "power: a run with epsilon" in p.stdout and "cannot see" in p.stdout
    assert f"{power.epsilon:.4g}" in p.stdout


def test_white_box_gradient_refuses_an_optimizer_it_cannot_simulate():
    import keras

    import tf_dp.keras
    from tf_dp.auditing import audit_dp_sgd

    x = np.zeros((8, 4), "float32")
    y = np.zeros(8, "int32")
    with pytest.raises(ValueError, match="white_box_gradient.*plain SGD"):
        audit_dp_sgd(
            model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
            optimizer_fn=lambda: tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1, momentum=0.9),
            x=x, y=y, loss="sparse_categorical_crossentropy", num_canaries=10,
            threat_model="white_box_gradient")
