"""PrivacyBudget's per-step work with a clip schedule: the next steps' ledger entries predicted in
one call (numpy schedules), checked against what the ledger then records, and the budget's stop
checked against the accountant on the whole ledger."""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tf_dp import accounting
from tf_dp.accounting import rdp
from tf_dp.engine import budget as budget_module
from tf_dp.keras import callbacks as dpcb
from tf_dp.engine import budget as budget_internals  # the planner's internals
from tf_dp.ledger import query_with_ledger
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

N, Q = 400, 0.05


def _model(clip, seed=0, **noise):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
    noise = noise or {"noise_stddev": 1.0}
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=clip, learning_rate=0.1,
                                                  noise_seed=seed, **noise),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def _batches(steps_per_epoch=None, seed=0, q=Q):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(N, 8)).astype(np.float32)
    y = rng.integers(0, 2, size=N).astype(np.int32)
    return tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=seed,
                                      steps_per_epoch=steps_per_epoch)


def _epsilon(entries):
    return accounting.compute_epsilon(list(entries), delta=1e-5, accountant="rdp").epsilon


def test_decreasing_clip_numpy_values_equal_the_tensorflow_schedule():
    steps = np.concatenate([np.arange(3000), np.random.default_rng(0).integers(0, 10**9, 3000)])
    for clip in (tf_dp.keras.DecreasingClip(1.0, 1e7), tf_dp.keras.DecreasingClip(4.0, 1000),
                 tf_dp.keras.DecreasingClip(3.3, 7.7, floor_fraction=0.3)):
        expected = clip(tf.constant(steps, tf.int64)).numpy()
        assert np.array_equal(clip.numpy_values(steps), expected)


@pytest.mark.parametrize("noise", [{"noise_stddev": 1.3}, {"noise_multiplier": 1.1}])
def test_predicted_entries_equal_the_entries_the_ledger_records(noise):
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), **noise)
    opt = model.optimizer
    opt.set_sampling(tf_dp.data.Sampling(N, Q))
    data = _batches()
    predicted = opt.next_sample_entries(12)
    assert predicted == [opt.next_sample_entry(i) for i in range(12)]  # the per-step path
    # run the 12 steps (the same sampling, declared by fit), then read what was recorded
    model.fit(data, epochs=1, steps_per_epoch=12, verbose=0)
    recorded = opt.ledger.samples()
    assert len(recorded) == 12 and len({e.queries[0].l2_sensitivity for e in recorded}) == 12
    # the compiled step evaluates the schedule in a graph, which may round its float32
    # division differently from eager TensorFlow and numpy (by one float32 ulp at most)
    ulp = 2.0**-23
    for p, r in zip(predicted, recorded):
        assert (p.sampling.population_size, p.sampling.selection_probability,
                p.sampling.policy) == (r.sampling.population_size,
                                       r.sampling.selection_probability, r.sampling.policy)
        (pq,), (rq,) = p.queries, r.queries
        assert pq.l2_sensitivity == pytest.approx(rq.l2_sensitivity, rel=2 * ulp, abs=0)
        assert pq.noise_stddev == pytest.approx(rq.noise_stddev, rel=2 * ulp, abs=0)
        assert (pq.mechanism, pq.noise_seed) == (rq.mechanism, rq.noise_seed)
    # and after them: the next window starts where the ledger stopped
    after = opt.next_sample_entries(3)
    model.fit(data, epochs=1, steps_per_epoch=3, verbose=0)
    for p, r in zip(after, opt.ledger.samples()[12:]):
        assert p.queries[0].l2_sensitivity == pytest.approx(r.queries[0].l2_sensitivity,
                                                            rel=2 * ulp, abs=0)


