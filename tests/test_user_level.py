"""User-level DP: Poisson sampling of users, per-user clipping, the ledger's claim.

References are independent of the code under test: per-user clipped sums from a plain
``GradientTape`` per user (sum of the user's weighted losses, its gradient, clipped by hand);
participation counts against Binomial(steps, q); epsilon against ``dp_accounting``.
"""

import dataclasses

import keras
import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
import tf_dp.keras as dpk
from tests.helpers.tolerance import (
    dense_gradient_terms,
    model_gradient_terms,
    norm_terms,
    sgd_tolerance,
    tolerance,
)
from tests.test_gradients_exact import compiled, conv_model, sequential_model
from tf_dp.data.users import UserIndex, sample_user_rows
from tf_dp.dp_query.gaussian_query import GaussianSumQuery
from tf_dp.gradients import make_clipper
from tf_dp.gradients.per_user import for_users
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.keras.losses import PerExampleLoss


def _user_terms(model, k):
    """Roundings of one user's clipped contribution (tests/helpers/tolerance.py): a record's
    gradient, the sum of the user's ``k`` records, the user's norm over all parameters."""
    params = sum(int(np.prod(v.shape)) for v in model.trainable_variables)
    return model_gradient_terms(model, classes=3) + k + norm_terms(params)


def _user_batch(shape, k=3, users=4, seed=0):
    """A user-level batch as poisson_batches lays it out: ``users`` slots of ``k`` rows, some
    slots short (zero-weight padding rows of zeros) and one slot empty."""
    rng = np.random.default_rng(seed)
    b = users * k
    x = rng.normal(size=(b,) + shape).astype(np.float32) * 2.0
    y = rng.integers(0, 3, b).astype(np.int32)
    sw = np.ones(b, np.float32)
    sw[k - 1] = 0.0  # user 0 has k - 1 records
    sw[2 * k + 1:3 * k] = 0.0  # user 2 has one record
    sw[(users - 1) * k:] = 0.0  # the last slot is empty
    x[sw == 0] = 0.0
    y[sw == 0] = 0
    sw[k] = 0.5  # a weighted record
    return x, y, sw


