"""Every way of training records where each pass over the data starts, and the accountants count
what the records really paid.

The independent count: a spy wrapped around the model's DP ``train_step`` adds one to a
per-record counter (record ids ride in the first input column) for every record of every batch
that ran. Each epsilon the ledger gives is compared with the epsilon of the worst record's real
participations, computed by ``dp_accounting`` (never with the ledger's own numbers).
"""

from __future__ import annotations

import math

import keras
import numpy as np
import pytest
import tensorflow as tf

import tf_dp
import tf_dp.keras as dpk
from tf_dp.accounting import compute_epsilon

N, BATCH, Z, DELTA = 20, 5, 2.0, 1e-5


def _data(n=N):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    x[:, 0] = np.arange(n)  # the record id (the model sees it as one more feature)
    y = (x[:, 1] > 0).astype(np.int32)
    return x, y


def _model(optimizer, jit_compile=False):
    keras.utils.set_random_seed(1)
    model = dpk.make_private(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    model.compile(optimizer=optimizer, jit_compile=jit_compile,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    counts = tf.Variable(tf.zeros([N], tf.int32), trainable=False)
    dp_step = model.train_step

    def spy(data):
        ids = tf.cast(tf.reshape(data[0][:, 0], [-1]), tf.int32)
        counts.scatter_nd_add(ids[:, None], tf.ones_like(ids))
        return dp_step(data)

    model.train_step = spy
    model._tf_dp_counts = counts
    return model


def _gaussian_epsilon(noise_multiplier, count):
    """Epsilon of ``count`` full-batch Gaussian mechanisms (dp_accounting, RDP)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rpa

    accountant = rpa.RdpAccountant()
    accountant.compose(dp_event.GaussianDpEvent(noise_multiplier), count)
    return accountant.get_epsilon(DELTA)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_several_fits_that_end_mid_epoch_count_every_participation(jit_compile):
    """Issue repro: three ``fit(..., steps_per_epoch=2)`` on n=20, batch 5 (4 steps an epoch)."""
    x, y = _data()
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z), jit_compile)
    for _ in range(3):
        model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0)
    worst = int(model._tf_dp_counts.numpy().max())
    # with this seed a record really is in a batch of each of the three fits
    assert worst == 3
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 6
    # Replace-one adjacency: a participation moves the sum by 2C, i.e. noise multiplier Z / 2.
    reference = _gaussian_epsilon(Z / 2, worst)
    ours = compute_epsilon(entries, DELTA, "rdp")
    assert ours.epsilon >= reference * (1 - 1e-3)
    assert [e.sampling.pass_start for e in entries] == [True, False] * 3
    # and the count is the passes that ran, not more: mu-GDP of 3 Gaussians exactly
    assert compute_epsilon(entries, DELTA, "gdp").mu == pytest.approx(math.sqrt(3) * 2 / Z)


def test_stopped_fits_each_start_a_new_pass():
    x, y = _data()
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z))

    class StopAfterTwo(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 1:
                self.model.stop_training = True

    for _ in range(3):
        model.fit(x, y, batch_size=BATCH, epochs=3, callbacks=[StopAfterTwo()], verbose=0)
    assert model.optimizer.ledger.num_samples == 6
    worst = int(model._tf_dp_counts.numpy().max())
    assert worst == 3  # with this seed a record is in a batch of each stopped fit
    entries = model.optimizer.ledger.samples()
    ours = compute_epsilon(entries, DELTA, "rdp")
    assert ours.epsilon >= _gaussian_epsilon(Z / 2, worst) * (1 - 1e-3)


def test_ftrl_tree_restarts_with_each_pass():
    """DP-FTRL: each fit's tree holds each record in at most one leaf, and the ledger's epsilon
    covers the worst record's trees (dp_accounting's tree-aggregation event)."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import rdp_privacy_accountant as rpa

    x, y = _data()
    optimizer = dpk.DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=Z, learning_rate=0.1)
    model = _model(optimizer)
    leaves = {}  # (tree, record) -> leaves

    class Spy(keras.callbacks.Callback):
        tree = -1

        def on_train_batch_begin(self, batch, logs=None):
            self.before = model._tf_dp_counts.numpy().copy()

        def on_train_batch_end(self, batch, logs=None):
            if optimizer.tree_step == 1:  # this step was a new tree's first
                Spy.tree += 1
            for r in np.flatnonzero(model._tf_dp_counts.numpy() - self.before):
                leaves[(Spy.tree, r)] = leaves.get((Spy.tree, r), 0) + 1

    for _ in range(3):
        model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=2, verbose=0,
                  callbacks=[Spy()])
    assert Spy.tree == 2  # one tree per fit
    assert max(leaves.values()) == 1
    per_record = np.bincount([r for (_, r) in leaves], minlength=N)
    worst = int(per_record.max())
    accountant = rpa.RdpAccountant(neighboring_relation=rpa.NeighborRel.REPLACE_SPECIAL)
    # replace-one: a leaf moves by 2C (tf_dp's adjacency), i.e. noise multiplier Z / 2
    accountant.compose(dp_event.SingleEpochTreeAggregationDpEvent(Z / 2, [2]), worst)
    reference = accountant.get_epsilon(DELTA)
    ours = compute_epsilon(optimizer.ledger.samples(), DELTA, "rdp")
    assert ours.epsilon >= reference * (1 - 1e-3)


