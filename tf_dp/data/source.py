"""Random-access sources: anything that fetches records by index, for Poisson sampling.

A *random-access source* has a length and reads the records at given indices. That is all
:func:`tf_dp.data.poisson_sample` needs to draw exact Poisson samples from data that does not fit
in memory: it reads only the sampled records, never a copy of the whole data set.

The protocol (:class:`RandomAccessSource`)::

    class MySource:
        def __len__(self) -> int: ...                  # number of records
        def read(self, indices: np.ndarray) -> Any:    # a batch: the records at `indices`, in
            ...                                        # that order, as numpy arrays (rows first)

For training with ``fit``, ``read`` returns ``(x, y)`` or ``(x, y, sample_weight)``, each a numpy
array or a nested structure (dict, tuple) of arrays with one row per index. Adapters:

- :class:`ArraySource`: numpy arrays, ``np.memmap`` files, ``h5py`` datasets, and any other
  array-like with ``len`` and integer-array indexing;
- :func:`tf_dp.data.hdf5_source`: datasets of an HDF5 file, by name;
- :class:`tf_dp.data.ArrayRecordSource`: ArrayRecord files;
- :class:`tf_dp.data.TFRecordSource`: TFRecord files (one indexing pass, then reads by offset).

Example::

    x = np.memmap("images.u8", dtype=np.uint8, mode="r").reshape(-1, 28, 28, 1)
    y = np.memmap("labels.u8", dtype=np.uint8, mode="r")
    batches = tf_dp.data.poisson_sample(tf_dp.data.ArraySource(x, y), sampling_probability=1e-3)
"""

from __future__ import annotations

import os
from typing import Any, Optional, Protocol, runtime_checkable

import numpy as np
import tensorflow as tf

from tf_dp.data.files import FileSet


@runtime_checkable
class RandomAccessSource(Protocol):
    """Records fetched by index: ``len(source)`` and ``source.read(indices) -> batch``."""

    def __len__(self) -> int: ...

    def read(self, indices: np.ndarray) -> Any: ...


