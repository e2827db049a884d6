"""Random-access sources and tf_dp.data.poisson_sample: memmaps, HDF5, ArrayRecord, TFRecord.

Every source holds records whose content encodes their index (x[i] = (i, i / 2), y[i] = i), so a
test can tell which records a batch holds and check them against an independent read.
"""

import math
import os

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from array_record.python.array_record_module import ArrayRecordWriter

import tf_dp
from tf_dp.data import (
    ArrayRecordSource,
    ArraySource,
    TFRecordSource,
    hdf5_source,
    poisson_sample,
)


def _records(n):
    x = np.stack([np.arange(n), np.arange(n) / 2], axis=1).astype(np.float32)
    y = np.arange(n).astype(np.int64)
    return x, y


def _example(x, y):
    return tf.train.Example(features=tf.train.Features(feature={
        "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
        "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
    })).SerializeToString()


_SPEC = {"x": tf.io.FixedLenFeature([2], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def _parse(serialized):
    f = tf.io.parse_example(serialized, _SPEC)
    return f["x"].numpy(), f["y"].numpy()


def _write_tfrecords(tmp_path, n, files=2):
    """Records split over `files` TFRecord files, written by TensorFlow's own writer."""
    x, y = _records(n)
    paths = []
    for f, rows in enumerate(np.array_split(np.arange(n), files)):
        path = str(tmp_path / f"part{f}.tfrecord")
        with tf.io.TFRecordWriter(path) as w:
            for i in rows:
                w.write(_example(x[i], y[i]))
        paths.append(path)
    return paths


def _write_array_records(tmp_path, n, files=2):
    x, y = _records(n)
    paths = []
    for f, rows in enumerate(np.array_split(np.arange(n), files)):
        path = str(tmp_path / f"part{f}.array_record")
        w = ArrayRecordWriter(path, "group_size:1")
        for i in rows:
            w.write(_example(x[i], y[i]))
        w.close()
        paths.append(path)
    return paths


def _source(kind, tmp_path, n):
    x, y = _records(n)
    if kind == "memmap":
        xm = np.memmap(tmp_path / "x.f32", np.float32, "w+", shape=x.shape)
        ym = np.memmap(tmp_path / "y.i64", np.int64, "w+", shape=y.shape)
        xm[:], ym[:] = x, y
        xm.flush(), ym.flush()
        return ArraySource(np.memmap(tmp_path / "x.f32", np.float32, "r", shape=x.shape),
                           np.memmap(tmp_path / "y.i64", np.int64, "r", shape=y.shape))
    if kind == "hdf5":
        with h5py.File(tmp_path / "d.h5", "w") as f:
            f["images"], f["labels"] = x, y
        return hdf5_source(str(tmp_path / "d.h5"), x="images", y="labels")
    if kind == "tfrecord":
        return TFRecordSource(_write_tfrecords(tmp_path, n), parse_fn=_parse)
    return ArrayRecordSource(_write_array_records(tmp_path, n), parse_fn=_parse)


KINDS = ["memmap", "hdf5", "tfrecord", "arrayrecord"]


@pytest.mark.parametrize("kind", KINDS)
def test_reads_match_an_independent_read_in_the_order_asked(kind, tmp_path):
    n = 30
    source = _source(kind, tmp_path, n)
    x, y = _records(n)
    assert len(source) == n
    idx = np.array([17, 3, 29, 3, 0])
    bx, by = source.read(idx)
    np.testing.assert_array_equal(bx, x[idx])
    np.testing.assert_array_equal(by, y[idx])
    if kind == "tfrecord":  # the bytes themselves, against TensorFlow's sequential reader
        raw = TFRecordSource(source._files.paths)
        seq = [r.numpy() for r in tf.data.TFRecordDataset(source._files.paths)]
        assert list(raw.read(idx)) == [seq[i] for i in idx]
    with pytest.raises(IndexError, match=r"indices must be in \[0, 30\)"):
        source.read(np.array([1, 30]))
    with pytest.raises(IndexError, match="indices must be in"):
        source.read(np.array([-1]))


@pytest.mark.parametrize("kind", KINDS)
def test_each_record_participates_binomially_and_batches_hold_the_sampled_records(
    kind, tmp_path
):
    n, q, steps = 40, 0.2, 400
    source = _source(kind, tmp_path, n)
    x, _ = _records(n)
    batches = poisson_sample(source, sampling_probability=q, steps_per_epoch=steps, seed=11)
    assert batches.sampling == tf_dp.data.Sampling(n, q, "poisson", "sampled")
    counts = np.zeros(n)
    sizes = []
    for bx, by, bw in batches.dataset.as_numpy_iterator():
        real = bw > 0
        ids = by[real]
        assert len(np.unique(ids)) == len(ids), "a record twice in one batch"
        np.testing.assert_array_equal(bx[real], x[ids])  # the records at the sampled indices
        np.testing.assert_array_equal(bx[~real], 0)
        counts[ids] += 1
        sizes.append(real.sum())
    assert len(sizes) == steps
    var = steps * q * (1 - q)
    # Each count ~ Binomial(steps, q): the mean over n records has sd sqrt(var / n) (5 sd), the
    # dispersion (n - 1) s^2 / var ~ chi2(n - 1) (quantiles 1e-6 either side).
    assert abs(counts.mean() - steps * q) < 5 * math.sqrt(var / n)
    from scipy import stats

    chi = (n - 1) * counts.var(ddof=1) / var
    assert stats.chi2.ppf(1e-6, n - 1) < chi < stats.chi2.isf(1e-6, n - 1)
    # Batch sizes ~ Binomial(n, q): mean within 5 sd.
    assert abs(np.mean(sizes) - n * q) < 5 * math.sqrt(n * q * (1 - q) / steps)


def test_large_population_inclusion_rate_is_q_without_n_uniforms():
    # 10^7 virtual records: only the sampled indices are ever asked for.
    class Virtual:
        def __len__(self):
            return 10_000_000

        def read(self, indices):
            self.asked = max(getattr(self, "asked", 0), len(indices))
            return indices.astype(np.float32)[:, None], indices

    source, n, q, steps = Virtual(), 10_000_000, 1e-4, 20
    batches = poisson_sample(source, sampling_probability=q, steps_per_epoch=steps, seed=2)
    total, seen = 0, []
    for _, by, bw in batches.dataset.as_numpy_iterator():
        ids = by[bw > 0]
        total += len(ids)
        seen.append(ids)
    # total ~ Binomial(steps n, q): 5 sd.
    assert abs(total - steps * n * q) < 5 * math.sqrt(steps * n * q * (1 - q))
    # Uniform over the population: the sampled indices' mean is n / 2 (sd n / sqrt(12 total)).
    assert abs(np.concatenate(seen).mean() - n / 2) < 5 * n / math.sqrt(12 * total)
    assert source.asked < 2 * n * q


def test_worker_shards_partition_the_source(tmp_path):
    n, q, steps = 30, 0.3, 200
    source = _source("memmap", tmp_path, n)
    seen = []
    for w in range(3):
        b = poisson_sample(source, q, steps_per_epoch=steps, seed=4, num_shards=3, shard_index=w)
        assert b.tf_dp_sampling == (n, q) and b.num_shards == 3
        counts = np.zeros(n)
        for _, by, bw in b.dataset.as_numpy_iterator():
            counts[by[bw > 0]] += 1
        assert np.all(counts[np.arange(n) % 3 != w] == 0)
        seen.append(counts[np.arange(n) % 3 == w])
    counts = np.concatenate(seen)
    assert abs(counts.mean() - steps * q) < 5 * math.sqrt(steps * q * (1 - q) / n)


def _model():
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(
        keras.Sequential([keras.Input((2,)), keras.layers.Dense(3)])
    )
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def test_fit_on_tfrecord_files_records_poisson_n_and_q(tmp_path):
    n, q = 60, 0.25

    def parse(serialized):
        bx, by = _parse(serialized)
        return bx / n, by % 3

    source = TFRecordSource(_write_tfrecords(tmp_path, n, files=3), parse_fn=parse)
    model = _model()
    batches = poisson_sample(source, sampling_probability=q, seed=1)
    model.fit(batches, epochs=2, verbose=0)
    entries = model.optimizer.ledger.samples()
    assert len(entries) == 2 * round(1 / q)
    for e in entries:
        assert e.sampling.population_size == n  # the files' record count, counted here by
        assert n == sum(1 for _ in tf.data.TFRecordDataset(source._files.paths))  # TF itself
        assert e.sampling.selection_probability == q and e.sampling.policy == "poisson"


def test_a_corrupt_tfrecord_fails_its_crc_check(tmp_path):
    paths = _write_tfrecords(tmp_path, 10, files=1)
    with open(paths[0], "r+b") as f:  # one byte of the 4th record's data
        f.seek(3 * (len(_example([0, 0], 0)) + 16) + 20)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    source = TFRecordSource(paths)
    source.read(np.array([0, 1, 2]))
    with pytest.raises(ValueError, match="paths: record 3 .* fails its CRC check"):
        source.read(np.array([3]))
    with open(paths[0], "r+b") as f:  # the first header's length
        f.write(b"\x07")
    with pytest.raises(ValueError, match="paths: .* fails the CRC check of the record header"):
        TFRecordSource(paths)
    with open(tmp_path / "short.tfrecord", "wb") as f:
        f.write(b"\x01\x02")
    with pytest.raises(ValueError, match="truncated"):
        TFRecordSource(str(tmp_path / "short.tfrecord"))


def test_a_source_whose_length_changes_stops_the_sampling(tmp_path):
    class Growing:
        def __init__(self):
            self.n = 20

        def __len__(self):
            self.n += 1 if getattr(self, "started", False) else 0
            return self.n

        def read(self, indices):
            self.started = True
            return indices.astype(np.float32)[:, None], indices

    batches = poisson_sample(Growing(), sampling_probability=0.5, steps_per_epoch=5, seed=0)
    with pytest.raises(Exception, match="source changed length from 20"):
        list(batches.dataset.as_numpy_iterator())
    paths = _write_tfrecords(tmp_path, 10, files=1)
    source = TFRecordSource(paths)
    with open(paths[0], "ab") as f:  # a record appended after indexing
        f.write(open(paths[0], "rb").read()[:40])
    with pytest.raises(ValueError, match="paths: .* changed while in use"):
        source.read(np.array([0]))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"sampling_probability": 0.0}, ValueError, r"sampling_probability must be in \(0, 1\]"),
        ({"sampling_probability": 1.5}, ValueError, r"sampling_probability must be in \(0, 1\]"),
        ({"sampling_probability": 0.1, "shard_index": 2, "num_shards": 2}, ValueError,
         "shard_index"),
        ({"sampling_probability": 0.1, "prefetch": 0}, ValueError, "prefetch"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, match):
    x, y = _records(10)
    with pytest.raises(error, match=match):
        poisson_sample(ArraySource(x, y), **kwargs)


