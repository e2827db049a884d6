"""Clip and noise schedules (issue 15 item 1): DecreasingClip's closed form, the values the ledger
records step by step in every gradient mode (eager, graph and XLA), epsilon as the direct
composition of those steps, noise_stddev vs noise_multiplier, bad schedules failing before
anything runs or is recorded, get_config / .keras round trips, and PrivacyBudget with a schedule."""

import math
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp.accounting import compute_epsilon, rdp
from tf_dp.keras import DecreasingClip

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, BATCH = 48, 12  # 4 steps per epoch
MODES = {
    "vectorized": {},
    "microbatch": {"num_microbatches": BATCH},
    "ghost": {},
    "jl": {"jl_projections": 2},
    "auto": {},
}


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 5)).astype("float32")
    y = (x[:, 0] - x[:, 1] > 0).astype("int64")
    return x, y


def _model(optimizer, jit_compile=False, run_eagerly=False, seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)]))
    model.compile(optimizer=optimizer, loss=LOSS, jit_compile=jit_compile,
                  run_eagerly=run_eagerly)
    return model


def _closed_form_clip(c, t_decay, t, floor=0.5):
    return c / min(1.0 / floor, 1.0 + t / t_decay)


def _exp_decay(z0, decay_steps, rate, t):
    return z0 * rate ** (t / decay_steps)


def _recorded(optimizer):
    return [(e.queries[0].l2_sensitivity, e.queries[0].noise_stddev)
            for e in optimizer.ledger.samples()]


# -- DecreasingClip ------------------------------------------------------------------------------


@pytest.mark.parametrize("floor", [0.5, 0.25, 1.0])
def test_decreasing_clip_equals_the_closed_form(floor):
    schedule = DecreasingClip(initial_clip=3.0, decay_steps=40, floor_fraction=floor)
    for t in [0, 1, 7, 20, 39, 40, 41, 80, 119, 120, 121, 1000, 10**6]:
        assert float(schedule(t)) == pytest.approx(_closed_form_clip(3.0, 40, t, floor), rel=1e-6)
    # the paper's schedule: C / min(2, 1 + t/T); C/2 from t = T on
    paper = DecreasingClip(4.0, 100)
    assert [float(paper(t)) for t in (0, 50, 100, 500)] == pytest.approx([4.0, 8 / 3, 2.0, 2.0])
    # a tensor step (int64, as the optimizer passes it) and inside tf.function
    step = tf.constant(60, tf.int64)
    assert float(tf.function(paper)(step)) == pytest.approx(4.0 / 1.6, rel=1e-6)


@pytest.mark.parametrize("kwargs, match", [
    (dict(initial_clip=0.0, decay_steps=10), "initial_clip must be a finite number > 0"),
    (dict(initial_clip=-1.0, decay_steps=10), "initial_clip"),
    (dict(initial_clip=1.0, decay_steps=0), "decay_steps must be a finite number > 0"),
    (dict(initial_clip=1.0, decay_steps=math.inf), "decay_steps"),
    (dict(initial_clip=1.0, decay_steps=10, floor_fraction=0.0), "floor_fraction"),
    (dict(initial_clip=1.0, decay_steps=10, floor_fraction=1.5), r"floor_fraction must be in \(0, 1\]"),
])
def test_decreasing_clip_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DecreasingClip(**kwargs)
    with pytest.raises(TypeError, match="initial_clip"):
        DecreasingClip("1.0", 10)


def test_decreasing_clip_is_exported_and_serialisable():
    assert tf_dp.keras.DecreasingClip is tf_dp.keras.schedules.DecreasingClip
    assert "DecreasingClip" in tf_dp.keras.__all__
    schedule = DecreasingClip(2.0, 30, floor_fraction=0.4)
    config = keras.saving.serialize_keras_object(schedule)
    again = keras.saving.deserialize_keras_object(config)
    assert isinstance(again, DecreasingClip)
    assert again.get_config() == schedule.get_config()
    assert isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule)


