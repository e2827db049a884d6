"""tf_dp.auditing: estimators against closed forms and dp_accounting; audits of real DP-SGD runs.

The Keras audits use seeded noise (deterministic; the certificate is then marked as not a
guarantee, but its value is what an unseeded run gets, and that is what is compared).
"""

import dataclasses
import math
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import dp_accounting  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy import special, stats  # noqa: E402

from tf_dp.auditing import gaussian, many_run, one_run  # noqa: E402


def _gaussian_eps(mu, delta):
    """Exact epsilon of the Gaussian mechanism with sensitivity/std = mu, from dp_accounting."""
    return dp_accounting.pld.PLDAccountant().compose(
        dp_accounting.GaussianDpEvent(1.0 / mu)).get_epsilon(delta)


def _gaussian_trials(mu, n, seed):
    rng = np.random.default_rng(seed)
    included = rng.random(n) < 0.5
    return rng.normal(mu * included, 1.0), included


# ---------------------------------------------------------------- Clopper-Pearson / many-run

@pytest.mark.parametrize("k,n", [(0, 50), (3, 50), (25, 50), (50, 50), (7, 1000)])
def test_clopper_pearson_is_the_binomial_tail_inversion(k, n):
    alpha = 0.025
    low, high = many_run.clopper_pearson(k, n, alpha)
    if k < n:  # P[Bin(n, high) <= k] = alpha
        assert stats.binom.cdf(k, n, high) == pytest.approx(alpha, rel=1e-6)
    else:
        assert high == 1.0
    if k > 0:  # P[Bin(n, low) >= k] = alpha
        assert stats.binom.sf(k - 1, n, low) == pytest.approx(alpha, rel=1e-6)
    else:
        assert low == 0.0


def test_epsilon_from_rates_closed_form():
    # TPR = e^eps FPR + delta exactly -> eps
    eps, delta, fpr = 1.3, 1e-3, 0.05
    assert many_run.epsilon_from_rates(math.exp(eps) * fpr + delta, fpr, delta) == pytest.approx(
        eps)
    # the complementary test: 1 - FPR = e^eps (1 - TPR) + delta
    # (at FPR = 0.5 the first inequality allows a smaller eps, so this one decides)
    tpr = 1.0 - (1.0 - 0.5 - delta) / math.exp(eps)
    assert many_run.epsilon_from_rates(tpr, 0.5, delta) == pytest.approx(eps)


@pytest.mark.parametrize("mu", [1.0, 2.0])
def test_many_run_gaussian_mechanism_below_and_near_true_epsilon(mu):
    # 40000 trials, 20000 used for the bound: Clopper-Pearson at 95% then resolves rates down to
    # ~1e-4, enough for at least half of the true epsilon at delta = 1e-3 (the bound must never
    # exceed it: it holds with probability 95% per seed, and the slack here is >= 0.5 eps).
    delta = 1e-3
    true = _gaussian_eps(mu, delta)
    for seed in range(3):
        bound = many_run.epsilon_lower_bound(*_gaussian_trials(mu, 40000, seed), delta)
        assert 0.5 * true < bound.epsilon < true


def test_many_run_fixed_thresholds_union_bound():
    scores, included = _gaussian_trials(2.0, 20000, 0)
    one = many_run.epsilon_lower_bound(scores, included, 1e-3, thresholds=[3.0])
    many = many_run.epsilon_lower_bound(scores, included, 1e-3,
                                        thresholds=np.linspace(2.0, 4.0, 21))
    # a single threshold at 3 with the full level vs the same threshold at level / 21: recompute
    tp = int((scores[included] >= 3.0).sum())
    fp = int((scores[~included] >= 3.0).sum())
    low, _ = many_run.clopper_pearson(tp, int(included.sum()), 0.025)
    _, high = many_run.clopper_pearson(fp, int((~included).sum()), 0.025)
    assert one.epsilon == pytest.approx(math.log((low - 1e-3) / high))
    assert many.method == "fixed thresholds (21)"
    assert many.epsilon < _gaussian_eps(2.0, 1e-3)


