"""tf_dp.data.poisson_batches: Poisson sampling, padding, overflow, empty batches, the ledger."""

import math

import keras
import numpy as np
import pytest
from scipy import stats

import tf_dp
from tf_dp.data import default_max_batch_size, poisson_batches
from tf_dp.data.poisson import default_pad_sizes
from tf_dp.gradients import make_clipper
from tf_dp.keras.losses import PerExampleLoss


def _indexed_data(n):
    """x[i] = (i, i), y[i] = i: lets a test tell which examples a batch holds."""
    x = np.stack([np.arange(n), np.arange(n)], axis=1).astype(np.float32)
    y = np.arange(n).astype(np.int32)
    return x, y


def _batches(pb, count):
    out = []
    it = iter(pb.dataset.repeat())
    for _ in range(count):
        bx, by, bw = next(it)
        out.append((bx.numpy(), by.numpy(), bw.numpy()))
    return out


def test_batch_sizes_follow_binomial():
    n, q, k = 1000, 0.05, 400
    x, y = _indexed_data(n)
    pb = poisson_batches(x, y, sampling_probability=q, seed=7)
    sizes = np.array([bw.sum() for _, _, bw in _batches(pb, k)])
    mean, var = n * q, n * q * (1 - q)
    # Sample mean of k Binomial(n, q) draws: sd sqrt(var / k); 5 sd tolerance.
    assert abs(sizes.mean() - mean) < 5 * math.sqrt(var / k)
    # Sample variance: relative sd about sqrt(2 / (k - 1)) (plus a small kurtosis term).
    assert abs(sizes.var(ddof=1) / var - 1) < 5 * math.sqrt(2 / (k - 1)) + 0.05
    # Distribution: Kolmogorov-Smirnov-type check against the Binomial cdf.
    grid = np.arange(int(mean - 4 * math.sqrt(var)), int(mean + 4 * math.sqrt(var)))
    emp = np.array([(sizes <= g).mean() for g in grid])
    assert np.max(np.abs(emp - stats.binom.cdf(grid, n, q))) < 1.63 / math.sqrt(k) * 1.5


def test_each_example_included_with_probability_q_and_rows_stay_paired():
    n, q, k = 200, 0.1, 300
    x, y = _indexed_data(n)
    pb = poisson_batches(x, y, sampling_probability=q, seed=3)
    counts = np.zeros(n)
    for bx, by, bw in _batches(pb, k):
        real = bw > 0
        ids = by[real]
        assert len(np.unique(ids)) == len(ids), "an example appears twice in one batch"
        np.testing.assert_array_equal(bx[real, 0], ids)  # x and y rows stay paired
        np.testing.assert_array_equal(bx[~real], 0)
        counts[ids] += 1
    # counts ~ Binomial(k, q) per example; the overall mean has sd sqrt(k q (1-q) / n).
    assert abs(counts.mean() - k * q) < 5 * math.sqrt(k * q * (1 - q) / n)
    # Independence across examples: dispersion of counts matches Binomial(k, q).
    assert abs(counts.var() / (k * q * (1 - q)) - 1) < 5 * math.sqrt(2 / n)


def test_padding_shape_weights_and_sample_weight():
    n, q = 300, 0.1
    x, y = _indexed_data(n)
    sw = np.linspace(0.5, 2.0, n).astype(np.float32)
    pb = poisson_batches(x, y, sampling_probability=q, sample_weight=sw, seed=1, pad_sizes=None)
    assert pb.pad_sizes == (pb.max_batch_size,)
    assert pb.tf_dp_sampling == (n, q)
    assert pb.steps_per_epoch == 10
    assert pb.max_batch_size == default_max_batch_size(n, q)
    assert pb.dataset.element_spec[0].shape.as_list() == [None, 2]
    for bx, by, bw in _batches(pb, 20):
        assert bx.shape[0] == pb.max_batch_size
        k = int((bw > 0).sum())
        np.testing.assert_allclose(bw[:k], sw[by[:k]])
        np.testing.assert_array_equal(bw[k:], 0)