# -- the ledger records the scheduled values, step by step ---------------------------------------


@pytest.mark.parametrize("mode", list(MODES))
def test_ledger_records_the_scheduled_clip_and_noise_at_every_step(mode):
    clip = DecreasingClip(2.0, decay_steps=3)
    noise = keras.optimizers.schedules.ExponentialDecay(1.2, decay_steps=2, decay_rate=0.9)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=clip, noise_multiplier=noise, gradient_mode=mode, learning_rate=0.1,
        **MODES[mode])
    x, y = _data()
    model = _model(opt)
    model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    recorded = _recorded(opt)
    assert len(recorded) == 8 == int(opt.iterations.numpy())
    multipliers = set()
    for t, (sens, std) in enumerate(recorded):
        c = _closed_form_clip(2.0, 3, t)
        z = _exp_decay(1.2, 2, 0.9, t)
        multipliers.add(round(sens / c, 5))
        assert std == pytest.approx(z * c, rel=1e-5), t
    assert multipliers in ({1.0}, {2.0})  # the clip times the mode's sensitivity multiplier
    # the values differ from step to step (the schedule was really applied)
    assert len({s for s, _ in recorded}) == 4  # 2, 1.5, 1.2, then the floor 1 from step 3 on
    mechanism = "jl" if mode == "jl" else "gaussian"
    assert {e.queries[0].mechanism for e in opt.ledger.samples()} == {mechanism}


def test_fixed_stddev_with_decreasing_clip_and_eager_graph_xla_agree():
    runs = {}
    for name, kw in {"eager": dict(run_eagerly=True), "graph": {}, "xla": dict(jit_compile=True)}.items():
        opt = tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=DecreasingClip(1.5, decay_steps=4), noise_stddev=0.9, learning_rate=0.1)
        model = _model(opt, **kw)
        x, y = _data()
        model.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
        runs[name] = _recorded(opt)
    assert runs["eager"] == runs["graph"] == runs["xla"]
    for t, (sens, std) in enumerate(runs["xla"]):
        assert sens == pytest.approx(_closed_form_clip(1.5, 4, t), rel=1e-6)
        assert std == pytest.approx(0.9, rel=1e-7)
    # the effective noise multiplier sigma / C_t grows
    z = [std / sens for sens, std in runs["xla"]]
    assert all(a <= b for a, b in zip(z, z[1:])) and z[-1] == pytest.approx(2 * z[0], rel=1e-6)


def test_clip_changes_the_clipping_itself():
    """The step's clip is applied before clipping: with noise 0 and one example whose gradient is
    far above every clip, the applied update is exactly lr * C_t per step."""
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=DecreasingClip(1.0, decay_steps=2), noise_stddev=0.0, learning_rate=1.0,
        gradient_mode="vectorized")
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((1,)), keras.layers.Dense(1, use_bias=False)]))
    model.compile(optimizer=opt, loss="mse")
    model.layers[0].kernel.assign([[0.0]])
    x, y = np.array([[1.0]], "float32"), np.array([[1000.0]], "float32")
    kernels = [0.0]
    for _ in range(3):
        model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False)
        kernels.append(float(model.layers[0].kernel.numpy()[0, 0]))
    steps = np.diff(kernels)
    # shuffle sampling of 1 record: the update is the clipped gradient itself (denominator 1)
    assert steps == pytest.approx([1.0, 2 / 3, 0.5], rel=1e-5)


def test_next_sample_entry_predicts_the_next_scheduled_step():
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=DecreasingClip(2.0, decay_steps=10), noise_stddev=1.0, learning_rate=0.1)
    model = _model(opt)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    predicted = opt.next_sample_entry()
    ahead = opt.next_sample_entry(steps_ahead=2)
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    entries = opt.ledger.samples()
    # the scheduled values (the second fit's first step also starts a pass, which a prediction
    # made between the fits does not know of)
    assert entries[4].queries == predicted.queries
    assert entries[6].queries == ahead.queries
    assert entries[6] == ahead
    assert predicted.queries[0].l2_sensitivity == pytest.approx(2.0 / 1.4, rel=1e-6)