def test_a_budget_with_a_schedule_predicts_with_tensorflow_once_per_window(monkeypatch):
    # The schedule is evaluated in numpy and the query's variables read once per window of
    # LOOK_AHEAD steps, not once or twice per batch.
    calls = [0]
    original = query_with_ledger.QueryWithLedger.next_sample_entry

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    monkeypatch.setattr(query_with_ledger.QueryWithLedger, "next_sample_entry", counted)
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=1000))
    budget = dpcb.PrivacyBudget(target_epsilon=1e6, delta=1e-5, verbose=False)
    steps = 2 * dpcb.PrivacyBudget.LOOK_AHEAD + 10
    model.fit(_batches(steps_per_epoch=steps), epochs=1, verbose=0, callbacks=[budget])
    assert model.optimizer.ledger.num_samples == steps and not budget.stopped
    windows = -(-steps // dpcb.PrivacyBudget.LOOK_AHEAD)
    # one per window, plus on_train_begin's check and the first step's own window
    assert calls[0] <= windows + 3


def test_a_schedule_budget_stops_where_the_whole_ledger_says_after_a_distinct_prefix():
    # A prefix of distinct steps, then DecreasingClip steps (each one distinct): the budget
    # stops at the step that the accountant, composing the whole ledger from scratch, says
    # would exceed the target; its reported epsilon is that accountant's.
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), noise_stddev=1.2)
    prefix = [(SampleEntry(SamplingEvent(N, Q), (SumQueryEvent(1.0, 1.0 + i / 50),)), 7)
              for i in range(60)]
    model.optimizer.ledger.restore_runs(prefix)
    target = _epsilon(prefix) + 0.25
    budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
    model.fit(_batches(steps_per_epoch=20), epochs=20, verbose=0, callbacks=[budget])
    runs = model.optimizer.ledger.runs()
    new = sum(count for _, count in runs) - 420
    assert budget.stopped and 0 < new < 400
    assert _epsilon(runs) <= target < _epsilon([*runs, (model.optimizer.next_sample_entry(), 1)])
    assert budget.epsilon_spent == _epsilon(runs)


def test_the_first_check_on_a_long_prefix_composes_it_once_at_few_orders(monkeypatch):
    # Far from the budget, the first check of a fit evaluates the prefix's distinct steps at
    # the few orders the order search starts from (it stops at the first order within the
    # budget), and never hands the whole ledger to the accountant.
    shapes = []
    original = rdp._rdp_matrix

    def spy(q, s, orders):
        shapes.append((q.size, orders.size))
        return original(q, s, orders)

    monkeypatch.setattr(rdp, "_rdp_matrix", spy)
    whole = []
    monkeypatch.setattr(budget_module, "compute_epsilon", lambda *a: whole.append(a) or (0.0, None))
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=1000))
    prefix = [(SampleEntry(SamplingEvent(N, Q), (SumQueryEvent(1.0, 2.0 + i / 1000),)), 50)
              for i in range(2000)]
    model.optimizer.ledger.restore_runs(prefix)
    budget = dpcb.PrivacyBudget(target_epsilon=1e6, delta=1e-5, verbose=False)
    budget.set_model(model)
    budget.on_train_begin()
    budget.on_train_batch_begin(0)
    assert not budget.stopped and not whole
    over_prefix = [orders for units, orders in shapes if units >= 2000]
    assert len(over_prefix) == 1 and over_prefix[0] <= len(rdp._seed_orders(
        np.unique(rdp.DEFAULT_ORDERS)))


def test_composed_epsilon_at_most_decides_like_the_optimum():
    rng = np.random.default_rng(1)
    q = rng.uniform(0.01, 0.2, 30)
    z = rng.uniform(0.7, 3.0, 30)
    c = rng.integers(1, 200, 30)
    optimum = rdp.rdp_epsilon(q, z, c, 1e-5)[0]
    for target in (optimum * 0.5, optimum * 0.999, optimum * 1.001, optimum * 3):
        acc = rdp.ComposedRdp(1e-5)
        acc.add(q, z, c)
        value = acc.epsilon(at_most=target)
        assert (value <= target) == (optimum <= target)
        assert value >= optimum * (1 - 1e-9)


