"""The ledger file: a versioned, checksummed JSON record of a run's sampling and sum-query events.

Format (version 3; version 2 is the same without ``origin``, ``unit`` and ``records_per_unit``,
version 1 also without ``pass_start``)::

    {
      "format": "tf_dp.privacy_ledger",
      "version": 1,
      "num_samples": 1200,                  # total number of samples (steps), after expanding runs
      "runs": [                              # consecutive identical samples, run-length encoded
        {"count": 1200,
         "sampling": {"population_size": 60000, "selection_probability": 0.004266,
                      "policy": "poisson"},
         "queries": [{"l2_sensitivity": 1.0, "noise_stddev": 1.1, "mechanism": "gaussian",
                      "jl_projections": null}]}
      ],
      "metadata": {...},                     # free-form, informative only (not used by accounting)
      "sha256": "<hex digest of the canonical JSON of every other key>"
    }

Optional query keys (still version 1: files without them read as before, and files written
without them are byte for byte what earlier versions wrote): ``noise_seed`` (seeded test/debug
runs only), ``tree_step`` (``"mechanism": "tree"`` queries only: the leaf's 0-based index in
its tree-aggregation tree) and ``noise_grid`` (grid-mode noise only: the grid spacing; the
sensitivity already includes the rounding term, so a reader that ignores the key still accounts
correctly), ``mf_strategy`` (``"mechanism": "mf"`` queries only: the correlated-noise strategy's
config, ``C``); optional sampling key ``pass_start`` (``true`` on the draws that start a new pass over
shuffled data; a file without it is one pass from its first draw). Version 3 sampling keys:
``origin`` (``"sampled"`` when tf_dp drew the batches; absent: ``"declared"``, a sampling the user
declared and tf_dp did not check), ``unit`` (``"user"`` for user-level DP, with
``records_per_unit``, the most records one sampled user contributes; absent: ``"example"``). Files
of versions 1 and 2 predate these keys: tf_dp did not record who drew their batches, so they
read as ``declared`` and example-level, and their statements say the sampling was not checked.
A file with any of these keys says version 3, as does a file with the sampling policies
``truncated_poisson`` (with the key ``max_batch_size``, the truncation ``B``) or
``balls_in_bins`` (readers that predate a policy reject the file, naming it).

Version 4 (the indexed form, written for :data:`INDEXED_MIN_RUNS` runs or more, e.g. a cyclic
clip schedule's 1e6 runs over 1e4 values) holds, in place of ``"runs"``, ``"entries"`` (each
distinct entry once: objects as in ``"runs"`` without ``"count"``), ``"codes"`` (for each run, the
index of its entry) and ``"counts"`` (its step count), so files and reading cost O(distinct
entries) of events and two integer arrays; it is written without indentation. A reader that
predates a
mechanism rejects the file as a malformed
event naming the mechanism, never misreads it.

Files are written atomically (temporary file in the same directory, fsync, rename), so a reader
never sees half a file. A rewritten file keeps the permission bits of the file it replaces; a new
file gets ``0666`` less the process's umask (``0644`` with the usual umask ``022``), like any file
``open`` creates. A file that fails to parse, has a different format/version, a bad checksum, or
a key given twice in one JSON object, or
events outside their valid ranges is rejected with :class:`LedgerFileError` naming the problem;
nothing is half-read.

The SHA-256 checksum detects corruption and accidental edits (a truncated copy, a changed digit).
It is not a signature: anyone who edits the file on purpose can recompute it, so it does not
protect a ledger against deliberate tampering. Keep ledgers where only trusted people can write,
or sign them separately.

This module is pure Python so that the accountants and command-line tools can read ledgers without
TensorFlow.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import tempfile
from typing import Any, Iterable, Mapping, Optional, Sequence

from tf_dp.ledger.events import (
    EntryCodes,
    SampleEntry,
    SamplingEvent,
    SumQueryEvent,
    compress,
    mf_strategy_json,
    without_gc,
)

FORMAT_NAME = "tf_dp.privacy_ledger"
FORMAT_VERSION = 3
#: The indexed form: a file of :data:`INDEXED_MIN_RUNS` runs or more lists each distinct entry
#: once (``"entries"``, objects as in ``"runs"`` without ``"count"``) and the runs as two
#: arrays, ``"codes"`` (the index of each run's entry) and ``"counts"``, in place of ``"runs"``.
INDEXED_VERSION = 4
#: Run count from which files are written in the indexed form (shorter files keep versions 1-3,
#: byte for byte).
INDEXED_MIN_RUNS = 10_000
#: Versions this reader understands. Version 2 adds the sampling key ``pass_start``, which an
#: accountant must not ignore (it would under-count epochs), so files that use it say version 2
#: and readers that predate it reject them; files without it are still written as version 1.
#: Version 3 adds ``origin``, ``unit`` and ``records_per_unit`` (what a statement must not
#: misreport: a checked claim, a user-level guarantee); files that use them say version 3.
READ_VERSIONS = (1, 2, 3, 4)


class LedgerFileError(ValueError):
    """A ledger file could not be read: missing, malformed, corrupted (bad checksum), truncated or
    from another version."""


def _refuse_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json`` object hook: a key given twice is refused (``json`` alone keeps the last one, so
    a second ``"noise_stddev"`` would silently replace the first)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise LedgerFileError(f"ledger file holds the key {key!r} twice in one JSON object")
        out[key] = value
    return out


def _canonical(payload: Mapping[str, Any]) -> bytes:
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()


def _query_payload(q: SumQueryEvent) -> dict[str, Any]:
    out: dict[str, Any] = {
        "l2_sensitivity": q.l2_sensitivity,
        "noise_stddev": q.noise_stddev,
        "mechanism": q.mechanism,
        "jl_projections": q.jl_projections,
    }
    if q.noise_seed is not None:  # only seeded (test/debug) runs carry the key
        out["noise_seed"] = q.noise_seed
    if q.tree_step is not None:  # only tree-aggregation queries carry the key
        out["tree_step"] = q.tree_step
    if q.noise_grid is not None:  # only grid-mode noise carries the key
        out["noise_grid"] = q.noise_grid
    if q.mf_strategy is not None:  # only correlated-noise (mf) queries carry the key
        out["mf_strategy"] = json.loads(q.mf_strategy)
    return out


def runs_payload(entries: Sequence[SampleEntry]) -> list[dict[str, Any]]:
    """``entries`` as run-length-encoded JSON runs (the ``"runs"`` value of a ledger file)."""
    return payload_from_runs(compress(entries))


def payload_from_runs(runs: Sequence[tuple[SampleEntry, int]]) -> list[dict[str, Any]]:
    """Runs ``[(entry, count), ...]`` as JSON runs (the ``"runs"`` value of a ledger file);
    consecutive identical runs are merged, so the result is what :func:`runs_payload` gives for
    the expanded steps."""
    out: list[dict[str, Any]] = []
    last: Optional[SampleEntry] = None
    for entry, count in runs:
        if out and entry == last:
            out[-1]["count"] += count
            continue
        out.append(
            {
                "count": count,
                "sampling": _sampling_payload(entry.sampling),
                "queries": [_query_payload(q) for q in entry.queries],
            }
        )
        last = entry
    return out


def _sampling_payload(s: SamplingEvent) -> dict[str, Any]:
    out: dict[str, Any] = {
        "population_size": s.population_size,
        "selection_probability": s.selection_probability,
        "policy": s.policy,
    }
    if s.pass_start:  # only draws that start a pass carry the key
        out["pass_start"] = True
    if s.origin != "declared":  # absent: declared (what every older file means too)
        out["origin"] = s.origin
    if s.unit != "example":
        out["unit"] = s.unit
        out["records_per_unit"] = s.records_per_unit
    if s.max_batch_size is not None:  # truncated_poisson only
        out["max_batch_size"] = s.max_batch_size
    if s.num_parts is not None:  # cyclic_poisson only
        out["num_parts"] = s.num_parts
    return out


def _file_version(runs: Sequence[tuple[SampleEntry, int]]) -> int:
    """The oldest version that can say everything in ``runs``."""
    if any(e.sampling.origin != "declared" or e.sampling.unit != "example"
           or e.sampling.policy not in ("poisson", "shuffle") for e, _ in runs):
        return 3
    return 2 if any(e.sampling.pass_start for e, _ in runs) else 1


def entries_to_payload(
    entries: Sequence[SampleEntry], metadata: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """Builds the JSON payload (with checksum) for ``entries``."""
    return runs_to_payload(compress(entries), metadata)


@without_gc
def _indexed_payload(
    runs: list[tuple[SampleEntry, int]], metadata: Optional[Mapping[str, Any]]
) -> dict[str, Any]:
    """The version 4 payload of ``runs``: each distinct entry once, runs as entry codes."""
    codes = EntryCodes()
    run_codes: list[int] = []
    counts: list[int] = []
    last = -1
    for entry, count in runs:
        code = codes.code(entry)
        if code == last:
            counts[-1] += count
        else:
            run_codes.append(code)
            counts.append(count)
            last = code
    return {
        "format": FORMAT_NAME,
        "version": INDEXED_VERSION,
        "num_samples": sum(counts),
        "entries": [
            {"sampling": _sampling_payload(e.sampling),
             "queries": [_query_payload(q) for q in e.queries]}
            for e in codes.entries
        ],
        "codes": run_codes,
        "counts": counts,
        "metadata": dict(metadata or {}),
    }


def runs_to_payload(
    runs: Sequence[tuple[SampleEntry, int]], metadata: Optional[Mapping[str, Any]] = None
) -> dict[str, Any]:
    """Builds the JSON payload (with checksum) for runs ``[(entry, count), ...]``; the same
    payload as :func:`entries_to_payload` gives for the expanded steps. From
    :data:`INDEXED_MIN_RUNS` runs on, the version 4 (indexed) form."""
    runs = list(runs)
    if len(runs) >= INDEXED_MIN_RUNS:
        payload = _indexed_payload(runs, metadata)
        payload["sha256"] = hashlib.sha256(_canonical(payload)).hexdigest()
        return payload
    payload: dict[str, Any] = {
        "format": FORMAT_NAME,
        "version": _file_version(runs),
        "num_samples": sum(count for _, count in runs),
        "runs": payload_from_runs(runs),
        "metadata": dict(metadata or {}),
    }
    payload["sha256"] = hashlib.sha256(_canonical(payload)).hexdigest()
    return payload


#: Most steps a ledger file may hold (far beyond any real training).
MAX_FILE_SAMPLES = 10**15

#: Most steps :func:`read_ledger_file` lists one entry per step; :func:`read_ledger_runs` reads
#: any file in memory proportional to its runs.
MAX_LISTED_SAMPLES = 10_000_000


def parse_runs(runs: Any) -> tuple[list[tuple[SampleEntry, int]], int]:
    """Validates run-length-encoded JSON runs (see :func:`runs_payload`) without expanding them.

    Returns ``([(entry, count), ...], total steps)``, consecutive identical runs merged (as
    :func:`~tf_dp.ledger.events.compress` gives). Counts must be integers in
    ``[1, MAX_FILE_SAMPLES]`` and so must their total.
    """
    out: list[tuple[SampleEntry, int]] = []
    total = 0
    try:
        for run in runs:
            count = run["count"]
            if isinstance(count, bool) or not (
                isinstance(count, int) and 1 <= count <= MAX_FILE_SAMPLES
            ):
                raise LedgerFileError(
                    f"run count must be an integer in [1, {MAX_FILE_SAMPLES:.0e}], got {count!r}"
                )
            total += count
            if total > MAX_FILE_SAMPLES:
                raise LedgerFileError(f"a ledger file holds at most {MAX_FILE_SAMPLES:.0e} steps")
            s = run["sampling"]
            entry = SampleEntry(
                sampling=SamplingEvent(
                    population_size=s["population_size"],
                    selection_probability=s["selection_probability"],
                    policy=s["policy"],
                    pass_start=s.get("pass_start", False),
                    origin=s.get("origin", "declared"),
                    unit=s.get("unit", "example"),
                    records_per_unit=s.get("records_per_unit"),
                    max_batch_size=s.get("max_batch_size"),
                    num_parts=s.get("num_parts"),
                ),
                queries=tuple(
                    SumQueryEvent(
                        l2_sensitivity=q["l2_sensitivity"],
                        noise_stddev=q["noise_stddev"],
                        mechanism=q["mechanism"],
                        jl_projections=q["jl_projections"],
                        noise_seed=q.get("noise_seed"),
                        tree_step=q.get("tree_step"),
                        noise_grid=q.get("noise_grid"),
                        mf_strategy=(None if q.get("mf_strategy") is None
                                     else mf_strategy_json(q["mf_strategy"])),
                    )
                    for q in run["queries"]
                ),
            )
            if out and out[-1][0] == entry:
                out[-1] = (entry, out[-1][1] + count)
            else:
                out.append((entry, count))
    except LedgerFileError:
        raise
    except (KeyError, TypeError, ValueError, ArithmeticError) as e:
        raise LedgerFileError(f"malformed ledger event: {e}") from None
    return out, total


def _indexed_arrays(payload: Mapping[str, Any]) -> tuple[list[SampleEntry], Any, Any, int]:
    """Validates the ``entries``, ``codes`` and ``counts`` of a version 4 payload (each distinct
    entry once, the arrays with a few passes each); returns ``(distinct entries, codes, counts,
    total steps)``, codes and counts as int64 arrays, consecutive equal entries merged."""
    import numpy as np

    entries, codes, counts = (payload.get(k) for k in ("entries", "codes", "counts"))
    if not all(isinstance(v, list) for v in (entries, codes, counts)) or len(codes) != len(counts):
        raise LedgerFileError(
            "malformed ledger event: a version 4 file needs lists 'entries', 'codes' and "
            "'counts', the last two of equal length"
        )
    if not all(isinstance(e, dict) for e in entries):
        raise LedgerFileError("malformed ledger event: 'entries' must hold JSON objects")
    # each entry validated as a run of one step
    distinct = [parse_runs([dict(e, count=1)])[0][0][0] for e in entries]
    if set(map(type, codes)) - {int} or (codes and not 0 <= min(codes) <= max(codes) < len(
            distinct)):
        raise LedgerFileError(
            f"malformed ledger event: codes must be integers in [0, {len(distinct)})"
        )
    if set(map(type, counts)) - {int} or (counts and not 1 <= min(counts) <= max(counts)
                                          <= MAX_FILE_SAMPLES):
        raise LedgerFileError(
            f"run count must be an integer in [1, {MAX_FILE_SAMPLES:.0e}]"
        )
    total = sum(counts)
    if total > MAX_FILE_SAMPLES:
        raise LedgerFileError(f"a ledger file holds at most {MAX_FILE_SAMPLES:.0e} steps")
    canonical = EntryCodes()  # equal entries listed twice share one code
    remap = np.array([canonical.code(e) for e in distinct] or [0], np.int64)
    code_array = remap[np.array(codes, np.int64)]
    count_array = np.array(counts, np.int64)
    if code_array.size:
        keep = np.flatnonzero(np.r_[True, code_array[1:] != code_array[:-1]])
        code_array, count_array = code_array[keep], np.add.reduceat(count_array, keep)
    return canonical.entries, code_array, count_array, total


@without_gc
def _parse_indexed(payload: Mapping[str, Any]) -> tuple[list[tuple[SampleEntry, int]], int]:
    """The runs of a version 4 payload, validated, and their total step count."""
    entries, codes, counts, total = _indexed_arrays(payload)
    return list(zip(map(entries.__getitem__, codes.tolist()), counts.tolist())), total


def read_ledger_codes(path: str | os.PathLike) -> tuple[list[SampleEntry], Any, Any]:
    """Reads and validates a ledger file as ``(entries, codes, counts)``: its distinct entries
    and, for each run, the index of its entry and its step count (int64 arrays), without
    building one object per run (``PrivacyLedger.load`` restores from it).

    Example::

        entries, codes, counts = read_ledger_codes("run.ledger.json")
        steps = int(counts.sum())
    """
    payload = _read_payload(path)
    with _NamingFile(path):
        return _payload_codes(payload)


def _payload_codes(payload: Any) -> tuple[list[SampleEntry], Any, Any]:
    import numpy as np

    if isinstance(payload, dict) and payload.get("version") == INDEXED_VERSION and not isinstance(
            payload.get("version"), bool):
        _check_payload(payload)
        entries, codes, counts, total = _indexed_arrays(payload)
        _check_total(payload, total)
        return entries, codes, counts
    codes_of = EntryCodes()
    runs = payload_to_runs(payload)
    codes = np.fromiter(map(codes_of.code, (e for e, _ in runs)), np.int64, len(runs))
    return codes_of.entries, codes, np.array([c for _, c in runs], np.int64)


def runs_to_entries(runs: Any) -> list[SampleEntry]:
    """Validates run-length-encoded JSON runs (see :func:`runs_payload`) and expands them (at
    most :data:`MAX_LISTED_SAMPLES` steps)."""
    parsed, total = parse_runs(runs)
    _check_listable(total)
    return [entry for entry, count in parsed for _ in range(count)]


def _check_listable(total: int) -> None:
    if total > MAX_LISTED_SAMPLES:
        raise LedgerFileError(
            f"the ledger holds {total} steps, more than can be listed one entry per step (at most "
            f"{MAX_LISTED_SAMPLES}); read it with tf_dp.ledger.read_ledger_runs, which does not "
            "list them"
        )


def payload_to_runs(payload: Any) -> list[tuple[SampleEntry, int]]:
    """Validates a parsed payload; returns its runs ``[(entry, count), ...]`` without expanding
    them (consecutive identical runs merged, as :func:`~tf_dp.ledger.events.compress` gives)."""
    _check_payload(payload)
    if payload["version"] == INDEXED_VERSION:
        runs, total = _parse_indexed(payload)
    else:
        runs, total = parse_runs(payload.get("runs"))
    _check_total(payload, total)
    return runs


def _check_total(payload: Mapping[str, Any], total: int) -> None:
    if total != payload.get("num_samples"):
        raise LedgerFileError(
            f"ledger says num_samples={payload.get('num_samples')!r} but holds {total}"
        )


def _check_payload(payload: Any) -> None:
    """Format, version and checksum of a parsed payload (the events are checked after)."""
    if not isinstance(payload, dict):
        raise LedgerFileError("ledger file must hold a JSON object")
    if payload.get("format") != FORMAT_NAME:
        raise LedgerFileError(f"not a tf_dp ledger file (format={payload.get('format')!r})")
    if payload.get("version") not in READ_VERSIONS or isinstance(payload.get("version"), bool):
        raise LedgerFileError(
            f"unsupported ledger version {payload.get('version')!r}; this tf_dp reads version "
            f"{' and '.join(map(str, READ_VERSIONS))}"
        )
    body = {k: v for k, v in payload.items() if k != "sha256"}
    try:
        digest = hashlib.sha256(_canonical(body)).hexdigest()
    except (TypeError, ValueError) as e:
        raise LedgerFileError(f"ledger file holds values that are not valid JSON numbers: {e}")
    if payload.get("sha256") != digest:
        raise LedgerFileError(
            "ledger checksum mismatch: the file was corrupted or edited after it was written"
        )


def payload_to_entries(payload: Any) -> list[SampleEntry]:
    """Validates a parsed payload and expands it to a list of :class:`SampleEntry` (at most
    :data:`MAX_LISTED_SAMPLES`; :func:`payload_to_runs` reads any ledger without listing it)."""
    runs = payload_to_runs(payload)
    _check_listable(sum(count for _, count in runs))
    return [entry for entry, count in runs for _ in range(count)]


def _current_umask() -> int:
    try:  # Linux: read it without changing it (os.umask would, briefly, for every thread)
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _file_mode(path: str) -> int:
    """The permission bits for a ledger written to ``path``: those of the file it replaces, or
    ``0666`` less the umask for a new file (what ``open`` would give it)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        return 0o666 & ~_current_umask()


