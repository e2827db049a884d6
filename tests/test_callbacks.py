"""tf_dp.keras.callbacks: PrivacyReport, PrivacyBudget, BackupAndRestore with the ledger, LedgerCheckpoint."""

import collections
import dataclasses
import json
import os

import keras
import numpy as np
import pytest
from sklearn.datasets import load_digits

import tf_dp
from tf_dp import accounting
from tf_dp.keras import callbacks as dpcb
from tf_dp.engine import budget as budget_internals  # the planner's internals
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
from tf_dp.ledger.ledger_file import LedgerFileError, read_ledger_file

N, Q, SIGMA, CLIP = 300, 0.1, 1.0, 1.0
STEPS = 10  # round(1 / Q)


@pytest.fixture(scope="module")
def digits():
    x, y = load_digits(return_X_y=True)
    return (x[:N] / 16.0).astype(np.float32), y[:N].astype(np.int32)


def _model(seed=0, sigma=SIGMA):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    )
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=sigma, learning_rate=0.5, noise_seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _batches(digits, seed=0):
    x, y = digits
    return tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=seed)


ENTRY = SampleEntry(SamplingEvent(N, Q, "poisson", origin="sampled"), (SumQueryEvent(CLIP, SIGMA * CLIP),))


def _eps(k, delta=1e-5, accountant="rdp"):
    return float(accounting.compute_epsilon([ENTRY] * k, delta=delta, accountant=accountant).epsilon)


def test_privacy_report_epsilon_equals_the_accountant_on_the_ledger(digits):
    model = _model()
    report = dpcb.PrivacyReport(delta=1e-5)
    history = model.fit(_batches(digits), epochs=3, verbose=0, callbacks=[report])
    eps = history.history["epsilon"]
    assert len(eps) == 3 and eps[0] < eps[1] < eps[2]
    ledger = model.optimizer.ledger
    assert ledger.num_samples == 3 * STEPS
    # the run is seeded (noise_seed=0): the ledger records the seed with each sum query
    assert all(e.sampling == ENTRY.sampling and e.queries == (
        dataclasses.replace(ENTRY.queries[0], noise_seed=0),) for e in ledger.samples())
    expected = accounting.compute_epsilon(ledger.samples(), delta=1e-5, accountant="rdp")
    assert eps[-1] == pytest.approx(float(expected.epsilon), rel=1e-12)
    assert eps[0] == pytest.approx(_eps(STEPS), rel=1e-12)
    assert len(report.statements) == 3 and report.statements[-1] == str(expected)


def test_privacy_report_feeds_tensorboard_logs(digits, tmp_path):
    seen = []

    class Spy(keras.callbacks.Callback):  # stands for TensorBoard: reads the same logs dict
        def on_epoch_end(self, epoch, logs=None):
            seen.append(logs.get("epsilon"))

    model = _model()
    model.fit(_batches(digits), epochs=1, verbose=0,
              callbacks=[dpcb.PrivacyReport(delta=1e-5), Spy()])
    assert seen and seen[0] > 0


