"""Image data for the tutorials: MNIST when it can be fetched, else Fashion-MNIST from local files.

``load_mnist_or_fashion_mnist()`` never falls back to synthetic data: if neither source is
available it raises :class:`DataNotFoundError` saying what it tried and how to get the data.

Example::

    (x_train, y_train), (x_test, y_test), name = tf_dp.data.load_mnist_or_fashion_mnist()
    print(f"training on {name}")   # "mnist" or "fashion_mnist"
"""

from __future__ import annotations

import gzip
import logging
import os
import socket
from typing import Optional

import numpy as np

#: Where the Debian package ``dataset-fashion-mnist`` installs its IDX files.
DEBIAN_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

_FASHION_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

_logger = logging.getLogger("tf_dp")

Arrays = tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


class DataNotFoundError(FileNotFoundError):
    """Neither MNIST nor Fashion-MNIST could be loaded."""


def read_idx(path: str) -> np.ndarray:
    """Reads an IDX file (optionally gzipped) into a numpy array (uint8 data only)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number)")
    if data[2] != 0x08:
        raise ValueError(f"{path}: only unsigned-byte IDX files are supported (type {data[2]:#x})")
    ndim = data[3]
    dims = [int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    offset = 4 + 4 * ndim
    size = int(np.prod(dims))
    if len(data) - offset != size:
        raise ValueError(f"{path}: expected {size} bytes of data, found {len(data) - offset}")
    return np.frombuffer(data, np.uint8, offset=offset).reshape(dims)


def _find(directory: str, stem: str) -> Optional[str]:
    for name in (stem + ".gz", stem, stem.replace("-idx", ".idx")):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return path
    return None


def load_fashion_mnist_idx(data_dir: str) -> Arrays:
    """Fashion-MNIST (or any MNIST-format IDX set) from ``data_dir``: uint8 images [N, 28, 28]."""
    paths = {}
    for key, stem in _FASHION_FILES.items():
        path = _find(data_dir, stem)
        if path is None:
            raise DataNotFoundError(f"{data_dir!r} has no {stem}[.gz]")
        paths[key] = path
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        if arrays[f"x_{split}"].shape[0] != arrays[f"y_{split}"].shape[0]:
            raise ValueError(f"{data_dir}: {split} images and labels differ in count")
    return (arrays["x_train"], arrays["y_train"]), (arrays["x_test"], arrays["y_test"])


def _try_keras_mnist(timeout: float) -> Arrays:
    import keras

    old = socket.getdefaulttimeout()
    socket.setdefaulttimeout(timeout)
    try:
        return keras.datasets.mnist.load_data()
    finally:
        socket.setdefaulttimeout(old)


def load_mnist_or_fashion_mnist(
    data_dir: Optional[str] = None, try_mnist: bool = True, download_timeout: float = 20.0
) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray], str]:
    """MNIST via ``keras.datasets`` if it can be fetched (or is cached); else Fashion-MNIST.

    Fashion-MNIST IDX files (``train-images-idx3-ubyte.gz`` etc.) are read from ``data_dir``, or
    from ``/usr/share/datasets/fashion-mnist`` (``apt-get install dataset-fashion-mnist``).

    Args:
      data_dir: directory with Fashion-MNIST IDX files. When given, it is used *instead of*
        trying to fetch MNIST.
      try_mnist: set False to skip the MNIST attempt (e.g. offline machines).
      download_timeout: socket timeout in seconds for the MNIST download.

    Returns:
      ``((x_train, y_train), (x_test, y_test), name)`` with uint8 images ``[N, 28, 28]``, integer
      labels ``[N]`` and ``name`` either ``"mnist"`` or ``"fashion_mnist"``.

    Raises:
      DataNotFoundError: nothing could be loaded (never falls back to synthetic data).
    """
    errors = []
    if data_dir is None and try_mnist:
        try:
            train, test = _try_keras_mnist(download_timeout)
            return train, test, "mnist"
        except Exception as e:  # no network, blocked host, corrupt cache...
            errors.append(f"MNIST via keras.datasets: {type(e).__name__}: {str(e)[:200]}")
            _logger.warning("tf_dp: MNIST could not be loaded (%s); trying Fashion-MNIST", errors[-1])
    for directory in [data_dir] if data_dir is not None else [DEBIAN_FASHION_MNIST_DIR]:
        try:
            train, test = load_fashion_mnist_idx(directory)
            return train, test, "fashion_mnist"
        except (OSError, ValueError) as e:
            errors.append(f"Fashion-MNIST from {directory}: {e}")
    raise DataNotFoundError(
        "no training data found (tf_dp never substitutes synthetic data). Tried:\n  - "
        + "\n  - ".join(errors)
        + "\nInstall the Debian package (apt-get install dataset-fashion-mnist) or pass a "
        "directory holding the Fashion-MNIST IDX files (train-images-idx3-ubyte.gz, ...)."
    )