def test_a_budget_prediction_follows_a_sampling_declared_mid_fit():
    # A callback listed before the budget declares a costlier sampling after batch B: the
    # budget's next check must be of a step at the new rate (the window predicted before is
    # dropped), so it stops where one more step at the new rate would exceed the target.
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=40.0))
    opt = model.optimizer
    b, q2 = 5, 0.5
    opt.set_sampling(tf_dp.data.Sampling(N, Q))
    steps_q1 = [opt.next_sample_entry(i) for i in range(b + 2)]
    target = _epsilon(steps_q1) * (1 + 1e-6)  # room for step b+1 at the old rate only

    class Declare(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == b:
                opt.set_sampling(tf_dp.data.Sampling(N, q2))

    x = np.random.default_rng(0).normal(size=(40, 8)).astype(np.float32)
    data = tf.data.Dataset.from_tensor_slices((x, np.zeros(40, np.int32))).batch(2)
    budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
    model.fit(data, epochs=1, verbose=0, callbacks=[Declare(), budget])
    runs = opt.ledger.runs()
    assert budget.stopped and opt.ledger.num_samples == b + 1
    assert _epsilon(runs) <= target < _epsilon([*runs, (opt.next_sample_entry(), 1)])
    assert opt.next_sample_entry().sampling.selection_probability == q2


def test_a_schedule_budget_keeps_a_margin_for_the_compiled_rounding():
    # A scheduled step whose predicted epsilon lands within 1e-6 (relative) under the target is
    # not taken: the compiled step may round the schedule's float32 arithmetic one ulp away from
    # the prediction, so the check keeps SCHEDULE_MARGIN below the target.
    def run(target):
        model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), noise_stddev=1.2)
        budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
        model.fit(_batches(steps_per_epoch=20), epochs=5, verbose=0, callbacks=[budget])
        return model.optimizer

    opt = run(1.4)
    runs = opt.ledger.runs()
    taken = sum(count for _, count in runs)
    assert 0 < taken < 100, taken
    # the next step would reach epsilon e; a target a hair (2e-7 relative) above e still stops
    # before it, a target 1e-5 above e lets it run
    e = _epsilon([*runs, (opt.next_sample_entry(), 1)])
    assert dpcb.SCHEDULE_MARGIN == 1e-6
    assert sum(c for _, c in run(e * (1 + 2e-7)).ledger.runs()) == taken
    assert sum(c for _, c in run(e * (1 + 1e-5)).ledger.runs()) == taken + 1


@pytest.mark.parametrize("clip", [tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), 1.0])
def test_predictions_mark_only_the_first_step_of_a_shuffle_pass_as_its_start(clip):
    # fit on arrays with a fixed batch size: shuffle sampling, a pass starts at the first step.
    # Predicted at the first batch, the next three steps must be what the ledger then records:
    # only the first opens the pass (each later one marked as a start would count as an epoch).
    model = _model(clip)
    predicted = {}

    class Predict(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                opt = self.model.optimizer
                predicted["window"] = opt.next_sample_entries(3)
                predicted["each"] = [opt.next_sample_entry(i) for i in range(3)]

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 8)).astype(np.float32), rng.integers(0, 2, 40).astype(np.int32)
    model.fit(x, y, batch_size=10, epochs=1, steps_per_epoch=3, verbose=0, callbacks=[Predict()])
    recorded = [e.sampling for e in model.optimizer.ledger.samples()]
    assert [s.pass_start for s in recorded] == [True, False, False]
    assert all(s.policy == "shuffle" for s in recorded)
    for key in ("window", "each"):
        assert [e.sampling for e in predicted[key]] == recorded, key


def test_epsilon_spent_is_computed_when_read_for_the_ledger_as_fit_left_it(monkeypatch):
    # The end of a fit does not compose the whole ledger (a long ledger would cost seconds per
    # fit); epsilon_spent is computed on first read, for the steps recorded when the fit ended.
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), noise_stddev=1.2)
    budget = dpcb.PrivacyBudget(target_epsilon=50.0, delta=1e-5, verbose=False)
    calls = []
    real = budget_module.BudgetPlanner.epsilon
    monkeypatch.setattr(budget_module.BudgetPlanner, "epsilon",
                        lambda self, entries: calls.append(1) or real(self, entries))
    model.fit(_batches(steps_per_epoch=10), epochs=1, verbose=0, callbacks=[budget])
    assert calls == []  # the whole-ledger accountant was not called by the fit
    at_end = model.optimizer.ledger.runs()
    model.fit(_batches(steps_per_epoch=5, seed=1), epochs=1, verbose=0)  # more steps, no budget
    assert budget.epsilon_spent == _epsilon(at_end) < _epsilon(model.optimizer.ledger.runs())
    assert len(calls) == 1 and budget.epsilon_spent == _epsilon(at_end) and len(calls) == 1


