"""Progress lines for tf_dp's long work (tracing a big model's first DP step, calibrating noise,
accounting a long ledger, audits), so that a minute of work is not a minute of silence.

Work wrapped in :func:`working` prints nothing when it ends within ``delay`` seconds (5 by
default): past that, a line on stderr says what is running and for how long, again every
``interval`` seconds (15), and once more when it ends. Loops over known counts use
:func:`counted`, which also says how far they got.

Off switch: ``tf_dp.set_progress(False)`` (or ``True`` to turn it back on), or the environment
variable ``TF_DP_PROGRESS=0`` (read when a piece of work starts; ``1`` turns it on). Each line
also goes to the ``tf_dp`` logger at DEBUG (not INFO: a program whose logging shows INFO, such
as the absl command-line tools, would show each line twice).

Example::

    import tf_dp
    tf_dp.set_progress(False)        # no progress lines from tf_dp
    with tf_dp._progress.working("calibrating the noise (pld)"):
        ...                           # after 5 s: "tf_dp: calibrating the noise (pld)... 5 s"
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
from collections.abc import Iterator

_logger = logging.getLogger("tf_dp")
_enabled: bool | None = None  # None: from the environment variable (default on)

#: seconds before the first line, and between lines
DELAY, INTERVAL = 5.0, 15.0


def set_progress(enabled: bool) -> None:
    """Turns tf_dp's progress lines on or off for this process (overrides ``TF_DP_PROGRESS``).

    Example::

        tf_dp.set_progress(False)   # silent, e.g. in a batch job's logs
    """
    global _enabled
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    _enabled = enabled


def progress_enabled() -> bool:
    """Whether progress lines are shown: :func:`set_progress`'s choice, else ``TF_DP_PROGRESS``
    (``0``, ``false``, ``off`` or ``no`` turn them off; on by default)."""
    if _enabled is not None:
        return _enabled
    value = os.environ.get("TF_DP_PROGRESS", "1").strip().lower()
    return value not in ("0", "false", "off", "no")


def _emit(message: str) -> None:
    line = f"tf_dp: {message}"
    _logger.debug(line)
    try:
        print(line, file=sys.stderr, flush=True)
    except (OSError, ValueError):  # a closed stderr: progress is never worth an error
        pass


class _Work:
    """One piece of work: its description, start time, when its next line is due and (for
    loops) its count. One shared monitor thread writes the lines (:func:`_monitor`), so a piece
    of work costs a list append, not a thread."""

    def __init__(self, what: str, total: int | None, delay: float, interval: float):
        self.what, self.total = what, total
        self.interval = interval
        self.done = 0
        self.start = time.monotonic()
        self.due = self.start + delay
        self.shown = False

    def status(self) -> str:
        elapsed = time.monotonic() - self.start
        count = "" if self.total is None else f" {self.done}/{self.total}"
        return f"{self.what}...{count} {elapsed:.0f} s"

    def __enter__(self) -> _Work:
        with _lock:
            _active.append(self)
        _ensure_monitor()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with _lock:
            _active.remove(self)
            shown = self.shown
        if shown:
            elapsed = time.monotonic() - self.start
            outcome = "done" if exc_type is None else f"stopped ({exc_type.__name__})"
            _emit(f"{self.what}: {outcome} in {elapsed:.1f} s")


_lock = threading.Lock()
_active: list[_Work] = []
_monitor_thread: threading.Thread | None = None
#: how often the monitor looks at the work in progress (seconds)
_POLL = 0.5


def _monitor() -> None:
    while True:
        time.sleep(_POLL)
        now = time.monotonic()
        with _lock:
            due = [w for w in _active if w.due <= now]
            for w in due:
                w.shown, w.due = True, now + w.interval
            lines = [w.status() for w in due]
        for line in lines:
            _emit(line)


def _ensure_monitor() -> None:
    global _monitor_thread
    with _lock:
        if _monitor_thread is None or not _monitor_thread.is_alive():
            _monitor_thread = threading.Thread(target=_monitor, name="tf_dp-progress",
                                               daemon=True)
            _monitor_thread.start()


@contextlib.contextmanager
def working(what: str, total: int | None = None, delay: float | None = None,
            interval: float | None = None) -> Iterator[_Work | None]:
    """Shows progress lines for the work inside the block if it lasts more than ``delay``
    seconds (and progress is on); yields the work (set its ``done`` count for loops) or None.
    Costs a list append: one daemon thread, started on first use, writes every line."""
    if not progress_enabled():
        yield None
        return
    with _Work(what, total, DELAY if delay is None else delay,
               INTERVAL if interval is None else interval) as work:
        yield work


def counted(items, what: str, total: int | None = None):
    """``items`` as they are, with progress lines (``what... i/total``) while the loop runs."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)
    with working(what, total) as work:
        for item in items:
            yield item
            if work is not None:
                work.done += 1
