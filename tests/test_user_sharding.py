"""User-level Poisson sampling: O(sampled) work per step, and sharding by user for multi-worker
training (worker w samples the users whose position is w modulo num_shards).

Every count here is made from the emitted rows (the record index stored in x) and the user id of
each record, independently of the sampler's index.
"""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tf_dp.data import ArraySource, poisson_batches, poisson_sample

N_USERS, K, Q, STEPS = 24, 2, 0.25, 300
RECORDS = np.arange(N_USERS) % 5 + 1  # user u has 1..5 records


def _data(seed=0):
    ids = np.repeat(np.arange(N_USERS) * 11 + 5, RECORDS)  # arbitrary integer ids
    ids = ids[np.random.default_rng(seed).permutation(len(ids))]
    x = np.arange(len(ids), dtype=np.float32)[:, None]  # x = the record's index
    y = np.zeros(len(ids), np.int32)
    return x, y, ids


def _batches(kind, x, y, ids, num_shards, shard_index, steps=STEPS, q=Q, seed=7):
    args = dict(sampling_probability=q, steps_per_epoch=steps, seed=seed,
                user_ids=ids, max_records_per_user=K, num_shards=num_shards,
                shard_index=shard_index)
    if kind == "arrays":
        return poisson_batches(x, y, **args)
    return poisson_sample(ArraySource(x, y), **args)


def _users_per_step(batches, ids):
    """For each step: {user id: [its records in the batch]}, checking the slot layout."""
    steps = []
    for bx, _, bw in batches.dataset.as_numpy_iterator():
        assert len(bw) % K == 0
        users = {}
        for slot_x, slot_w in zip(bx[:, 0].reshape(-1, K), bw.reshape(-1, K)):
            real = slot_x[slot_w > 0].astype(np.int64)
            assert np.all(slot_w[len(real):] == 0)  # real rows first, then padding
            if len(real) == 0:
                continue
            owners = set(ids[real].tolist())
            assert len(owners) == 1  # one user per slot
            owner = owners.pop()
            assert owner not in users  # one slot per user
            users[owner] = real.tolist()
        steps.append(users)
    return steps


def _check_user_records(steps, ids):
    for users in steps:
        for owner, real in users.items():
            c = int(np.sum(ids == owner))
            assert len(set(real)) == len(real) == min(K, c)  # at most k, distinct, all if <= k


def _check_binomial_counts(steps, ids):
    keys = np.unique(ids)
    counts = np.array([sum(key in users for users in steps) for key in keys])
    # each user's participations ~ Binomial(STEPS, q): two-sided, Bonferroni over the users
    lo, hi = stats.binom.ppf([1e-4 / (2 * N_USERS), 1 - 1e-4 / (2 * N_USERS)], STEPS, Q)
    assert np.all((counts >= lo) & (counts <= hi)), counts
    # pooled: users sampled over all steps ~ Binomial(STEPS * n_users, q) (mean q n_users / step)
    lo, hi = stats.binom.ppf([1e-5, 1 - 1e-5], STEPS * N_USERS, Q)
    assert lo <= counts.sum() <= hi
    # the sample size of a step ~ Binomial(n_users, q): its variance too (chi-square bounds)
    sizes = np.array([len(users) for users in steps])
    var = N_USERS * Q * (1 - Q)
    lo, hi = stats.chi2.ppf([1e-5, 1 - 1e-5], STEPS) / STEPS * var
    assert lo <= np.mean((sizes - N_USERS * Q) ** 2) <= hi


@pytest.mark.parametrize("kind", ["arrays", "source"])
def test_unsharded_user_participation_is_binomial(kind):
    x, y, ids = _data()
    b = _batches(kind, x, y, ids, 1, 0)
    assert b.tf_dp_sampling == (N_USERS, Q) and b.records_per_user == K
    steps = _users_per_step(b, ids)
    assert len(steps) == STEPS
    _check_user_records(steps, ids)
    _check_binomial_counts(steps, ids)