def _reference(model, x, y, sw, k, clip):
    """Per user: gradient of the user's summed weighted loss (one tape per user), clipped."""
    total = [np.zeros(v.shape, np.float64) for v in model.trainable_variables]
    norms = []
    for j in range(len(x) // k):
        rows = slice(j * k, (j + 1) * k)
        with tf.GradientTape() as tape:
            logits = model(x[rows], training=True)
            loss = keras.losses.sparse_categorical_crossentropy(y[rows], logits, from_logits=True)
            loss = tf.reduce_sum(loss * sw[rows])
        grads = [np.asarray(g, np.float64) for g in tape.gradient(loss, model.trainable_variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        norms.append(norm)
        scale = min(1.0, clip / norm) if norm > 0 else 0.0
        total = [t + scale * g for t, g in zip(total, grads)]
    return total, np.array(norms)


def _run(clipper, model, x, y, sw, clip, compile_as):
    query = GaussianSumQuery(clip, 0.0)
    loss_fn = PerExampleLoss(model)

    def step(x, y, sw):
        params = query.derive_sample_params(query.initial_global_state())
        out = clipper.clipped_sum(loss_fn, (x, y, sw), model.trainable_variables, query, params)
        return out.clipped_sum, out.norms, out.record_mask, out.num_records, out.losses

    if compile_as is not None:
        step = tf.function(step, jit_compile=compile_as == "xla")
    out = step(tf.constant(x), tf.constant(y), tf.constant(sw))
    return tf.nest.map_structure(np.asarray, out)


@pytest.mark.parametrize("compile_as", [None, "xla"])
@pytest.mark.parametrize("mode", ["vectorized", "ghost", "microbatch", "ghost-physical",
                                  "vectorized-physical"])
@pytest.mark.parametrize("builder", [sequential_model, conv_model])
def test_per_user_clipped_sum_matches_a_tape_per_user(builder, mode, compile_as):
    model = compiled(builder())
    k, clip = 3, 1.0
    x, y, sw = _user_batch(tuple(model.inputs[0].shape[1:]), k=k)
    name = mode.split("-")[0]
    inner = make_clipper(name, model=model, num_microbatches=2 if name == "microbatch" else None)
    if mode.endswith("physical"):
        inner = PhysicalBatches(inner, 4)  # rounded to 3: one user slot per piece
    clipper = for_users(inner, k)
    _, want_norms = _reference(model, x, y, sw, k, clip)
    real = want_norms[want_norms > 0]
    clip = float(np.sqrt(real.min() * real.max()))  # some users clipped, some not
    assert real.max() > clip > real.min()
    got, norms, mask, num, losses = _run(clipper, model, x, y, sw, clip, compile_as)
    want, _ = _reference(model, x, y, sw, k, clip)
    # each user's clipped gradient has entries <= clip; 4 user slots (+ 4 pieces); a user split
    # across replicas/pieces or clipped per record is off by O(clip) (tests/helpers/tolerance.py)
    atol = tolerance("float32", _user_terms(model, k) + 4 + 4, 4 * clip)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)
    np.testing.assert_allclose(
        norms, np.repeat(want_norms, k), rtol=tolerance("float32", _user_terms(model, k)),
        atol=tolerance("float32", _user_terms(model, k), real.min()),  # the empty user's 0
    )
    # one record per non-empty user: the first row of each of the first 3 slots
    assert mask.tolist() == [i % k == 0 and i < 3 * k for i in range(len(x))]
    assert int(num) == 3
    assert losses.shape == (len(x),)


def test_a_user_with_a_non_finite_record_adds_nothing():
    model = compiled(sequential_model())
    k, clip = 3, 0.4
    x, y, sw = _user_batch((6,), k=k)
    x[1, 0] = np.nan  # a record of user 0
    clipper = for_users(make_clipper("ghost", model=model), k)
    got = _run(clipper, model, x, y, sw, clip, None)[0]
    keep = sw.copy()
    keep[:k] = 0.0  # the reference without user 0
    x0 = np.where(np.isnan(x), 0.0, x).astype(np.float32)
    want, _ = _reference(model, x0, y, keep, k, clip)
    atol = tolerance("float32", _user_terms(model, k) + 4, 4 * clip)  # a NaN leak fails anyway
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=atol)


def test_user_sampling_counts_follow_binomial_and_at_most_k_records():
    # 30 users with 1..8 records; q = 0.2; k = 3
    counts = np.arange(30) % 8 + 1
    user_ids = np.repeat(np.arange(30) * 7 + 100, counts)  # arbitrary integer ids
    rng = np.random.default_rng(0)
    perm = rng.permutation(len(user_ids))
    user_ids = user_ids[perm]
    n, k, q, steps = len(user_ids), 3, 0.2, 400
    index = UserIndex.from_user_ids(user_ids, n)
    gen = np.random.Generator(np.random.Philox(12345))
    user_steps = np.zeros(30, int)
    record_steps = np.zeros(n, int)
    for step in range(steps):
        rows = sample_user_rows(index, q, k, 8, gen)
        assert len(rows) % k == 0
        slots = rows.reshape(-1, k)
        seen = set()
        for slot in slots:
            real = slot[slot >= 0]
            if len(real) == 0:
                continue
            owners = {int(user_ids[r]) for r in real}
            assert len(owners) == 1  # a slot holds one user's records
            owner = owners.pop()
            assert owner not in seen  # one slot per user
            seen.add(owner)
            u = (owner - 100) // 7
            assert len(set(real.tolist())) == len(real) == min(k, counts[u])
            assert list(real) == list(slot[: len(real)])  # real rows first, then padding
            user_steps[u] += 1
            record_steps[real] += 1
    # each user's participations ~ Binomial(steps, q): two-sided 1e-4 per user (Bonferroni 30)
    lo, hi = stats.binom.ppf([1e-4 / 60, 1 - 1e-4 / 60], steps, q)
    assert np.all((user_steps >= lo) & (user_steps <= hi)), user_steps
    # pooled: the total over users is Binomial(30 steps, q)
    total = user_steps.sum()
    lo, hi = stats.binom.ppf([1e-5, 1 - 1e-5], 30 * steps, q)
    assert lo <= total <= hi
    # a record of a user with c > k records joins with probability q k / c
    for u in np.flatnonzero(counts > k):
        recs = np.flatnonzero(user_ids == 100 + 7 * u)
        p = q * k / counts[u]
        lo, hi = stats.binom.ppf([1e-6, 1 - 1e-6], steps, p)
        assert np.all((record_steps[recs] >= lo) & (record_steps[recs] <= hi))


def _fit_user_level(mode, jit=False, steps=3, physical=None):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 6)).astype(np.float32)
    y = rng.integers(0, 3, 60).astype(np.int32)
    user_ids = rng.integers(0, 20, 60)
    keras.utils.set_random_seed(1)
    model = dpk.make_private(sequential_model())
    opt = dpk.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1, gradient_mode=mode,
        num_microbatches=2 if mode == "microbatch" else None,
        max_physical_batch_size=physical,
    )
    model.compile(optimizer=opt, jit_compile=jit,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batches = tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, user_ids=user_ids,
                                         max_records_per_user=2, steps_per_epoch=steps, seed=3)
    model.fit(batches, epochs=1, verbose=0)
    return model, opt


@pytest.mark.parametrize("mode,jit,physical", [("ghost", True, None), ("vectorized", False, 4),
                                               ("microbatch", False, None)])
