"""``noise_seed`` makes the microbatch and JL modes' public randomness repeat across processes.

The microbatch assignment and the JL directions are stateless draws keyed by ``(noise_seed,
step)``: the same seed gives the same draws and weights, another seed or no seed other ones
(``test_seeded_runs.py``: the same weights in two processes, under XLA and ``MirroredStrategy``).
The draws are checked against their laws directly (independent across steps, uniform
assignment), never against the ledger.
"""

import math

import numpy as np
import pytest
import tensorflow as tf

from tests.helpers.tolerance import tolerance
from tf_dp.engine import PrivacyConfig
from tf_dp.gradients import JLClipper, MicrobatchClipper


def _fit(mode, seed):
    """Weights after 2 DP steps of a tiny model (graph mode) with ``noise_seed=seed``."""
    import keras

    import tf_dp

    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
    extra = {"num_microbatches": 4} if mode == "microbatch" else {"jl_projections": 2}
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=0.5, noise_multiplier=0.0, learning_rate=0.5, gradient_mode=mode,
            noise_seed=seed, **extra),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    rng = np.random.default_rng(1)
    x = rng.normal(size=(32, 6)).astype("float32")
    model.fit(x, rng.integers(0, 3, 32), batch_size=16, verbose=0, shuffle=False)
    return np.concatenate([np.ravel(w) for w in model.get_weights()])


@pytest.mark.parametrize("mode", ["microbatch", "jl"])
def test_the_seed_keys_the_public_randomness_and_no_seed_draws_afresh(mode):
    # Noise 0: the weights differ only through the assignment or the directions.
    seven = _fit(mode, 7)
    assert np.array_equal(seven, _fit(mode, 7))
    assert np.max(np.abs(seven - _fit(mode, 8))) > 1e-4
    assert np.max(np.abs(_fit(mode, None) - _fit(mode, None))) > 1e-4


def _variables(sizes=(4000, 3000)):
    return [tf.Variable(tf.zeros([n])) for n in sizes]


def test_jl_directions_are_a_function_of_seed_and_step_and_fresh_at_every_step():
    variables = _variables()
    d = 7000
    draw = lambda clipper, step: np.concatenate(  # noqa: E731
        [np.concatenate([t.numpy() for t in v]) for v in clipper.draw_directions(variables, step)])
    first = draw(JLClipper(jl_projections=2, seed=7), 3)
    assert np.array_equal(first, draw(JLClipper(jl_projections=2, seed=7), 3))
    clipper = JLClipper(jl_projections=2, seed=7)
    compiled = tf.function(lambda s: clipper.draw_directions(variables, s), jit_compile=True)
    xla = np.concatenate([np.concatenate([t.numpy() for t in v]) for v in compiled(3)])
    # XLA rounds log and cos its own way: Box-Muller sqrt(-2 log u) cos(2 pi v) takes the word
    # to uniform conversions (2), log and cos (a few ulps each, counted 4 apiece), the products
    # and sqrt (4): 14 roundings, 16 with the split, of values at most max |first| (<= 9.49)
    # (tests/helpers/tolerance.py); a different seed, step or word gives O(1) differences
    np.testing.assert_allclose(
        xla, first, rtol=0, atol=tolerance("float32", 16, float(np.abs(first).max()))
    )
    v = {s: draw(JLClipper(jl_projections=2, seed=7), s).reshape(2, d) for s in range(4)}
    other_seed = draw(JLClipper(jl_projections=2, seed=8), 3).reshape(2, d)
    # Standard normal coordinates: sample mean within 6 standard errors (1/sqrt(n)) of 0 and
    # sample variance within 6 standard errors (sqrt(2/n)) of 1.
    pooled = np.concatenate(list(v.values()))
    n = pooled.size
    assert abs(pooled.mean()) < 6 / math.sqrt(n)
    assert abs(pooled.var() - 1) < 6 * math.sqrt(2 / n)
    # Independent directions (across steps, across the r directions of a step, across seeds):
    # the correlation of two independent N(0, I_d) vectors has standard deviation 1/sqrt(d).
    pairs = [(v[0][0], v[1][0]), (v[1][1], v[2][1]), (v[2][0], v[3][1]), (v[0][0], v[0][1]),
             (v[3][0], other_seed[0])]
    for p, q in pairs:
        assert abs(np.corrcoef(p, q)[0, 1]) < 6 / math.sqrt(d)


def test_microbatch_assignment_is_a_function_of_seed_and_step_and_uniform():
    b, m = 6000, 4
    ids = {s: MicrobatchClipper(m, seed=7).assignment(b, s).numpy() for s in range(3)}
    assert np.array_equal(ids[0], MicrobatchClipper(m, seed=7).assignment(b, 0).numpy())
    clipper = MicrobatchClipper(m, seed=7)
    compiled = tf.function(lambda s: clipper.assignment(b, s), jit_compile=True)
    assert np.array_equal(compiled(tf.constant(2, tf.int64)).numpy(), ids[2])
    for s in range(3):
        counts = np.bincount(ids[s], minlength=m)
        # each count is Binomial(b, 1/m): within 6 standard deviations of b/m
        assert np.all(np.abs(counts - b / m) < 6 * math.sqrt(b * (1 / m) * (1 - 1 / m)))
    # fresh at every step: two independent assignments agree on a fraction 1/m of the examples
    # (Binomial(b, 1/m) agreements)
    agree = np.sum(ids[0] == ids[1])
    assert abs(agree - b / m) < 6 * math.sqrt(b * (1 / m) * (1 - 1 / m))


def test_noise_seed_must_be_an_integer_of_at_most_2_to_53():
    for bad in ("7", 1.5, True, 2**53 + 1):
        with pytest.raises(ValueError, match="noise_seed"):
            PrivacyConfig(l2_norm_clip=1.0, noise_multiplier=1.0, noise_seed=bad)
    assert PrivacyConfig(l2_norm_clip=1.0, noise_multiplier=1.0, noise_seed=-(2**53)).noise_seed
    # a numpy integer is an integer (kept as a Python int)
    seed = PrivacyConfig(l2_norm_clip=1.0, noise_multiplier=1.0, noise_seed=np.int64(7)).noise_seed
    assert seed == 7 and type(seed) is int
