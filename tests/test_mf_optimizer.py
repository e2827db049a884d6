"""DPKerasMFOptimizer: correlated (matrix factorization) noise through fit, saving and resuming.

Zero inputs and bias-free layers make every gradient zero, so SGD with learning rate 1 on batches
of B records moves the weights by exactly ``-w_t / B`` at step t: the released noise is read back
from the weights and compared with numpy's ``sigma * np.linalg.solve(C, Z)`` for the draws ``Z``
of a generator of the same seed (tests/test_correlated_noise.py checks the query alone).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import eps
from tests.test_correlated_noise import BLT_PARAMS, Banded, banded_matrix, blt_inverse, coef_of
from tf_dp.dp_query.noise import gaussian_noise, make_generator
from tf_dp.keras import make_private
from tf_dp.keras.mf import DPKerasMFOptimizer
from tests.helpers import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
N_STEPS, BANDS, B, SIGMA = 8, 3, 8, 1.3
SHAPES = [(4, 3), (3, 2)]  # the two kernels (no biases)


def _strategy(kind):
    if kind == "banded":
        c = banded_matrix(N_STEPS, BANDS, seed=5)
        return Banded(coef_of(c, BANDS)), c
    return BLT_PARAMS, np.linalg.inv(blt_inverse(BLT_PARAMS.omega, BLT_PARAMS.theta, N_STEPS))


def _model():
    return make_private(
        keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
                keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros"),
            ]
        )
    )


def _compile(model, kind, seed, **kwargs):
    opt = DPKerasMFOptimizer(
        learning_rate=1.0,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        strategy=_strategy(kind)[0],
        noise_seed=seed,
        **kwargs,
    )
    model.compile(optimizer=opt, loss="mse")
    return opt


class _Weights(keras.callbacks.Callback):
    def on_train_begin(self, logs=None):
        self.seen = [[w.copy() for w in self.model.get_weights()]]

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append([w.copy() for w in self.model.get_weights()])


def _fit(model, steps, **kwargs):
    x = np.zeros((steps * B, 4), "float32")
    y = np.zeros((steps * B, 2), "float32")
    cb = _Weights()
    model.fit(x, y, batch_size=B, epochs=1, shuffle=False, verbose=0, callbacks=[cb], **kwargs)
    return cb.seen


def _released(seen):
    """[steps, d]: the noise w_t read back from consecutive weights (-B * difference)."""
    flat = [np.concatenate([np.reshape(w, -1) for w in ws]).astype(np.float64) for ws in seen]
    return np.stack([-B * (b - a) for a, b in zip(flat[:-1], flat[1:])]), flat


def _draws(seed, steps):
    gen = make_generator(seed)
    rows = []
    for _ in range(steps):
        rows.append(
            np.concatenate(
                [gaussian_noise(gen, int(np.prod(s)), tf.float32, 1.0).numpy() for s in SHAPES]
            )
        )
    return np.stack(rows).astype(np.float64)


def _tolerance(c, want, flat_weights):
    """The recurrence in float32 (forward substitution, test_correlated_noise's bound, with the
    XLA/eager Box-Muller and sigma scaling roundings), then the weight update w / B added to
    weights of magnitude |theta| in float32 and read back as a difference times B."""
    k = BANDS + 12
    solve = k * eps("float32") * (np.abs(np.linalg.inv(c)) @ np.abs(c) @ np.abs(want))
    theta = np.max(np.abs(np.stack(flat_weights)), axis=0)
    return solve + 4 * B * eps("float32") * (theta + np.abs(want) / B)


@pytest.mark.parametrize(
    "kind, options",
    [
        ("banded", {}),
        ("blt", {}),
        ("banded", {"gradient_mode": "ghost", "max_physical_batch_size": 3}),
        ("blt", {"gradient_mode": "vectorized", "jit_compile": True}),
    ],
)
def test_fit_releases_sigma_c_inverse_z(kind, options):
    options = dict(options)
    jit = options.pop("jit_compile", False)
    model = _model()
    opt = _compile(model, kind, seed=11, **options)
    if jit:
        model.compile(optimizer=opt, loss="mse", jit_compile=True)
    w, flat = _released(_fit(model, N_STEPS))
    c = _strategy(kind)[1]
    want = SIGMA * np.linalg.solve(c, _draws(11, N_STEPS))
    assert np.all(np.abs(w - want) <= _tolerance(c, want, flat))
    assert opt.mf_step == N_STEPS
    assert len(opt.ledger.samples()) == N_STEPS


@pytest.mark.parametrize("kind, how", [("banded", "keras_file"), ("blt", "checkpoint")])
def test_resumed_run_continues_the_same_mechanism(kind, how, tmp_path):
    """k steps, save, a new optimizer (seed 2) restores and runs the rest: the noise over the
    whole run is sigma * C^{-1} [Z1[:k]; Z2[:n-k]]. A restart of the state (buffers lost) or a
    step counter back at 0 changes every later release by O(sigma)."""
    k = 3
    model = _model()
    _compile(model, kind, seed=1)
    first = _released(_fit(model, k))[0]
    model2 = _model()
    opt2 = _compile(model2, kind, seed=2)
    if how == "keras_file":
        path = str(tmp_path / "m.weights.h5")
        model.save_weights(path)
        model2.load_weights(path)
    else:
        tf.train.Checkpoint(model=model, optimizer=model.optimizer).write(str(tmp_path / "ck"))
        model2.optimizer.build(model2.trainable_variables)
        tf.train.Checkpoint(model=model2, optimizer=opt2).read(str(tmp_path / "ck"))
        opt2.restore_ledger_tables(*model.optimizer.ledger.tables())  # not in the checkpoint
    assert opt2.mf_step == k
    rest, flat = _released(_fit(model2, N_STEPS - k))
    c = _strategy(kind)[1]
    z = np.concatenate([_draws(1, k), _draws(2, N_STEPS - k)])
    want = SIGMA * np.linalg.solve(c, z)
    got = np.concatenate([first, rest])
    assert np.all(np.abs(got - want) <= _tolerance(c, want, flat))


def test_backup_and_restore_resumes_the_noise(tmp_path):
    """An interrupted fit (2 epochs of 2 steps, killed in the second) resumed by
    BackupAndRestore from the end of epoch 1: the noise of epoch 2 continues the mechanism."""
    kind, steps = "banded", 4
    x = np.zeros((2 * B, 4), "float32")
    y = np.zeros((2 * B, 2), "float32")

    class Stop(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if self.model.optimizer.iterations.numpy() == 3:
                raise RuntimeError("interrupted")

    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    model = _model()
    _compile(model, kind, seed=1)
    cb = _Weights()
    with pytest.raises(RuntimeError, match="interrupted"):
        model.fit(
            x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[backup, cb, Stop()]
        )
    first = _released(cb.seen[:3])[0]  # steps 0 and 1 (epoch 1)
    model2 = _model()
    opt2 = _compile(model2, kind, seed=2)
    cb2 = _Weights()
    model2.fit(x, y, batch_size=B, epochs=2, shuffle=False, verbose=0, callbacks=[backup, cb2])
    assert opt2.mf_step == steps
    rest, flat = _released(cb2.seen)
    c = _strategy(kind)[1][:steps, :steps]
    want = SIGMA * np.linalg.solve(c, np.concatenate([_draws(1, 2), _draws(2, 2)]))
    got = np.concatenate([first, rest])
    assert np.all(np.abs(got - want) <= _tolerance(c, want, flat))


def test_config_round_trips_and_bad_arguments_are_named():
    opt = DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=2.0, strategy=BLT_PARAMS)
    again = DPKerasMFOptimizer.from_config(opt.get_config())
    np.testing.assert_array_equal(again.noise_query.recurrence.theta, BLT_PARAMS.theta)
    assert (again.l2_norm_clip, again.noise_multiplier) == (1.0, 2.0)
    with pytest.raises(ValueError, match="strategy"):
        DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="noise_multiplier"):
        DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=-1.0, strategy=BLT_PARAMS)
    with pytest.raises(ValueError, match="gradient_mode='jl'"):
        DPKerasMFOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, strategy=BLT_PARAMS, gradient_mode="jl"
        )


def test_mirrored_strategy_keeps_one_noise_state_per_global_step():
    """2 logical CPUs (a subprocess): the weights move by the same w_t on both replicas, and the
    state kept after the run is the one the released noise implies (the last b - 1 w's for a
    banded strategy), i.e. the first replica's draw both released and remembered."""
    env = dict(
        os.environ,
        TF_CPP_MIN_LOG_LEVEL="2",
        PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]),
    )
    proc = warm_python.run(
        [sys.executable, os.path.join(HERE, "helpers", "mirrored_mf.py")],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("REPORT ") :])
    w = np.array(r["released"])
    buffers = np.array(r["buffers"])  # [b - 1, d], newest first
    assert r["in_sync"] and r["mf_step"] == len(w)
    # the buffers hold the released noise exactly up to the weights' float32 read-back
    tol = 4 * r["batch"] * eps("float32") * (np.array(r["max_weight"]) + np.abs(w[-1]))
    for j in range(buffers.shape[0]):
        assert np.all(np.abs(buffers[j] - w[-1 - j]) <= tol)
    assert np.max(np.abs(w)) > 0.1