# -- epsilon is the direct composition of the recorded steps --------------------------------------


def test_ledger_epsilon_equals_direct_composition_of_scheduled_steps():
    n, q, sigma = 200, 0.05, 1.3
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=DecreasingClip(1.0, decay_steps=10), noise_stddev=sigma, learning_rate=0.1)
    model = _model(opt)
    x, y = _data(n)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=3)
    model.fit(batches, epochs=1, verbose=0)
    steps = len(opt.ledger.samples())
    assert steps == int(opt.iterations.numpy()) > 10
    # independent computation: each step t is a Poisson-subsampled Gaussian mechanism with noise
    # multiplier sigma / C_t, C_t from the closed form; RDP adds up over steps
    orders = rdp.DEFAULT_ORDERS
    curve = sum(
        rdp.rdp_poisson_gaussian(q, sigma / _closed_form_clip(1.0, 10, t), orders)
        for t in range(steps))
    direct, _ = rdp.epsilon_from_rdp(orders, curve, 1e-5)
    result = compute_epsilon(opt.ledger, 1e-5, "rdp")
    assert result.epsilon == pytest.approx(direct, rel=1e-5)
    # with the clip held at C (the same sigma) the same steps cost more
    constant = sum(rdp.rdp_poisson_gaussian(q, sigma, orders) for _ in range(steps))
    assert rdp.epsilon_from_rdp(orders, constant, 1e-5)[0] > result.epsilon * 1.05


# -- arguments ------------------------------------------------------------------------------------


def test_noise_multiplier_and_noise_stddev_are_exclusive():
    cls = tf_dp.keras.DPKerasSGDOptimizer
    with pytest.raises(ValueError, match="exactly one of noise_multiplier .* and noise_stddev"):
        cls(l2_norm_clip=1.0, noise_multiplier=1.0, noise_stddev=1.0)
    with pytest.raises(ValueError, match="exactly one of noise_multiplier .* got neither"):
        cls(l2_norm_clip=1.0)
    with pytest.raises(ValueError, match="l2_norm_clip"):
        cls(noise_stddev=1.0)
    with pytest.raises(ValueError, match="dp_sum_query or"):
        cls(dp_sum_query=tf_dp.GaussianSumQuery(1.0, 1.0), noise_stddev=1.0)
    with pytest.raises(ValueError, match="noise_stddev must be a finite number >= 0"):
        cls(l2_norm_clip=1.0, noise_stddev=-1.0)
    with pytest.raises(TypeError, match="noise_stddev must be"):
        cls(l2_norm_clip=1.0, noise_stddev="1.0")
    # a constant noise_stddev is the absolute stddev, independent of the clip
    opt = cls(l2_norm_clip=2.0, noise_stddev=3.0)
    assert opt.next_sample_entry().queries[0].noise_stddev == 3.0
    assert opt.noise_stddev == 3.0 and opt.noise_multiplier is None
    assert not opt.has_dp_schedules
    # the Adam and custom classes take it too
    DPRMSprop = tf_dp.keras.make_dp_optimizer_class(keras.optimizers.RMSprop)
    assert DPRMSprop(l2_norm_clip=DecreasingClip(1.0, 5), noise_stddev=1.0).has_dp_schedules
    assert tf_dp.keras.DPKerasAdamOptimizer(l2_norm_clip=1.0, noise_stddev=1.0).noise_stddev == 1.0


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(l2_norm_clip=lambda t: 0.0, noise_multiplier=1.0), ValueError,
     r"l2_norm_clip schedule gave 0.0 at step 0; the clip must be a finite number > 0"),
    (dict(l2_norm_clip=lambda t: -1.0, noise_stddev=1.0), ValueError, "l2_norm_clip schedule"),
    (dict(l2_norm_clip=lambda t: float("nan"), noise_stddev=1.0), ValueError, "l2_norm_clip"),
    (dict(l2_norm_clip=1.0, noise_multiplier=lambda t: -0.5), ValueError,
     r"noise_multiplier schedule gave -0.5 at step 0"),
    (dict(l2_norm_clip=1.0, noise_stddev=lambda t: float("inf")), ValueError,
     "noise_stddev schedule gave inf"),
    (dict(l2_norm_clip=lambda t: tf.ones([2]), noise_stddev=1.0), ValueError,
     "l2_norm_clip schedule must return a scalar"),
    (dict(l2_norm_clip=lambda t: "x", noise_stddev=1.0), TypeError, "l2_norm_clip schedule"),
    (dict(l2_norm_clip=lambda t: t * 0.5, noise_stddev=1.0), TypeError,
     "could not be evaluated"),
    (dict(l2_norm_clip=DecreasingClip, noise_stddev=1.0), TypeError, "l2_norm_clip must be"),
])
def test_bad_schedules_fail_at_construction(kwargs, error, match):
    with pytest.raises(error, match=match):
        tf_dp.keras.DPKerasSGDOptimizer(learning_rate=0.1, **kwargs)