def test_design_threshold_maximises_the_expected_bound_of_a_gaussian_mechanism():
    # Reference scores N(mu, 1) / N(0, 1): the expected bound at threshold t has the closed-form
    # rates Phi(mu - t), Phi(-t); the designed threshold must reach the best of a fine grid.
    mu, n, delta = 2.0, 5000, 1e-5
    rng = np.random.default_rng(0)
    ref_in, ref_out = rng.normal(mu, 1.0, 200_000), rng.normal(0.0, 1.0, 200_000)

    def expected_bound(t):
        low, _ = many_run.clopper_pearson(np.round(stats.norm.sf(t - mu) * n), n, 0.025)
        _, high = many_run.clopper_pearson(np.round(stats.norm.sf(t) * n), n, 0.025)
        return float(many_run.epsilon_from_rates(low, high, delta))

    t = many_run.design_threshold(ref_in, ref_out, n, n, delta, 0.95)
    best = max(expected_bound(g) for g in np.linspace(0.0, 4.5, 901))
    assert expected_bound(t) >= best - 0.1  # reference sampling error on the rates, ~1/sqrt(FP)
    with pytest.raises(ValueError, match="trials_in"):
        many_run.design_threshold(ref_in, ref_out, 0, n, delta)


def test_fixed_designed_threshold_beats_the_split_at_the_same_trials():
    # The split spends half of the trials choosing the threshold; a threshold fixed from a model of
    # the mechanism uses all of them. Gaussian mechanism mu = 2, 5000 trials, 5 seeds: the mean
    # bound is larger (the split's bound has half the trials: its Clopper-Pearson margin at the
    # same counts is ~sqrt(2) wider) and both stay below the true epsilon.
    delta, true = 1e-5, _gaussian_eps(2.0, 1e-5)
    rng = np.random.default_rng(1)
    t = many_run.design_threshold(rng.normal(2.0, 1.0, 100_000), rng.normal(0.0, 1.0, 100_000),
                                  2500, 2500, delta)
    split, fixed = [], []
    for seed in range(5):
        scores, included = _gaussian_trials(2.0, 5000, seed)
        split.append(many_run.epsilon_lower_bound(scores, included, delta).epsilon)
        fixed.append(many_run.epsilon_lower_bound(scores, included, delta, thresholds=[t]).epsilon)
    assert max(fixed) < true and max(split) < true
    assert np.mean(fixed) > np.mean(split) + 0.1


def test_dirac_score_is_the_log_likelihood_ratio_of_the_sampled_gaussian():
    from tf_dp.auditing.canaries import dirac_score

    q, sigma = 0.3, 0.8
    u = np.random.default_rng(0).normal(0.5, 2.0, size=(7, 5))
    direct = np.log(((1 - q) * stats.norm.pdf(u, 0, sigma) + q * stats.norm.pdf(u, 1, sigma))
                    / stats.norm.pdf(u, 0, sigma)).sum(axis=1)
    np.testing.assert_allclose(dirac_score(u, q, sigma), direct, rtol=1e-10)
    np.testing.assert_allclose(dirac_score(u, 1.0, sigma), u.sum(axis=1))


def test_likelihood_ratio_score_is_more_powerful_than_the_sum_under_sampling():
    # q = 0.1, sigma = 0.5, 20 steps: a trained-on canary shows in ~2 steps as a jump of 1 = 2 sd;
    # the sum dilutes it in 20 steps of noise. TPR at FPR 1% (50000 trials per class): the sum's is
    # 0.12, the likelihood ratio's 0.27 (binomial sd about 0.002 at these sizes).
    from tf_dp.auditing.canaries import dirac_score

    q, sigma, steps, n = 0.1, 0.5, 20, 50_000
    rng = np.random.default_rng(0)
    u_in = (rng.random((n, steps)) < q) + sigma * rng.normal(size=(n, steps))
    u_out = sigma * rng.normal(size=(n, steps))

    def tpr_at_1pct(score):
        s_in, s_out = score(u_in), score(u_out)
        return float(np.mean(s_in > np.quantile(s_out, 0.99)))

    sum_tpr = tpr_at_1pct(lambda u: u.sum(axis=1))
    llr_tpr = tpr_at_1pct(lambda u: dirac_score(u, q, sigma))
    assert llr_tpr > sum_tpr + 0.1


