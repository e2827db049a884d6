"""The files behind a file-backed source, and a check that none changed since it was opened.

A sampler fixes the population ``n`` when it starts; a file that grows, shrinks or is rewritten
afterwards would make the recorded ``n`` (and, for indexed formats, the record offsets) false.
:meth:`FileSet.check` compares each file's size and modification time with those seen at opening.

Example::

    files = FileSet(["a.tfrecord", "b.tfrecord"])
    files.check()   # raises ValueError naming the file if one changed
"""

from __future__ import annotations

import os
from typing import Sequence, Union

PathLike = Union[str, os.PathLike]


class FileSet:
    """Paths of existing files, with their size and modification time when opened."""

    def __init__(self, paths: Union[PathLike, Sequence[PathLike]], arg: str = "paths"):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError(f"{arg} must name at least one file")
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{arg}: no such file: {p}")
        self.arg = arg
        self.paths = paths
        self._stats = [self._stat(p) for p in paths]

    @staticmethod
    def _stat(path: str) -> tuple[int, int]:
        st = os.stat(path)
        return st.st_size, st.st_mtime_ns

    @property
    def sizes(self) -> list[int]:
        """Size of each file when opened, in bytes."""
        return [size for size, _ in self._stats]

    def check(self) -> None:
        """Raises ``ValueError`` if a file changed size or modification time since opening."""
        for path, seen in zip(self.paths, self._stats):
            now = self._stat(path)
            if now != seen:
                raise ValueError(
                    f"{self.arg}: {path} changed while in use (size {seen[0]} -> {now[0]} bytes): "
                    "a source's records must not change during training (the recorded population "
                    "size would be false); open a new source"
                )