def _goes_bad_at_step_3(step):
    # 1.0 for steps 0-2, then 0 (not a valid clip)
    return tf.where(step < 3, 1.0, 0.0)


@pytest.mark.parametrize("how", ["graph", "eager", "xla"])
def test_schedule_going_bad_later_fails_before_that_step_runs(how):
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=_goes_bad_at_step_3, noise_multiplier=1.0, learning_rate=0.1)
    model = _model(opt, run_eagerly=how == "eager", jit_compile=how == "xla")
    x, y = _data()
    weights = None

    class Keep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            nonlocal weights
            weights = [w.numpy() for w in model.weights]

    with pytest.raises(ValueError, match="l2_norm_clip schedule gave 0.0 at step 3"):
        model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[Keep()])
    assert opt.ledger.num_samples == 3 == int(opt.iterations.numpy())
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, model.weights))


def test_graph_step_with_bad_schedule_value_fails_before_recording():
    """Outside fit (a custom tf.function step), a bad value fails the step in the graph."""
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=_goes_bad_at_step_3, noise_multiplier=1.0, learning_rate=0.1)
    opt.iterations.assign(3)

    @tf.function
    def step():
        opt.update_dp_schedules()
        return opt._dp_global_state.l2_norm_clip.read_value()

    with pytest.raises(tf.errors.InvalidArgumentError, match="clip or noise schedule gave a value"):
        step()
    assert float(opt._dp_global_state.l2_norm_clip.numpy()) == 1.0  # not assigned
    assert opt.ledger.num_samples == 0
    with pytest.raises(ValueError, match="at step 3"):
        opt.next_sample_entry()
    # under XLA (no assertions) the values become NaN: the update is withheld, nothing usable
    opt.iterations.assign(3)
    assert math.isnan(float(tf.function(step, jit_compile=True)()))


# -- serialisation --------------------------------------------------------------------------------


def test_schedules_round_trip_through_get_config():
    clip = DecreasingClip(2.0, 50, floor_fraction=0.25)
    noise = keras.optimizers.schedules.PiecewiseConstantDecay([10], [1.0, 1.5])
    opt = tf_dp.keras.DPKerasAdamOptimizer(
        l2_norm_clip=clip, noise_multiplier=noise, learning_rate=1e-3, gradient_mode="ghost")
    config = opt.get_config()
    assert config["l2_norm_clip"]["class_name"] == "DecreasingClip"
    assert config["noise_stddev"] is None
    again = tf_dp.keras.DPKerasAdamOptimizer.from_config(config)
    assert isinstance(again.l2_norm_clip, DecreasingClip)
    assert again.l2_norm_clip.get_config() == clip.get_config()
    assert isinstance(again.noise_multiplier, keras.optimizers.schedules.PiecewiseConstantDecay)
    for t in (0, 9, 10, 100):
        assert again.dp_values_at(t) == opt.dp_values_at(t)
    # noise_stddev and plain numbers too
    opt2 = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.5, noise_stddev=2.0)
    again2 = tf_dp.keras.DPKerasSGDOptimizer.from_config(opt2.get_config())
    assert (again2.l2_norm_clip, again2.noise_stddev, again2.noise_multiplier) == (1.5, 2.0, None)
    # keras's optimizer serialisation (what .keras files store)
    again3 = keras.optimizers.deserialize(keras.optimizers.serialize(opt))
    assert type(again3) is type(opt) and again3.l2_norm_clip.get_config() == clip.get_config()


