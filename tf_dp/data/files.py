"""The files behind a file-backed source: each counted once, and a check that none changed.

A sampler fixes the population ``n`` when it starts, and a file source numbers its records file
after file. Two things would make the recorded ``n`` (and the privacy bound) false:

- **The same file twice** (the same path twice, a hard link, a symbolic link): each of its records
  would be counted twice in ``n`` and get two chances to be sampled at every step. A
  :class:`FileSet` opened with ``distinct=True`` (what :class:`~tf_dp.data.TFRecordSource` and
  :class:`~tf_dp.data.ArrayRecordSource` do) refuses it: files are compared by device and inode
  (``st_dev``, ``st_ino``, symbolic links followed), not by name.
- **A file that changes** while it is sampled (grows, shrinks, is rewritten or replaced): the
  index built at opening (record offsets, record counts, HDF5 metadata) no longer describes it.

:meth:`FileSet.check` compares each file's identity now with the one seen at opening: device,
inode, size and modification time in nanoseconds (``st_mtime_ns``); any difference raises. A
rewrite that keeps the size and restores the modification time (``os.utime``) still moves the
inode change time (``st_ctime_ns``, which no user call can set back): when that time moved, the
check reads the file's *content digest* again and raises if it differs. The digest (BLAKE2b)
covers the size, the first and last 64 KiB and 4 KiB blocks at 62 evenly spaced offsets in
between, read with ``pread``: every byte of a file up to 128 KiB, at most 376 KiB of any file.
A change of metadata only (``chmod``, a new hard link) moves the inode change time but leaves
the digest, and is accepted. The kernel may stamp times from a coarse clock (a few ms; 1-2 s on
some file systems), so a rewrite just after the file's last change could keep its inode change
time: until a check finds the file unchanged :data:`SETTLE_NS` after that last change, every
check reads the digest. After that, a check costs one ``os.stat`` per file. Not detected: a
rewrite that restores the modification time and changes only bytes outside the digest's blocks
of a file above 128 KiB (a TFRecord record whose data changed still fails its CRC check when
read), and changes on a file system whose clock is more than :data:`SETTLE_NS` behind this
machine's (a network file system's server).

Example::

    files = FileSet(["a.tfrecord", "b.tfrecord"])
    files.check()   # raises ValueError naming the file if one changed
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from typing import Optional, Sequence, Union

PathLike = Union[str, os.PathLike]

#: Bytes of the digest's first and last blocks.
EDGE_BLOCK = 1 << 16
#: Bytes of each evenly spaced block in between, and their number.
PROBE_BLOCK = 1 << 12
PROBES = 62
#: A file's inode change time is trusted (checks stop reading its digest) once a check found it
#: unchanged this many nanoseconds after it: longer than any file system's timestamp granularity.
SETTLE_NS = 3 * 10**9


def content_digest(path: str, size: int) -> bytes:
    """BLAKE2b of ``size`` and of the file's first and last :data:`EDGE_BLOCK` bytes and
    :data:`PROBES` blocks of :data:`PROBE_BLOCK` bytes evenly spaced between them (the whole
    file when it is at most ``2 * EDGE_BLOCK`` bytes). ``size`` is the size seen by the caller's
    ``os.stat``; fewer bytes read (the file shrank since) change the digest.

    Example: ``content_digest("a.tfrecord", os.path.getsize("a.tfrecord"))`` (16 bytes).
    """
    h = hashlib.blake2b(size.to_bytes(8, "little"), digest_size=16)
    if size <= 2 * EDGE_BLOCK:
        ranges = [(0, size)]
    else:
        inner = size - 2 * EDGE_BLOCK
        step = inner / (PROBES + 1)
        probes = [EDGE_BLOCK + int(step * (i + 1)) - PROBE_BLOCK // 2 for i in range(PROBES)]
        ranges = [(0, EDGE_BLOCK)] + [(p, PROBE_BLOCK) for p in probes]
        ranges.append((size - EDGE_BLOCK, EDGE_BLOCK))
    fd = os.open(path, os.O_RDONLY)
    try:
        for offset, length in ranges:
            data = os.pread(fd, length, offset)
            h.update(len(data).to_bytes(8, "little"))
            h.update(data)
    finally:
        os.close(fd)
    return h.digest()


@dataclasses.dataclass
class _Seen:
    """What :class:`FileSet` saw of one file at opening."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    digest: bytes
    settled: bool = False