class LedgerOverwriteError(LedgerFileError):
    """A ledger write was refused: the file at the path records more steps than the new ledger."""


def _check_not_shorter(path: str, new_steps: int) -> None:
    """Raises :class:`LedgerOverwriteError` if ``path`` holds a readable ledger with more steps
    than ``new_steps`` (a file that is not a readable ledger is replaced as before)."""
    if not os.path.exists(path):
        return
    try:
        old_steps = sum(count for _, count in read_ledger_runs(path))
    except (LedgerFileError, UnicodeDecodeError):
        return
    if old_steps > new_steps:
        raise LedgerOverwriteError(
            f"refusing to overwrite the ledger file {path!r}: it records {old_steps} steps and "
            f"the ledger being written records only {new_steps}, so the privacy spent by the "
            f"other {old_steps - new_steps} steps would be forgotten. Write to another path, or "
            "pass overwrite=True if that file does not belong to this data"
        )


def write_ledger_file(
    path: str | os.PathLike,
    entries: Sequence[SampleEntry],
    metadata: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
) -> None:
    """Writes ``entries`` to ``path`` atomically, keeping the permission bits of a file it
    replaces (a new file: ``0666`` less the umask).

    A ledger file at ``path`` that records more steps than ``entries`` is not replaced: it raises
    :class:`LedgerOverwriteError` (naming the path and both step counts) unless
    ``overwrite=True``. A file recording as many steps or fewer (e.g. an earlier checkpoint of
    the same run) is replaced.

    Example::

        write_ledger_file("out/ledger.json", ledger.samples(), metadata={"model": "cnn"})
    """
    write_ledger_runs(path, compress(entries), metadata, overwrite=overwrite)