def test_dp_train_step_in_a_custom_loop_releases_sigma_c_inverse_z():
    """The custom-loop path (DPTrainStep, called eagerly here: tracing it costs about 30 s on
    this machine, for any DP optimizer; graph and XLA are covered by the fit tests): same
    mechanism."""
    import tf_dp

    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
            keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros"),
        ]
    )
    opt = DPKerasMFOptimizer(
        learning_rate=1.0,
        l2_norm_clip=1.0,
        noise_multiplier=SIGMA,
        strategy=_strategy("banded")[0],
        noise_seed=4,
    )
    step = tf_dp.keras.DPTrainStep(
        model, opt, "mse", sampling=tf_dp.engine.Sampling(N_STEPS * B, B / (N_STEPS * B), "shuffle")
    )
    x, y = np.zeros((B, 4), "float32"), np.zeros((B, 2), "float32")
    seen = [[w.copy() for w in model.get_weights()]]
    for _ in range(N_STEPS):
        step(x, y)
        seen.append([w.copy() for w in model.get_weights()])
    w, flat = _released(seen)
    c = _strategy("banded")[1]
    want = SIGMA * np.linalg.solve(c, _draws(4, N_STEPS))
    assert np.all(np.abs(w - want) <= _tolerance(c, want, flat))
    assert opt.mf_step == N_STEPS and len(opt.ledger.samples()) == N_STEPS