def _seen(path: str, st: Optional[os.stat_result] = None) -> _Seen:
    st = os.stat(path) if st is None else st
    return _Seen(
        st.st_dev,
        st.st_ino,
        st.st_size,
        st.st_mtime_ns,
        st.st_ctime_ns,
        content_digest(path, st.st_size),
    )


class FileSet:
    """Paths of existing files, each checked for changes against what was seen when opened.

    Args:
      paths: a path or a sequence of paths.
      arg: the argument's name, in error messages.
      distinct: refuse two paths to the same file (by device and inode: the same path twice, a
        hard link, a symbolic link). Sources that number records file after file need it; a
        source whose arrays may share a file (HDF5 datasets of one file) passes ``False`` and
        keeps each file once.

    Example::

        files = FileSet(["a.tfrecord", "b.tfrecord"])   # ValueError if both name one file
        files.check()                                   # ValueError if either changed since
    """

    def __init__(
        self,
        paths: Union[PathLike, Sequence[PathLike]],
        arg: str = "paths",
        distinct: bool = True,
    ):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [os.fspath(p) for p in paths]
        if not paths:
            raise ValueError(f"{arg} must name at least one file")
        for p in paths:
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{arg}: no such file: {p}")
        self.arg = arg
        stats = [os.stat(p) for p in paths]
        first: dict[tuple[int, int], str] = {}
        kept, kept_stats = [], []
        for p, st in zip(paths, stats):
            key = (st.st_dev, st.st_ino)
            if key in first:
                if not distinct:
                    continue
                raise ValueError(
                    f"{arg}: {first[key]!r} and {p!r} are the same file (device {st.st_dev}, "
                    f"inode {st.st_ino}: the same path twice, a hard link or a symbolic link); "
                    "its records would be counted twice in the population and each would get "
                    "two chances to be sampled at every step, so the recorded population size "
                    "and the privacy bound would be false: give each file once"
                )
            first[key] = p
            kept.append(p)
            kept_stats.append(st)
        self.paths = kept
        self._seen = [_seen(p, st) for p, st in zip(kept, kept_stats)]

    @property
    def sizes(self) -> list[int]:
        """Size of each file when opened, in bytes."""
        return [s.size for s in self._seen]

    def check(self) -> None:
        """Raises ``ValueError`` naming the file if one was removed, replaced, resized, given
        another modification time, or rewritten with its modification time restored (its
        content digest differs) since opening. See the module docstring for what is covered."""
        for path, seen in zip(self.paths, self._seen):
            try:
                st = os.stat(path)
            except OSError as e:
                self._changed(path, f"it can no longer be read: {e.strerror}")
            if (st.st_dev, st.st_ino) != (seen.device, seen.inode):
                self._changed(
                    path,
                    f"replaced by another file: device/inode {seen.device}/{seen.inode} -> "
                    f"{st.st_dev}/{st.st_ino}",
                )
            if st.st_size != seen.size:
                self._changed(path, f"size {seen.size} -> {st.st_size} bytes")
            if st.st_mtime_ns != seen.mtime_ns:
                self._changed(path, f"modification time {seen.mtime_ns} -> {st.st_mtime_ns} ns")
            if st.st_ctime_ns != seen.ctime_ns or not seen.settled:
                now = time.time_ns()  # before the digest: a later write moves the ctime
                if content_digest(path, st.st_size) != seen.digest:
                    self._changed(
                        path,
                        "its content differs with the same size and modification time (a "
                        "rewrite with the modification time restored)",
                    )
                seen.ctime_ns = st.st_ctime_ns  # metadata only: chmod, a new link...
                seen.settled = now >= st.st_ctime_ns + SETTLE_NS

    def _changed(self, path: str, what: str) -> None:
        raise ValueError(
            f"{self.arg}: {path} changed while in use ({what}): a source's records must not "
            "change during training (the recorded population size, and the records read, "
            "would be false); open a new source on the new files"
        )