def test_default_pads_to_a_few_sizes_near_the_expected_batch():
    """Issue 34 item 13: by default a sample is padded to the smallest of the few sizes of
    ``default_pad_sizes`` that holds it (a bound near the expected size), not always to the
    maximum; ``pad_sizes=None`` keeps one shape."""
    n, q = 3000, 0.01
    x, y = _indexed_data(n)
    pb = poisson_batches(x, y, sampling_probability=q, seed=3)
    assert pb.pad_sizes == default_pad_sizes(n, q, pb.max_batch_size)
    assert len(pb.pad_sizes) > 1 and pb.pad_sizes[-1] == pb.max_batch_size
    rows = [bx.shape[0] for bx, _, _ in _batches(pb, 200)]
    assert set(rows) <= set(pb.pad_sizes)
    assert np.mean(rows) < pb.max_batch_size  # padded less than to the maximum
    one = poisson_batches(x, y, sampling_probability=q, seed=3, pad_sizes=None)
    assert {bx.shape[0] for bx, _, _ in _batches(one, 20)} == {one.max_batch_size}


def _smallest_holding(sizes, k):
    """The reference rule, by a loop: the first size >= k, else k (an oversized sample)."""
    for s in sorted(sizes):
        if s >= k:
            return s
    return k


def test_pad_sizes_keep_the_sample_and_pad_to_the_smallest_size_that_holds_it():
    """Expected batch 8 of 60000: the default pad sizes are the median, 0.9 and 0.999 Binomial
    quantiles (each checked by its cdf) and max_batch_size; every step's real rows are exactly
    those of the same seed padded to max_batch_size (same records, same weights, same order),
    and each batch has the smallest pad size >= its sample."""
    n, q = 60000, 8 / 60000
    x, y = _indexed_data(n)
    sw = np.linspace(0.5, 2.0, n).astype(np.float32)
    kw = dict(sampling_probability=q, sample_weight=sw, seed=11, steps_per_epoch=400)
    auto = poisson_batches(x, y, pad_sizes="auto", **kw)
    one = poisson_batches(x, y, pad_sizes=None, **kw)
    b = auto.max_batch_size
    assert b == one.max_batch_size == default_max_batch_size(n, q)
    sizes = auto.pad_sizes
    assert sizes[-1] == b and list(sizes) == sorted(set(sizes)) and len(sizes) <= 4
    for p, s in zip((0.5, 0.9, 0.999), sizes):  # s: the smallest k with cdf(k) >= p
        assert stats.binom.cdf(s, n, q) >= p > stats.binom.cdf(s - 1, n, q)
    seen = set()
    for (bx, by, bw), (ox, oy, ow) in zip(_batches(auto, 400), _batches(one, 400)):
        real, oreal = bw > 0, ow > 0
        np.testing.assert_array_equal(by[real], oy[oreal])
        np.testing.assert_array_equal(bx[real], ox[oreal])
        np.testing.assert_array_equal(bw[real], ow[oreal])
        k = int(real.sum())
        assert bw.shape[0] == bx.shape[0] == _smallest_holding(sizes, k)
        np.testing.assert_array_equal(bx[k:], 0)
        np.testing.assert_array_equal(bw[k:], 0)
        seen.add(bw.shape[0])
    assert seen <= set(sizes) and len(seen) >= 3
    assert one.pad_sizes == (b,)


