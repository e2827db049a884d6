"""ArrayRecord files as a random-access source (the ``array-record`` package).

ArrayRecord files carry their own index of chunks, so records are read by number without an
indexing pass. Files written with ``group_size:1`` (one record per chunk) read one record per
access; a larger group size makes every random read decompress a whole group of records.

Example::

    from array_record.python.array_record_module import ArrayRecordWriter
    writer = ArrayRecordWriter("train.array_record", "group_size:1")
    for example in examples:
        writer.write(example.SerializeToString())
    writer.close()

    source = tf_dp.data.ArrayRecordSource(["train.array_record"], parse_fn=parse)
    model.fit(tf_dp.data.poisson_sample(source, sampling_probability=1e-3), epochs=1)
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional, Sequence, Union

import numpy as np

from tf_dp.data.files import FileSet
from tf_dp.data.source import check_indices, record_batch

#: Reader options for random access (no read-ahead, no reader threads).
RANDOM_ACCESS_OPTIONS = "readahead_buffer_size:0,max_parallelism:0"


class ArrayRecordSource:
    """Random access to the records of ArrayRecord files.

    Args:
      paths: an ArrayRecord file or a sequence of them; records are numbered file after file.
      parse_fn: maps a batch of records (a 1-D numpy object array of ``bytes``) to what ``read``
        returns, e.g. ``(x, y)`` numpy arrays; default: the bytes array itself.

    ``paths`` must name distinct files (the same file twice, or a hard or symbolic link to one
    of them, raises ``ValueError``: its records would count twice). A file the reader cannot
    open as ArrayRecord (truncated, corrupt, another format) or that holds no records raises
    ``ValueError`` naming it: a broken file reads as 0 records, which would shrink the data set
    and the recorded population size silently. ``len`` and every ``read`` (before and after
    reading) check that no file changed since opening (:class:`tf_dp.data.files.FileSet`:
    device, inode, size, modification time in ns, and a content digest when the inode change
    time moved), and every ``read`` checks the readers' status.

    Example::

        source = ArrayRecordSource("train.array_record")
        len(source), source.read(np.array([0]))
    """

    def __init__(
        self,
        paths: Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]],
        parse_fn: Optional[Callable[[np.ndarray], Any]] = None,
    ):
        try:
            from array_record.python.array_record_module import ArrayRecordReader
        except ImportError as e:  # pragma: no cover - array-record is in the "data" extra
            raise ImportError(
                "ArrayRecordSource needs array-record: pip install 'tf_dp[data]'"
            ) from e
        if parse_fn is not None and not callable(parse_fn):
            raise TypeError(f"parse_fn must be callable or None, got {type(parse_fn).__name__}")
        self._files = FileSet(paths)
        self._parse_fn = parse_fn
        self._readers = []
        try:
            for p in self._files.paths:
                reader = ArrayRecordReader(p, RANDOM_ACCESS_OPTIONS)
                self._readers.append(reader)
                if not reader.ok():
                    raise ValueError(
                        f"paths: {p} is not a readable ArrayRecord file (truncated, corrupt, or "
                        "another format: the ArrayRecord reader reports an error)"
                    )
                if reader.num_records() < 1:
                    raise ValueError(
                        f"paths: {p} holds no records (an ArrayRecord file that is broken in "
                        "a way its reader does not report also reads as empty): every file "
                        "must hold at least one record; leave empty files out of paths"
                    )
            self._files.check()  # the readers' indices describe the files as they were seen
        except BaseException:
            self.close()
            raise
        counts = [r.num_records() for r in self._readers]
        self._starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    def __len__(self) -> int:
        self._files.check()
        return int(self._starts[-1])

    def read(self, indices: np.ndarray) -> Any:
        """The records at ``indices`` (in that order), through ``parse_fn``."""
        idx = check_indices(indices, len(self))
        unique, inverse = np.unique(idx, return_inverse=True)
        files = np.searchsorted(self._starts, unique, side="right") - 1
        records: list = []
        for f in np.unique(files).tolist():
            local = unique[files == f] - self._starts[f]
            got = self._readers[f].read(local.tolist())
            if not self._readers[f].ok() or len(got) != len(local):
                raise ValueError(
                    f"paths: reading records of {self._files.paths[f]} failed (the ArrayRecord "
                    "reader reports an error): the file is corrupt or changed"
                )
            records.extend(got)
        self._files.check()  # nor while reading
        return record_batch(records, inverse, self._parse_fn)

    def close(self) -> None:
        """Closes the readers."""
        for r in self._readers:
            try:
                r.close()
            except RuntimeError:  # a reader in error reports it again when closed
                pass
        self._readers = []