def test_bad_sources_fail_before_sampling(tmp_path):
    with pytest.raises(TypeError, match="source must be a random-access source"):
        poisson_sample(np.zeros(3), 0.5)
    x, y = _records(10)
    with pytest.raises(ValueError, match="same number of rows"):
        ArraySource(x, y[:5])
    with pytest.raises(TypeError, match=r"source.read must return \(x, y\)"):
        poisson_sample(ArraySource(x), 0.5)
    with pytest.raises(FileNotFoundError, match="paths: no such file"):
        TFRecordSource(str(tmp_path / "missing.tfrecord"))
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["images"] = x
    with pytest.raises(KeyError, match="y='labels' is not a dataset"):
        hdf5_source(str(tmp_path / "d.h5"), x="images", y="labels")


def test_fit_stops_before_the_step_of_a_changed_source_and_keeps_the_earlier_steps():
    # The source shrinks once the third training step has ended (a callback, so the trigger
    # does not depend on how far tf.data or Keras read ahead, or on a peek at the dataset).
    class ShrinksWhenTold:
        shrunk = False

        def __len__(self):
            return 39 if self.shrunk else 40

        def read(self, indices):
            x = np.stack([indices, -indices], axis=1) / 40.0
            return x.astype(np.float32), indices % 3

    source = ShrinksWhenTold()

    class ShrinkAfterThirdStep(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                source.shrunk = True

    model = _model()
    batches = poisson_sample(source, sampling_probability=0.25, steps_per_epoch=40, seed=0,
                             prefetch=1)
    with pytest.raises(Exception, match="source changed length from 40 to 39"):
        model.fit(batches, epochs=1, verbose=0, callbacks=[ShrinkAfterThirdStep()])
    steps = int(model.optimizer.iterations.numpy())  # updates applied before the error
    # the three steps before the change ran; the read-ahead (prefetch=1 plus the batch being
    # built) is a few batches, far below the epoch's 40
    assert 3 <= steps < 20
    assert model.optimizer.ledger.num_samples == steps
