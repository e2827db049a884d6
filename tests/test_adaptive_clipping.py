"""QuantileAdaptiveClipSumQuery (Andrew et al. 2021): the clip follows a quantile of the record
norms, every gradient mode feeds it the count of unclipped records, the ledger records the sum and
the count query as run, and the accountants compose them by McMahan et al. 2018, Eq. (1)."""

import json
import math
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, tolerance
from tf_dp.accounting import rdp
from tf_dp.dp_query import (
    QuantileAdaptiveClipAverageQuery,
    QuantileAdaptiveClipSumQuery,
    sum_noise_multiplier_for,
)
from tf_dp.gradients import MicrobatchClipper, make_clipper
from tf_dp.keras import PerExampleLoss

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _query(**kw):
    args = dict(
        initial_l2_norm_clip=1.0, noise_multiplier=1.1, target_unclipped_quantile=0.5,
        learning_rate=0.2, clipped_count_stddev=1.0, expected_num_records=10.0,
    )
    args.update(kw)
    return QuantileAdaptiveClipSumQuery(**args)


# -- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.0, 1.0, -0.1, 1.5, float("nan")])
def test_target_quantile_outside_open_unit_interval_refused(value):
    with pytest.raises(ValueError, match=r"target_unclipped_quantile must be in the open interval"
                                         r" \(0, 1\)"):
        _query(target_unclipped_quantile=value)


@pytest.mark.parametrize("name", ["learning_rate", "clipped_count_stddev",
                                  "expected_num_records", "initial_l2_norm_clip"])
