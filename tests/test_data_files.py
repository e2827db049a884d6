"""The files behind tf_dp.data's file sources: each file counted once, and no change unnoticed.

A file given twice (the same path, a hard link, a symbolic link) would put each of its records in
the population twice, with two chances to be sampled at every step; a file that changes while it
is sampled would be read as other records (or as zeros). Each test checks against what the file
system or the format's own library says (``os.path.samefile``, ``os.stat``, h5py,
``ArrayRecordReader``), never against tf_dp's own numbers.
"""

import os
import re

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf
from array_record.python.array_record_module import ArrayRecordReader, ArrayRecordWriter

import tf_dp
from tf_dp.data import ArrayRecordSource, ArraySource, TFRecordSource, hdf5_source, poisson_sample
from tf_dp.data import files as files_module
from tf_dp.data.files import FileSet


def _records(n, shift=0):
    x = np.stack([np.arange(n), np.arange(n) / 2], axis=1).astype(np.float32) + shift
    y = np.arange(n).astype(np.int64) + shift
    return x, y


def _example(x, y):
    return tf.train.Example(
        features=tf.train.Features(
            feature={
                "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y])),
            }
        )
    ).SerializeToString()


_SPEC = {"x": tf.io.FixedLenFeature([2], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}


def _parse(serialized):
    f = tf.io.parse_example(serialized, _SPEC)
    return f["x"].numpy(), f["y"].numpy()


def _write(kind, path, n, shift=0):
    """One file of ``n`` records of the given kind; ``shift`` changes every value, not the size
    of a record (the values stay below 2^24, exact in float32, with as many digits)."""
    x, y = _records(n, shift)
    if kind == "tfrecord":
        with tf.io.TFRecordWriter(str(path)) as w:
            for i in range(n):
                w.write(_example(x[i], y[i]))
    elif kind == "arrayrecord":
        w = ArrayRecordWriter(str(path), "group_size:1")
        for i in range(n):
            w.write(_example(x[i], y[i]))
        w.close()
    elif kind == "hdf5":
        with h5py.File(path, "w") as f:
            f["images"], f["labels"] = x, y
    else:  # memmap: x and y side by side in one raw file
        np.concatenate([x, y[:, None].astype(np.float32)], axis=1).tofile(path)
    return str(path)


def _open(kind, path, n):
    if kind == "tfrecord":
        return TFRecordSource(path, parse_fn=_parse)
    if kind == "arrayrecord":
        return ArrayRecordSource(path, parse_fn=_parse)
    if kind == "hdf5":
        return hdf5_source(path, x="images", y="labels")
    table = np.memmap(path, np.float32, "r", shape=(n, 3))
    return ArraySource(table[:, :2], table[:, 2])


KINDS = ["tfrecord", "arrayrecord", "hdf5", "memmap"]
SUFFIX = {"tfrecord": ".tfrecord", "arrayrecord": ".array_record", "hdf5": ".h5", "memmap": ".f32"}


def _second_name(how, path, tmp_path):
    if how == "same path":
        return path
    if how == "another spelling":
        return os.path.join(os.path.dirname(path), ".", os.path.basename(path))
    other = str(tmp_path / ("other_" + os.path.basename(path)))
    (os.link if how == "hard link" else os.symlink)(path, other)
    return other


# -- Item: the same file twice ------------------------------------------------------------------


@pytest.mark.parametrize("how", ["same path", "another spelling", "hard link", "symbolic link"])
@pytest.mark.parametrize(
    "cls, kind", [(TFRecordSource, "tfrecord"), (ArrayRecordSource, "arrayrecord")]
)
def test_the_same_file_twice_is_refused_naming_both_paths(cls, kind, how, tmp_path):
    n = 12
    path = _write(kind, tmp_path / ("a" + SUFFIX[kind]), n)
    other = _write(kind, tmp_path / ("b" + SUFFIX[kind]), n)
    twice = _second_name(how, path, tmp_path)
    assert os.path.samefile(path, twice)  # the file system's own verdict
    # TensorFlow's reader of the list would deliver every record of the file twice: 2n records.
    if kind == "tfrecord":
        assert sum(1 for _ in tf.data.TFRecordDataset([path, twice])) == 2 * n
    with pytest.raises(ValueError, match="paths: .* are the same file") as info:
        cls([path, other, twice], parse_fn=_parse)
    assert repr(path) in str(info.value) and repr(twice) in str(info.value)
    # distinct files are fine
    assert len(cls([path, other], parse_fn=_parse)) == 2 * n


def test_arrays_of_one_file_are_read_from_it_once(tmp_path):
    # x and y datasets of one HDF5 file, or two memmaps of one file, are not the same records
    # twice: ArraySource keeps the file once for its checks and accepts them.
    path = _write("hdf5", tmp_path / "d.h5", 10)
    source = hdf5_source(path, x="images", y="labels")
    assert source._files.paths == [path] and len(source) == 10
    raw = _write("memmap", tmp_path / "t.f32", 10)
    a = np.memmap(raw, np.float32, "r", shape=(10, 3))
    b = np.memmap(os.path.join(str(tmp_path), ".", "t.f32"), np.float32, "r", shape=(10, 3))
    assert len(ArraySource(a[:, :2], b[:, 2])._files.paths) == 1


# -- Item: a file that changes ------------------------------------------------------------------


def _rewrite_same_size_keep_mtime(kind, path, n, tmp_path):
    """Replaces the file's bytes in place (same inode) by those of a file of other records of the
    same size, then restores the modification time to the nanosecond."""
    before = os.stat(path)
    fresh = _write(kind, tmp_path / ("fresh" + SUFFIX[kind]), n, shift=1)
    data = open(fresh, "rb").read()
    assert len(data) == before.st_size  # same size, by construction
    assert data != open(path, "rb").read()
    with open(path, "r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.stat(path)
    # what a size-and-mtime check sees: nothing
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
        before.st_ino,
        before.st_size,
        before.st_mtime_ns,
    )


@pytest.mark.parametrize("kind", KINDS)
def test_a_same_size_rewrite_with_the_mtime_restored_is_detected(kind, tmp_path):
    n = 20
    path = _write(kind, tmp_path / ("d" + SUFFIX[kind]), n)
    source = _open(kind, path, n)
    x, y = _records(n)
    bx, by = source.read(np.array([3, 0]))
    np.testing.assert_array_equal(by, y[[3, 0]])
    _rewrite_same_size_keep_mtime(kind, path, n, tmp_path)
    with pytest.raises(ValueError, match=re.escape(path) + " changed while in use"):
        source.read(np.array([3]))
    with pytest.raises(ValueError, match="changed while in use"):
        len(source)


@pytest.mark.parametrize("kind", KINDS)
def test_a_truncated_or_replaced_file_is_detected(kind, tmp_path):
    n = 20
    path = _write(kind, tmp_path / ("d" + SUFFIX[kind]), n)
    source = _open(kind, path, n)
    source.read(np.array([1]))
    # (the memmap's file is 240 bytes, within one page: reading it truncated cannot SIGBUS)
    os.truncate(path, os.path.getsize(path) // 2)
    with pytest.raises(ValueError, match=re.escape(path) + r" changed while in use \(size"):
        source.read(np.array([1]))
    path2 = _write(kind, tmp_path / ("e" + SUFFIX[kind]), n)
    source = _open(kind, path2, n)
    os.replace(_write(kind, tmp_path / ("f" + SUFFIX[kind]), n), path2)  # another inode
    with pytest.raises(ValueError, match="replaced by another file"):
        source.read(np.array([1]))


def test_a_metadata_change_is_accepted_and_checks_read_the_digest_only_when_needed(
    tmp_path, monkeypatch
):
    path = _write("tfrecord", tmp_path / "d.tfrecord", 30)
    reads = []
    digest = files_module.content_digest
    monkeypatch.setattr(files_module, "content_digest", lambda *a: reads.append(a) or digest(*a))
    monkeypatch.setattr(files_module, "SETTLE_NS", 0)  # the inode change time is trusted at once
    source = TFRecordSource(path)
    source.read(np.array([0]))
    opened = len(reads)
    for _ in range(5):
        source.read(np.array([2]))
    assert len(reads) == opened  # nothing changed: one os.stat per check, no digest
    ctime = os.stat(path).st_ctime_ns
    os.chmod(path, 0o600)
    assert os.stat(path).st_ctime_ns != ctime  # metadata changed ...
    source.read(np.array([2]))  # ... content did not: accepted, after one digest
    assert len(reads) == opened + 1
    _rewrite_same_size_keep_mtime("tfrecord", path, 30, tmp_path)
    with pytest.raises(ValueError, match="content differs with the same size and modification"):
        source.read(np.array([2]))


@pytest.mark.parametrize("where", ["first block", "a probe", "last block"])
def test_the_digest_of_a_large_file_sees_its_edges_and_probes(where, tmp_path):
    size = 1 << 20
    path = str(tmp_path / "big.bin")
    rng = np.random.default_rng(0)
    open(path, "wb").write(rng.integers(0, 256, size, dtype=np.uint8).tobytes())
    files = FileSet(path)
    inner = size - 2 * files_module.EDGE_BLOCK
    offset = {
        "first block": 100,
        "a probe": files_module.EDGE_BLOCK + int(inner / (files_module.PROBES + 1) * 7),
        "last block": size - 100,
    }[where]
    before = os.stat(path)
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 1]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    with pytest.raises(ValueError, match="content differs"):
        files.check()


def _private_model():
    keras.utils.set_random_seed(0)
    model = tf_dp.keras.make_private(keras.Sequential([keras.Input((2,)), keras.layers.Dense(80)]))
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.0, learning_rate=0.1
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


@pytest.mark.parametrize("change", ["truncate", "rewrite"])
def test_fit_stops_when_the_hdf5_file_changes_and_trains_no_rows_of_zeros(change, tmp_path):
    n = 64
    x, y = _records(n)
    path = _write("hdf5", tmp_path / "d.h5", n)
    if change == "truncate":  # what h5py itself returns from a truncated file: zeros
        probe = _write("hdf5", tmp_path / "probe.h5", n)
        with h5py.File(probe, "r") as f:
            os.truncate(probe, os.path.getsize(probe) // 2)
            assert np.all(f["labels"][n - 8 :] == 0) and np.all(f["images"][n - 8 :] == 0)

    class Logged:  # every batch the source handed over, beside the indices asked
        def __init__(self, source):
            self.source, self.reads = source, []

        def __len__(self):
            return len(self.source)

        def read(self, indices):
            bx, by = self.source.read(indices)
            self.reads.append((indices.copy(), bx, by))
            return bx, by

    source = Logged(hdf5_source(path, x="images", y="labels"))

    class Changer(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2:
                if change == "truncate":
                    os.truncate(path, os.path.getsize(path) // 2)
                else:
                    _rewrite_same_size_keep_mtime("hdf5", path, n, tmp_path)

    model = _private_model()
    batches = poisson_sample(
        source, sampling_probability=0.25, steps_per_epoch=64, seed=0, prefetch=1
    )
    with pytest.raises(Exception, match=re.escape(path) + " changed while in use"):
        model.fit(batches, epochs=1, verbose=0, callbacks=[Changer()])
    steps = int(model.optimizer.iterations.numpy())
    # the steps before the change ran, then the read-ahead (prefetch=1 plus the batch being
    # built): a few batches, far below the 64 of the epoch
    assert 3 <= steps < 10
    assert model.optimizer.ledger.num_samples == steps
    # every batch handed over holds the records written at those indices: no zeros, no others
    assert len(source.reads) >= steps + 1  # the spec's first read, then one per step at least
    for indices, bx, by in source.reads:
        np.testing.assert_array_equal(by, y[indices])
        np.testing.assert_array_equal(bx, x[indices])


# -- Item: broken ArrayRecord files -------------------------------------------------------------


def _reader_view(path):
    reader = ArrayRecordReader(path, "readahead_buffer_size:0,max_parallelism:0")
    ok, count = reader.ok(), reader.num_records()
    if ok:  # closing a reader in error raises that error again
        reader.close()
    return ok, count


@pytest.mark.parametrize(
    "broken", ["truncated", "cut at 10 bytes", "a TFRecord file", "empty", "no records"]
)
def test_a_broken_or_empty_arrayrecord_file_is_refused_naming_it(broken, tmp_path):
    n = 15
    good = _write("arrayrecord", tmp_path / "good.array_record", n)
    bad = str(tmp_path / "bad.array_record")
    if broken == "truncated":
        data = open(_write("arrayrecord", tmp_path / "full.array_record", n), "rb").read()
        open(bad, "wb").write(data[: len(data) // 2])
    elif broken == "cut at 10 bytes":
        open(bad, "wb").write(open(good, "rb").read()[:10])
    elif broken == "a TFRecord file":
        os.replace(_write("tfrecord", tmp_path / "t.tfrecord", n), bad)
    elif broken == "empty":
        open(bad, "wb").close()
    else:
        _write("arrayrecord", bad, 0)
    # the library's own view: a broken file reports an error, all read as 0 records
    ok, count = _reader_view(bad)
    assert count == 0 and ok == (broken == "no records")
    with pytest.raises(
        ValueError,
        match="paths: " + re.escape(bad) + " (is not a readable ArrayRecord file|holds no records)",
    ):
        ArrayRecordSource([good, bad], parse_fn=_parse)
    assert len(ArrayRecordSource([good], parse_fn=_parse)) == n == _reader_view(good)[1]


def test_the_cost_of_a_file_given_twice_quoted_in_docs_data_md():
    """docs/data.md: q = 0.01, noise multiplier 1, 1000 steps, delta 1e-5. The ledger of a
    doubled list records Poisson sampling at q; each record of the doubled file really takes part
    through two independent coins, so its neighbour differs by 0, 1 or 2 clipped gradients with
    probabilities (1-q)^2, 2q(1-q), q^2: a mixture of Gaussians (dp_accounting's PLD of it)."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    q, z, steps, delta = 0.01, 1.0, 1000, 1e-5
    recorded = tf_dp.accounting.dp_sgd_epsilon(2000, 20, z, delta, steps=steps, accountant="pld")
    single = pld.from_gaussian_mechanism(z, sampling_prob=q, value_discretization_interval=1e-3)
    assert recorded.epsilon == pytest.approx(
        single.self_compose(steps).get_epsilon_for_delta(delta), rel=0.01
    )
    doubled = pld.from_mixture_gaussian_mechanism(
        z,
        sensitivities=[0, 1, 2],
        sampling_probs=[(1 - q) ** 2, 2 * q * (1 - q), q * q],
        value_discretization_interval=1e-3,
    )
    real = doubled.self_compose(steps).get_epsilon_for_delta(delta)
    assert round(recorded.epsilon, 2) == 1.83 and round(real, 2) == 3.98
