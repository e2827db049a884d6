"""DPKerasFTRLOptimizer: DP-FTRL (Kairouz et al. 2021) as a Keras optimizer, its ledger and epsilon."""

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import tolerance
from tf_dp.accounting import compute_epsilon, rdp
from tf_dp.accounting import tree as tree_acc
from tf_dp.dp_query.tree_aggregation import TreeCumulativeSumQuery, tree_depth
from tf_dp.keras import DPKerasFTRLOptimizer, make_private


def _model():
    return make_private(keras.Sequential([keras.Input((5,)), keras.layers.Dense(2)]))


def _data(n=64):
    rng = np.random.RandomState(0)
    x = rng.randn(n, 5).astype("float32")
    return x, (x[:, 0] > 0).astype("int32")


def test_fit_records_tree_events_and_ledger_epsilon_equals_direct_computation():
    x, y = _data()
    model = _model()
    opt = DPKerasFTRLOptimizer(learning_rate=0.1, momentum=0.9, l2_norm_clip=1.5,
                               noise_multiplier=2.0)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(x, y, batch_size=16, epochs=3, verbose=0)
    entries = opt.ledger.samples()
    assert [e.queries[0].tree_step for e in entries] == [0, 1, 2, 3] * 3
    assert opt.tree_restart_period == 4 and opt.tree_depth == 3
    for e in entries:
        assert (e.sampling.population_size, e.sampling.selection_probability,
                e.sampling.policy) == (64, 0.25, "shuffle")
        (q,) = e.queries
        assert (q.mechanism, q.l2_sensitivity, q.noise_stddev, q.noise_seed) == (
            "tree", 1.5, pytest.approx(3.0), None)
    curve = 3 * tree_acc.rdp_tree_aggregation(2.0 / 2, 4, rdp.DEFAULT_ORDERS)  # 2C: z / 2
    eps, _ = rdp.epsilon_from_rdp(rdp.DEFAULT_ORDERS, curve, 1e-5)
    assert compute_epsilon(opt.ledger, 1e-5).epsilon == pytest.approx(eps, rel=1e-12)
    mu = 2 * math.sqrt(3 * tree_depth(4)) / 2.0
    assert compute_epsilon(opt.ledger, 1e-5, "gdp").mu == pytest.approx(mu, rel=1e-12)
    assert np.all(np.isfinite(model.get_weights()[0]))


def test_plain_sgd_on_residuals_is_dp_ftrl_exactly():
    """Zero gradients isolate the noise: after m steps of a tree, theta_m = theta_0 - lr / b * S_m
    with S_m the noised prefix sum of the cumulative tree query drawn from the same seed."""
    n, b, lr, clip, z, seed = 48, 16, 0.5, 1.0, 1.7, 123
    x = np.zeros((n, 5), "float32")
    y = np.zeros((n, 2), "float32")
    # no biases and zero inputs: every gradient is zero at every step, whatever the weights
    model = make_private(keras.Sequential([
        keras.Input((5,)),
        keras.layers.Dense(3, use_bias=False, kernel_initializer="zeros"),
        keras.layers.Dense(2, use_bias=False, kernel_initializer="zeros"),
    ]))
    opt = DPKerasFTRLOptimizer(learning_rate=lr, l2_norm_clip=clip, noise_multiplier=z,
                               noise_seed=seed)
    model.compile(optimizer=opt, loss="mse")
    model.fit(x, y, batch_size=b, epochs=1, shuffle=False, verbose=0)
    specs = [tf.TensorSpec(v.shape, v.dtype) for v in model.trainable_variables]
    cum = TreeCumulativeSumQuery(clip, z * clip, record_specs=specs, restart_every=3, seed=seed)
    gs = cum.initial_global_state()
    magnitude = [np.zeros(sp.shape) for sp in specs]
    for _ in range(3):
        s, gs = cum.get_noised_result([tf.zeros(sp.shape) for sp in specs], gs)
        magnitude = [m + 2 * np.abs(t.numpy()) for m, t in zip(magnitude, s)]
    # the optimizer adds 3 residual updates lr / b * (S_k - S_k-1) to the weights: per step a
    # difference, a division, a product and a sum in float32 (and the tree's sums of up to 3
    # nodes), each of at most lr / b * (|S_k| + |S_k-1|) (tests/helpers/tolerance.py). A missing
    # or repeated tree node moves a weight by lr / b * z * clip ~ 5e-2, far above this
    for v, s_m, m in zip(model.trainable_variables, s, magnitude):
        atol = tolerance("float32", terms=3 * 4 + 3, scale=lr / b * float(m.max()))
        np.testing.assert_allclose(v.numpy(), -lr / b * s_m.numpy(), rtol=0, atol=atol)


def test_poisson_sampling_and_jl_are_refused():
    opt = DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0)
    with pytest.raises(ValueError, match="needs sampling_policy='shuffle'.*Poisson"):
        opt.set_sampling(1000, 0.01, "poisson")
    with pytest.raises(ValueError, match="gradient_mode='jl' cannot be used"):
        DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=1.0, gradient_mode="jl")


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(l2_norm_clip=0.0, noise_multiplier=1.0), "l2_norm_clip must be a finite number > 0"),
        (dict(l2_norm_clip=1.0, noise_multiplier=-1.0),
         "noise_multiplier must be a finite number >= 0"),
        (dict(l2_norm_clip=1.0), "needs l2_norm_clip .* and noise_multiplier"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, restart_every=0),
         r"restart_every must be 'epoch' or an integer in \[1, 2\*\*40 - 1\]"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, restart_every=4, max_epoch_steps=8),
         "max_epoch_steps is only used with restart_every='epoch'"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, max_epoch_steps=0),
         r"max_epoch_steps must be an integer in \[1, 2\*\*40 - 1\]"),
        (dict(l2_norm_clip=1.0, noise_multiplier=1.0, nesterov=True), "nesterov"),
    ],
)
def test_bad_arguments_name_the_argument_and_range(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPKerasFTRLOptimizer(**kwargs)


def test_epoch_longer_than_the_built_tree_is_refused_and_config_round_trips():
    opt = DPKerasFTRLOptimizer(learning_rate=0.2, momentum=0.5, l2_norm_clip=1.0,
                               noise_multiplier=1.0, max_epoch_steps=4)
    opt.set_sampling(64, 0.25, "shuffle")  # 4 steps per epoch
    opt.build([tf.Variable(tf.zeros([3]))])
    assert opt.tree_depth == 3
    with pytest.raises(ValueError, match="max_epoch_steps >= 8"):
        opt.set_sampling(64, 0.125, "shuffle")
    config = opt.get_config()
    assert config["restart_every"] == "epoch" and config["max_epoch_steps"] == 4
    again = DPKerasFTRLOptimizer.from_config(config)
    assert again.get_config() == config


def test_tree_query_as_dp_sum_query_of_another_optimizer_is_refused():
    from tf_dp.dp_query.tree_aggregation import TreeResidualSumQuery
    from tf_dp.keras import DPKerasSGDOptimizer

    q = TreeResidualSumQuery(1.0, 1.0, record_specs=tf.TensorSpec([2]), restart_every=4)
    with pytest.raises(TypeError, match="use tf_dp.keras.DPKerasFTRLOptimizer"):
        DPKerasSGDOptimizer(dp_sum_query=q, learning_rate=0.1)
