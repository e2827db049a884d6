"""Small real image data in Fashion-MNIST's IDX format (sklearn digits, upscaled to 28x28)."""

import gzip
import os

import numpy as np
from sklearn.datasets import load_digits


def write_idx(path, array):
    array = np.asarray(array, np.uint8)
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(
        int(d).to_bytes(4, "big") for d in array.shape
    )
    with gzip.open(path, "wb") as f:
        f.write(header + array.tobytes())


def write_digits_idx(directory, n_train=1200, n_test=400):
    """Writes train/t10k images and labels (gzipped IDX) to ``directory``; returns the arrays."""
    x, y = load_digits(return_X_y=True)
    images = np.kron(x.reshape(-1, 8, 8), np.ones((3, 3)))  # 24x24
    images = np.pad(images, ((0, 0), (2, 2), (2, 2))) * (255.0 / 16.0)
    images = images.round().astype(np.uint8)
    os.makedirs(directory, exist_ok=True)
    parts = {
        "train-images-idx3-ubyte.gz": images[:n_train],
        "train-labels-idx1-ubyte.gz": y[:n_train],
        "t10k-images-idx3-ubyte.gz": images[n_train : n_train + n_test],
        "t10k-labels-idx1-ubyte.gz": y[n_train : n_train + n_test],
    }
    for name, arr in parts.items():
        write_idx(os.path.join(directory, name), arr)
    return parts