def test_train_on_batch_needs_a_declaration():
    x, y = _data()
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z))
    with pytest.raises(ValueError, match="train_on_batch of a private model needs a sampling"):
        model.train_on_batch(x[:BATCH], y[:BATCH])
    assert model.optimizer.ledger.num_samples == 0
    # a Poisson fit's declaration does not outlive the fit
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.25, seed=0), epochs=1,
              verbose=0)
    recorded = model.optimizer.ledger.num_samples
    with pytest.raises(ValueError, match="needs a sampling declaration"):
        model.train_on_batch(x, y)
    assert model.optimizer.ledger.num_samples == recorded


def test_train_on_batch_charges_each_call_as_a_pass_and_averages_over_the_batch():
    x, y = _data()
    clip, lr = 0.5, 0.25
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=clip, noise_multiplier=0.0,
                                           learning_rate=lr))
    model.optimizer.set_sampling(N, BATCH / N, "shuffle")
    kernel, bias = (v.numpy() for v in model.trainable_variables)
    # the mean clipped gradient, from per-example gradients computed here
    per_example = []
    for i in range(BATCH):
        kv, bv = tf.Variable(kernel), tf.Variable(bias)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                y[i:i + 1], x[i:i + 1] @ kv + bv))
        g = [t.numpy() for t in tape.gradient(loss, [kv, bv])]
        norm = math.sqrt(sum(float(np.sum(t * t)) for t in g))
        per_example.append([t * min(1.0, clip / norm) for t in g])
    mean = [sum(p[j] for p in per_example) / BATCH for j in range(2)]
    model.train_on_batch(x[:BATCH], y[:BATCH])
    new_kernel, new_bias = (v.numpy() for v in model.trainable_variables)
    np.testing.assert_allclose(new_kernel, kernel - lr * mean[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new_bias, bias - lr * mean[1], rtol=1e-5, atol=1e-6)

    # three calls: each may reuse any record, so each is a full pass
    noisy = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z))
    noisy.optimizer.set_sampling(N, BATCH / N, "shuffle")
    for _ in range(3):
        noisy.train_on_batch(x[:BATCH], y[:BATCH])
    assert int(noisy._tf_dp_counts.numpy().max()) == 3
    ours = compute_epsilon(noisy.optimizer.ledger.samples(), DELTA, "rdp")
    assert ours.epsilon >= _gaussian_epsilon(Z / 2, 3) * (1 - 1e-3)


@pytest.mark.parametrize("jit_compile", [False, True])
def test_dataset_of_unknown_length_records_only_the_steps_that_ran(jit_compile):
    x, y = _data()
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda a, b: True).batch(BATCH)
    assert int(dataset.cardinality()) == tf.data.UNKNOWN_CARDINALITY
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z), jit_compile)
    model.optimizer.set_sampling(N, BATCH / N, "shuffle")
    model.fit(dataset, epochs=3, verbose=0)
    counts = model._tf_dp_counts.numpy()
    assert counts.min() == counts.max() == 3  # every record once per epoch
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 3 * N // BATCH
    assert all(len(e.queries) == 1 and e.queries[0].noise_seed is None for e in entries)
    result = compute_epsilon(entries, DELTA, "rdp")
    assert "NOT A PRIVACY GUARANTEE" not in str(result)
    assert result.epsilon == pytest.approx(_gaussian_epsilon(Z / 2, 3), rel=2e-2)
    assert result.epsilon >= _gaussian_epsilon(Z / 2, 3) * (1 - 1e-3)