def test_default_pad_sizes_cost_little_padding():
    """The mean rows per step over 1500 steps at n q = 8 match the closed form
    E[smallest pad size >= K], K ~ Binomial(n, q), within 5 standard errors, and that expectation
    is within 1.3 n q (padding to max_batch_size alone: 25 rows, 3.1 n q)."""
    n, q, steps = 60000, 8 / 60000, 1500
    x, y = _indexed_data(n)
    pb = poisson_batches(x, y, sampling_probability=q, seed=5, steps_per_epoch=steps,
                         pad_sizes="auto")
    ks = np.arange(0, 200)
    pmf = stats.binom.pmf(ks, n, q)
    rows = np.array([_smallest_holding(pb.pad_sizes, k) for k in ks])
    mean = float(np.sum(pmf * rows))
    sd = math.sqrt(float(np.sum(pmf * (rows - mean) ** 2)))
    got = np.array([int(bw.shape[0]) for _, _, bw in pb.dataset])
    assert len(got) == steps
    assert abs(got.mean() - mean) < 5 * sd / math.sqrt(steps)
    assert mean < 1.3 * n * q < pb.max_batch_size / 2


def test_pad_sizes_bound_the_traces_of_a_compiled_step():
    """An XLA-compiled function of the batch, called on 400 steps, traces once per distinct
    shape: at most len(pad_sizes) (4) times, against one per distinct size without padding."""
    import tensorflow as tf

    n, q = 60000, 8 / 60000
    x, y = _indexed_data(n)

    def traces(dataset):
        @tf.function(jit_compile=True, reduce_retracing=False)
        def f(bx, bw):
            return tf.reduce_sum(bx[:, 0] * bw)

        for bx, _, bw in dataset:
            f(bx, bw)
        return f.experimental_get_tracing_count()

    pb = poisson_batches(x, y, sampling_probability=q, seed=4, steps_per_epoch=400,
                         pad_sizes="auto")
    count = traces(pb.dataset)
    assert count <= len(pb.pad_sizes) == 4
    unpadded = pb.dataset.map(lambda bx, by, bw: (tf.boolean_mask(bx, bw > 0),
                                                  tf.boolean_mask(by, bw > 0),
                                                  tf.boolean_mask(bw, bw > 0)))
    assert traces(unpadded) > 2 * count  # Poisson(8) sizes: more than 8 distinct in 400 draws


def test_pad_sizes_argument_is_checked():
    x, y = _indexed_data(100)
    pb = poisson_batches(x, y, sampling_probability=0.1, pad_sizes=[12, 6, 12], seed=0)
    assert pb.pad_sizes == (6, 12) and pb.max_batch_size == 12
    for bad, err, match in [
        ([], ValueError, "pad_sizes must hold at least one size"),
        ([0, 5], ValueError, "every pad_sizes entry must be"),
        ("big", TypeError, "pad_sizes must be 'auto', None or a sequence"),
        (7, TypeError, "pad_sizes must be 'auto', None or a sequence"),
    ]:
        with pytest.raises(err, match=match):
            poisson_batches(x, y, sampling_probability=0.1, pad_sizes=bad)
    with pytest.raises(ValueError, match=r"max_batch_size must be None or the largest of "
                                         r"pad_sizes \(12\), got 20"):
        poisson_batches(x, y, sampling_probability=0.1, pad_sizes=[6, 12], max_batch_size=20)
    with pytest.raises(ValueError, match="pad_sizes must be 'auto' or None with user_ids"):
        poisson_batches(x, y, sampling_probability=0.1, pad_sizes=[6, 12],
                        user_ids=np.arange(100) // 2, max_records_per_user=2)


def test_default_max_batch_size_is_the_binomial_quantile():
    n, q, p = 60000, 256 / 60000, 1e-6
    k = default_max_batch_size(n, q, p)
    assert stats.binom.sf(k, n, q) <= p < stats.binom.sf(k - 1, n, q)
    assert 256 < k < 400


def test_overflow_emits_the_full_sample_untruncated():
    n, q = 100, 0.5
    x, y = _indexed_data(n)
    pb = poisson_batches(x, y, sampling_probability=q, max_batch_size=5, seed=2)
    for bx, by, bw in _batches(pb, 5):
        assert bw.shape[0] > 5  # ~50 examples: the whole sample, no padding, no truncation
        np.testing.assert_array_equal(bw, 1.0)
        assert len(np.unique(by)) == len(by)


def test_fresh_samples_every_pass_and_seed_reproduces():
    x, y = _indexed_data(500)
    pb = poisson_batches(x, y, sampling_probability=0.1, seed=11)
    first = [b[1].numpy().tolist() for b in pb.dataset]
    second = [b[1].numpy().tolist() for b in pb.dataset]
    assert first != second  # Keras re-iterates the dataset each epoch: new samples
    again = [b[1].numpy().tolist() for b in poisson_batches(x, y, sampling_probability=0.1, seed=11).dataset]
    assert again == first
    unseeded = [b[1].numpy().tolist() for b in poisson_batches(x, y, sampling_probability=0.1).dataset]
    assert unseeded != first


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(sampling_probability=0.0), "sampling_probability"),
        (dict(sampling_probability=1.5), "sampling_probability"),
        (dict(sampling_probability="0.1"), "sampling_probability"),
        (dict(sampling_probability=0.1, max_batch_size=0), "max_batch_size"),
        (dict(sampling_probability=0.1, steps_per_epoch=-1), "steps_per_epoch"),
        (dict(sampling_probability=0.1, sample_weight=np.ones(3)), "sample_weight"),
    ],
)
def test_bad_arguments_fail_with_the_argument_name(kwargs, match):
    x, y = _indexed_data(10)
    with pytest.raises((ValueError, TypeError), match=match):
        poisson_batches(x, y, **kwargs)


