"""Private ``fit`` under MultiWorkerMirroredStrategy: 2 worker processes on localhost (TF_CONFIG).

Each worker Poisson-samples its own shard; a global step must process exactly the union of the
workers' samples, noise it once and apply the same update on every worker. Reference: one process
training the same model on the union of the two workers' (seeded, re-drawable) batches.
"""

import json
import os
import socket
import subprocess
import sys

import keras
import numpy as np
import tensorflow as tf

import tf_dp
from tests.helpers.tolerance import dense_gradient_terms, norm_terms, sgd_tolerance

HERE = os.path.dirname(os.path.abspath(__file__))
N, Q, STEPS, CLIP = 200, 0.05, 3, 0.3  # as in helpers/multi_worker_run.py
C32 = float(np.float32(CLIP))  # the ledger holds the float32 values the step used
#: weights of 2 workers' all-reduced step vs one process (tests/helpers/tolerance.py): STEPS
#: steps of learning rate 0.5 on clipped means (clip 0.3) of a 12-8-3 network (131 parameters),
#: sums of up to N rows and 2 workers; |w| <= 1 + STEPS x 0.15. A worker's sum counted twice or
#: missing moves the weights by O(0.5 x 0.3 / 2), far above this.
WEIGHT_ATOL = sgd_tolerance("float32", STEPS, 0.5, CLIP,
                            dense_gradient_terms([12, 8, 3]) + norm_terms(131) + N + 2 + 1,
                            weight_scale=1.0 + STEPS * 0.15)


def _free_ports(k):
    socks = [socket.socket() for _ in range(k)]
    for s in socks:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _cluster(tmp_path, mode, sigma, phase="train"):
    ports = ",".join(str(p) for p in _free_ports(2))
    env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE), TF_CPP_MIN_LOG_LEVEL="2")
    script = os.path.join(HERE, "helpers", "multi_worker_run.py")
    procs, outs = [], []
    for i in range(2):
        out = tmp_path / f"worker{i}.json"
        outs.append(out)
        procs.append(subprocess.Popen(
            [sys.executable, script, str(i), ports, str(out), mode, str(sigma), phase], env=env,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads(o.read_text()) for o in outs]


def _reference(reports, sampling=None):
    """The same model trained in one process on the union of the workers' batches (declared
    with ``sampling``, default example-level ``(N, Q)``)."""
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([
        keras.Input((12,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=CLIP, noise_multiplier=0.0, learning_rate=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    np.testing.assert_allclose(
        np.concatenate([np.ravel(w) for w in model.get_weights()]),
        np.concatenate([np.ravel(w) for w in reports[0]["before"]]), rtol=0, atol=0)
    union = []
    for s in range(STEPS):
        parts = [r["seen"][-STEPS:][s] for r in reports]  # the pass fit trained on
        union.append(tuple(np.concatenate([np.asarray(p[k]) for p in parts]) for k in range(3)))
    dataset = tf.data.Dataset.from_generator(
        lambda: iter(union),
        output_signature=(tf.TensorSpec([None, 12], tf.float32), tf.TensorSpec([None], tf.int32),
                          tf.TensorSpec([None], tf.float32)))
    model.optimizer.set_sampling(sampling or tf_dp.data.Sampling(N, Q, "poisson"))
    model.fit(dataset, epochs=1, steps_per_epoch=STEPS, verbose=0, shuffle=False)
    return [v.numpy() for v in model.trainable_variables]


def test_two_workers_train_on_the_union_of_their_poisson_samples(tmp_path):
    reports = _cluster(tmp_path, "ghost", sigma=0.0)
    for r in reports:
        assert r["same_batches_when_redrawn"]
        # The seeded sampler draws new batches at every pass over it. Before training, the
        # batch-mixing probe read the start of one pass (the sampler's first, as drawn outside
        # fit), then fit iterated it twice (one pass to build, one to train): the second pass
        # drawn outside fit, then a third that trained (the last STEPS batches).
        probe = len(r["seen"]) - len(r["second_pass"]) - STEPS
        assert 1 <= probe <= len(r["batches"])
        assert r["seen"][:probe] == r["batches"][:probe]
        assert r["seen"][probe:probe + len(r["second_pass"])] == r["second_pass"]
        assert r["iterations"] == STEPS
        # one sampling event per global step, with the global population and rate
        assert r["ledger"] == [[N, Q, "poisson", C32, 0.0, "example", None]] * STEPS
        assert all(np.isfinite(r["loss"]))
    # every worker ends with the same weights ...
    for a, b in zip(reports[0]["after"], reports[1]["after"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # ... those of one process training on the union of the workers' samples
    assert any(np.asarray(r["seen"][-1][2]).sum() > 0 for r in reports)
    for got, want in zip(reports[0]["after"], _reference(reports)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=WEIGHT_ATOL)


def test_two_workers_sample_users_by_shard_and_train_on_their_union(tmp_path):
    """User-level: each worker samples its own users (position modulo 2); the step trains on the
    union of the workers' user slots, and every worker records the whole population of users."""
    reports = _cluster(tmp_path, "ghost", sigma=0.0, phase="users")
    users, k, q = 40, 2, 4 * Q  # as in helpers/multi_worker_run.py
    user_of = np.random.default_rng(5).integers(0, users, N)
    x = np.random.default_rng(0).normal(size=(N, 12)).astype("float32")
    keys = np.unique(user_of)
    assert len(keys) == users
    owners = []
    for w, r in enumerate(reports):
        assert r["iterations"] == STEPS
        assert r["ledger"] == [[users, q, "poisson", C32, 0.0, "user", k]] * STEPS
        mine = set()
        for bx, _, bw in r["seen"][-STEPS:]:  # the pass fit trained on
            bx, bw = np.asarray(bx), np.asarray(bw)
            assert len(bw) % k == 0
            for slot_x, slot_w in zip(bx.reshape(-1, k, 12), bw.reshape(-1, k)):
                rows = [int(np.flatnonzero((x == v).all(axis=1))[0]) for v in slot_x[slot_w > 0]]
                assert len({int(user_of[i]) for i in rows}) <= 1  # one user per slot
                mine |= {int(user_of[i]) for i in rows}
        # worker w samples only the users at positions w, w + 2, ... of the sorted ids
        assert all(int(np.searchsorted(keys, u)) % 2 == w for u in mine)
        owners.append(mine)
    assert not owners[0] & owners[1] and owners[0] | owners[1]
    for a, b in zip(reports[0]["after"], reports[1]["after"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    claim = tf_dp.data.Sampling(users, q, "poisson", unit="user", records_per_unit=k)
    for got, want in zip(reports[0]["after"], _reference(reports, claim)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=WEIGHT_ATOL)


def test_backup_and_restore_resumes_every_worker_with_its_ledger(tmp_path):
    """With noise: the workers still end with exactly the same weights, because the noise of one
    replica is broadcast (independent draws per worker would make them differ)."""
    reports = _cluster(tmp_path, "vectorized", sigma=1.0, phase="backup")
    for r in reports:
        assert r["crashed_at"] == STEPS  # the first epoch ran, the second never started
        assert r["iterations"] == 2 * STEPS  # resumed at epoch 2, not from the start
        assert r["ledger"] == [[N, Q, "poisson"]] * (2 * STEPS)
    for a, b in zip(reports[0]["after"], reports[1]["after"]):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