@pytest.mark.parametrize("kind", ["arrays", "source"])
def test_sharded_users_partition_and_union_is_one_poisson_sample(kind):
    x, y, ids = _data(1)
    shards = 3
    per_shard = []
    for w in range(shards):
        b = _batches(kind, x, y, ids, shards, w)
        # every worker declares the whole population of users and q: the global q * n_users
        assert b.tf_dp_sampling == (N_USERS, Q) and b.num_shards == shards
        assert b.sampling.unit == "user" and b.sampling.records_per_unit == K
        assert b.expected_batch_size == Q * N_USERS
        per_shard.append(_users_per_step(b, ids))
    seen_on = {}
    union = []
    for s in range(STEPS):
        step = {}
        for w in range(shards):
            for owner, real in per_shard[w][s].items():
                assert owner not in step  # never sampled by two workers at one step
                assert seen_on.setdefault(owner, w) == w  # a user lives on one shard
                step[owner] = real
        union.append(step)
    # the shards partition the users: every user is on exactly one shard, w = position % W
    keys = np.unique(ids)
    assert {int(keys[i]): i % shards for i in range(N_USERS)} == seen_on
    _check_user_records(union, ids)
    _check_binomial_counts(union, ids)


class _CountingGenerator(np.random.Generator):
    """Counts the random numbers asked of numpy (the size of every draw)."""

    drawn = 0

    def _count(self, size):
        _CountingGenerator.drawn += int(np.prod(size)) if size is not None else 1

    def binomial(self, n, p, size=None):
        self._count(size)
        return super().binomial(n, p, size)

    def choice(self, a, size=None, replace=True, p=None, axis=0, shuffle=True):
        self._count(size)
        return super().choice(a, size, replace, p, axis, shuffle)

    def random(self, size=None, dtype=np.float64, out=None):
        self._count(size)
        return super().random(size, dtype, out)

    def integers(self, low, high=None, size=None, dtype=np.int64, endpoint=False):
        self._count(size)
        return super().integers(low, high, size, dtype, endpoint)

    def permutation(self, x, axis=0):
        self._count(x if np.ndim(x) == 0 else len(x))
        return super().permutation(x, axis)


@pytest.mark.parametrize("kind", ["arrays", "source"])
def test_per_step_random_draws_grow_with_the_sample_not_with_the_users(kind, monkeypatch):
    """200,000 users, q = 1e-4 (20 users a step, 2 records each): the random numbers drawn per
    step (numpy's and TensorFlow's uniforms) stay of the order of the sampled records."""
    n_users, q, steps = 200_000, 1e-4, 5
    ids = np.repeat(np.arange(n_users), 2)
    x = np.arange(len(ids), dtype=np.float32)[:, None]
    y = np.zeros(len(ids), np.int32)
    uniforms = tf.Variable(0, dtype=tf.int64)
    stateless_uniform = tf.random.stateless_uniform

    def counting_uniform(shape, *args, **kwargs):
        out = stateless_uniform(shape, *args, **kwargs)
        with tf.control_dependencies([uniforms.assign_add(tf.size(out, out_type=tf.int64))]):
            return tf.identity(out)

    monkeypatch.setattr(tf.random, "stateless_uniform", counting_uniform)
    monkeypatch.setattr(np.random, "Generator", _CountingGenerator)
    _CountingGenerator.drawn = 0
    args = dict(sampling_probability=q, steps_per_epoch=steps, seed=3, user_ids=ids,
                max_records_per_user=K)
    if kind == "arrays":
        b = poisson_batches(x, y, **args)
    else:
        b = poisson_sample(ArraySource(x, y), **args)
    _CountingGenerator.drawn = 0  # what building the sampler drew is not per-step work
    uniforms.assign(0)
    sampled = sum(int(np.count_nonzero(bw)) for _, _, bw in b.dataset.as_numpy_iterator())
    drawn = _CountingGenerator.drawn + int(uniforms.numpy())
    # per step: one binomial, the sampled users' indices, one key per sampled record
    # (expected 1 + 20 + 40); 20 x that mean over 5 steps is far below one uniform per user
    assert sampled > 0
    assert drawn <= 20 * steps * (1 + 3 * n_users * q), drawn


