"""A custom loop's traced DP step keeps the unit of privacy (example or user, and k) it was traced
with: run under a sampling of another unit, it records and applies nothing and fails (eagerly
in graph mode, at the next flush under XLA); a new tf.function clips with the new unit."""

import json
import os
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, sgd_tolerance
from tf_dp.engine import Sampling
from tests.helpers import warm_python

HERE = os.path.dirname(os.path.abspath(__file__))
CLIP, LR, ROWS = 0.5, 0.5, 8
# One step, the traced step vs the hand reference (other op order and kernels), in float32
# (tests/helpers/tolerance.py): a per-example gradient of the 5-4-3 model, a user's sum of k <= 4
# of them 4, the norm over 39 parameters, the sum of the 8 rows 8, the division 1; the update is
# <= LR * CLIP and |w| <= 0.82 (Glorot) + 2 * LR * CLIP < 1.5
ATOL = sgd_tolerance("float32", steps=1, learning_rate=LR, update_scale=CLIP,
                     terms=dense_gradient_terms([5, 4, 3]) + 4 + norm_terms(39) + ROWS + 1,
                     weight_scale=1.5)

# Poisson claims whose public denominator q * n is exactly the batch's number of units (8 rows:
# 8 examples, 4 users of 2 records, 2 users of 4 records), so a hand reference can divide by it
EXAMPLES = Sampling(16, 0.5)
USERS_OF_2 = Sampling(8, 0.5, unit="user", records_per_unit=2)
USERS_OF_4 = Sampling(4, 0.5, unit="user", records_per_unit=4)
SWITCHES = {
    "example->user": (EXAMPLES, USERS_OF_4),
    "user->example": (USERS_OF_4, EXAMPLES),
    "k=2->k=4": (USERS_OF_2, USERS_OF_4),
}


def _data():
    rng = np.random.default_rng(3)
    return rng.normal(size=(ROWS, 5)).astype("float32") * 3.0, rng.integers(0, 3, size=ROWS)


def _model():
    keras.utils.set_random_seed(0)
    return keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(3)
    ])


def _loss():
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _by_hand(weights, x, y, sampling):
    """One noiseless DP-SGD step by hand: a GradientTape per unit (a slot of k rows, or one row),
    the unit's gradient clipped to CLIP in global L2 norm, summed, divided by q n, SGD."""
    model = _model()
    model.set_weights(weights)
    k = sampling.records_per_unit or 1
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    for start in range(0, ROWS, k):
        with tf.GradientTape() as tape:
            value = tf.reduce_sum(_loss().call(y[start:start + k], model(x[start:start + k])))
        grads = [g.numpy().astype(np.float64)
                 for g in tape.gradient(value, model.trainable_variables)]
        scale = min(1.0, CLIP / np.sqrt(sum(np.sum(g * g) for g in grads)))
        total = [t + scale * g for t, g in zip(total, grads)]
    denominator = sampling.population_size * sampling.selection_probability
    return [w - LR * t / denominator for w, t in zip(weights, total)]


def _units(ledger):
    return [(e.sampling.unit, e.sampling.records_per_unit) for e in ledger.samples()]


def _unit_of(sampling):
    return (sampling.unit, sampling.records_per_unit)


@pytest.mark.parametrize("jit", [False, True], ids=["tf.function", "jit_compile"])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_a_traced_step_refuses_another_unit_and_a_new_function_clips_with_it(switch, jit):
    first, second = SWITCHES[switch]
    x, y = _data()
    model = _model()
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=0.0,
                                          learning_rate=LR)
    dp_step = tf_dp.keras.DPTrainStep(model, opt, _loss(), sampling=first)
    train = tf.function(dp_step, jit_compile=jit)
    start = model.get_weights()
    train(x, y)
    dp_step.flush()
    after_first = model.get_weights()
    for got, want in zip(after_first, _by_hand(start, x, y, first)):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    tables = opt.ledger.tables()

    opt.set_sampling(second)
    error = tf.errors.InvalidArgumentError if not jit else ValueError
    with pytest.raises(error, match="build a new tf.function"):
        train(x, y)  # traced for `first`: must not run under `second`
        dp_step.flush()
    for got, want in zip(model.get_weights(), after_first):
        np.testing.assert_array_equal(got, want)  # exact: nothing was applied
    assert int(opt.iterations.numpy()) == 1
    for got, want in zip(opt.ledger.tables(), tables):
        np.testing.assert_array_equal(np.nan_to_num(got, nan=-7), np.nan_to_num(want, nan=-7))
    assert _units(opt.ledger) == [_unit_of(first)]

    rebuilt = tf.function(dp_step, jit_compile=jit)
    rebuilt(x, y)
    dp_step.flush()  # the error was reported once: the rebuilt function's flush is clean
    for got, want in zip(model.get_weights(), _by_hand(after_first, x, y, second)):
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL)
    assert _units(opt.ledger) == [_unit_of(first), _unit_of(second)]
    assert int(opt.iterations.numpy()) == 2


