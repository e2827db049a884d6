"""User-level Poisson sampling from random-access sources: poisson_sample(..., user_ids=...).

The sources hold records whose content encodes their index (tests.test_data_sources), so a test
can tell which records a batch holds, whose they are, and check them against an independent read.
"""

import numpy as np
import pytest
import tensorflow as tf
from scipy import stats

import tf_dp
from tests.test_data_sources import _model, _parse, _records, _source, _write_tfrecords
from tf_dp.data import ArraySource, TFRecordSource, poisson_sample

# 12 users with 1..6 records each (arbitrary integer ids), records shuffled among users
COUNTS = np.arange(12) % 6 + 1
N = int(COUNTS.sum())


def _user_ids(tmp_path, seed=0):
    ids = np.repeat(np.arange(12) * 5 + 1000, COUNTS)
    ids = ids[np.random.default_rng(seed).permutation(N)]
    mm = np.memmap(tmp_path / "users.i64", np.int64, "w+", shape=ids.shape)
    mm[:] = ids
    mm.flush()
    return ids, np.memmap(tmp_path / "users.i64", np.int64, "r", shape=ids.shape)


class _Logged:
    """A source that keeps the indices of every read (to check only sampled records are read)."""

    def __init__(self, source):
        self.source, self.reads = source, []

    def __len__(self):
        return len(self.source)

    def read(self, indices):
        self.reads.append(np.array(indices))
        return self.source.read(indices)


@pytest.mark.parametrize("kind", ["memmap", "tfrecord"])
def test_users_participate_binomially_with_at_most_k_of_their_records(kind, tmp_path):
    q, k, steps = 0.3, 3, 300
    ids, ids_on_disk = _user_ids(tmp_path)
    x, _ = _records(N)
    source = _Logged(_source(kind, tmp_path, N))
    batches = poisson_sample(source, sampling_probability=q, steps_per_epoch=steps, seed=5,
                             user_ids=ids_on_disk, max_records_per_user=k)
    assert batches.sampling == tf_dp.data.Sampling(12, q, "poisson", "sampled", unit="user",
                                                   records_per_unit=k)
    user_of = {1000 + 5 * u: u for u in range(12)}
    user_steps = np.zeros(12, int)
    read_back = []
    for bx, by, bw in batches.dataset.as_numpy_iterator():
        assert len(bw) % k == 0 and len(bw) >= batches.max_batch_size * k
        real = bw > 0
        # the rows hold the source's records at the sampled indices (y[i] = i), padding is inert
        np.testing.assert_array_equal(bx[real], x[by[real]])
        np.testing.assert_array_equal(bx[~real], 0)
        np.testing.assert_array_equal(by[~real], 0)
        seen = set()
        for slot_y, slot_real in zip(by.reshape(-1, k), real.reshape(-1, k)):
            got = slot_y[slot_real]
            if len(got) == 0:
                continue
            assert slot_real[: len(got)].all()  # real rows first in the slot
            owners = {user_of[int(ids[i])] for i in got}
            assert len(owners) == 1  # a slot holds one user's records
            u = owners.pop()
            assert u not in seen  # one slot per user
            seen.add(u)
            assert len(set(got.tolist())) == len(got) == min(k, COUNTS[u])
            user_steps[u] += 1
        if real.any():
            read_back.append(np.sort(by[real]))
    # only the sampled records were read: one read per non-empty batch (after the element-spec
    # read of one record), exactly those records
    asked = [np.sort(r) for r in source.reads[1:]]
    assert len(asked) == len(read_back)
    for a, b in zip(asked, read_back):
        np.testing.assert_array_equal(a, b)
    # each user's participations ~ Binomial(steps, q): two-sided 1e-4 over all 12 users
    lo, hi = stats.binom.ppf([1e-4 / 24, 1 - 1e-4 / 24], steps, q)
    assert np.all((user_steps >= lo) & (user_steps <= hi)), user_steps
    lo, hi = stats.binom.ppf([1e-5, 1 - 1e-5], 12 * steps, q)  # pooled: Binomial(12 steps, q)
    assert lo <= user_steps.sum() <= hi


def test_fit_on_tfrecord_files_with_user_ids_records_users_and_k(tmp_path):
    q, k = 0.25, 2
    ids, ids_on_disk = _user_ids(tmp_path)

    def parse(serialized):
        bx, by = _parse(serialized)
        return bx / N, by % 3

    source = TFRecordSource(_write_tfrecords(tmp_path, N, files=3), parse_fn=parse)
    model = _model()
    batches = poisson_sample(source, sampling_probability=q, steps_per_epoch=3, seed=2,
                             user_ids=ids_on_disk, max_records_per_user=k)
    model.fit(batches, epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 6 == int(model.optimizer.iterations.numpy())
    n_users = len(set(ids.tolist()))  # counted here, independently of UserIndex
    assert N == sum(1 for _ in tf.data.TFRecordDataset(source._files.paths))
    for e in entries:
        s = e.sampling
        assert (s.population_size, s.selection_probability, s.policy) == (n_users, q, "poisson")
        assert (s.origin, s.unit, s.records_per_unit) == ("sampled", "user", k)
        assert e.queries[0].l2_sensitivity == 1.0  # one user's clipped sum


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"user_ids": np.zeros(N - 1, np.int64), "max_records_per_user": 2},
         r"user_ids must hold one id per record \(%d\), got %d" % (N, N - 1)),
        ({"user_ids": np.zeros(N, np.float32), "max_records_per_user": 2},
         "user_ids must be integers or strings"),
        ({"user_ids": np.zeros((N, 1), np.int64), "max_records_per_user": 2},
         "user_ids must be a 1-D array"),
        ({"user_ids": np.zeros(N, np.int64)}, "max_records_per_user must be an integer >= 1"),
        ({"user_ids": np.zeros(N, np.int64), "max_records_per_user": 0},
         "max_records_per_user must be an integer >= 1"),
        ({"max_records_per_user": 2}, "max_records_per_user is only used with user_ids"),
        ({"user_ids": np.zeros(N, np.int64), "max_records_per_user": 2, "num_shards": 2},
         r"num_shards must be <= the number of users \(1\) with user_ids, got 2"),
    ],
)
def test_bad_user_arguments_fail_before_any_read(kwargs, match):
    x, y = _records(N)
    source = _Logged(ArraySource(x, y))
    with pytest.raises(ValueError, match=match):
        poisson_sample(source, sampling_probability=0.2, **kwargs)
    assert source.reads == []