def test_pass_starts_survive_the_ledger_file_which_says_version_2(tmp_path):
    import json

    from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
    from tf_dp.ledger.ledger_file import read_ledger_file, write_ledger_file

    query = (SumQueryEvent(1.0, Z),)
    start, cont = (SampleEntry(SamplingEvent(N, BATCH / N, "shuffle", pass_start=flag), query)
                   for flag in (True, False))
    entries = [start, cont] * 3
    write_ledger_file(tmp_path / "l.json", entries)
    payload = json.loads((tmp_path / "l.json").read_text())
    assert payload["version"] == 2  # a reader that ignores pass_start must refuse the file
    assert read_ledger_file(tmp_path / "l.json") == entries
    assert compute_epsilon(tmp_path / "l.json", DELTA, "gdp").mu == pytest.approx(
        math.sqrt(3) * 2 / Z)
    # without the marks the same steps are one pass: 2 epochs
    write_ledger_file(tmp_path / "old.json", [cont] * 6)
    assert json.loads((tmp_path / "old.json").read_text())["version"] == 1
    assert compute_epsilon(tmp_path / "old.json", DELTA, "gdp").mu == pytest.approx(
        math.sqrt(2) * 2 / Z)


def test_ftrl_tree_spanning_short_passes_counts_every_node_a_record_is_in():
    """DP-FTRL with ``restart_every`` a number of steps: one tree spans four fits of one step
    each, so a record can be in all four leaves. The released nodes a record is in are counted
    directly from the batches that ran (leaf i is in node ``i >> l`` of level ``l``); the tree's
    squared sensitivity is the sum of the squared counts, and its epsilon (one Gaussian
    mechanism, dp_accounting) bounds the ledger's from below."""
    from tf_dp.accounting.tree import tree_depth

    x, y = _data()
    optimizer = dpk.DPKerasFTRLOptimizer(l2_norm_clip=1.0, noise_multiplier=Z,
                                         learning_rate=0.1, restart_every=4)
    model = _model(optimizer)
    batches = []

    class Spy(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self.before = model._tf_dp_counts.numpy().copy()

        def on_train_batch_end(self, batch, logs=None):
            batches.append(set(np.flatnonzero(model._tf_dp_counts.numpy() - self.before)))

    for _ in range(4):
        model.fit(x, y, batch_size=BATCH, epochs=1, steps_per_epoch=1, verbose=0,
                  callbacks=[Spy()])
    assert len(batches) == 4
    depth = tree_depth(len(batches))  # one tree of 4 leaves: levels 0, 1, 2
    worst = 0
    for record in range(N):
        leaves = [i for i, batch in enumerate(batches) if record in batch]
        squared = 0
        for level in range(depth):
            nodes = np.bincount([leaf >> level for leaf in leaves], minlength=1)
            squared += int(np.sum(nodes.astype(np.int64) ** 2))
        worst = max(worst, squared)
    assert worst == 4 * 1**2 + 2 * 2**2 + 1 * 4**2  # with this seed a record is in all 4 leaves
    # replace-one: a leaf moves by 2C, so the tree is one Gaussian with multiplier Z/(2 sqrt(s2))
    reference = _gaussian_epsilon(Z / (2 * math.sqrt(worst)), 1)
    ours = compute_epsilon(optimizer.ledger.samples(), DELTA, "rdp")
    assert ours.epsilon >= reference * (1 - 1e-3)


def test_privacy_budget_charges_the_pass_the_next_epoch_starts():
    """Epochs of 2 steps while an epoch of the declared data (n=20, batch 5) is 4 steps: a
    dataset of two batches, unshuffled, so records 0-4 are in the first batch of every epoch.
    The budget allows two such participations, not three: the real epsilon of the worst record,
    counted by the spy and computed by dp_accounting, stays within it (planning at an epoch end
    as if the pass went on would let a third epoch run)."""
    x, y = _data()
    two, three = _gaussian_epsilon(Z / 2, 2), _gaussian_epsilon(Z / 2, 3)
    target = (two + three) / 2
    model = _model(dpk.DPKerasSGDOptimizer(l2_norm_clip=1.0, noise_multiplier=Z))
    model.optimizer.set_sampling(N, BATCH / N, "shuffle")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH).take(2)
    budget = dpk.PrivacyBudget(target, DELTA, verbose=False)
    model.fit(dataset, epochs=10, callbacks=[budget], verbose=0)
    worst = int(model._tf_dp_counts.numpy().max())
    assert worst == 2
    assert _gaussian_epsilon(Z / 2, worst) <= target
    assert compute_epsilon(model.optimizer.ledger.samples(), DELTA, "rdp").epsilon <= target
