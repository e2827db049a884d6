"""Truncated Poisson and balls-in-bins under MultiWorkerMirroredStrategy: 2 worker processes on
localhost (TF_CONFIG, tests/helpers/multi_worker_run.py). All workers draw one global selection
per step from a shared seed and each trains on its share: the shares of a step are disjoint, their
union is one truncated sample (at most B examples) or one batch of a balls-in-bins pass (every
example exactly once per pass), the ledger counts the global population, rate and B, and the
weights equal one process training on the union (noise 0; tolerance of tests/test_multi_worker.py).
"""

import numpy as np

import tf_dp
from tests.test_multi_worker import C32, N, STEPS, WEIGHT_ATOL, _cluster, _reference

X = np.random.default_rng(0).normal(size=(N, 12)).astype("float32")  # helpers' data()


def _examples(batch):
    bx, _, bw = (np.asarray(t) for t in batch)
    real = bx[bw > 0]
    rows = [int(np.flatnonzero((X == v).all(axis=1))[0]) for v in real]
    assert len(set(rows)) == len(rows)
    return set(rows)


def _check(reports, policy, q, bound):
    for r in reports:
        assert r["iterations"] == STEPS
        assert r["ledger"] == [[N, q, policy, C32, 0.0, "example", None]] * STEPS
        assert r["bounds"] == [bound] * STEPS
        assert r["same_batches_when_redrawn"]
    union = []
    for s in range(STEPS):  # the pass fit trained on: the last STEPS batches of each worker
        shares = [_examples(r["seen"][-STEPS:][s]) for r in reports]
        assert not shares[0] & shares[1]  # each example in at most one replica
        union.append(shares[0] | shares[1])
    for a, b in zip(reports[0]["after"], reports[1]["after"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    return union


def test_two_workers_share_one_global_selection_per_step(tmp_path):
    """One cluster runs both selections in turn (a cluster costs 1-2 minutes)."""
    both = _cluster(tmp_path, "vectorized", sigma=0.0, phase="selections")
    _truncated([r["truncated"] for r in both])
    _balls_in_bins([r["balls_in_bins"] for r in both])


def _truncated(reports):
    q, b = 0.1, 16  # as in helpers/multi_worker_run.py
    union = _check(reports, "truncated_poisson", q, b)
    assert all(len(u) <= b for u in union) and any(len(u) == b for u in union)
    claim = tf_dp.data.Sampling(N, q, "truncated_poisson", max_batch_size=b)
    for got, want in zip(reports[0]["after"], _reference(reports, claim)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=WEIGHT_ATOL)


def _balls_in_bins(reports):
    union = _check(reports, "balls_in_bins", 1 / STEPS, None)
    assert sorted(i for u in union for i in u) == list(range(N))  # each example once per pass
    for r in reports:
        assert r["pass_starts"] == [True] + [False] * (STEPS - 1)
    claim = tf_dp.data.Sampling(N, 1 / STEPS, "balls_in_bins")
    for got, want in zip(reports[0]["after"], _reference(reports, claim)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=WEIGHT_ATOL)