# ---------------------------------------------------------------- one-run (Steinke et al. 2023)

@pytest.mark.parametrize("r", [10, 100, 1000])
def test_one_run_all_correct_pure_dp_closed_form(r):
    # delta = 0, v = r: P[Bin(r, p) >= r] = p^r = beta  ->  eps = logit(beta^(1/r))
    beta = 0.05
    expected = special.logit(beta ** (1.0 / r))
    assert one_run.epsilon_from_guesses(2 * r, r, r, 0.0, beta) == pytest.approx(expected,
                                                                                  abs=1e-9)
    scores = np.concatenate([np.ones(r), np.zeros(r)])
    included = scores > 0
    bound = one_run.epsilon_lower_bound(scores, included, 0.0, 1 - beta, guess_counts=[(r, 0)])
    assert bound.correct == r and bound.epsilon == pytest.approx(expected, abs=1e-9)


def _slow_p_value(m, r, v, eps, delta):
    p = math.exp(eps) / (1 + math.exp(eps))
    pmf = [math.comb(r, j) * p**j * (1 - p) ** (r - j) for j in range(r + 1)]
    tail = sum(pmf[v:])
    worst = max(sum(pmf[v - i:v]) / i for i in range(1, v + 1))
    return min(tail + 2 * m * delta * worst, 1.0)


@pytest.mark.parametrize("m,r,v,eps,delta", [
    (100, 40, 35, 1.0, 1e-3), (1000, 60, 60, 3.0, 1e-5), (50, 50, 30, 0.2, 1e-2)])
def test_one_run_p_value_matches_the_theorem_term_by_term(m, r, v, eps, delta):
    assert one_run.p_value(m, r, v, eps, delta) == pytest.approx(
        _slow_p_value(m, r, v, eps, delta), rel=1e-9)


@pytest.mark.parametrize("eps0", [0.5, 1.0, 2.0])
def test_one_run_randomized_response_is_below_and_near_its_epsilon(eps0):
    # Every guess is right with probability e^eps0 / (1 + e^eps0) (eps0-DP randomized response):
    # the bound holds (<= eps0) and, with r = 2000 guesses, is within ~2 binomial standard
    # deviations of the rate, i.e. about 0.25 in epsilon.
    m = 4000
    for seed in range(3):
        rng = np.random.default_rng(seed)
        included = rng.random(m) < 0.5
        flip = rng.random(m) >= special.expit(eps0)
        scores = np.where(included ^ flip, 1.0, -1.0) + 1e-6 * rng.random(m)
        bound = one_run.epsilon_lower_bound(scores, included, 0.0, 0.95, guess_counts=[1000])
        assert eps0 - 0.3 < bound.epsilon <= eps0


def test_one_run_gaussian_mechanism_below_true_epsilon():
    for mu in (1.0, 3.0):
        bound = one_run.epsilon_lower_bound(*_gaussian_trials(mu, 2000, 0), 1e-5)
        assert 0.0 < bound.epsilon < _gaussian_eps(mu, 1e-5)


# ---------------------------------------------------------------- Gaussian DP

def test_gdp_estimate_and_lower_bound_cover_true_mu():
    mu = 1.5
    covered = 0
    for seed in range(10):
        scores, included = _gaussian_trials(mu, 4000, seed)
        est = gaussian.mu_estimate(scores, included, 0.95)
        covered += est.low <= mu <= est.high
        assert gaussian.mu_lower_bound(scores, included, 0.95, seed=seed).mu < mu
    assert covered >= 8  # 95% intervals: P[<= 7 of 10 cover] < 1.2%
    assert "ESTIMATE" in str(est)