def _tensorboard_scalars(train_dir, tag):
    """(step, value) pairs of ``tag`` in every event file of ``train_dir``, read back from disk."""
    import glob

    import tensorflow as tf

    found = []
    for path in sorted(glob.glob(os.path.join(train_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == tag:
                    found.append((event.step, float(tf.make_ndarray(value.tensor))))
    return sorted(found)


@pytest.mark.parametrize("order", ["report_first", "tensorboard_first", "between_two"])
def test_privacy_report_reaches_tensorboard_in_any_order(digits, tmp_path, order):
    import tensorboard  # noqa: F401 -- tf.summary needs it (the test extra); missing: a failure

    report = dpcb.PrivacyReport(delta=1e-5)
    first = keras.callbacks.TensorBoard(str(tmp_path / "first"))
    second = keras.callbacks.TensorBoard(str(tmp_path / "second"))
    callbacks = {
        "report_first": [report, first],
        "tensorboard_first": [first, report],
        "between_two": [first, report, second],
    }[order]
    model = _model()
    epochs = 2
    model.fit(_batches(digits), epochs=epochs, verbose=0, callbacks=callbacks)
    assert model.optimizer.ledger.num_samples == epochs * STEPS
    # Independently: the accountant on STEPS, 2 * STEPS identical entries; the event file stores
    # float32, so the value read back is epsilon rounded to float32 (relative error <= 2**-24).
    expected = [(e, _eps((e + 1) * STEPS)) for e in range(epochs)]
    tensorboards = [first, second] if order == "between_two" else [first]
    for tb in tensorboards:
        got = _tensorboard_scalars(os.path.join(tb.log_dir, "train"), "epoch_epsilon")
        assert [step for step, _ in got] == [step for step, _ in expected], (order, tb.log_dir)
        for (_, value), (_, eps) in zip(got, expected):
            assert value == pytest.approx(eps, rel=float(np.finfo(np.float32).eps))


def test_privacy_budget_stops_before_the_step_that_would_exceed(digits):
    # Independently, step by step: the largest k with eps(k) <= target.
    eps = [_eps(k) for k in range(1, 41)]
    target = 0.5 * (eps[22] + eps[23])  # eps(23) <= target < eps(24)
    expected = max(k for k in range(1, 41) if eps[k - 1] <= target)
    assert expected == 23
    model = _model()
    budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
    model.fit(_batches(digits), epochs=10, verbose=0, callbacks=[budget])
    ledger = model.optimizer.ledger
    assert budget.stopped
    assert ledger.num_samples == expected  # mid-epoch stop (epoch 3, step 3)
    spent = float(accounting.compute_epsilon(ledger.samples(), 1e-5, accountant="rdp").epsilon)
    assert spent <= target < _eps(expected + 1)
    assert budget.epsilon_spent == pytest.approx(spent)
    # Budget already spent: the next fit raises before any step runs.
    with pytest.raises(dpcb.BudgetExhaustedError, match="spent"):
        model.fit(_batches(digits), epochs=1, verbose=0, callbacks=[budget])
    assert ledger.num_samples == expected


def test_privacy_budget_no_raise_runs_no_step(digits):
    model = _model()
    model.fit(_batches(digits), epochs=1, verbose=0)
    target = _eps(STEPS) * 1.0000001  # exactly one epoch's worth: no further step fits
    budget = dpcb.PrivacyBudget(target, 1e-5, raise_if_exhausted=False, verbose=False)
    weights = [w.copy() for w in model.get_weights()]
    model.fit(_batches(digits), epochs=2, verbose=0, callbacks=[budget])
    assert budget.stopped and model.optimizer.ledger.num_samples == STEPS
    for a, b in zip(weights, model.get_weights()):
        np.testing.assert_array_equal(a, b)
    # The train function is restored: without the budget, training goes on.
    model.fit(_batches(digits), epochs=1, verbose=0)
    assert model.optimizer.ledger.num_samples == 2 * STEPS


def test_privacy_budget_headroom_matches_step_by_step():
    budget = dpcb.PrivacyBudget(target_epsilon=4.0, delta=1e-5)
    k = budget.headroom([], ENTRY, cap=10_000)
    assert k > 10 and _eps(k) <= 4.0 < _eps(k + 1)
    assert budget.headroom([ENTRY] * k, ENTRY, cap=10_000) == 0
    assert budget.headroom([], ENTRY, cap=5) == 5


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, at_epoch):
        super().__init__()
        self.at_epoch = at_epoch

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == self.at_epoch:
            raise KeyboardInterrupt("simulated preemption")


def test_backup_and_restore_resumes_with_the_same_ledger(digits, tmp_path):
    backup = str(tmp_path / "backup")
    model = _model(seed=1)
    with pytest.raises(KeyboardInterrupt):
        model.fit(_batches(digits), epochs=4, verbose=0,
                  callbacks=[dpcb.BackupAndRestore(backup), _Interrupt(at_epoch=2)])
    before = model.optimizer.ledger.samples()
    assert len(before) == 2 * STEPS
    saved = read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME))
    assert saved == before

    # A new process: fresh model and optimizer (empty ledger), same backup dir. While the
    # interrupted model (its ledger still journaling) lives, a second writer is refused.
    resumed = _model(seed=2)
    resumed.build((None, 64))
    assert resumed.optimizer.ledger.num_samples == 0
    with pytest.raises(LedgerFileError, match="already open for writing"):
        resumed.fit(_batches(digits), epochs=4, verbose=0,
                    callbacks=[dpcb.BackupAndRestore(backup)])
    assert read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME)) == before
    del model  # the first "process" ends (its journal is closed when it is collected)
    report = dpcb.PrivacyReport(delta=1e-5)
    history = resumed.fit(_batches(digits), epochs=4, verbose=0,
                          callbacks=[dpcb.BackupAndRestore(backup), report])
    assert len(history.history["epsilon"]) == 2  # epochs 3 and 4 only
    after = resumed.optimizer.ledger.samples()
    assert len(after) == 4 * STEPS and after[: 2 * STEPS] == before
    # The spent budget carries over: epsilon after epoch 3 is that of 30 steps, not 10.
    assert history.history["epsilon"][0] == pytest.approx(_eps(3 * STEPS), rel=1e-12)
    # Keras's weights and epoch are deleted at the end; the finished ledger stays.
    assert sorted(os.listdir(backup)) == [dpcb.LEDGER_BACKUP_NAME]
    assert read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME)) == after


def test_backup_and_restore_refuses_weights_without_a_ledger(digits, tmp_path):
    backup = tmp_path / "plain"
    model = _model()
    model.fit(_batches(digits), epochs=1, verbose=0,
              callbacks=[keras.callbacks.BackupAndRestore(str(backup), delete_checkpoint=False)])
    fresh = _model()
    fresh.build((None, 64))
    with pytest.raises(FileNotFoundError, match="privacy"):
        fresh.fit(_batches(digits), epochs=2, verbose=0,
                  callbacks=[dpcb.BackupAndRestore(str(backup))])


def test_resumed_budget_counts_the_restored_ledger(digits, tmp_path):
    backup = str(tmp_path / "b")
    target = 0.5 * (_eps(25) + _eps(26))
    model = _model(seed=3)
    with pytest.raises(KeyboardInterrupt):
        model.fit(_batches(digits), epochs=10, verbose=0,
                  callbacks=[dpcb.PrivacyBudget(target, 1e-5, verbose=False),
                             dpcb.BackupAndRestore(backup), _Interrupt(at_epoch=2)])
    del model  # the interrupted "process" ends
    resumed = _model(seed=4)
    resumed.build((None, 64))
    budget = dpcb.PrivacyBudget(target, 1e-5, verbose=False)
    resumed.fit(_batches(digits), epochs=10, verbose=0,
                callbacks=[budget, dpcb.BackupAndRestore(backup)])
    assert budget.stopped and resumed.optimizer.ledger.num_samples == 25


class _CountSteps(keras.callbacks.Callback):
    steps = 0

    def on_train_batch_end(self, batch, logs=None):
        _CountSteps.steps += 1


def test_a_finished_run_run_again_continues_its_ledger(digits, tmp_path):
    backup = str(tmp_path / "b")
    _CountSteps.steps = 0
    model = _model(seed=5)
    model.fit(_batches(digits), epochs=2, verbose=0,
              callbacks=[dpcb.BackupAndRestore(backup), _CountSteps()])
    first = model.optimizer.ledger.samples()
    assert len(first) == _CountSteps.steps == 2 * STEPS
    # The same script again (a restart policy): fresh model and optimizer, same backup dir.
    again = _model(seed=6)
    again.build((None, 64))
    again.fit(_batches(digits, seed=1), epochs=2, verbose=0,
              callbacks=[dpcb.BackupAndRestore(backup), _CountSteps()])
    entries = again.optimizer.ledger.samples()
    # every step that ran in either run is charged, counted directly
    assert len(entries) == _CountSteps.steps == 4 * STEPS and entries[: 2 * STEPS] == first
    assert read_ledger_file(os.path.join(backup, dpcb.LEDGER_BACKUP_NAME)) == entries


def test_a_finished_run_run_again_is_stopped_by_its_budget(digits, tmp_path):
    backup = str(tmp_path / "b")
    target = 0.5 * (_eps(2 * STEPS) + _eps(2 * STEPS + 1))  # room for the first run only
    model = _model(seed=7)
    model.fit(_batches(digits), epochs=2, verbose=0, callbacks=[
        dpcb.PrivacyBudget(target, 1e-5, verbose=False), dpcb.BackupAndRestore(backup)])
    assert model.optimizer.ledger.num_samples == 2 * STEPS
    again = _model(seed=8)
    again.build((None, 64))
    weights = [w.numpy() for w in again.weights]
    with pytest.raises(dpcb.BudgetExhaustedError):
        again.fit(_batches(digits), epochs=2, verbose=0, callbacks=[
            dpcb.PrivacyBudget(target, 1e-5, verbose=False), dpcb.BackupAndRestore(backup)])
    assert again.optimizer.ledger.num_samples == 2 * STEPS
    assert all(np.array_equal(a, w.numpy()) for a, w in zip(weights, again.weights))


def test_ledger_checkpoint_refuses_to_overwrite_a_longer_ledger(digits, tmp_path):
    path = str(tmp_path / "ledger.json")
    model = _model()
    model.fit(_batches(digits), epochs=2, verbose=0, callbacks=[dpcb.LedgerCheckpoint(path)])
    written = read_ledger_file(path)
    assert len(written) == 2 * STEPS
    other = _model(seed=1)  # a second run on the same data, with a new ledger
    with pytest.raises(tf_dp.ledger.LedgerOverwriteError, match=r"20 steps.*only 10"):
        other.fit(_batches(digits), epochs=1, verbose=0, callbacks=[dpcb.LedgerCheckpoint(path)])
    assert read_ledger_file(path) == written
    with pytest.raises(tf_dp.ledger.LedgerOverwriteError, match="ledger.json"):
        other.optimizer.ledger.save(path)
    other.optimizer.ledger.save(path, overwrite=True)  # the explicit opt-out
    assert read_ledger_file(path) == other.optimizer.ledger.samples()


def test_ledger_checkpoint_writes_a_ledger_per_epoch(digits, tmp_path):
    model = _model()
    pattern = str(tmp_path / "ckpt" / "ledger-{epoch:02d}.json")
    model.fit(_batches(digits), epochs=2, verbose=0, callbacks=[
        keras.callbacks.ModelCheckpoint(str(tmp_path / "ckpt" / "model-{epoch:02d}.keras")),
        dpcb.LedgerCheckpoint(pattern, metadata={"run": "t"}),
    ])
    for epoch in (1, 2):
        path = pattern.format(epoch=epoch)
        assert len(read_ledger_file(path)) == epoch * STEPS
        assert os.path.exists(tmp_path / "ckpt" / f"model-{epoch:02d}.keras")
    with open(pattern.format(epoch=2)) as f:
        assert json.load(f)["metadata"]["run"] == "t"


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: dpcb.PrivacyReport(delta=0.0), "delta"),
        (lambda: dpcb.PrivacyReport(delta=1e-5, accountant=""), "accountant"),
        (lambda: dpcb.PrivacyReport(delta=1e-5, accountant="renyi"), "accountant"),
        (lambda: dpcb.PrivacyBudget(1.0, delta=1e-5, accountant="rpd"), "accountant"),
        (lambda: dpcb.PrivacyBudget(target_epsilon=-1.0, delta=1e-5), "target_epsilon"),
        (lambda: dpcb.PrivacyBudget(target_epsilon=float("inf"), delta=1e-5), "target_epsilon"),
        (lambda: dpcb.LedgerCheckpoint("x.json", save_freq=0), "save_freq"),
    ],
)
def test_bad_arguments_fail_with_the_argument_name(make, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make()


def test_callbacks_refuse_a_non_private_optimizer(digits):
    x, y = digits
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer="sgd", loss="sparse_categorical_crossentropy")
    with pytest.raises(TypeError, match="DP optimizer"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[dpcb.PrivacyReport(1e-5)])


@pytest.mark.parametrize(
    "make", [lambda: dpcb.PrivacyReport(1e-5), lambda: dpcb.PrivacyBudget(5.0, 1e-5)]
)
def test_an_accountant_that_cannot_analyse_jl_steps_fails_before_the_first_step(digits, make):
    """rdp has no bound for the JL mechanism: the callback must say so at the start of fit, not
    after a whole epoch of training (nothing applied, nothing recorded)."""
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=SIGMA, learning_rate=0.5,
            gradient_mode="jl", jl_projections=2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    before = [w.copy() for w in model.get_weights()]
    with pytest.raises(ValueError, match="accountant='rdp'.*JL.*pld"):
        model.fit(_batches(digits), epochs=1, verbose=0, callbacks=[make()])
    assert int(model.optimizer.iterations) == 0
    assert len(model.optimizer.ledger.samples()) == 0
    assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    # the accountant that can analyse JL steps trains and reports
    history = model.fit(
        _batches(digits), epochs=1, verbose=0, callbacks=[dpcb.PrivacyReport(1e-5, "pld")])
    # (JL with r=2 has a heavy tail: no finite epsilon at this delta, never less than exact's)
    assert history.history["epsilon"][0] >= _eps(STEPS, accountant="pld")


