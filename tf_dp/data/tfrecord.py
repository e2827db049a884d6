"""TFRecord files as a random-access source: one indexing pass, then reads by offset.

A TFRecord file is a sequence of records, each framed as::

    uint64 length | uint32 masked CRC-32C of length | data[length] | uint32 masked CRC-32C of data

(little-endian). :class:`TFRecordSource` walks the headers of every file once (the data is not
read) and keeps, per record, the offset of its data as an int64 (8 bytes per record: 80 MB for
10^7 records; one array per file, filled in place by the indexing pass) and, per file, where its
records start. A read then fetches each asked-for record
with one ``pread`` at its offset and checks its CRC before handing it over. Only uncompressed
TFRecord files have offsets (a GZIP/ZLIB file must be decompressed from its start).

Example::

    spec = {"x": tf.io.FixedLenFeature([784], tf.float32), "y": tf.io.FixedLenFeature([], tf.int64)}

    def parse(serialized):  # a batch of serialized tf.train.Example -> (x, y)
        f = tf.io.parse_example(serialized, spec)
        return f["x"].numpy(), f["y"].numpy()

    source = tf_dp.data.TFRecordSource(tf.io.gfile.glob("train-*.tfrecord"), parse_fn=parse)
    model.fit(tf_dp.data.poisson_sample(source, sampling_probability=1e-3), epochs=1)
"""

from __future__ import annotations

import array
import mmap
import os
import struct
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from tf_dp.data.files import FileSet

_MASK_DELTA = 0xA282EAD8
#: The indexing pass maps each file and releases the pages it has walked every this many bytes.
_DROP_EVERY = 1 << 22


def _crc32c(data: bytes) -> int:
    try:
        import google_crc32c
    except ImportError as e:  # pragma: no cover - google-crc32c is in the "data" extra
        raise ImportError("TFRecordSource needs google-crc32c: pip install 'tf_dp[data]'") from e
    return google_crc32c.value(data)


def masked_crc(data: bytes) -> int:
    """The masked CRC-32C that TFRecord framing stores (``rot15(crc) + 0xa282ead8``)."""
    crc = _crc32c(data)
    return ((((crc >> 15) | (crc << 17)) & 0xFFFFFFFF) + _MASK_DELTA) & 0xFFFFFFFF


def _index_file(path: str) -> "array.array":
    """Data offsets of the records of one TFRecord file (length CRCs checked)."""
    offsets = array.array("q")
    size = os.path.getsize(path)
    if size == 0:
        return offsets
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        off = dropped = 0
        unpack = struct.unpack_from
        while off < size:
            if off - dropped >= _DROP_EVERY:  # the walked pages leave this process's memory
                end = off - off % mmap.PAGESIZE
                mm.madvise(mmap.MADV_DONTNEED, dropped, end - dropped)
                dropped = end
            if off + 12 > size:
                raise ValueError(f"paths: {path} is truncated at byte {off} (a partial header)")
            length, length_crc = unpack("<QI", mm, off)
            if masked_crc(mm[off : off + 8]) != length_crc:
                raise ValueError(
                    f"paths: {path} fails the CRC check of the record header at byte {off} "
                    "(corrupt, compressed, or not a TFRecord file)"
                )
            end = off + 16 + length
            if end > size:
                raise ValueError(f"paths: {path} is truncated in the record at byte {off}")
            offsets.append(off + 12)
            off = end
    return offsets


class TFRecordSource:
    """Random access to the records of uncompressed TFRecord files.

    Args:
      paths: a TFRecord file or a sequence of them; records are numbered file after file.
      parse_fn: maps a batch of records (a 1-D numpy object array of ``bytes``, e.g. serialized
        ``tf.train.Example``) to what ``read`` returns, e.g. ``(x, y)`` numpy arrays with one row
        per record. Default: ``read`` returns the bytes array itself.

    The index (built once, in ``__init__``) holds 8 bytes per record. ``paths`` must name
    distinct files (the same file twice, or a hard or symbolic link to one of them, raises
    ``ValueError``: its records would count twice). ``len`` and every ``read`` (before and after
    reading) check that no file changed since opening (:class:`tf_dp.data.files.FileSet`:
    device, inode, size, modification time in ns, and a content digest when the inode change
    time moved), and every ``read`` checks each record's data CRC.

    Example::

        source = TFRecordSource(["a.tfrecord", "b.tfrecord"])
        first_two = source.read(np.array([0, 1]))   # array([b'...', b'...'], dtype=object)
    """

    def __init__(
        self,
        paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        parse_fn: Optional[Callable[[np.ndarray], Any]] = None,
    ):
        self._files = FileSet(paths)
        if parse_fn is not None and not callable(parse_fn):
            raise TypeError(f"parse_fn must be callable or None, got {type(parse_fn).__name__}")
        self._parse_fn = parse_fn
        # One int64 array per file, viewed (not copied) from the array the indexing pass filled.
        self._offsets = [np.frombuffer(_index_file(p), np.int64) for p in self._files.paths]
        counts = np.array([len(o) for o in self._offsets], np.int64)
        #: record number where each file starts (and the total at the end)
        self._starts = np.concatenate([[0], np.cumsum(counts)])
        self._sizes = self._files.sizes
        self._fds = [os.open(p, os.O_RDONLY) for p in self._files.paths]
        self._files.check()  # the index describes the files as they were seen

    def __len__(self) -> int:
        self._files.check()
        return int(self._starts[-1])

    @property
    def index_bytes(self) -> int:
        """Memory held by the index (record offsets and file starts), in bytes."""
        return sum(o.nbytes for o in self._offsets) + self._starts.nbytes

    def read(self, indices: np.ndarray) -> Any:
        """The records at ``indices`` (in that order), CRC-checked, through ``parse_fn``."""
        from tf_dp.data.source import check_indices, record_batch

        idx = check_indices(indices, len(self))
        unique, inverse = np.unique(idx, return_inverse=True)
        files = np.searchsorted(self._starts, unique, side="right") - 1
        records: list = []
        for f in np.unique(files).tolist():
            offsets = self._offsets[f]
            local = unique[files == f] - self._starts[f]
            starts = offsets[local]
            # A record's data ends 16 bytes before the next one's starts (4 before the file end).
            after = local + 1
            following = np.where(
                after < len(offsets),
                offsets[np.minimum(after, len(offsets) - 1)],
                self._sizes[f] + 12,
            )
            for i, start, end in zip(local.tolist(), starts.tolist(), (following - 16).tolist()):
                blob = os.pread(self._fds[f], end - start + 4, start)
                data, crc = blob[:-4], blob[-4:]
                if len(blob) != end - start + 4 or masked_crc(data) != int.from_bytes(
                    crc, "little"
                ):
                    raise ValueError(
                        f"paths: record {i + self._starts[f]} ({self._files.paths[f]}, byte "
                        f"{start - 12}) fails its CRC check: the file is corrupt"
                    )
                records.append(data)
        self._files.check()  # nor while reading
        return record_batch(records, inverse, self._parse_fn)

    def close(self) -> None:
        """Closes the files (the source cannot read afterwards)."""
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass
