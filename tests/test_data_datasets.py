"""tf_dp.data.load_mnist_or_fashion_mnist and the IDX reader: real files, clear errors."""

import gzip

import numpy as np
import pytest

from tests.idx_fixtures import write_digits_idx
from tf_dp.data import DataNotFoundError, load_fashion_mnist_idx, load_mnist_or_fashion_mnist, read_idx


def test_reads_fashion_mnist_idx_files_from_data_dir(tmp_path):
    parts = write_digits_idx(str(tmp_path), n_train=100, n_test=30)
    (x, y), (xt, yt), name = load_mnist_or_fashion_mnist(data_dir=str(tmp_path))
    assert name == "fashion_mnist"
    assert x.shape == (100, 28, 28) and x.dtype == np.uint8 and xt.shape == (30, 28, 28)
    np.testing.assert_array_equal(x, parts["train-images-idx3-ubyte.gz"])
    np.testing.assert_array_equal(yt, parts["t10k-labels-idx1-ubyte.gz"])


def test_missing_data_is_a_clear_error_never_synthetic(tmp_path):
    with pytest.raises(DataNotFoundError, match="dataset-fashion-mnist") as info:
        load_mnist_or_fashion_mnist(data_dir=str(tmp_path / "nothing"))
    assert "synthetic" in str(info.value)
    with pytest.raises(DataNotFoundError):
        load_fashion_mnist_idx(str(tmp_path))


def test_read_idx_rejects_bad_files(tmp_path):
    bad = tmp_path / "bad.gz"
    with gzip.open(bad, "wb") as f:
        f.write(b"\x01\x02\x08\x01" + (3).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="magic"):
        read_idx(str(bad))
    short = tmp_path / "short.gz"
    with gzip.open(short, "wb") as f:
        f.write(b"\x00\x00\x08\x01" + (5).to_bytes(4, "big") + b"abc")
    with pytest.raises(ValueError, match="expected 5 bytes"):
        read_idx(str(short))