@pytest.mark.parametrize("value", [0.0, -1.0, float("inf"), float("nan")])
def test_non_positive_arguments_refused(name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite number > 0"):
        _query(**{name: value})


def test_other_bad_input():
    with pytest.raises(ValueError, match="noise_multiplier must be a finite number >= 0"):
        _query(noise_multiplier=-1.0)
    with pytest.raises(TypeError, match="learning_rate must be"):
        _query(learning_rate="0.2")
    with pytest.raises(TypeError, match="target_unclipped_quantile must be a number"):
        _query(target_unclipped_quantile=True)
    with pytest.raises(TypeError, match="geometric_update must be a bool"):
        _query(geometric_update=1)
    with pytest.raises(ValueError, match="clipped_count_stddev must be > 0.55"):
        sum_noise_multiplier_for(1.1, clipped_count_stddev=0.5)


# -- the query -----------------------------------------------------------------------------------


#: float32 against closed forms in float64: a record's norm (2 squares, a sum, a sqrt), the clip
#: factor (a division, a minimum) and product, the sum of 4 records; the clip's update (an exp,
#: a product). A record clipped to the wrong norm or counted wrongly is off by >= 1e-2.
QUERY_RTOL = tolerance("float32", terms=2 + 1 + 1 + 2 + 1 + 4 + 2)


def test_protocol_counts_unclipped_records_and_updates_the_clip_geometrically():
    q = _query(noise_multiplier=0.0, clipped_count_stddev=1e-30, expected_num_records=4.0)
    gs = q.initial_global_state()
    params = q.derive_sample_params(gs)
    state = q.initial_sample_state(tf.zeros([2]))
    for r in ([3.0, 4.0], [0.1, 0.0], [0.0, 0.5], [6.0, 8.0]):  # norms 5, .1, .5, 10
        state = q.accumulate_record(params, state, tf.constant(r))
    # clipped sum: [.6,.8] + [.1,0] + [0,.5] + [.6,.8]; two unclipped: sum of (b - 1/2) = 0
    np.testing.assert_allclose(state.sum_state.numpy(), [1.3, 2.1], rtol=QUERY_RTOL)
    assert float(state.unclipped_count) == 0.0
    result, gs = q.get_noised_result(state, gs)
    np.testing.assert_allclose(result.numpy(), [1.3, 2.1], rtol=QUERY_RTOL)
    # b_hat = 0 / 4 + 1/2 = 0.5 = target: the clip stays
    np.testing.assert_allclose(q.l2_norm_clip.numpy(), 1.0, rtol=QUERY_RTOL)
    state = q.accumulate_record(params, q.initial_sample_state(tf.zeros([2])), tf.constant([0., 0.]))
    q.get_noised_result(state, gs)  # b_hat = 0.5 / 4 + 0.5 = 0.625
    np.testing.assert_allclose(q.l2_norm_clip.numpy(), math.exp(-0.2 * 0.125), rtol=QUERY_RTOL)


def test_linear_update_and_floor_at_zero():
    q = _query(clipped_count_stddev=1e-30, expected_num_records=1.0, geometric_update=False,
               learning_rate=5.0)
    gs = q.initial_global_state()
    st = q.accumulate_norms(q.derive_sample_params(gs), [tf.zeros([2])], tf.constant([0.1]))
    q.get_noised_result(st, gs)  # b_hat = 1: C - 5 * 0.5 < 0
    assert float(q.l2_norm_clip.numpy()) == 0.0


def test_accumulate_norms_masks_padding_and_nan():
    q = _query()
    params = tf.constant(1.0)
    st = q.accumulate_norms(params, [tf.zeros([3])], tf.constant([0.5, 2.0, 0.0, float("nan")]),
                            tf.constant([True, True, False, True]))
    # +1/2 (unclipped), -1/2 (clipped), 0 (padding), -1/2 (NaN counts as clipped)
    assert float(st.unclipped_count) == -0.5


def test_specs_record_sum_and_count_queries_as_run():
    q = _query(initial_l2_norm_clip=2.0, noise_multiplier=1.5, clipped_count_stddev=3.0)
    gs = q.initial_global_state()
    specs = q.sum_query_specs(gs)
    assert [(float(s.l2_sensitivity), float(s.noise_stddev)) for s in specs] == [
        (2.0, 3.0), (0.5, 3.0)]
    assert specs[1].exact_gaussian and not specs[0].exact_gaussian
    q.l2_norm_clip.assign(0.5)
    assert float(q.sum_query_specs(gs)[0].noise_stddev) == 0.75


def test_effective_noise_multiplier_and_split():
    q = _query(noise_multiplier=2.0, clipped_count_stddev=1.0)  # count: 1 / 0.5 = z 2
    assert q.effective_noise_multiplier() == pytest.approx(2.0 ** 0.5)
    z = sum_noise_multiplier_for(1.1, clipped_count_stddev=5.0)
    assert (z ** -2 + 10.0 ** -2) ** -0.5 == pytest.approx(1.1)


def test_converges_to_target_quantile_on_known_norm_distribution():
    """Norms ~ LogNormal(0, 1), so the gamma-quantile is exp(Phi^-1(gamma)); m = 100 records a
    step, count noise sigma_b = 5 (Andrew et al.'s m / 20), 600 steps, fixed seeds. Each step's
    estimate b_hat has stddev sd = sqrt(gamma (1 - gamma) / m + (sigma_b / m)^2) (sampling plus
    count noise); the fraction of the distribution below the clip, averaged over the last 200
    steps, must be within max(0.05, 2 sd) of gamma: the geometric update with eta = 0.2 averages
    over several steps, so the average fluctuates well inside one per-step sd."""
    from scipy.stats import norm as normal

    m, sigma_b = 100, 5.0
    for target in (0.2, 0.5, 0.9):
        q = _query(initial_l2_norm_clip=0.01, target_unclipped_quantile=target,
                   learning_rate=0.2, clipped_count_stddev=sigma_b, expected_num_records=m,
                   seed=3)
        gs = q.initial_global_state()
        rng = np.random.default_rng(7)

        @tf.function
        def step(norms):
            params = q.derive_sample_params(gs)
            st = q.accumulate_norms(params, [tf.zeros([1])], norms)
            q.get_noised_result(st, gs)

        clips = []
        for _ in range(600):
            step(tf.constant(np.exp(rng.normal(size=m)), tf.float32))
            clips.append(float(q.l2_norm_clip.numpy()))
        tail = np.log(clips[-200:])
        achieved = normal.cdf(tail).mean()  # fraction of the distribution below the clip
        # the per-step estimate's noise: stddev of b_hat is sqrt(g(1-g)/m + (sigma_b/m)^2)
        sd = math.sqrt(target * (1 - target) / m + (sigma_b / m) ** 2)
        assert abs(achieved - target) < max(0.05, 2 * sd), (target, achieved)
        # and the clip is near the true quantile
        assert abs(np.median(tail) - normal.ppf(target)) < 0.2, target


# -- every gradient mode ---------------------------------------------------------------------------


def _model(seed=0):
    keras.utils.set_random_seed(seed)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(5, activation="tanh"),
                          keras.layers.Dense(3)])
    m.compile(optimizer="sgd", loss=LOSS)
    return m


def _reference(model, x, y, clip, sw, groups=None, clip_norms=None):
    """Clipped sum and count of unclipped (b - 1/2) by a slow loop over records: one example each,
    or ``groups`` (microbatches: the mean gradient of their rows of non-zero weight). Rows of
    weight 0 (Poisson padding) and empty groups are not records. Each record is clipped by its
    exact norm, or by ``clip_norms[i]`` (row ``i``'s norm as a clipper estimated it) if given."""
    groups = groups or [[i] for i in range(len(x))]
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    count, norms = 0.0, []
    for idx in groups:
        idx = [i for i in idx if sw[i] != 0]
        if not idx:
            continue
        with tf.GradientTape() as tape:
            loss = keras.losses.sparse_categorical_crossentropy(
                y[idx], model(x[idx], training=True), from_logits=True)
            loss = tf.reduce_sum(loss * sw[idx]) / len(idx)
        g = [np.asarray(t, np.float64) for t in tape.gradient(loss, model.trainable_variables)]
        n = math.sqrt(sum(float(np.sum(a * a)) for a in g))
        norms.append(n)
        m = n if clip_norms is None else float(clip_norms[idx[0]])
        total = [t + min(1.0, clip / m) * a for t, a in zip(total, g)]
        count += (1.0 if m <= clip else 0.0) - 0.5
    return total, count, norms


#: JL directions per step in the test below (its reference clips by the estimated norms, so a few
#: suffice; the estimate itself is checked against its chi-squared law)
JL_PROJECTIONS = 8


@pytest.mark.parametrize("mode", ["vectorized", "ghost", "jl", "microbatch"])
def test_every_mode_gives_the_same_sample_state_as_the_slow_reference(mode):
    model = _model()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    y = rng.integers(0, 3, 8).astype(np.int32)
    sw = np.array([1, 1, 1, 1, 1, 1, 0, 0], np.float32)  # two rows of Poisson padding
    groups, real = None, 6
    if mode == "microbatch":  # a twin strategy with the same seed draws the same microbatches
        strategy = MicrobatchClipper(4, seed=5)
        ids = MicrobatchClipper(4, seed=5).assignment(8).numpy()
        groups = [list(np.flatnonzero(ids == j)) for j in range(4)]
        real = sum(1 for g in groups if any(sw[i] != 0 for i in g))
    else:
        options = {"jl_projections": JL_PROJECTIONS, "seed": 3} if mode == "jl" else {}
        strategy = make_clipper(mode, model=model, **options)
    data = (tf.constant(x), tf.constant(y), tf.constant(sw))
    norms = _reference(model, x, y, 1.0, sw, groups)[2]
    clip_from = norms
    if mode == "jl":  # JL clips by its estimated norms: a twin (same seed, same directions)
        twin = make_clipper(mode, model=model, **options)
        q0 = tf_dp.QueryWithLedger(_query(initial_l2_norm_clip=1.0))
        p0 = q0.derive_sample_params(q0.initial_global_state())
        est = twin.clipped_sum(PerExampleLoss(model), data, model.trainable_variables, q0, p0)
        clip_from = np.asarray(est.norms, np.float64)[np.flatnonzero(sw)]
    clip = float(np.median(clip_from)) * 1.01  # binds for some records, not for others
    q = tf_dp.QueryWithLedger(_query(initial_l2_norm_clip=clip))
    params = q.derive_sample_params(q.initial_global_state())
    out = strategy.clipped_sum(PerExampleLoss(model), data, model.trainable_variables, q, params)
    state = q.accumulate_norms(params, out.clipped_sum, out.norms, out.record_mask)
    estimated = None
    if mode == "jl":  # JL clips by estimated norms: the reference clips each record by its own
        estimated = np.asarray(out.norms, np.float64)
        np.testing.assert_array_equal(estimated[np.flatnonzero(sw)], clip_from)  # the twin's
        # ||g||^2 estimated from r projections is ||g||^2 chi2_r / r: within its 1e-6 quantiles
        lo, hi = (stats.chi2.ppf(p, JL_PROJECTIONS) / JL_PROJECTIONS for p in (1e-6, 1 - 1e-6))
        real_rows = np.flatnonzero(sw)
        ratio = estimated[real_rows] ** 2 / np.square(norms)
        assert np.all((lo < ratio) & (ratio < hi)), ratio
    expected, count, _ = _reference(model, x, y, clip, sw, groups, clip_norms=estimated)
    assert np.sum(np.asarray(out.record_mask)) == real
    assert float(state.unclipped_count) == count
    assert -real / 2 < count < real / 2, "some records clipped, some not"
    # the 6-5-3 gradient (of a microbatch's mean of up to 8 rows), its norm over 53 parameters,
    # the sum of 8 records, on entries of at most real x clip (tests/helpers/tolerance.py); a
    # record clipped by the wrong norm or a padding row counted is off by O(clip / 2)
    atol = tolerance(
        "float32", dense_gradient_terms([6, 5, 3]) + 8 + norm_terms(53) + 8, real * clip
    )
    for a, e in zip(state.sum_state, expected):
        np.testing.assert_allclose(np.asarray(a), e, rtol=0, atol=atol)


# -- Keras: ledger and accounting ------------------------------------------------------------------


N, Q = 400, 0.05


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")
    return x, y


@pytest.mark.parametrize("mode,extra", [("vectorized", {}), ("ghost", {}),
                                         ("microbatch", {"num_microbatches": 4})])