def _counting_whole_ledger_calls(monkeypatch):
    """Counts the budget's whole-ledger accountant calls (``tf_dp.engine.budget.compute_epsilon``)."""
    calls = []
    original = budget_module.compute_epsilon
    monkeypatch.setattr(budget_module, "compute_epsilon",
                        lambda *a, **k: calls.append(1) or original(*a, **k))
    return calls


# A gdp budget takes steps without subsampling only (there gdp is exact; subsampled steps are
# refused, tests/test_callbacks.py): its runs here are full-batch Poisson steps (q = 1).
@pytest.mark.parametrize("accountant, q, noise", [("gdp", 1.0, 10.0), ("pld", Q, 1.0)])
def test_a_gdp_or_pld_schedule_budget_stops_where_that_accountant_says(accountant, q, noise,
                                                                      monkeypatch):
    # As with rdp: the stop is where the chosen accountant, on the whole ledger from scratch,
    # says the next step would exceed the target. gdp keeps the ledger's mu^2 and never asks
    # the whole ledger; pld asks it only once the (looser) RDP bound is above the target.
    def epsilon(runs):
        return accounting.compute_epsilon(list(runs), 1e-5, accountant).epsilon

    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=50.0), noise_stddev=1.2 * noise)
    prefix = [(SampleEntry(SamplingEvent(N, q), (SumQueryEvent(1.0, noise * (1.0 + i / 50)),)),
               7) for i in range(60)]
    model.optimizer.ledger.restore_runs(prefix)
    target = epsilon(prefix) + 0.25
    budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, accountant=accountant,
                                verbose=False)
    calls = _counting_whole_ledger_calls(monkeypatch)
    model.fit(_batches(steps_per_epoch=20, q=q), epochs=20, verbose=0, callbacks=[budget])
    runs = model.optimizer.ledger.runs()
    new = sum(count for _, count in runs) - 420
    assert budget.stopped and 0 < new < 400
    assert epsilon(runs) <= target < epsilon([*runs, (model.optimizer.next_sample_entry(), 1)])
    if accountant == "gdp":
        assert calls == []
    else:
        # once the RDP bound is over the target, the next 1024 predicted steps are checked at
        # once: one call if they all fit, else a search (at most 2 log2(1024) + 1 calls), and
        # not again while the steps are recorded as checked (a float32 ulp off the prediction
        # stays covered) until the last one that fits; the old code made one call per batch
        assert len(calls) <= 2 * (2 * 10 + 1) < new


@pytest.mark.parametrize("accountant, q", [("gdp", 1.0), ("pld", Q)])
def test_far_from_the_budget_gdp_and_pld_checks_do_not_read_the_whole_ledger(accountant, q,
                                                                           monkeypatch):
    model = _model(tf_dp.keras.DecreasingClip(1.0, decay_steps=1000))
    model.optimizer.ledger.restore_runs(
        [(SampleEntry(SamplingEvent(N, q), (SumQueryEvent(1.0, 1.0 + i / 100),)), 3)
         for i in range(100)])
    budget = dpcb.PrivacyBudget(target_epsilon=1e3, delta=1e-5, accountant=accountant,
                                verbose=False)
    calls = _counting_whole_ledger_calls(monkeypatch)
    model.fit(_batches(steps_per_epoch=30, q=q), epochs=2, verbose=0, callbacks=[budget])
    assert model.optimizer.ledger.num_samples == 360 and not budget.stopped
    assert calls == []  # the old code ran the whole-ledger accountant at every batch
    assert budget.epsilon_spent == pytest.approx(
        accounting.compute_epsilon(model.optimizer.ledger, 1e-5, accountant).epsilon)