def test_fit_records_a_user_level_sampled_claim(mode, jit, physical):
    model, opt = _fit_user_level(mode, jit, physical=physical)
    entries = opt.ledger.samples()
    assert len(entries) == 3
    n_users = 20
    for e in entries:
        s = e.sampling
        assert (s.population_size, s.selection_probability, s.policy) == (n_users, 0.25, "poisson")
        assert (s.origin, s.unit, s.records_per_unit) == ("sampled", "user", 2)
        assert e.queries[0].l2_sensitivity == 1.0  # one user's clipped sum: C, not 2C
    assert np.all(np.isfinite(model.get_weights()[0]))


def test_user_level_statement_and_ledger_file_round_trip(tmp_path):
    _, opt = _fit_user_level("ghost")
    path = tmp_path / "user.ledger.json"
    opt.ledger.save(path)
    import json
    payload = json.loads(path.read_text())
    assert payload["version"] == 3
    again = tf_dp.PrivacyLedger.load(path).samples()
    assert again == opt.ledger.samples()
    text = str(tf_dp.accounting.compute_epsilon(path, delta=1e-5))
    assert "user-level" in text and "sampling performed by tf_dp" in text


def test_declared_sampling_is_recorded_as_declared_and_stated_so():
    model = dpk.make_private(sequential_model())
    opt = dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    # a Sampling that says "sampled" is still a declaration when the user makes it
    opt.set_sampling(tf_dp.data.Sampling(1000, 0.01, origin="sampled"))
    x = np.zeros((4, 6), np.float32)
    y = np.zeros(4, np.int32)
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)
    model.fit(ds, epochs=1, verbose=0)
    s = opt.ledger.samples()[0].sampling
    assert (s.origin, s.unit) == ("declared", "example")
    text = str(tf_dp.accounting.compute_epsilon(opt.ledger, delta=1e-5))
    assert "declared by the user, not checked" in text and "example-level" in text
    # arrays batched by fit: tf_dp derived the (shuffle) sampling from the arrays
    model.fit(x, y, batch_size=2, epochs=1, verbose=0)
    s = opt.ledger.samples()[-1].sampling
    assert (s.origin, s.policy) == ("sampled", "shuffle")