def check_indices(indices: Any, length: int) -> np.ndarray:
    """``indices`` as a 1-D int64 array, each in ``[0, length)``; raises ``IndexError`` otherwise.

    Example: ``check_indices([3, 0], 10)`` gives ``array([3, 0])``.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or (idx.size and not np.issubdtype(idx.dtype, np.integer)):
        raise IndexError(
            f"indices must be a 1-D array of integers, got shape {idx.shape} and dtype {idx.dtype}"
        )
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < 0 or idx.max() >= length):
        bad = idx[(idx < 0) | (idx >= length)][0]
        raise IndexError(f"indices must be in [0, {length}) (the source's length), got {bad}")
    return idx


def record_batch(records: list, inverse: np.ndarray, parse_fn: Any = None) -> Any:
    """The byte records read for the distinct sorted indices, put back in the caller's order
    (``inverse`` from ``np.unique(..., return_inverse=True)``) as a 1-D object array, then through
    ``parse_fn`` when given (the record files' ``read``)."""
    batch = np.empty(len(records), dtype=object)
    batch[:] = records
    batch = batch[inverse]
    return batch if parse_fn is None else parse_fn(batch)


def read_rows(array: Any, indices: np.ndarray) -> np.ndarray:
    """The rows ``indices`` of an array-like, read in increasing order of index (each once: what
    h5py requires, and what keeps memmap reads local), returned in the order asked."""
    unique, inverse = np.unique(indices, return_inverse=True)
    rows = np.asarray(array[unique] if unique.size else array[0:0])
    return rows[inverse]


class ArraySource:
    """A random-access source over array-likes: numpy arrays, memmaps, h5py datasets...

    Args:
      x: an array-like, or a nested structure (dict, tuple) of them, with ``n`` rows each.
      y: optional targets, same rules. With ``y``, ``read`` returns ``(x, y)``; without, ``x``.
      sample_weight: optional per-record weights (an array-like of ``n`` rows).

    Nothing is copied: ``read`` indexes the array-likes with the requested rows only, and
    ``len`` is asked of them on every call (a data set that grows or shrinks is noticed).
    Array-likes backed by a file (``np.memmap``, including ``np.load(..., mmap_mode="r")``, and
    h5py datasets of a file on disk) are checked too: ``len`` and every ``read`` (before and
    after reading) raise ``ValueError`` naming the file if it changed since the source was made
    (:class:`tf_dp.data.files.FileSet`: device, inode, size, modification time in ns, and a
    content digest when the inode change time moved). A file truncated or rewritten under a
    memmap or h5py would otherwise read as rows of zeros, or crash the process (``SIGBUS``; a
    memmap's file truncated between the check and the read still does).

    Example::

        source = ArraySource(np.load("x.npy", mmap_mode="r"), np.load("y.npy", mmap_mode="r"))
        xb, yb = source.read(np.array([5, 2]))
    """

    def __init__(self, x: Any, y: Any = None, sample_weight: Any = None):
        self._parts = tuple(p for p in (x, y, sample_weight) if p is not None)
        if y is None and sample_weight is not None:
            raise ValueError("sample_weight needs y: Keras applies weights only with targets")
        self._has_y = y is not None
        self._leaves = tf.nest.flatten(self._parts)
        if not self._leaves:
            raise ValueError("x must hold at least one array")
        for leaf in self._leaves:
            if not (hasattr(leaf, "__len__") and hasattr(leaf, "__getitem__")):
                raise TypeError(
                    "x, y and sample_weight must be array-likes with len() and integer-array "
                    f"indexing (numpy arrays, memmaps, h5py datasets), got {type(leaf).__name__}"
                )
        paths = [p for p in map(_backing_file, self._leaves) if p is not None]
        self._files = (
            FileSet(paths, arg="x, y and sample_weight", distinct=False) if paths else None
        )
        self._check_lengths()

    def _check_lengths(self) -> int:
        if self._files is not None:
            self._files.check()
        lengths = {len(leaf) for leaf in self._leaves}
        if len(lengths) != 1:
            raise ValueError(
                f"x, y and sample_weight must have the same number of rows, got {sorted(lengths)}"
            )
        return lengths.pop()

    def __len__(self) -> int:
        return self._check_lengths()

    def read(self, indices: np.ndarray) -> Any:
        """The records at ``indices`` (in that order): ``x``, or ``(x, y[, sample_weight])``."""
        idx = check_indices(indices, len(self))
        parts = tf.nest.map_structure(lambda a: read_rows(a, idx), self._parts)
        if self._files is not None:
            self._files.check()  # nor while reading
        return parts if self._has_y else parts[0]


def _backing_file(leaf: Any) -> Optional[str]:
    """The file on disk an array-like reads from: a memmap's, an h5py dataset's (not of an
    in-memory HDF5 file); ``None`` for anything else."""
    if isinstance(leaf, np.memmap):
        path = getattr(leaf, "filename", None)
    else:
        handle = getattr(leaf, "file", None)
        path = getattr(handle, "filename", None)
        if getattr(handle, "driver", "core") == "core":
            path = None
    return path if isinstance(path, str) and os.path.isfile(path) else None


def hdf5_source(
    path: str, x: str, y: Optional[str] = None, sample_weight: Optional[str] = None
) -> ArraySource:
    """An :class:`ArraySource` over datasets of an HDF5 file (opened read-only with h5py).

    Args:
      path: the HDF5 file.
      x, y, sample_weight: names of its datasets (``y`` and ``sample_weight`` optional).

    The file is checked before and after every read, as for any :class:`ArraySource` over h5py
    datasets: if it was truncated, rewritten or replaced since, ``read`` and ``len`` raise
    ``ValueError`` naming it (h5py itself would return rows of zeros).

    Example::

        source = tf_dp.data.hdf5_source("train.h5", x="images", y="labels")
        batches = tf_dp.data.poisson_sample(source, sampling_probability=1e-3)
    """
    try:
        import h5py
    except ImportError as e:  # pragma: no cover - h5py is in the "data" extra
        raise ImportError("hdf5_source needs h5py: pip install 'tf_dp[data]'") from e
    handle = h5py.File(path, "r")
    names = {"x": x, "y": y, "sample_weight": sample_weight}
    for arg, name in names.items():
        if name is not None and name not in handle:
            raise KeyError(f"{arg}={name!r} is not a dataset of {path} (it has {list(handle)})")
    source = ArraySource(*(handle[n] if n is not None else None for n in names.values()))
    source.file = handle  # keeps the file open as long as the source lives
    return source
