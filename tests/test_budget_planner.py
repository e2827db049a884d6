"""tf_dp.engine.BudgetPlanner: the privacy budget of PrivacyBudget, for custom loops.

The callback's tests (tests/test_callbacks.py, tests/test_budget_speed.py), run on loops that ask
the planner "may the next step run?" before each step: a DPTrainStep loop, a DP optimizer's
``dp_step`` loop and a bare DPEngine. The stop is checked against epsilon computed from scratch,
step by step, on entries built by hand (and against dp_accounting's RDP accountant)."""

import dp_accounting
import keras
import numpy as np
import pytest
import tensorflow as tf
from sklearn.datasets import load_digits

import tf_dp
from tf_dp import accounting
from tf_dp.engine import BudgetPlanner, DPEngine, PrivacyConfig, Sampling
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

N, Q, SIGMA, CLIP = 300, 0.1, 1.0, 1.0
ENTRY = SampleEntry(SamplingEvent(N, Q, "poisson"), (SumQueryEvent(CLIP, SIGMA * CLIP),))


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x[:N] / 16.0).astype(np.float32), y[:N].astype(np.int32)


def _eps(runs, delta=1e-5, accountant="rdp"):
    return float(accounting.compute_epsilon(list(runs), delta=delta,
                                            accountant=accountant).epsilon)


def _dpa_rdp(k, delta=1e-5):
    """dp_accounting's RDP epsilon of k Poisson-sampled Gaussian steps (the independent oracle)."""
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(Q, dp_accounting.GaussianDpEvent(SIGMA)), k)
    return acc.get_epsilon(delta)


def _step(digits, clip=CLIP, sampling=Sampling(N, Q), seed=0, **noise):
    keras.utils.set_random_seed(seed)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    noise = noise or {"noise_multiplier": SIGMA}
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, learning_rate=0.5, noise_seed=seed,
                                          **noise)
    dp_step = tf_dp.keras.DPTrainStep(
        model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling=sampling)
    return dp_step, opt


def _poisson(digits, seed=0):
    """An endless stream of Poisson batches (padded rows weigh 0)."""
    x, y = digits
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=seed)
    return iter(batches.dataset.repeat())


def _run(dp_step, planner, batches, limit=400, steps=1):
    """The custom loop: ask the planner, then run ``steps`` steps in one compiled call."""
    @tf.function
    def train(xb, yb, wb):
        return dp_step(xb, yb, wb)

    ran = 0
    while ran < limit and planner.allows(dp_step, steps=steps):
        for _ in range(steps):
            train(*next(batches))
        dp_step.flush()
        ran += steps
    return ran


def test_a_custom_loop_stops_before_the_step_that_would_exceed(digits):
    # Independently, step by step: the largest k with eps(k) <= target; dp_accounting's RDP
    # accountant agrees on that k (same orders, same bound up to its own rounding).
    eps = {k: _eps([(ENTRY, k)]) for k in (22, 23, 24)}  # epsilon grows with k
    target = 0.5 * (eps[23] + eps[24])  # eps(23) <= target < eps(24)
    assert eps[22] < eps[23] <= target < eps[24]
    assert _dpa_rdp(23) <= target < _dpa_rdp(24)
    dp_step, opt = _step(digits)
    planner = BudgetPlanner(target_epsilon=target, delta=1e-5)
    ran = _run(dp_step, planner, _poisson(digits))
    assert ran == opt.ledger.num_samples == 23
    assert _eps(opt.ledger.runs()) <= target < _eps([*opt.ledger.runs(), (ENTRY, 1)])
    assert planner.steps_left(dp_step) == 0 and not planner.allows(opt)
    # a new planner on the spent ledger says no before any step (the budget holds across loops)
    assert not BudgetPlanner(target, 1e-5).allows(dp_step)


def test_steps_per_call_stop_once_fewer_are_left(digits):
    # Three steps per compiled call: the loop stops when fewer than three fit (never over).
    target = 0.5 * (_eps([(ENTRY, 23)]) + _eps([(ENTRY, 24)]))
    dp_step, opt = _step(digits)
    ran = _run(dp_step, BudgetPlanner(target, 1e-5), _poisson(digits), steps=3)
    assert ran == opt.ledger.num_samples == 21  # 21 + 3 > 23


def test_a_step_of_another_kind_run_without_asking_is_charged(digits):
    # The loop runs one step at q = 0.5 without asking, then goes back to q = 0.1: the next
    # check reads that step from the ledger and plans again, so the stop is still exact.
    dp_step, opt = _step(digits)
    target = _eps([(ENTRY, 30)])
    planner = BudgetPlanner(target, 1e-5)
    batches = _poisson(digits)
    assert _run(dp_step, planner, batches, limit=5) == 5
    opt.set_sampling(Sampling(N, 0.5))
    dp_step(*next(batches))
    opt.set_sampling(Sampling(N, Q))
    _run(dp_step, planner, batches)
    runs = opt.ledger.runs()
    assert _eps(runs) <= target < _eps([*runs, (ENTRY, 1)])
    assert opt.ledger.num_samples < 30  # the costlier step took more than one step's share


def test_a_schedule_loop_stops_where_the_whole_ledger_says_after_a_distinct_prefix(digits):
    dp_step, opt = _step(digits, clip=tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0),
                         noise_stddev=1.2)
    prefix = [(SampleEntry(SamplingEvent(N, Q), (SumQueryEvent(1.0, 1.0 + i / 50),)), 7)
              for i in range(60)]
    opt.ledger.restore_runs(prefix)
    target = _eps(prefix) + 0.25
    planner = BudgetPlanner(target, 1e-5)
    ran = _run(dp_step, planner, _poisson(digits))
    runs = opt.ledger.runs()
    assert 0 < ran == opt.ledger.num_samples - 420 < 400
    # with a schedule the check keeps SCHEDULE_MARGIN (1e-6) below the target
    assert _eps(runs) <= target < _eps([*runs, (opt.next_sample_entry(), 1)]) * (1 + 1e-6)


@pytest.mark.parametrize("accountant", ["pld", "gdp"])
def test_pld_stops_on_its_bound_and_gdp_is_refused_on_subsampled_steps(digits, accountant):
    dp_step, opt = _step(digits)
    planner = BudgetPlanner(3.0, 1e-5, accountant=accountant)
    weights = [w.numpy().copy() for w in dp_step.model.weights]
    if accountant == "gdp":
        with pytest.raises(ValueError, match=r"accountant='gdp'.*subsampled.*sampling rate 0\.1 "
                           r"< 1.*accountant must be one of \('rdp', 'moments', 'pld'\)"):
            planner.allows(dp_step)
        assert opt.ledger.num_samples == 0
        assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, dp_step.model.weights))
        return
    _run(dp_step, planner, _poisson(digits))
    runs = opt.ledger.runs()
    assert _eps(runs, accountant="pld") <= 3.0 < _eps([*runs, (ENTRY, 1)], accountant="pld")


def test_gdp_on_shuffled_passes_stops_before_the_pass_that_would_exceed(digits):
    # Shuffled fixed-size batches: each pass is one Gaussian mechanism with noise multiplier
    # sigma / 2 (sensitivity 2C), so E passes are exactly mu-GDP with mu = 2 sqrt(E) / sigma.
    from scipy import optimize, stats

    sigma, delta = 4.0, 1e-5

    def exact_epsilon(passes):  # the mu-GDP curve, inverted by root finding
        mu = 2.0 * np.sqrt(passes) / sigma
        return optimize.brentq(lambda e: stats.norm.cdf(-e / mu + mu / 2)
                               - np.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta,
                               1e-9, 100.0, xtol=1e-12)

    target = 0.5 * (exact_epsilon(3) + exact_epsilon(4))
    dp_step, opt = _step(digits, sampling=Sampling(N, 30 / N, policy="shuffle"),
                         noise_multiplier=sigma)
    planner = BudgetPlanner(target, delta, accountant="gdp")
    x, y = digits
    train = tf.function(lambda xb, yb: dp_step(xb, yb))
    stopped = False
    for _ in range(10):
        dp_step.start_pass()
        for i in range(0, N, 30):
            if not planner.allows(dp_step):
                stopped = True
                break
            train(x[i:i + 30], y[i:i + 30])
            dp_step.flush()
        if stopped:
            break
    # 10 steps a pass: 3 passes fit, the first step of the 4th opens a 4th
    assert stopped and opt.ledger.num_samples == 30
    assert _eps(opt.ledger.runs(), delta, "gdp") == pytest.approx(exact_epsilon(3), rel=1e-9)


def test_a_bare_engine_loop_stops_like_the_optimizer(digits):
    # DPEngine.step with a per-example loss and a tf.Variable: the planner takes the engine
    # and the number of the next step.
    x, y = digits
    engine = DPEngine(PrivacyConfig(l2_norm_clip=CLIP, noise_multiplier=SIGMA, noise_seed=0))
    engine.set_sampling(Sampling(N, Q))
    w = tf.Variable(tf.zeros([64, 10]))

    def loss_fn(xb, yb, sample_weight):
        logits = xb @ w
        return tf.keras.losses.sparse_categorical_crossentropy(yb, logits, from_logits=True), logits

    def sgd(grads, variables):
        return [v.assign_sub(0.5 * g) for g, v in zip(grads, variables)]

    target = 0.5 * (_eps([(ENTRY, 11)]) + _eps([(ENTRY, 12)]))
    planner = BudgetPlanner(target, 1e-5)
    rng = np.random.default_rng(0)
    step = 0
    while planner.allows(engine, step=step):
        rows = rng.random(N) < Q
        engine.step(loss_fn, (x[rows], y[rows], None), [w], step=step, apply_fn=sgd)
        engine.flush()
        step += 1
    assert step == engine.ledger.num_samples == 11
    with pytest.raises(ValueError, match="step is required with a DPEngine"):
        planner.allows(engine)


def test_bad_arguments_name_the_argument_and_the_range(digits):
    dp_step, _ = _step(digits)
    planner = BudgetPlanner(1.0, 1e-5)
    for steps in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"steps must be an integer >= 1"):
            planner.allows(dp_step, steps=steps)
    with pytest.raises(TypeError, match="source must be a tf_dp DP optimizer"):
        planner.allows(object())
    with pytest.raises(ValueError, match=r"target_epsilon must be a finite number > 0"):
        BudgetPlanner(float("inf"), 1e-5)
    with pytest.raises(ValueError, match=r"delta must be in \(0, 1\)"):
        BudgetPlanner(1.0, 1.0)
    with pytest.raises(ValueError, match="accountant must be one of"):
        BudgetPlanner(1.0, 1e-5, accountant="nope")