def test_mixed_float16_under_xla_refuses_another_unit():
    x, y = _data()
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _model()
        opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=CLIP, noise_multiplier=1.0,
                                              learning_rate=LR, noise_seed=1)
        dp_step = tf_dp.keras.DPTrainStep(model, opt, _loss(), sampling=EXAMPLES)
        train = tf.function(dp_step, jit_compile=True)
        train(x, y)
        dp_step.flush()
        weights = model.get_weights()
        opt.set_sampling(USERS_OF_4)
        train(x, y)
        with pytest.raises(ValueError, match="records_per_unit=4"):
            dp_step.flush()
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert model.layers[0].compute_dtype == "float16"
    for got, want in zip(model.get_weights(), weights):
        np.testing.assert_array_equal(got, want)  # exact: nothing was applied
    assert _units(opt.ledger) == [("example", None)]
    assert int(opt.iterations.numpy()) == 1


def test_engine_step_in_a_tf_function_refuses_another_unit():
    """The engine's own step (no Keras optimizer): an example-level trace run under a user-level
    claim leaves the variable and the ledger as they were."""
    engine = tf_dp.engine.DPEngine(tf_dp.engine.PrivacyConfig(l2_norm_clip=1.0,
                                                             noise_multiplier=1.0))
    engine.set_sampling(EXAMPLES)
    w = tf.Variable(tf.ones([5]))
    x, y = _data()
    y = tf.constant(y, tf.float32)

    def loss_fn(xb, yb, sample_weight):
        pred = tf.linalg.matvec(xb, w)
        return tf.square(pred - yb), pred

    def sgd(grads, variables):
        for g, v in zip(grads, variables):
            v.assign_sub(0.1 * g)

    @tf.function
    def step(xb, yb):
        engine.step(loss_fn, (xb, yb, None), [w], step=0, apply_fn=sgd)

    step(x, y)
    engine.flush()
    before = w.numpy()
    engine.set_sampling(USERS_OF_2)
    with pytest.raises(tf.errors.InvalidArgumentError, match="example-level clipping"):
        step(x, y)
    np.testing.assert_array_equal(w.numpy(), before)
    assert _units(engine.ledger) == [("example", None)]


def test_mirrored_strategy_refuses_another_unit():
    """2 logical CPU devices, in a tf.function: the mismatched step fails, weights, optimizer step
    and ledger as they were; a new tf.function records the user-level step and trains."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE), os.environ.get("PYTHONPATH", "")]))
    proc = warm_python.run(
        [sys.executable, os.path.join(HERE, "helpers", "custom_loop_mirrored_unit.py")],
        capture_output=True, text=True, timeout=300, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("REPORT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    r = json.loads(lines[-1][len("REPORT "):])
    assert r["replicas"] == 2
    assert "build a new tf.function" in r["error"]
    assert r["unchanged"] is True
    assert r["units_after_error"] == [["example", None]]
    assert r["units_after_rebuild"] == [["example", None], ["user", 4]]
    assert r["moved_after_rebuild"] > 1e-4


def test_xla_steps_without_flush_are_applied_and_recorded_until_the_staging_table_is_full():
    """docs/keras.md: a compiled DPTrainStep called repeatedly without flush() applies and
    records 64 steps (the staging table's rows; the room is taken before a step records, so the
    step that fills the table is applied too), records and applies nothing after, and the next
    flush raises LedgerOverflowError. Counted by the calls made and the weights seen."""
    from tf_dp.ledger.privacy_ledger import LedgerOverflowError

    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    opt = tf_dp.keras.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1,
                                          learning_rate=0.1)
    dp_step = tf_dp.keras.DPTrainStep(
        model, opt, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        sampling=Sampling(len(x), 1.0, policy="shuffle"))

    @tf.function(jit_compile=True)
    def train(xb, yb):
        return dp_step(xb, yb)

    applied = []
    for _ in range(65):
        before = [w.numpy().copy() for w in model.trainable_weights]
        train(x, y)
        after = [w.numpy() for w in model.trainable_weights]
        applied.append(any(not np.array_equal(a, b) for a, b in zip(before, after)))
    # noise makes a zero update impossible: an unchanged weight is a withheld step
    assert applied == [True] * 64 + [False]
    with pytest.raises(LedgerOverflowError):
        dp_step.flush()
    assert opt.ledger.num_samples == 64  # every applied step, nothing else
    assert int(opt.engine.skipped_steps) == 0  # none recorded without its update