def test_strategy_objects_round_trip_through_the_config():
    from tf_dp.correlated.strategies import BandedStrategy, BLTStrategy

    for strategy in (BandedStrategy.square_root(16, 4), BLTStrategy.optimize(16, buffers=2)):
        opt = DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=1.5, strategy=strategy)
        again = DPKerasMFOptimizer.from_config(opt.get_config())
        assert type(again.strategy) is type(strategy)
        np.testing.assert_array_equal(again.strategy.matrix(), strategy.matrix())


def test_for_target_epsilon_calibrates_the_gaussian_mechanism_of_c():
    """Fixed order, period = bands: a banded square root's participations touch disjoint rows, so
    the sensitivity is sqrt(k * sum_j r_j^2) (closed form); dp_accounting's PLD of that Gaussian
    mechanism at the calibrated noise is at the target (pessimistic: a little above at most)."""
    import math

    from dp_accounting.pld import privacy_loss_distribution as pld

    from tf_dp.correlated.strategies import BandedStrategy

    n, bands = 40, 4
    strategy = BandedStrategy.square_root(n, bands)
    opt = DPKerasMFOptimizer.for_target_epsilon(
        3.0, 1e-5, strategy=strategy, period=bands, l2_norm_clip=1.0
    )
    r = [math.comb(2 * j, j) / 4**j for j in range(bands)]
    sens = math.sqrt(n / bands * sum(x * x for x in r))
    eps = pld.from_gaussian_mechanism(
        opt.noise_multiplier, sensitivity=sens, value_discretization_interval=1e-4
    ).get_epsilon_for_delta(1e-5)
    assert 3.0 * (1 - 1e-3) <= eps <= 3.0 * 1.01
    with pytest.raises(ValueError, match="noise_multiplier must not be given"):
        DPKerasMFOptimizer.for_target_epsilon(
            3.0, 1e-5, strategy=strategy, noise_multiplier=1.0, l2_norm_clip=1.0
        )