@pytest.mark.parametrize("jit", [False, True])
def test_keras_fit_records_both_queries_and_epsilon_is_the_composed_mechanism(
    mode, extra, jit, tmp_path
):
    x, y = _data()
    z, sigma_b = 1.1, 2.0
    query = QuantileAdaptiveClipSumQuery(
        initial_l2_norm_clip=0.05, noise_multiplier=z, target_unclipped_quantile=0.5,
        learning_rate=0.3, clipped_count_stddev=sigma_b,
        expected_num_records=extra.get("num_microbatches", N * Q))
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        dp_sum_query=query, gradient_mode=mode, learning_rate=0.1, **extra),
        loss=LOSS, jit_compile=jit)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=1)
    steps = 2 * batches.steps_per_epoch
    model.fit(batches, epochs=2, verbose=0)
    opt = model.optimizer
    entries = opt.ledger.samples()
    assert len(entries) == steps
    mult = 2.0 if mode == "microbatch" else 1.0
    clips = [e.queries[0].l2_sensitivity / mult for e in entries]
    assert clips[0] == pytest.approx(0.05)
    assert len(set(np.round(clips, 6))) > 1, "the clip adapted"
    for e, c in zip(entries, clips):
        sum_q, count_q = e.queries
        assert sum_q.noise_stddev == pytest.approx(z * c, rel=1e-6)
        assert (count_q.l2_sensitivity, count_q.noise_stddev) == (0.5 * mult, sigma_b)
        assert count_q.mechanism == sum_q.mechanism == "gaussian"
        assert e.effective_noise_multiplier() == pytest.approx(
            (z ** -2 + (sigma_b / 0.5) ** -2) ** -0.5 / mult, rel=1e-5)
    # the clip moved towards the median norm: the last recorded clip is the query's previous
    assert float(query.l2_norm_clip.numpy()) != clips[-1]
    if mode == "microbatch":
        return
    z_eff = (z ** -2 + (sigma_b / 0.5) ** -2) ** -0.5
    orders = rdp.DEFAULT_ORDERS
    direct, _ = rdp.epsilon_from_rdp(
        orders, steps * rdp.rdp_poisson_gaussian(Q, z_eff, orders), 1e-5)
    ledger_eps = tf_dp.accounting.compute_epsilon(opt.ledger, delta=1e-5).epsilon
    # rel 1e-6: the ledger holds z * C_t and C_t as the step used them (float32)
    assert ledger_eps == pytest.approx(direct, rel=1e-6)
    if mode == "vectorized" and not jit:  # the CLI reads the saved ledger of such a run
        path = tmp_path / "adaptive_ledger.json"
        opt.ledger.save(str(path))
        p = subprocess.run([sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy",
                            f"--ledger={path}", "--delta=1e-5", "--format=json"],
                           capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stderr
        assert json.loads(p.stdout)["rdp"]["epsilon"] == pytest.approx(ledger_eps, rel=1e-9)
    import dp_accounting  # test dependency (setup.py extras "test")
    acc = dp_accounting.rdp.RdpAccountant(list(orders))
    acc.compose(dp_accounting.PoissonSampledDpEvent(
        Q, dp_accounting.GaussianDpEvent(z_eff)), steps)
    assert ledger_eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-3)


def test_jl_mode_trains_and_accountants_refuse_the_mixed_sample():
    x, y = _data()
    query = _query(initial_l2_norm_clip=0.1, expected_num_records=N * Q)
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(4), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        dp_sum_query=query, gradient_mode="jl", jl_projections=2, learning_rate=0.1), loss=LOSS)
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=1), epochs=1,
              verbose=0)
    e = model.optimizer.ledger.samples()[0]
    assert [q.mechanism for q in e.queries] == ["jl", "gaussian"]
    with pytest.raises(ValueError, match="JL with exact clipping"):
        tf_dp.accounting.compute_epsilon(model.optimizer.ledger, delta=1e-5, accountant="pld")


def test_average_variant_divides_by_expected_records():
    q = QuantileAdaptiveClipAverageQuery(1.0, 0.0, 0.5, 0.2, 1e-30, expected_num_records=4.0)
    gs = q.initial_global_state()
    params = q.derive_sample_params(gs)
    st = q.accumulate_norms(params, [tf.constant([2.0, 4.0])], tf.constant([0.5, 0.5]))
    res, _ = q.get_noised_result(st, gs)
    np.testing.assert_allclose(np.asarray(res[0]), [0.5, 1.0])
    assert q.l2_norm_clip is q.numerator_query.l2_norm_clip
    # b_hat = 1 / 4 + 1/2 = 0.75 > 0.5: the clip shrinks
    assert float(q.l2_norm_clip.numpy()) == pytest.approx(math.exp(-0.2 * 0.25))