@pytest.mark.parametrize("kind", ["arrays", "source"])
@pytest.mark.parametrize(
    "shards, match",
    [
        (dict(num_shards=25, shard_index=0),
         r"num_shards must be <= the number of users \(24\) with user_ids, got 25"),
        (dict(num_shards=2, shard_index=2), r"shard_index must be an integer in \[0, num_shards=2\)"),
        (dict(num_shards=2, shard_index=-1),
         r"shard_index must be an integer in \[0, num_shards=2\)"),
        (dict(num_shards=0, shard_index=0), "num_shards must be None or an integer >= 1"),
    ],
)
def test_bad_shards_with_user_ids_name_the_argument(kind, shards, match):
    x, y, ids = _data()

    class Logged(ArraySource):
        reads = 0

        def read(self, indices):
            Logged.reads += 1
            return super().read(indices)

    args = dict(sampling_probability=Q, user_ids=ids, max_records_per_user=K, **shards)
    with pytest.raises(ValueError, match=match):
        if kind == "arrays":
            poisson_batches(x, y, **args)
        else:
            poisson_sample(Logged(x, y), **args)
    assert Logged.reads == 0


@pytest.mark.parametrize("mode", ["ghost", "vectorized", "microbatch"])
def test_a_step_with_no_sampled_user_is_finite_and_adds_only_noise(mode):
    """A worker with no sampled user gives an all-padding batch: its per-user clipping adds
    exactly 0 (with sigma = 0 the weights do not move) and nothing becomes NaN."""
    import keras

    x, y, ids = _data()
    x = np.tile(x, (1, 3)) / len(x)
    b = poisson_batches(x, y, sampling_probability=1e-9, steps_per_epoch=2, seed=0,
                        user_ids=ids, max_records_per_user=K)
    assert all(not bw.any() for _, _, bw in b.dataset.as_numpy_iterator())  # no user sampled
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((3,)), keras.layers.Dense(4, activation="tanh"), keras.layers.Dense(2)]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=0.0, learning_rate=0.5, gradient_mode=mode,
        num_microbatches=2 if mode == "microbatch" else None),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    before = [w.copy() for w in model.get_weights()]
    model.fit(b, epochs=1, verbose=0)
    assert int(model.optimizer.iterations.numpy()) == 2
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


class _OneWorkerTwoReplicas:
    """Stands in for a worker of a multi-worker strategy with two local replicas: hands
    ``distribute_poisson_batches``'s dataset function the input context such a worker gets."""

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        return dataset_fn(tf.distribute.InputContext(
            num_input_pipelines=1, input_pipeline_id=0, num_replicas_in_sync=2))


@pytest.mark.parametrize("unit_rows", [1, 2])
def test_each_step_splits_into_one_piece_per_local_replica_even_when_it_overflows(unit_rows):
    """A worker's sample may exceed max_batch_size (it is never truncated). Its local replicas
    must still get exactly one piece each of that step's sample, in whole slots: a piece
    spilling into the next global step would join two steps' samples in one update (a record
    then in a step with probability about 2q, above the recorded q)."""
    from tf_dp.keras.multi_worker import distribute_poisson_batches

    m = 4 * unit_rows  # max_batch_size in rows
    sizes = [m, m + 2 * unit_rows, m, m + 4 * unit_rows, m]  # steps 1 and 3 overflow
    batches = []
    for step, rows in enumerate(sizes):
        real = rows - unit_rows  # a padding slot at the end of each batch
        x = np.where(np.arange(rows) < real, 100 * step + np.arange(rows), -1).astype(np.float32)
        batches.append((x[:, None], np.zeros(rows, np.int32), (x >= 0).astype(np.float32)))
    dataset = tf.data.Dataset.from_generator(lambda: iter(batches), output_signature=(
        tf.TensorSpec([None, 1], tf.float32), tf.TensorSpec([None], tf.int32),
        tf.TensorSpec([None], tf.float32)))
    pieces = list(distribute_poisson_batches(_OneWorkerTwoReplicas(), dataset, m, unit_rows)
                  .as_numpy_iterator())
    assert len(pieces) == 2 * len(sizes)  # one element per local replica and global step
    for step, (bx, _, bw) in enumerate(batches):
        a, b = pieces[2 * step], pieces[2 * step + 1]
        assert len(a[2]) == len(b[2]) and len(a[2]) % unit_rows == 0  # equal, whole slots
        got = np.concatenate([a[0][a[2] > 0, 0], b[0][b[2] > 0, 0]])
        np.testing.assert_array_equal(got, bx[bw > 0, 0])  # exactly this step's sample