def test_saved_ledger_with_the_mechanism_gives_dp_sgd_epsilon_for_one_band(tmp_path):
    """One band (C = I) on cyclic Poisson batches of one part (Poisson sampling): the ledger saved
    with the run's event recomputes DP-SGD's epsilon, as dp_accounting's PLD composes it."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    import tf_dp
    from tf_dp.accounting.matrix_factorization import mf_epsilon_from_ledger
    from tf_dp.correlated.strategies import BandedStrategy

    n, batch, sigma, epochs = 64, 8, 1.3, 2
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    batches = tf_dp.data.cyclic_poisson_batches(x, y, num_parts=1, batch_size=batch, seed=2)
    model = _model()
    opt = DPKerasMFOptimizer(
        l2_norm_clip=1.0, noise_multiplier=sigma, strategy=BandedStrategy.square_root(16, 1)
    )
    model.compile(optimizer=opt, loss="mse")
    model.fit(batches, epochs=epochs, verbose=0)
    path = str(tmp_path / "run.ledger.json")
    opt.save_ledger(path)
    ours = mf_epsilon_from_ledger(path, 1e-5).epsilon
    acc = pld_privacy_accountant.PLDAccountant()
    acc.compose(
        dp_accounting.PoissonSampledDpEvent(batch / n, dp_accounting.GaussianDpEvent(sigma)),
        epochs,
    )
    ref = acc.get_epsilon(1e-5)
    assert abs(ours - ref) <= 0.02 * ref  # two pessimistic PLD discretisations
    with pytest.raises(ValueError, match="participation is required"):
        DPKerasMFOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, strategy=BandedStrategy.square_root(16, 2)
        ).mf_event()
    with pytest.raises(TypeError, match="to_config"):
        DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, strategy=BLT_PARAMS).mf_event(
            "single"
        )


# -- the ledger-driven numbers: every reader of the ledger dispatches on the recorded mechanism --


def _dp_accounting_amplified(q, z, col, releases, delta=1e-5):
    import dp_accounting

    acc = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z / col)),
                releases)
    return acc.get_epsilon(delta)


def test_fit_statement_budget_and_cli_use_the_amplified_bandmf_epsilon(tmp_path, capsys):
    """BandMF on cyclic Poisson batches over b = bands parts: PrivacyReport's printed epsilon,
    compute_epsilon on the ledger and on its file, and the CLI all give amplified BandMF's
    epsilon: ceil(n / b) Poisson-subsampled Gaussians of sensitivity C's column norm, composed by
    dp_accounting (the coefficients from their closed form binom(2k, k) / 4^k)."""
    import math

    import tf_dp
    from tf_dp.accounting import compute_epsilon
    from tf_dp.accounting.matrix_factorization import amplified_bandmf_epsilon
    from tf_dp.correlated.strategies import BandedStrategy

    n_rec, bands, batch, z = 96, 4, 6, 1.5
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n_rec, 4)).astype("float32")
    y = rng.normal(size=(n_rec, 2)).astype("float32")
    batches = tf_dp.data.cyclic_poisson_batches(x, y, num_parts=bands, batch_size=batch, seed=2)
    strategy = BandedStrategy.square_root(64, bands)
    model = _model()
    opt = DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=z, strategy=strategy)
    model.compile(optimizer=opt, loss="mse")
    report = tf_dp.keras.PrivacyReport(1e-5, accountant="pld", verbose=True)
    history = model.fit(batches, epochs=2, verbose=0, callbacks=[report])
    steps = opt.ledger.num_samples
    q = batch * bands / n_rec
    col = math.sqrt(sum((math.comb(2 * k, k) / 4**k) ** 2 for k in range(bands)))
    ref = _dp_accounting_amplified(q, z, col, math.ceil(steps / bands))
    eps_fit = history.history["epsilon"][-1]
    assert math.isfinite(eps_fit) and eps_fit == pytest.approx(ref, rel=1e-2)  # two PLD grids
    assert f"epsilon = {eps_fit:.4g}" in capsys.readouterr().out
    ours = amplified_bandmf_epsilon(BandedStrategy.square_root(steps, bands), z, 1e-5, q).epsilon
    assert compute_epsilon(opt.ledger, 1e-5, "pld").epsilon == pytest.approx(ours, rel=1e-9)
    path = str(tmp_path / "run.ledger.json")
    opt.save_ledger(path)
    assert compute_epsilon(path, 1e-5, "pld").epsilon == pytest.approx(ours, rel=1e-9)
    p = subprocess.run([sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy",
                        f"--ledger={path}", "--delta=1e-5", "--accountant=pld", "--format=json"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["pld"]["epsilon"] == pytest.approx(ours, rel=1e-9)


def test_fit_on_shuffled_arrays_reports_the_gaussian_of_c_and_the_budget_stops_on_it():
    """BLT on Keras's shuffled batches: no amplification, replace-one adjacency; the run is one
    Gaussian mechanism of sensitivity 2 ||C 1|| (C from numpy's inverse of the BLT's C^{-1},
    C >= 0 here), whose exact epsilon GDP gives. PrivacyBudget stops at the last step whose
    independently computed epsilon is within the target."""
    import math

    from scipy import optimize, stats

    import tf_dp
    from tf_dp.accounting import compute_epsilon
    from tf_dp.correlated.strategies import BLTStrategy

    def gaussian_eps(mu, delta=1e-5):
        def d(e):
            return (stats.norm.cdf(-e / mu + mu / 2)
                    - math.exp(e) * stats.norm.cdf(-e / mu - mu / 2) - delta)
        return optimize.brentq(d, 0.0, 500.0, xtol=1e-14)

    def sens(steps):
        lag = np.arange(steps)[:, None] - np.arange(steps)[None, :]
        k = np.maximum(lag, 1)
        inv = np.where(lag > 0, -0.3 * 0.5 ** (k - 1), np.where(lag == 0, 1.0, 0.0))
        c = np.linalg.inv(inv)
        assert np.all(c >= -1e-12)
        return 2.0 * float(np.linalg.norm(c.sum(axis=1)))

    z, batch, n_rec = 3.0, 8, 64
    strategy = BLTStrategy([-0.3], [0.5], 100)
    model = _model()
    opt = DPKerasMFOptimizer(l2_norm_clip=1.0, noise_multiplier=z, strategy=strategy)
    model.compile(optimizer=opt, loss="mse")
    rng = np.random.default_rng(1)
    x = rng.normal(size=(n_rec, 4)).astype("float32")
    y = rng.normal(size=(n_rec, 2)).astype("float32")
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    steps = opt.ledger.num_samples
    assert compute_epsilon(opt.ledger, 1e-5, "gdp").epsilon == pytest.approx(
        gaussian_eps(sens(steps) / z), rel=1e-9)
    # the budget: it allows exactly the steps whose epsilon stays within the target
    target = 0.5 * (gaussian_eps(sens(steps + 5) / z) + gaussian_eps(sens(steps + 6) / z))
    budget = tf_dp.keras.PrivacyBudget(target, 1e-5, accountant="gdp")
    model.fit(x, y, batch_size=batch, epochs=3, verbose=0, callbacks=[budget])
    assert opt.ledger.num_samples == steps + 5
