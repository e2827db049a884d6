"""Private training under XLA (jit_compile=True) in every gradient mode, and training metrics that
count only the real records of Poisson batches (not their zero-weight padding)."""

import keras
import numpy as np
import pytest

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, tolerance
from tf_dp.accounting import rdp
from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
N, Q, SIGMA, CLIP = 400, 0.05, 1.1, 1.0
MODES = {
    "vectorized": {},
    "microbatch": {"num_microbatches": 4},
    "ghost": {},
    "jl": {"jl_projections": 2},
    "auto": {},
}


def _data(n=N, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int64")
    return x, y


def _model(mode, jit_compile, steps_per_execution=1, metrics=("accuracy",), seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=SIGMA, gradient_mode=mode, learning_rate=0.1,
            **MODES[mode]),
        loss=LOSS, metrics=list(metrics), jit_compile=jit_compile,
        steps_per_execution=steps_per_execution)
    return model


@pytest.mark.parametrize("mode", sorted(MODES))
def test_300_poisson_steps_under_xla_record_exactly_what_ran(mode):
    x, y = _data()
    spe = 7 if mode in ("ghost", "vectorized") else 1  # several steps per compiled call
    model = _model(mode, jit_compile=True, steps_per_execution=spe)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=1)
    model.fit(batches, epochs=300 // batches.steps_per_epoch, verbose=0)
    opt = model.optimizer
    assert int(opt.iterations.numpy()) == 300
    entries = opt.ledger.samples()
    assert len(entries) == 300
    multiplier = 2.0 if mode == "microbatch" else 1.0
    mech = ("jl", 2) if mode == "jl" else ("gaussian", None)
    expected = SampleEntry(
        SamplingEvent(N, Q, "poisson", origin="sampled"),
        (SumQueryEvent(CLIP * multiplier, float(np.float32(SIGMA * CLIP)), *mech),))
    assert all(e == expected for e in entries)
    assert all(np.all(np.isfinite(w.numpy())) for w in model.weights)
    if mode != "jl":  # the JL mechanism has its own accountant (PLD); RDP refuses it
        orders = rdp.DEFAULT_ORDERS
        z = float(np.float32(SIGMA * CLIP)) / (CLIP * multiplier)
        direct, _ = rdp.epsilon_from_rdp(
            orders, 300 * rdp.rdp_poisson_gaussian(Q, z, orders), 1e-5)
        ledger_eps = tf_dp.accounting.compute_epsilon(opt.ledger, delta=1e-5).epsilon
        assert ledger_eps == pytest.approx(direct, rel=1e-12)


@pytest.mark.parametrize("mode", ["vectorized", "microbatch", "ghost", "jl"])
@pytest.mark.parametrize("jit_compile", [False, True])
def test_training_metrics_count_only_real_rows(mode, jit_compile):
    """A model that predicts class 1 everywhere on data whose labels are all 1: over the real
    rows, accuracy is exactly 1 and the loss is the same for every row; padding rows (zeros,
    label 0, weight 0) would pull the accuracy down if they were counted."""
    x, _ = _data()
    y = np.ones(N, np.int64)
    model = _model(mode, jit_compile, metrics=("accuracy",))
    kernel, bias = model.layers[-1].weights
    kernel.assign(np.zeros(kernel.shape, np.float32))
    bias.assign(np.array([0.0, 3.0], np.float32))
    model.optimizer.learning_rate.assign(0.0)
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=Q, seed=2)
    history = model.fit(batches, epochs=1, verbose=0)
    assert history.history["accuracy"][0] == 1.0
    row_loss = float(LOSS(np.array([1]), np.array([[0.0, 3.0]], np.float32)))
    assert history.history["loss"][0] == pytest.approx(row_loss, rel=1e-5)


def _one_step_update(policy, mode, jit_compile):
    keras.mixed_precision.set_global_policy(policy)
    try:
        keras.utils.set_random_seed(0)
        model = tf_dp.keras.make_private(keras.Sequential([
            keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(2)]))
        model.compile(
            optimizer=tf_dp.keras.DPKerasSGDOptimizer(
                l2_norm_clip=0.5, noise_multiplier=0.0, gradient_mode=mode, learning_rate=1.0,
                **MODES[mode]),
            loss=LOSS, jit_compile=jit_compile)
        assert isinstance(model.optimizer, tf_dp.keras.DPKerasSGDOptimizer)  # not loss-scaled
        before = [w.numpy() for w in model.trainable_weights]
        x, y = _data(64, seed=5)
        model.fit(x, y, batch_size=64, shuffle=False, verbose=0)
        assert model.optimizer.ledger.num_samples == 1
        return [w.numpy() - b for w, b in zip(model.trainable_weights, before)]
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
@pytest.mark.parametrize("mode", ["vectorized", "ghost"])
def test_mixed_precision_gives_the_float32_clipped_sum(policy, mode):
    """Noise 0, one step, learning rate 1: the update is the normalised clipped sum. Under a mixed
    policy it matches float32 to the precision of the compute dtype, for eager graphs and XLA
    alike: each per-example gradient of the 6-8-2 model takes dense_gradient_terms roundings in
    the compute dtype (float16 eps 2^-10, bfloat16 2^-7), relative to its clipped norm <= 0.5,
    so the mean of the 64 clipped gradients differs by at most that times 0.5 (in L2 norm); the
    float32 rest (the norm over 90 parameters, the sum of 64, the division) adds its own
    (tests/helpers/tolerance.py)."""
    compute = policy.split("_")[1]
    clip = 0.5
    atol = tolerance(compute, dense_gradient_terms([6, 8, 2]), clip) + tolerance(
        "float32", dense_gradient_terms([6, 8, 2]) + norm_terms(6 * 8 + 8 + 8 * 2 + 2) + 64 + 1,
        clip)
    reference = _one_step_update("float32", mode, False)
    for jit_compile in (False, True):
        update = _one_step_update(policy, mode, jit_compile)
        for u, r in zip(update, reference):
            assert u.dtype == np.float32
            assert np.linalg.norm(u - r) <= atol


@pytest.mark.parametrize("mode", ["microbatch", "jl"])
def test_randomised_modes_train_under_mixed_float16(mode):
    update = _one_step_update("mixed_float16", mode, True)
    assert all(np.all(np.isfinite(u)) and np.any(u != 0) for u in update)


def test_an_explicit_loss_scale_optimizer_is_unwrapped():
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = tf_dp.keras.make_private(keras.Sequential([keras.Input((6,)), keras.layers.Dense(2)]))
        opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
        model.compile(optimizer=keras.optimizers.LossScaleOptimizer(opt), loss=LOSS)
        assert model.optimizer is opt
    finally:
        keras.mixed_precision.set_global_policy("float32")
