"""DP optimizers' ``for_target_epsilon``: target epsilon in, the calibrated noise out (the
one-line equivalent of Opacus's ``make_private_with_epsilon``)."""

import math

import dp_accounting
import keras
import numpy as np
import pytest

import tf_dp
from tf_dp import accounting

N, BATCH, EPOCHS, TARGET, DELTA, CLIP = 200, 20, 2, 2.0, 1e-5, 1.0


def test_noise_is_calibrate_noise_multiplier_and_the_run_stays_within_the_target():
    opt = tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
        TARGET, DELTA, n=N, batch_size=BATCH, epochs=EPOCHS, l2_norm_clip=CLIP, learning_rate=0.1
    )
    sigma = accounting.calibrate_noise_multiplier(TARGET, DELTA, N, BATCH, epochs=EPOCHS)
    assert opt.noise_multiplier == sigma and opt.l2_norm_clip == CLIP
    assert opt.learning_rate.numpy() == pytest.approx(0.1, rel=np.finfo(np.float32).eps)

    # The run it plans: Poisson batches at q = BATCH / N, ceil(EPOCHS * N / BATCH) steps.
    steps = math.ceil(EPOCHS * N / BATCH)
    q = BATCH / N
    rng = np.random.default_rng(0)
    x = rng.normal(size=(N, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(
        tf_dp.data.poisson_batches(x, y, sampling_probability=q, seed=0), epochs=EPOCHS, verbose=0
    )
    ledger = model.optimizer.ledger
    assert ledger.num_samples == steps
    entry = ledger.samples()[0]
    assert entry.sampling.population_size == N and entry.sampling.selection_probability == q
    # recorded as the float32 stddev the step used (rounding: relative error <= 2**-24)
    assert entry.queries[0].noise_stddev == pytest.approx(
        sigma * CLIP, rel=float(np.finfo(np.float32).eps)
    )
    spent = accounting.compute_epsilon(ledger, delta=DELTA, accountant="rdp").epsilon
    assert spent <= TARGET
    # Independently (dp_accounting's PLD, pessimistic, tighter than RDP): also within the target.
    pld = dp_accounting.pld.PLDAccountant(value_discretization_interval=1e-4)
    pld.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), steps)
    assert pld.get_epsilon(DELTA) <= TARGET
    # ... and the noise is the smallest that does (calibrate's rtol 1e-3): 1% less overshoots.
    rdp = dp_accounting.rdp.RdpAccountant(orders=[1 + k / 10 for k in range(1, 1000)])
    rdp.compose(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(0.99 * sigma)), steps
    )
    assert rdp.get_epsilon(DELTA) > TARGET


def test_other_optimizers_and_arguments():
    rmsprop = tf_dp.keras.make_dp_optimizer_class(keras.optimizers.RMSprop)
    opt = rmsprop.for_target_epsilon(
        3.0, 1e-5, n=60000, batch_size=256, steps=1000, accountant="pld", l2_norm_clip=0.5
    )
    assert opt.noise_multiplier == accounting.calibrate_noise_multiplier(
        3.0, 1e-5, 60000, 256, steps=1000, accountant="pld"
    )
    # Microbatches of several examples: sensitivity 2C, the noise calibrated for it.
    micro = tf_dp.keras.DPKerasAdamOptimizer.for_target_epsilon(
        3.0, 1e-5, n=60000, batch_size=256, epochs=1, l2_norm_clip=1.0, num_microbatches=64
    )
    assert micro.noise_multiplier == accounting.calibrate_noise_multiplier(
        3.0, 1e-5, 60000, 256, epochs=1, microbatch_size=2
    )


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"noise_multiplier": 1.0, "l2_norm_clip": 1.0}, "noise_multiplier must not be given"),
        ({"noise_stddev": 1.0, "l2_norm_clip": 1.0}, "noise_stddev must not be given"),
        ({}, "needs l2_norm_clip"),
    ],
)
def test_refuses_a_given_noise_or_a_missing_clip(kwargs, match):
    with pytest.raises(ValueError, match=match):
        tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
            1.0, 1e-5, n=1000, batch_size=10, epochs=1, **kwargs
        )


def test_refuses_bad_targets_with_calibrates_message():
    with pytest.raises(ValueError, match="target_epsilon must be a finite number > 0"):
        tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
            -1.0, 1e-5, n=1000, batch_size=10, epochs=1, l2_norm_clip=1.0
        )


def test_dp_ftrl_is_refused():
    with pytest.raises(TypeError, match="not accounted as DP-SGD"):
        tf_dp.keras.DPKerasFTRLOptimizer.for_target_epsilon(
            1.0, 1e-5, n=1000, batch_size=10, epochs=1, l2_norm_clip=1.0
        )