def test_estimators_name_bad_arguments():
    scores, included = _gaussian_trials(1.0, 100, 0)
    with pytest.raises(ValueError, match="confidence"):
        many_run.epsilon_lower_bound(scores, included, 1e-5, confidence=1.5)
    with pytest.raises(ValueError, match="delta"):
        one_run.epsilon_lower_bound(scores, included, delta=-1)
    with pytest.raises(ValueError, match="included"):
        one_run.epsilon_lower_bound(scores, np.ones(100, bool), 1e-5)
    with pytest.raises(ValueError, match="guess_counts"):
        one_run.epsilon_lower_bound(scores, included, 1e-5, guess_counts=[80])


# ---------------------------------------------------------------- audits of DP-SGD through fit

def _audit(optimizer_fn, **kw):
    import keras

    from tf_dp.auditing import audit_dp_sgd

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    kw.setdefault("seed", 0)
    return audit_dp_sgd(
        model_fn=lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]),
        optimizer_fn=optimizer_fn, x=x, y=y,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), **kw)


def _sgd(clip=1.0, **kw):
    import tf_dp.keras

    kw.setdefault("gradient_mode", "vectorized")
    return lambda: tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, learning_rate=0.1, **kw)


def _certified(noise_multiplier, steps, q, delta=1e-5):
    from tf_dp.accounting import dp_sgd_epsilon

    return dp_sgd_epsilon(1000, q * 1000, noise_multiplier, delta, steps=steps).epsilon


def test_dirac_canary_goes_through_clipping_exactly():
    # No noise, full batch: every included canary's gradient (norm 10) is clipped to C = 1 and
    # divided by the batch size (64 real rows + k canaries) each step; excluded canaries stay 0.
    report = _audit(_sgd(noise_multiplier=0.0), sampling_probability=1.0, steps=3,
                    num_canaries=20)
    k = int(report.included.sum())
    assert report.updates.shape == (20, 3)  # every step's update on every canary's coordinate
    np.testing.assert_allclose(report.updates[report.included], 0.1 * 1.0 / (64 + k), rtol=1e-5)
    np.testing.assert_array_equal(report.updates[~report.included], 0.0)


@pytest.mark.parametrize("q,noise,steps",
                         [(1.0, 2.0, 10), (1.0, 4.0, 8), (0.5, 1.0, 10), (0.2, 0.8, 10)])
def test_correct_mechanism_never_audits_above_its_certificate(q, noise, steps):
    for seed in range(2):
        report = _audit(_sgd(noise_multiplier=noise, noise_seed=seed), sampling_probability=q,
                        steps=steps, num_canaries=600, seed=seed)
        assert report.lower_bound <= report.certified.epsilon
        assert not report.violation, str(report)
    assert report.certified.epsilon == pytest.approx(_certified(noise, steps, q), rel=0.05)


def test_white_box_many_run_counts_every_canary_at_a_threshold_fixed_in_advance():
    report = _audit(_sgd(noise_multiplier=1.0, noise_seed=0), sampling_probability=0.5,
                    steps=5, num_canaries=400)
    assert report.score == "likelihood ratio" and report.updates.shape == (400, 5)
    assert report.many_run.method == "fixed thresholds (1)"
    assert report.many_run.trials_in + report.many_run.trials_out == 400
    assert report.lower_bound <= report.certified.epsilon


def test_no_noise_audits_far_above_the_correct_certificate():
    certified = _certified(10.0, 10, 1.0)  # the configuration that was meant: sigma = 10
    report = _audit(_sgd(noise_multiplier=0.0), sampling_probability=1.0, steps=10,
                    num_canaries=600)
    assert report.lower_bound > 4.0 > 3 * certified
    assert report.one_run.correct == report.one_run.guesses  # perfect separation