def write_ledger_runs(
    path: str | os.PathLike,
    runs: Sequence[tuple[SampleEntry, int]],
    metadata: Optional[Mapping[str, Any]] = None,
    overwrite: bool = False,
) -> None:
    """:func:`write_ledger_file` for runs ``[(entry, count), ...]`` (as
    :func:`read_ledger_runs` or ``PrivacyLedger.runs()`` give them): the same file, written
    in time and memory proportional to the runs, whatever the step count.

    Example::

        write_ledger_runs("out/ledger.json", ledger.runs(), metadata={"model": "cnn"})
    """
    path = os.fspath(path)
    runs = list(runs)
    if not overwrite:
        _check_not_shorter(path, sum(count for _, count in runs))
    payload = runs_to_payload(runs, metadata)
    # the indexed form holds long arrays: written compactly (one line per number would not be
    # readable either)
    indent = None if payload["version"] == INDEXED_VERSION else 1
    data = json.dumps(payload, indent=indent, allow_nan=False)
    directory = os.path.dirname(os.path.abspath(path))
    mode = _file_mode(path)
    fd, tmp = tempfile.mkstemp(prefix=".ledger-", suffix=".tmp", dir=directory)
    try:
        if hasattr(os, "fchmod"):  # mkstemp creates the file 0600
            os.fchmod(fd, mode)
        else:  # pragma: no cover (Windows)
            os.chmod(tmp, mode)
        with os.fdopen(fd, "w") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename != path:
            # e.g. ENOSPC from write or fsync, which name no file: name the ledger file
            raise OSError(e.errno, f"cannot write ledger file: {e.strerror}", path) from e
        raise