def test_budget_composed_curve_follows_a_growing_ledger_like_dp_accounting():
    # The budget's incremental composition (only the new runs added at each update) against
    # dp_accounting's RDP accountant on the same Poisson Gaussian steps, listed directly.
    import dp_accounting

    ledger = tf_dp.PrivacyLedger()
    curve = budget_internals._ComposedCurve(1e-5, "rdp")
    steps = []
    rng = np.random.default_rng(3)
    pool = [SampleEntry(SamplingEvent(N, q, "poisson"), (SumQueryEvent(1.0, z),))
            for q in (0.05, 0.1) for z in (0.8, 1.1, 1.5)]
    upcoming = SampleEntry(SamplingEvent(N, 0.1, "poisson"), (SumQueryEvent(1.0, 0.9),))
    for _ in range(3):
        steps += [pool[i] for i in rng.integers(len(pool), size=int(rng.integers(5, 30)))]
        ledger.restore_entries(steps)  # the same first steps, more at the end
        eps = curve.epsilon_with(ledger, [(upcoming, 5)])
        acc = dp_accounting.rdp.RdpAccountant(list(accounting.rdp.DEFAULT_ORDERS))
        for e, count in collections.Counter([*steps, *[upcoming] * 5]).items():
            acc.compose(dp_accounting.PoissonSampledDpEvent(
                e.sampling.selection_probability,
                dp_accounting.GaussianDpEvent(e.queries[0].noise_stddev)), count)
        assert eps == pytest.approx(acc.get_epsilon(1e-5), rel=1e-6)
    shuffle = SampleEntry(SamplingEvent(N, 0.1, "shuffle"), (SumQueryEvent(1.0, 1.0),))
    assert curve.epsilon_with(ledger, [(shuffle, 1)]) is None  # epochs span runs: whole ledger


def test_privacy_budget_with_a_schedule_reads_only_the_new_steps(digits, monkeypatch):
    # Every batch with a clip schedule checks "ledger + next step": after a 50,000-step ledger
    # prefix, the batch and epoch hooks read only the rows of the steps since the last check.
    from tf_dp.ledger import privacy_ledger

    model = _model()
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=tf_dp.keras.DecreasingClip(1.0, decay_steps=4), noise_stddev=1.0,
            learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    prefix = [(SampleEntry(SamplingEvent(N, Q, "poisson"),
                           (SumQueryEvent(1.0, 50.0 + i / 100),)), 100) for i in range(500)]
    model.optimizer.ledger.restore_runs(prefix)
    budget = dpcb.PrivacyBudget(target_epsilon=50.0, delta=1e-5, verbose=False)
    rows = []  # steps turned into runs, rows read from the tables
    to_runs, read = privacy_ledger._tables_to_runs, privacy_ledger._read_rows
    counting = [False]

    def spy_runs(samples, queries, *rest):
        if counting[0]:
            rows.append(len(samples))
        return to_runs(samples, queries, *rest)

    def spy_read(table, start, stop):
        if counting[0]:
            rows.append(stop - start)
        return read(table, start, stop)

    monkeypatch.setattr(privacy_ledger, "_tables_to_runs", spy_runs)
    monkeypatch.setattr(privacy_ledger, "_read_rows", spy_read, raising=False)
    for hook in ("on_train_batch_end", "on_epoch_end"):
        original = getattr(budget, hook)

        def counted(*args, _original=original, **kwargs):
            counting[0] = True
            try:
                return _original(*args, **kwargs)
            finally:
                counting[0] = False

        setattr(budget, hook, counted)
    model.fit(_batches(digits), epochs=2, verbose=0, callbacks=[budget])
    assert model.optimizer.ledger.num_samples > 50_000 and not budget.stopped
    assert rows and max(rows) <= 2 * STEPS and sum(rows) <= 40 * (2 * STEPS + 4)