def test_disabled_clip_audits_far_above_the_correct_certificate():
    # Clip 1e4 with the noise meant for clip 1: canaries of norm 100 pass unclipped, noise std 10.
    certified = _certified(10.0, 10, 1.0)
    report = _audit(_sgd(clip=1e4, noise_stddev=10.0, noise_seed=0), sampling_probability=1.0,
                    steps=10, num_canaries=600, canary_gradient_norm=100.0)
    assert report.lower_bound > 4.0 > 3 * certified


def test_black_box_audit_reports_consistent_bounds():
    report = _audit(_sgd(noise_multiplier=1.0, noise_seed=0), sampling_probability=0.5,
                    steps=5, num_canaries=40, threat_model="black_box", num_classes=2)
    assert report.many_run is None and report.gdp_estimate is None  # canaries share a model
    assert 0.0 <= report.lower_bound <= report.certified.epsilon
    text = str(report)
    assert "black-box" in text and "certified" in text and "one-run" in text


def test_audit_refuses_bad_arguments_before_training():
    with pytest.raises(ValueError, match="threat_model"):
        _audit(_sgd(noise_multiplier=1.0), threat_model="grey")
    with pytest.raises(ValueError, match="sampling_probability"):
        _audit(_sgd(noise_multiplier=1.0), sampling_probability=0.0)
    with pytest.raises(ValueError, match="num_classes"):
        _audit(_sgd(noise_multiplier=1.0), threat_model="black_box")
    with pytest.raises(TypeError, match="DP optimizer"):
        import keras

        _audit(lambda: keras.optimizers.SGD(0.1))


def test_report_bounds_split_the_confidence_so_that_their_maximum_holds_at_the_stated_level():
    # lower_bound is the largest of the one-run and many-run bounds, and violation also takes the
    # GDP bound: were each at 95%, all would hold together only at 85% (Bonferroni: 1 - 3 x 5%).
    # Each of the k = 3 bounds is at 1 - alpha / k instead, so that together (hence their
    # maximum) they hold at 1 - alpha, the level the report states.
    alpha, delta = 0.1, 1e-5
    each = 1.0 - alpha / 3
    report = _audit(_sgd(noise_multiplier=2.0, noise_seed=0), sampling_probability=1.0,
                    steps=5, num_canaries=400, delta=delta, confidence=1.0 - alpha)
    for bound in (report.one_run, report.many_run, report.gdp_bound):
        assert bound.confidence == pytest.approx(each, abs=1e-15)
    # each bound is the estimator's at that level on the report's own scores
    s, inc = report.scores, report.included
    assert report.one_run == one_run.epsilon_lower_bound(s, inc, delta, each)
    assert report.many_run == many_run.epsilon_lower_bound(
        s, inc, delta, each, thresholds=[report.many_run.threshold])
    assert report.gdp_bound == gaussian.mu_lower_bound(s, inc, each, delta)
    # the level stated for lower_bound, violation and the saved summary is the requested one
    assert report.confidence == 1.0 - alpha and report.summary()["confidence"] == 1.0 - alpha
    text = str(report)
    assert "96.66% confidence" in text and "hold together at 90%" in text
    # a report assembled from bounds each at 95% states what holds: 85% (two bounds: 90%)
    at95 = [dataclasses.replace(b, confidence=0.95)
            for b in (report.one_run, report.many_run, report.gdp_bound)]
    assert dataclasses.replace(report, one_run=at95[0], many_run=at95[1],
                               gdp_bound=at95[2]).confidence == pytest.approx(0.85, abs=1e-12)
    assert dataclasses.replace(report, one_run=at95[0], many_run=at95[1],
                               gdp_bound=None).confidence == pytest.approx(0.90, abs=1e-12)
    # black-box canaries share one model: the one-run bound alone, at the full level
    black = _audit(_sgd(noise_multiplier=1.0, noise_seed=0), sampling_probability=0.5, steps=3,
                   num_canaries=40, threat_model="black_box", num_classes=2,
                   confidence=1.0 - alpha)
    assert black.bounds == [black.one_run] and black.one_run.confidence == 1.0 - alpha
    assert black.confidence == 1.0 - alpha