def test_missing_y_and_mismatched_lengths_fail():
    x, y = _indexed_data(10)
    with pytest.raises(ValueError, match="y is required"):
        poisson_batches(x, sampling_probability=0.1)
    with pytest.raises(ValueError, match="same number of examples"):
        poisson_batches(x, y[:5], sampling_probability=0.1)


def _model(noise, seed=0):
    keras.utils.set_random_seed(seed)
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(4, activation="tanh"),
                          keras.layers.Dense(3)])
    )
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=noise, learning_rate=0.1, noise_seed=seed),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.mark.parametrize("mode", ["vectorized", "ghost"])
def test_zero_weight_padding_rows_contribute_nothing_to_the_clipped_sum(mode):
    model = _model(noise=0.0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(6, 2)).astype(np.float32) * 3
    y = np.array([0, 1, 2, 0, 1, 2], np.int32)
    xp = np.concatenate([x, np.zeros((4, 2), np.float32)])
    yp = np.concatenate([y, np.zeros(4, np.int32)])
    wp = np.concatenate([np.ones(6), np.zeros(4)]).astype(np.float32)
    query = model.optimizer.dp_query
    params = query.derive_sample_params(model.optimizer._dp_global_state)
    strategy = make_clipper(mode, model=model)
    loss_fn = PerExampleLoss(model)
    variables = list(model.trainable_variables)
    real = strategy.clipped_sum(loss_fn, (x, y, None), variables, query, params)
    padded = strategy.clipped_sum(loss_fn, (xp, yp, wp), variables, query, params)
    for a, b in zip(real.clipped_sum, padded.clipped_sum):
        np.testing.assert_allclose(a.numpy(), b.numpy(), atol=1e-6)
    assert np.any([np.abs(a.numpy()).sum() > 0 for a in real.clipped_sum])