def test_schedules_survive_a_keras_file_and_training_continues(tmp_path):
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=DecreasingClip(2.0, decay_steps=6), noise_stddev=1.1, learning_rate=0.1)
    model = tf_dp.keras.DPSequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="relu"), keras.layers.Dense(2)])
    model.compile(optimizer=opt, loss=LOSS)
    x, y = _data()
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    path = os.path.join(tmp_path, "m.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    lopt = loaded.optimizer
    assert isinstance(lopt.l2_norm_clip, DecreasingClip)
    assert lopt.l2_norm_clip.get_config() == opt.l2_norm_clip.get_config()
    assert lopt.noise_stddev == 1.1 and lopt.noise_multiplier is None
    assert int(lopt.iterations.numpy()) == 4 and lopt.ledger.num_samples == 4
    loaded.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    recorded = _recorded(lopt)
    assert len(recorded) == 8
    for t, (sens, std) in enumerate(recorded):  # the schedule continues at step 4
        assert sens == pytest.approx(_closed_form_clip(2.0, 6, t), rel=1e-6)
        assert std == pytest.approx(1.1, rel=1e-7)


# -- PrivacyBudget --------------------------------------------------------------------------------


def test_privacy_budget_uses_the_schedule_and_spends_the_budget():
    n, q, sigma, target = 100, 0.1, 1.5, 2.0
    x, y = _data(n)

    def run(clip):
        opt = tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=clip, noise_stddev=sigma, learning_rate=0.05)
        model = _model(opt)
        budget = tf_dp.keras.PrivacyBudget(target, 1e-5, verbose=False)
        batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=5)
        model.fit(batches, epochs=200, verbose=0, callbacks=[budget])
        assert budget.stopped
        entries = opt.ledger.samples()
        assert compute_epsilon(entries, 1e-5).epsilon <= target
        # the next step (as the schedule gives it) would exceed the budget
        assert compute_epsilon(entries + [opt.next_sample_entry()], 1e-5).epsilon > target
        return len(entries)

    constant = run(1.0)
    decreasing = run(DecreasingClip(1.0, decay_steps=30))
    assert decreasing > constant * 1.2  # later steps cost less: more of them fit


def test_privacy_budget_checks_every_step_of_a_call_with_a_rising_cost():
    """steps_per_execution=4 and a clip that grows (fixed stddev: each step costs more than the
    one before): the budget checks the next call's four scheduled steps, never overspends."""
    n, q, target = 100, 0.1, 2.0
    x, y = _data(n)
    opt = tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=lambda t: 0.5 + 0.02 * tf.cast(t, tf.float32), noise_stddev=1.0,
        learning_rate=0.05)
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(2)]))
    model.compile(optimizer=opt, loss=LOSS, steps_per_execution=4)
    budget = tf_dp.keras.PrivacyBudget(target, 1e-5, verbose=False)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=7)
    model.fit(batches, epochs=100, verbose=0, callbacks=[budget])
    assert budget.stopped
    entries = opt.ledger.samples()
    assert compute_epsilon(entries, 1e-5).epsilon <= target
    upcoming = [opt.next_sample_entry(i) for i in range(4)]
    assert compute_epsilon(entries + upcoming, 1e-5).epsilon > target
    sens = [e.queries[0].l2_sensitivity for e in entries]
    assert sens == pytest.approx([0.5 + 0.02 * t for t in range(len(entries))], rel=1e-5)