def test_privacy_budget_with_a_schedule_stops_like_the_whole_ledger_with_few_rdp_evaluations(
        digits, monkeypatch):
    # DecreasingClip with a fixed noise stddev: every step is of another kind. The budget must
    # stop exactly where the accountant, composing the whole recorded ledger from scratch, says
    # the next step would exceed the target; the RDP of the scheduled steps is evaluated
    # PrivacyBudget.LOOK_AHEAD steps at a time, not at every batch (about 1.2 calls per step
    # before).
    from tf_dp.accounting import rdp

    calls = [0]
    original = rdp._rdp_matrix

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(rdp, "_rdp_matrix", counted)
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=tf_dp.keras.DecreasingClip(1.0, decay_steps=1000), noise_stddev=1.0,
            learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    target = 8.0
    budget = dpcb.PrivacyBudget(target_epsilon=target, delta=1e-5, verbose=False)
    model.fit(_batches(digits), epochs=30, verbose=0, callbacks=[budget])
    runs = model.optimizer.ledger.runs()
    steps = sum(count for _, count in runs)
    assert budget.stopped and steps < 30 * STEPS

    monkeypatch.setattr(rdp, "_rdp_matrix", original)

    def epsilon(entries):
        return accounting.compute_epsilon(entries, delta=1e-5, accountant="rdp").epsilon

    assert epsilon(runs) <= target
    # the step the budget refused
    assert epsilon([*runs, (model.optimizer.next_sample_entry(), 1)]) > target
    assert len({e.queries[0].l2_sensitivity for e, _ in runs}) == steps  # all distinct
    assert calls[0] <= steps // 4


def _certified_epsilon(steps, q, z, delta=1e-5, h=1e-4):
    """dp_accounting's PLD epsilon (pessimistic: an upper bound, at most ``steps * h`` above the
    exact value) of ``steps`` Poisson-subsampled Gaussian steps: an oracle independent of
    tf_dp's accountants."""
    import dp_accounting

    if steps == 0:
        return 0.0
    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=h)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
    return acc.get_epsilon(delta)


@pytest.mark.parametrize("accountant", ["rdp", "moments", "pld", "gdp"])
def test_a_budget_never_lets_a_step_run_past_a_certified_bound(digits, accountant):
    # Poisson q = 0.1, noise multiplier 1, target 3: a gdp budget let 30 steps run (the CLT's
    # epsilon 2.99), which cost 4.18 by pessimistic PLD. The budget stops on certified bounds
    # only: gdp is refused for subsampled steps before any step runs, with an error that names
    # the accountants to use; the others stop where a certified bound says.
    target, h = 3.0, 1e-4
    model = _model()
    before = [w.copy() for w in model.get_weights()]
    budget = dpcb.PrivacyBudget(target, 1e-5, accountant=accountant, verbose=False)
    if accountant == "gdp":
        with pytest.raises(ValueError, match=r"accountant='gdp'.*subsampled.*sampling rate 0\.1 "
                           r"< 1.*accountant must be one of \('rdp', 'moments', 'pld'\)"):
            model.fit(_batches(digits), epochs=10, verbose=0, callbacks=[budget])
        assert all(np.array_equal(a, b) for a, b in zip(before, model.get_weights()))
    else:
        model.fit(_batches(digits), epochs=10, verbose=0, callbacks=[budget])
        assert budget.stopped
    steps = model.optimizer.ledger.num_samples
    assert steps == 0 if accountant == "gdp" else steps > 0
    # Every step that ran is within the target by an independent certified accountant. tf_dp's
    # own bound (RDP, moments, or its pessimistic PLD) is >= the exact epsilon, and the oracle is
    # at most steps * h above exact: it may exceed the target by that much, never more.
    assert _certified_epsilon(steps, Q, SIGMA) <= target + steps * h


def test_a_gdp_budget_runs_where_gdp_is_exact(digits):
    # Shuffled fixed-size batches are not subsampled: each epoch counts as one Gaussian mechanism
    # with noise multiplier sigma / 2 (replace-one, sensitivity 2C), so E epochs are exactly
    # mu-GDP with mu = 2 sqrt(E) / sigma (Dong, Roth & Su), and a gdp budget is a certified stop.
    from scipy import optimize, stats

    sigma, delta = 4.0, 1e-5

    def exact_epsilon(epochs):  # the mu-GDP curve, inverted by root finding
        mu = 2.0 * np.sqrt(epochs) / sigma
        return optimize.brentq(lambda e: stats.norm.cdf(-e / mu + mu / 2)
                               - np.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta,
                               1e-9, 100.0, xtol=1e-12)

    target = 0.5 * (exact_epsilon(3) + exact_epsilon(4))
    model = _model(sigma=sigma)
    budget = dpcb.PrivacyBudget(target, delta, accountant="gdp", verbose=False)
    x, y = digits
    model.fit(x, y, batch_size=30, epochs=10, verbose=0, callbacks=[budget])
    # 10 steps an epoch: 3 epochs fit, the first step of the 4th opens a 4th epoch
    assert budget.stopped and model.optimizer.ledger.num_samples == 30
    assert budget.epsilon_spent == pytest.approx(exact_epsilon(3), rel=1e-9)