def test_ledger_records_poisson_with_real_n_and_q():
    x, y = _indexed_data(120)
    x = x / 120.0
    y = y % 3
    model = _model(noise=1.0)
    pb = poisson_batches(x, y, sampling_probability=0.1, seed=5)
    model.fit(pb, epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 2 * pb.steps_per_epoch == 20
    for e in entries:
        assert (e.sampling.population_size, e.sampling.selection_probability) == (120, 0.1)
        assert e.sampling.policy == "poisson"
        assert e.queries[0].noise_stddev == pytest.approx(1.0)


def test_fit_on_pad_sizes_matches_padding_to_the_maximum():
    """fit on two pad sizes (6, 14) and on batches all padded to max_batch_size=14, same
    sampling seed and noise seed: every step recorded (30 of Poisson (n, q)) and the same
    weights. (XLA's shapes are bounded by test_pad_sizes_bound_the_traces_of_a_compiled_step; a
    jit-compiled fit here took minutes of compilation on the shared machine.) Tolerance: 30 SGD
    steps whose float32 sums differ only in the order zero rows and real rows are added, a few
    ulps (2**-23) of the weights per step."""
    n, q, steps = 2000, 6 / 2000, 30
    x, y = _indexed_data(n)
    x, y = x / n, y % 3
    weights = []
    for pad_sizes in ((6, 14), None):
        model = _model(noise=1.0, seed=3)
        pb = poisson_batches(x, y, sampling_probability=q, seed=9, steps_per_epoch=steps,
                             pad_sizes=pad_sizes, max_batch_size=14)
        model.fit(pb, epochs=1, verbose=0)
        entries = model.optimizer.ledger.samples()
        assert len(entries) == steps
        assert {(e.sampling.population_size, e.sampling.selection_probability,
                 e.sampling.policy) for e in entries} == {(n, q, "poisson")}
        weights.append(model.get_weights())
    assert pb.pad_sizes == (14,)
    scale = max(float(np.abs(w).max()) for w in weights[1])
    for a, b in zip(*weights):
        np.testing.assert_allclose(a, b, rtol=0, atol=steps * 8 * 2.0**-23 * scale)


def test_empty_batches_record_a_step_add_noise_and_no_gradient():
    x, y = _indexed_data(20)
    x, y = x / 20.0, y % 3
    # q tiny: nearly every batch is empty (all padding, all weights 0).
    pb = poisson_batches(x, y, sampling_probability=1e-6, steps_per_epoch=3,
                         max_batch_size=4, seed=1)
    assert all(float(b[2].numpy().sum()) == 0 for b in pb.dataset)
    quiet = _model(noise=0.0)
    before = [w.copy() for w in quiet.get_weights()]
    quiet.fit(pb, epochs=1, verbose=0)
    assert quiet.optimizer.ledger.num_samples == 3
    for a, b in zip(before, quiet.get_weights()):
        np.testing.assert_array_equal(a, b)  # zero clipped sum, zero noise: no change
    noisy = _model(noise=1.0)
    before = [w.copy() for w in noisy.get_weights()]
    noisy.fit(pb, epochs=1, verbose=0)
    assert noisy.optimizer.ledger.num_samples == 3
    assert any(np.abs(a - b).max() > 0 for a, b in zip(before, noisy.get_weights()))
    assert all(np.all(np.isfinite(w)) for w in noisy.get_weights())


def test_worker_shards_partition_the_data_and_sample_each_example_at_rate_q():
    """num_shards/shard_index: worker w samples only examples w mod k, at rate q, so the union of
    the workers' batches is one Poisson sample of the whole data set (declared globally)."""
    n, q, k, steps = 300, 0.2, 3, 400
    x = np.arange(n, dtype=np.float32)[:, None]
    y = np.zeros(n, np.int64)
    counts = np.zeros(n)
    for w in range(k):
        batches = tf_dp.data.poisson_batches(x, y, sampling_probability=q, num_shards=k,
                                             shard_index=w, steps_per_epoch=steps)
        assert batches.tf_dp_sampling == (n, q)
        for bx, _, bw in batches.dataset:
            rows = bx.numpy()[bw.numpy() > 0, 0].astype(int)
            assert np.all(rows % k == w) and len(set(rows)) == len(rows)
            counts[rows] += 1
    # Each example's count is Binomial(steps, q): mean within 5 standard errors of q.
    se = np.sqrt(q * (1 - q) / (steps * n))
    assert abs(counts.mean() / steps - q) < 5 * se
    with pytest.raises(ValueError, match="shard_index must be an integer in"):
        tf_dp.data.poisson_batches(x, y, sampling_probability=q, num_shards=2, shard_index=2)