# ---------------------------------------------------------------- membership inference

def test_roc_auc_matches_sklearn_with_ties():
    from sklearn.metrics import roc_auc_score

    from tf_dp.auditing.membership_inference import roc_auc

    rng = np.random.default_rng(0)
    s_in = np.round(rng.normal(0.5, 1.0, 300), 1)  # rounding makes ties
    s_out = np.round(rng.normal(0.0, 1.0, 400), 1)
    expected = roc_auc_score(np.r_[np.ones(300), np.zeros(400)], np.r_[s_in, s_out])
    assert roc_auc(s_in, s_out) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("fpr", [0.001, 0.01, 0.1, 0.5])
def test_tpr_at_fpr_is_the_best_threshold_by_direct_count(fpr):
    from tf_dp.auditing.membership_inference import tpr_at_fpr

    rng = np.random.default_rng(1)
    s_in = np.round(rng.normal(1.0, 1.0, 500), 2)
    s_out = np.round(rng.normal(0.0, 1.0, 2000), 2)
    best = 0.0
    for t in np.concatenate([np.unique(np.r_[s_in, s_out]), [-np.inf]]):  # every test score > t
        if np.mean(s_out > t) <= fpr:
            best = max(best, float(np.mean(s_in > t)))
    assert tpr_at_fpr(s_in, s_out, fpr) == best


def test_loss_attack_scores_by_the_per_example_loss():
    import keras

    from tf_dp.auditing.membership_inference import loss_attack, roc_auc, tpr_at_fpr

    rng = np.random.default_rng(2)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(4)])
    x_in, x_out = rng.normal(size=(50, 3)).astype("float32"), rng.normal(size=(60, 3)).astype(
        "float32")
    y_in, y_out = rng.integers(0, 4, 50), rng.integers(0, 4, 60)
    w, b = (np.asarray(v, np.float64) for v in model.get_weights())

    def ce(x, y):  # softmax cross-entropy by hand
        z = x @ w + b
        return np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]

    result = loss_attack(model, (x_in, y_in), (x_out, y_out),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         fprs=(0.05,))
    assert result.auc == pytest.approx(roc_auc(-ce(x_in, y_in), -ce(x_out, y_out)), abs=1e-6)
    assert result.tpr_at_fpr[0.05] == tpr_at_fpr(-ce(x_in, y_in), -ce(x_out, y_out), 0.05)
    assert result.member_loss == pytest.approx(ce(x_in, y_in).mean(), rel=1e-5)
    assert (result.members, result.non_members) == (50, 60)
    with pytest.raises(ValueError, match="fprs"):
        loss_attack(model, (x_in, y_in), (x_out, y_out), fprs=(1.5,))
    with pytest.raises(ValueError, match="non_members"):
        loss_attack(model, (x_in, y_in), (x_out, y_out[:3]))


def test_loss_attack_resolves_confident_predictions():
    # Logit gaps 20-28: float32 cross-entropy rounds every loss to 0 (all tied); the true losses
    # log(1 + e^-gap) differ, and members (larger gaps) rank above every non-member: AUC 1.
    import keras

    from tf_dp.auditing.membership_inference import loss_attack

    model = keras.Sequential([keras.Input((1,)), keras.layers.Dense(2)])
    model.set_weights([np.array([[1.0, 0.0]], np.float32), np.zeros(2, np.float32)])
    gaps_in, gaps_out = np.array([[26.0], [27.0], [28.0]]), np.array([[20.0], [21.0], [22.0]])
    zeros = np.zeros(3, np.int32)
    result = loss_attack(model, (gaps_in, zeros), (gaps_out, zeros),
                         loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                         fprs=(0.3,))
    assert result.auc == 1.0 and result.tpr_at_fpr[0.3] == 1.0