@without_gc
def _read_payload(path: str | os.PathLike) -> Any:
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise LedgerFileError(f"cannot read ledger file {os.fspath(path)!r}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise LedgerFileError(f"ledger file {os.fspath(path)!r} is not UTF-8 text") from None
    try:
        return json.loads(text, object_pairs_hook=_refuse_duplicate_keys)
    except RecursionError:
        raise LedgerFileError(
            f"ledger file {os.fspath(path)!r} is not a ledger (JSON nested too deeply)"
        ) from None
    except ValueError as e:  # JSONDecodeError, or an integer of too many digits
        raise LedgerFileError(f"ledger file {os.fspath(path)!r} is not valid JSON ({e})") from None


class _NamingFile:
    """Context: a ``LedgerFileError`` / ``ValueError`` raised while validating the content of the
    ledger file ``path`` is re-raised as a ``LedgerFileError`` that names the file."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)

    def __enter__(self):
        return self

    def __exit__(self, kind, error, tb):
        if error is None or not isinstance(error, ValueError) or repr(self.path) in str(error):
            return False
        raise LedgerFileError(f"ledger file {self.path!r}: {error}") from None


def read_ledger_runs(path: str | os.PathLike) -> list[tuple[SampleEntry, int]]:
    """Reads and validates a ledger file; returns its runs of identical consecutive steps,
    ``[(entry, count), ...]``, in order, never listing the steps one by one (memory proportional
    to the number of runs, whatever the step count).

    Example::

        runs = read_ledger_runs("run.ledger.json")
        steps = sum(count for _, count in runs)
        tf_dp.accounting.compute_epsilon(runs, delta=1e-5)
    """
    payload = _read_payload(path)
    with _NamingFile(path):
        return payload_to_runs(payload)


def read_ledger_file(path: str | os.PathLike) -> list[SampleEntry]:
    """Reads and validates a ledger file; returns its sample entries in order, one per step (at
    most :data:`MAX_LISTED_SAMPLES`; :func:`read_ledger_runs` reads any ledger)."""
    payload = _read_payload(path)
    with _NamingFile(path):
        return payload_to_entries(payload)


def _is_run(item: Any) -> bool:
    return (
        isinstance(item, tuple)
        and len(item) == 2
        and isinstance(item[0], SampleEntry)
        and isinstance(item[1], int)
        and not isinstance(item[1], bool)
    )


@without_gc
def as_runs(source: Any) -> list[tuple[SampleEntry, int]]:
    """Normalises a ledger source to runs ``[(entry, count), ...]`` without listing steps: a
    path (read with :func:`read_ledger_runs`), a ``PrivacyLedger`` (anything with ``runs()``;
    else ``samples()``), an iterable of :class:`SampleEntry`, or an iterable of ``(SampleEntry,
    count)`` runs."""
    if isinstance(source, (str, os.PathLike)):
        return read_ledger_runs(source)
    if hasattr(source, "runs") and callable(source.runs):
        return list(source.runs())
    if hasattr(source, "samples") and callable(source.samples):
        return compress(list(source.samples()))
    if not isinstance(source, Iterable):
        raise TypeError(
            "ledger must be a file path, a PrivacyLedger, a sequence of SampleEntry or of "
            f"(SampleEntry, count) runs, got {type(source).__name__}"
        )
    runs: list[tuple[SampleEntry, int]] = []
    codes = EntryCodes()  # consecutive runs are compared by code: one dict lookup per item
    last = -1
    for item in source:
        if isinstance(item, SampleEntry):
            entry, count = item, 1
        elif _is_run(item):
            entry, count = item
            if not 1 <= count <= MAX_FILE_SAMPLES:
                raise ValueError(
                    f"a run's count must be an integer in [1, {MAX_FILE_SAMPLES:.0e}], got "
                    f"{count!r}"
                )
        else:
            raise TypeError(
                "ledger entries must be SampleEntry or (SampleEntry, count) runs, got "
                f"{type(item).__name__}"
            )
        code = codes.code(entry)
        if code == last:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            canonical = codes.entries[code]
            # a (canonical entry, count) tuple is kept as it is: no second copy of long lists
            runs.append(item if canonical is entry and type(item) is tuple else (canonical, count))
            last = code
    return runs


def as_entries(source: Any) -> list[SampleEntry]:
    """Normalises a ledger source: a path, a ``PrivacyLedger`` (anything with ``samples()``),
    or an iterable of :class:`SampleEntry`."""
    if isinstance(source, (str, os.PathLike)):
        return read_ledger_file(source)
    if hasattr(source, "samples") and callable(source.samples):
        return list(source.samples())
    if isinstance(source, Iterable):
        items = list(source)
        for e in items:
            if not isinstance(e, SampleEntry):
                raise TypeError(f"ledger entries must be SampleEntry, got {type(e).__name__}")
        return items
    raise TypeError(
        "ledger must be a file path, a PrivacyLedger or a sequence of SampleEntry, "
        f"got {type(source).__name__}"
    )