def test_a_checked_window_covers_steps_that_cost_no_more_privacy():
    # The budget checks predicted steps a hair less private than predicted (sensitivity raised
    # by 2^-21), so a step recorded one float32 ulp away is still covered; a costlier one, or
    # one that differs otherwise, is not (it is checked again).
    sampling = SamplingEvent(N, Q)
    step = SampleEntry(sampling, (SumQueryEvent(0.9, 1.2),))
    checked = budget_internals._pessimistic(step)
    (c,) = checked.queries
    assert c.l2_sensitivity == 0.9 * (1 + 2.0**-21) and c.noise_stddev == 1.2
    ulp = 2.0**-23
    for clip in (0.9, 0.9 * (1 + ulp), 0.9 * (1 - ulp), 0.9 * (1 + 2.0**-22)):
        assert budget_internals._covered(SampleEntry(sampling, (SumQueryEvent(clip, 1.2),)), checked)
    assert budget_internals._covered(SampleEntry(sampling, (SumQueryEvent(0.9, 1.3),)), checked)  # more noise
    costlier = [
        SampleEntry(sampling, (SumQueryEvent(0.9 * (1 + 2.0**-20), 1.2),)),  # beyond the slack
        SampleEntry(sampling, (SumQueryEvent(0.9, 1.19),)),                  # less noise
        SampleEntry(SamplingEvent(N, 2 * Q), (SumQueryEvent(0.9, 1.2),)),    # another rate
        SampleEntry(sampling, (SumQueryEvent(0.9, 1.2), SumQueryEvent(1.0, 1.0))),
        SampleEntry(sampling, (SumQueryEvent(0.9, 1.2, noise_seed=3),)),
    ]
    for entry in costlier:
        assert not budget_internals._covered(entry, checked)
    # JL and grid-noise queries are covered only when equal (their cost is not z alone)
    for query in (SumQueryEvent(0.9, 1.2, mechanism="jl", jl_projections=8),
                  SumQueryEvent(0.9, 1.2, noise_grid=2.0**-10)):
        entry = SampleEntry(sampling, (query,))
        assert budget_internals._pessimistic(entry) == entry and budget_internals._covered(entry, entry)
        assert not budget_internals._covered(
            SampleEntry(sampling, (dataclasses.replace(query, noise_stddev=1.3),)), entry)


def test_the_composed_curve_reads_new_steps_also_when_it_cannot_compose_them():
    # Shuffle steps do not compose step by step, but the budget still compares the steps
    # recorded since a whole-ledger check with the ones it checked: update must hand them over.
    ledger = tf_dp.PrivacyLedger()
    shuffled = SampleEntry(SamplingEvent(N, Q, policy="shuffle"), (SumQueryEvent(1.0, 1.2),))
    ledger.restore_runs([(shuffled, 3)])
    curve = budget_internals._ComposedCurve(1e-5, "pld")
    curve.update(ledger)
    assert not curve.composable and curve.take_unseen() == [(0, [(shuffled, 3)])]
    other = SampleEntry(SamplingEvent(N, Q, policy="shuffle"), (SumQueryEvent(1.0, 0.9),))
    ledger.restore_runs([(shuffled, 3), (other, 2)])
    curve.update(ledger)
    assert curve.steps == 5 and curve.take_unseen() == [(3, [(other, 2)])]
    curve.update(ledger)  # nothing new
    assert curve.take_unseen() == []


def test_a_fixed_clip_budget_predicts_the_next_step_once_per_kind_not_per_batch(monkeypatch):
    # With a fixed clip and noise, the next step's entry is predicted when what it depends on
    # changes (the first step's pass start, a sampling declared at each fit, the clipper
    # resolved), not at every batch: a batch's check is a read of the ledger's step count.
    calls = [0]
    original = query_with_ledger.QueryWithLedger.next_sample_entry

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    model = _model(1.0)
    budget = dpcb.PrivacyBudget(target_epsilon=1e6, delta=1e-5, verbose=False)
    model.fit(_batches(steps_per_epoch=5), epochs=1, verbose=0, callbacks=[budget])
    monkeypatch.setattr(query_with_ledger.QueryWithLedger, "next_sample_entry", counted)
    model.fit(_batches(steps_per_epoch=100), epochs=3, verbose=0, callbacks=[budget])
    assert model.optimizer.ledger.num_samples == 305 and not budget.stopped
    # on_train_begin's checks and a few changes of key; the old code made 2 per batch (600+)
    assert calls[0] <= 10
    # and the stop is still where the accountant says (a budget close to the ledger's epsilon)
    runs = model.optimizer.ledger.runs()
    target = _epsilon([*runs, (runs[-1][0], 40)]) * (1 + 1e-9)
    near = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
    model.fit(_batches(steps_per_epoch=100), epochs=1, verbose=0, callbacks=[near])
    runs = model.optimizer.ledger.runs()
    assert near.stopped and model.optimizer.ledger.num_samples == 345
    assert _epsilon(runs) <= target < _epsilon([*runs, (model.optimizer.next_sample_entry(), 1)])