def test_a_user_with_k_records_costs_one_example_at_example_level():
    """Same n, q, sigma, steps: the user-level epsilon equals the example-level one, and both
    equal dp_accounting's RDP epsilon for a Poisson-subsampled Gaussian."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent

    n, q, sigma, steps, delta = 5000, 0.01, 1.1, 700, 1e-5
    query = (SumQueryEvent(l2_sensitivity=1.0, noise_stddev=sigma),)
    user = SampleEntry(SamplingEvent(n, q, origin="sampled", unit="user", records_per_unit=8),
                       query)
    example = SampleEntry(SamplingEvent(n, q, origin="sampled"), query)
    eps_user = tf_dp.accounting.compute_epsilon([(user, steps)], delta=delta)
    eps_example = tf_dp.accounting.compute_epsilon([(example, steps)], delta=delta)
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)),
                steps)
    oracle = acc.get_epsilon(delta)
    assert eps_user.epsilon == eps_example.epsilon
    np.testing.assert_allclose(eps_user.epsilon, oracle, rtol=2e-2)
    assert "user-level" in eps_user.assumptions and "example-level" in eps_example.assumptions


@pytest.mark.parametrize("kwargs,match", [
    (dict(user_ids=np.zeros(6)), "user_ids must be integers or strings"),
    (dict(user_ids=np.zeros(4, int)), r"user_ids must hold one id per record \(6\)"),
    (dict(user_ids=np.zeros((6, 1), int)), "user_ids must be a 1-D array"),
    (dict(user_ids=np.zeros(6, int), max_records_per_user=0), "max_records_per_user must be"),
    (dict(user_ids=np.zeros(6, int), max_records_per_user=None), "max_records_per_user must be"),
    (dict(max_records_per_user=2), "max_records_per_user is only used with user_ids"),
    (dict(user_ids=np.zeros(6, int), sampling_probability=1.5), r"sampling_probability must be in"),
    (dict(user_ids=np.zeros(6, int), sampling_probability=0.0), r"sampling_probability must be in"),
])
def test_bad_user_level_input_names_the_argument(kwargs, match):
    args = dict(sampling_probability=0.5, max_records_per_user=2)
    args.update(kwargs)
    if args.get("max_records_per_user") is None and "user_ids" not in args:
        args.pop("max_records_per_user")
    with pytest.raises(ValueError, match=match):
        tf_dp.data.poisson_batches(np.zeros((6, 2), np.float32), np.zeros(6), **args)


def test_cli_says_user_level_and_who_sampled(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
    from tf_dp.ledger.ledger_file import write_ledger_runs

    q = (SumQueryEvent(l2_sensitivity=1.0, noise_stddev=1.1),)
    user = SampleEntry(SamplingEvent(500, 0.05, origin="sampled", unit="user",
                                     records_per_unit=4), q)
    declared = SampleEntry(SamplingEvent(500, 0.05), q)
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    for entry, want in ((user, "user-level (one user's records, at most 4 per batch); "
                                "sampling performed by tf_dp"),
                        (declared, "example-level (one example); sampling declared "
                                   "by the user, not checked by tf_dp")):
        path = tmp_path / f"{entry.sampling.unit}.json"
        write_ledger_runs(path, [(entry, 100)])
        for fmt in ("text", "json"):
            p = subprocess.run(
                [sys.executable, "-m", "tf_dp.cli.compute_dp_sgd_privacy", f"--ledger={path}",
                 "--delta=1e-5", f"--format={fmt}"],
                capture_output=True, text=True, timeout=300, env=env)
            assert p.returncode == 0, p.stderr
            text = json.loads(p.stdout)["sampling"] if fmt == "json" else p.stdout
            assert want in text


@pytest.mark.parametrize("mode", ["ghost", "vectorized"])
def test_mirrored_strategy_clips_whole_users_on_each_replica(mode):
    """2 logical CPU devices vs one, noise 0, the same seeded user batches: the same weights
    (each replica gets whole user slots); one user-level event per global step."""
    from tests.test_distributed import _run

    r = _run("mirrored_user_level.py", mode)
    assert r["max_abs_update"] > 1e-3
    # helpers/mirrored_user_level.py: 4 steps of learning rate 0.5 on user-clipped means (clip
    # 0.3) of a 6-5-3 network, users of 3 records, up to 75 rows, 2 replicas; a user split over
    # the replicas or clipped per record moves the weights by O(0.5 x 0.3 / 25)
    atol = sgd_tolerance("float32", 4, 0.5, 0.3,
                         dense_gradient_terms([6, 5, 3]) + 3 + norm_terms(53) + 75 + 2 + 1, 2.0)
    assert r["max_abs_diff"] <= atol, (r["max_abs_diff"], atol)
    assert r["steps"] == [4, 4]
    assert r["claims"] == r["claims_one"]
    assert r["claims"] == [[25, 0.3, "sampled", "user", 3, pytest.approx(0.3, rel=1e-7)]]


def test_a_user_level_fit_after_an_example_level_fit_clips_per_user():
    """The train step traced for example-level clipping is not reused for user-level batches:
    with noise 0, an example-level fit followed by a user-level fit ends where a model that
    starts from the same weights and runs only the user-level fit ends."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 6)).astype(np.float32) * 3.0
    y = rng.integers(0, 3, 60).astype(np.int32)
    user_ids = rng.integers(0, 10, 60)

    def private():
        keras.utils.set_random_seed(1)
        model = dpk.make_private(sequential_model())
        model.compile(
            optimizer=dpk.DPKerasSGDOptimizer(l2_norm_clip=0.1, noise_multiplier=0.0,
                                              learning_rate=1.0, gradient_mode="ghost"),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    drawn = tf_dp.data.poisson_batches(x, y, sampling_probability=0.5, user_ids=user_ids,
                                       max_records_per_user=5, steps_per_epoch=2, seed=7)
    fixed = list(drawn.dataset.as_numpy_iterator())  # the same two batches for both models
    assert len({f[0].shape for f in fixed}) == 1

    def user_batches():
        ds = tf.data.Dataset.from_tensor_slices(
            tuple(np.stack([f[i] for f in fixed]) for i in range(3)))
        return dataclasses.replace(drawn, dataset=ds)

    a = private()
    a.fit(x, y, batch_size=20, epochs=1, steps_per_epoch=1, verbose=0)
    start = [w.copy() for w in a.get_weights()]
    a.fit(user_batches(), epochs=1, verbose=0)
    b = private()
    b.set_weights(start)
    b.fit(user_batches(), epochs=1, verbose=0)
    moved = max(float(np.max(np.abs(w - s))) for w, s in zip(b.get_weights(), start))
    assert moved > 1e-3
    # 2 steps of learning rate 1 on clipped means (clip 0.1) of users of up to 5 records, batches
    # of up to 60 rows; the example-level trace reused would clip records, not users: O(0.1)
    atol = sgd_tolerance("float32", 2, 1.0, 0.1,
                         dense_gradient_terms([6, 5, 3]) + 5 + norm_terms(53) + 60 + 1,
                         weight_scale=2.0 + 2 * 0.1)
    for wa, wb in zip(a.get_weights(), b.get_weights()):
        np.testing.assert_allclose(wa, wb, rtol=0, atol=atol)
