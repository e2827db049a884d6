"""PrivacyLedger: records, inside the training graph, every sampling event and sum query as run.

McMahan et al. 2018, section 6: rather than fixing a privacy computation before training, record
what actually happened (population size, sampling probability, the clip and noise of every sum
query at every step) and analyse the record afterwards, with any accountant, now or later.

The ledger is a ``tf.Module`` holding ``tf.Variable`` tables, so recording works inside
``tf.function`` and the ledger is saved by ``tf.train.Checkpoint`` (resumed training continues the
same ledger); DP Keras optimizers also save it in ``.keras`` files and weight checkpoints.

Memory grows with the distinct runs of a ledger, not with the steps it claims: content restored
from a file, a journal or runs (:meth:`PrivacyLedger.load`, :meth:`~PrivacyLedger.restore_runs`,
:meth:`~PrivacyLedger.attach_journal`) is kept as a *run prefix*, one table row per run of
identical steps with its step count, and only the steps recorded after it take one row each.
Readers (:meth:`~PrivacyLedger.runs`, :meth:`~PrivacyLedger.runs_from`, :meth:`~PrivacyLedger.save`,
the journal) read the prefix as runs; :meth:`~PrivacyLedger.samples` and
:meth:`~PrivacyLedger.tables` list every step. Tables
double when full, so recording costs amortised O(1) per step. Inside an XLA-compiled step
(``jit_compile=True``), where no variable may change shape, rows go to a fixed-size staging table
(each written through a mask over its rows, so the step compiles once whatever the rows
staged); :meth:`PrivacyLedger.flush`, between compiled calls, moves them into the ledger
whenever the staging table could not hold another call's reserved rows (the Keras integration
flushes after every call; reading methods see staged rows too). A compiled step that finds the
staging table full records nothing and must release nothing (:meth:`PrivacyLedger.has_room`;
the DP optimizers withhold its update), and the next flush raises :class:`LedgerOverflowError`.

Example (every ``query.get_noised_result(...)`` call records one sample; training does it once
per step):

>>> import os, tempfile, tensorflow as tf, tf_dp
>>> ledger = tf_dp.PrivacyLedger()
>>> query = tf_dp.QueryWithLedger(
...     tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1), ledger,
...     population_size=60000, selection_probability=256 / 60000)
>>> gs = query.initial_global_state()
>>> state = query.initial_sample_state(tf.zeros([2]))
>>> state = query.accumulate_record(query.derive_sample_params(gs), state, tf.constant([3.0, 4.0]))
>>> _ = query.get_noised_result(state, gs)
>>> path = os.path.join(tempfile.mkdtemp(), "ledger.json")
>>> ledger.save(path)                       # versioned, checksummed JSON
>>> [e.sampling.population_size for e in tf_dp.PrivacyLedger.load(path).samples()]
[60000]
"""

from __future__ import annotations

import hashlib
import json
import os
import math
from operator import itemgetter
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_dp.dp_query.xla import in_xla_context
from tf_dp.ledger.events import (
    MECHANISMS,
    PRIVACY_UNITS,
    SAMPLING_ORIGINS,
    PASS_POLICIES,
    SAMPLING_POLICIES,
    SampleEntry,
    SamplingEvent,
    EntryCodes,
    SumQueryEvent,
    compress,
    mf_strategy_code,
    mf_strategy_of_code,
    runs_are_prefix,
    without_gc,
)
from tf_dp.ledger.journal import LedgerJournal, encode_runs
from tf_dp.ledger.ledger_file import (
    MAX_FILE_SAMPLES,
    LedgerFileError,
    as_runs,
    read_ledger_codes,
    write_ledger_runs,
)

# Column layouts of the two buffers.
# population_size, selection_probability, policy code, pass start (0/1), origin code (0
# declared, 1 sampled), unit code (0 example, 1 user), records per unit (0 for examples),
# max batch size (truncated_poisson's B; cyclic_poisson's number of parts; 0 for other
# policies). Tables with fewer columns (saved
# before a column existed) are read with zeros there: no pass start, declared, example-level.
_SAMPLE_COLS = 8
# sample index, l2_sensitivity, noise_stddev, mechanism code, jl_projections (jl) or tree_step
# (tree) or the strategy's mf_strategy_code (mf: a code of this process, never saved), noise
# seed (NaN: none), noise grid (NaN: continuous noise)
_QUERY_COLS = 7
_INITIAL_CAPACITY = 64
#: Columns of :meth:`PrivacyLedger.run_tables`' sample table: a step's columns and the run's
#: step count.
RUN_SAMPLE_COLS = _SAMPLE_COLS + 1


def _check_recorded_sampling(population_size: Any, selection_probability: Any) -> None:
    """ValueError / TypeError naming the argument for a Python or numpy number out of range;
    tensors and variables pass (their values are checked where they are set)."""
    for name, value in (("population_size", population_size),
                        ("selection_probability", selection_probability)):
        if isinstance(value, (tf.Tensor, tf.Variable)) or hasattr(value, "values"):
            continue
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.number)):
            raise TypeError(f"{name} must be a number or a tensor, got {type(value).__name__}")
        v = float(value) if abs(value) < 1e300 or isinstance(value, float) else math.inf
        if name == "population_size" and not (
            math.isfinite(v) and v == round(v) and 1 <= v <= 2**53
        ):
            raise ValueError(f"population_size must be an integer in [1, 2**53], got {value!r}"
                             if abs(v) < 1e20 else
                             f"population_size must be an integer in [1, 2**53], got {v:.3g}")
        if name == "selection_probability" and not (math.isfinite(v) and 0.0 < v <= 1.0):
            raise ValueError(f"selection_probability must be in (0, 1], got {value!r}")


def table_steps(samples: np.ndarray) -> int:
    """Steps in a sample table of :meth:`PrivacyLedger.tables` (its rows) or
    :meth:`PrivacyLedger.run_tables` (the sum of its last column)."""
    samples = np.asarray(samples)
    if samples.ndim == 2 and samples.shape[1] == RUN_SAMPLE_COLS:
        return int(np.sum(samples[:, -1])) if samples.size else 0
    return int(samples.shape[0])


def policy_code(policy: str) -> int:
    if policy not in SAMPLING_POLICIES:
        raise ValueError(f"sampling policy must be one of {SAMPLING_POLICIES}, got {policy!r}")
    return SAMPLING_POLICIES.index(policy)


def origin_code(origin: str) -> int:
    if origin not in SAMPLING_ORIGINS:
        raise ValueError(f"sampling origin must be one of {SAMPLING_ORIGINS}, got {origin!r}")
    return SAMPLING_ORIGINS.index(origin)


def unit_code(unit: str) -> int:
    if unit not in PRIVACY_UNITS:
        raise ValueError(f"privacy unit must be one of {PRIVACY_UNITS}, got {unit!r}")
    return PRIVACY_UNITS.index(unit)


def mechanism_code(mechanism: str) -> int:
    if mechanism not in MECHANISMS:
        raise ValueError(f"mechanism must be one of {MECHANISMS}, got {mechanism!r}")
    return MECHANISMS.index(mechanism)


def _f64(x) -> tf.Tensor:
    """``x`` as a float64 tensor without a float32 detour (``tf.cast(0.01, tf.float64)`` would
    first make a float32 constant and record 0.0099999998)."""
    if isinstance(x, (tf.Tensor, tf.Variable)) or hasattr(x, "dtype") and not isinstance(
        x, (np.ndarray, np.generic)
    ):
        return tf.cast(x, tf.float64)
    return tf.constant(x, tf.float64)


def _fixed_shape_context() -> bool:
    """XLA, or a replica of a ``tf.distribute`` step (where a mirrored variable cannot be
    resized inside the step): rows go to the fixed-size staging table.

    Any number of replicas, one included (``MirroredStrategy()`` on a machine with one GPU or
    none): a mirrored variable's assign in a replica context is a ``merge_call``, which cannot
    sit inside the ``tf.cond`` of a direct append. ``OneDeviceStrategy`` keeps plain variables
    (direct appends)."""
    if in_xla_context():
        return True
    return (
        not tf.executing_eagerly()
        and tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
        and not isinstance(tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy)
    )


def ledger_variable(initial_value, shape=None, name=None) -> tf.Variable:
    # Under tf.distribute every replica records the same (global) event; the first replica's write
    # is the one kept, so the ledger's variables stay identical on every device.
    return tf.Variable(
        initial_value,
        shape=shape,
        trainable=False,
        name=name,
        synchronization=tf.VariableSynchronization.ON_WRITE,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def tables_checksum(samples: np.ndarray, queries: np.ndarray) -> str:
    """SHA-256 (hex) of a ledger's raw tables, as :meth:`PrivacyLedger.tables` returns them.

    It covers the shape and every float64 value (little-endian bytes) of both tables, whatever
    their number of columns, so any changed, added or removed value changes it. Like the ledger
    file's checksum, it detects corruption and accidental edits, not deliberate ones: anyone can
    recompute it, so it is not a signature.

    Example::

        samples, queries = ledger.tables()
        digest = tables_checksum(samples, queries)   # 64 hex characters
    """
    h = hashlib.sha256(b"tf_dp.ledger_tables\0")
    for table in (samples, queries):
        table = np.ascontiguousarray(table, dtype="<f8")
        if table.ndim != 2:
            raise ValueError(f"ledger tables must be 2-D, got shape {table.shape}")
        h.update(np.asarray(table.shape, dtype="<i8").tobytes())
        h.update(table.tobytes())
    return h.hexdigest()


class _Buffer(tf.Module):
    """A [rows, cols] float64 table with a row count, usable inside tf.function and under XLA.

    Rows live in ``data`` (a growable table: it doubles when full, amortised O(1) per row) and,
    for rows recorded inside an XLA-compiled step, in ``staged``: a fixed-size table written by
    index, because XLA cannot grow a variable. :meth:`flush` (eager, between compiled calls) moves
    staged rows to ``data`` (the ledger's flush calls it only when :meth:`needs_move`). A row recorded while ``staged`` is full is not written: ``overflow``
    counts it, :meth:`has_room` lets the step release nothing instead, and :meth:`flush` raises.
    """

    def __init__(self, cols: int, name: str, staging_capacity: int = _INITIAL_CAPACITY):
        super().__init__(name=name)
        with tf.init_scope():
            self.data = ledger_variable(
                tf.zeros([_INITIAL_CAPACITY, cols], tf.float64), tf.TensorShape([None, cols]),
                "data",
            )
            self.count = ledger_variable(tf.constant(0, tf.int64), name="count")
            self.staged = ledger_variable(
                tf.zeros([staging_capacity, cols], tf.float64), tf.TensorShape([None, cols]),
                "staged",
            )
            self.staged_count = ledger_variable(tf.constant(0, tf.int64), name="staged_count")
            self.overflow = ledger_variable(tf.constant(0, tf.int64), name="overflow")
        # rows one compiled call may stage (set by reserve, raised to the most rows seen staged
        # between two flushes); 0: nothing reserved, so every flush moves the staged rows (a
        # call of unknown length finds the whole table free)
        self.call_rows = 0
        self._left = 0  # rows the last flush left staged

    @property
    def staging_capacity(self) -> int:
        return int(self.staged.numpy().shape[0])

    def _capacity_tensor(self) -> tf.Tensor:
        return tf.shape(self.staged, out_type=tf.int64)[0]

    def total(self) -> tf.Tensor:
        """Rows recorded so far (flushed and staged)."""
        return self.count.read_value() + self.staged_count.read_value()

    def has_room(self, rows: int = 1) -> tf.Tensor:
        """Whether ``rows`` more rows can be recorded in the current context (a bool tensor)."""
        if not _fixed_shape_context():
            return tf.constant(True)
        return self.staged_count.read_value() + rows <= self._capacity_tensor()

    def append(self, row: tf.Tensor, keep: Any = None) -> tf.Tensor:
        """Appends ``row`` (float64 [cols]); returns its index among all rows.

        ``keep`` (a bool tensor, compiled steps only): False drops the row (a step whose values
        cannot be recorded; outside XLA such a step fails before it appends)."""
        if _fixed_shape_context():
            return self._stage(row, keep)
        if tf.executing_eagerly():
            self.flush()
            index = self.count.read_value()
            if int(index) >= int(_shape_rows(self.data)):
                self.data.assign(tf.concat([self.data, tf.zeros_like(self.data)], axis=0))
        else:
            self._make_room()
            index = self.count.read_value()
        self.data.scatter_nd_update(tf.reshape(index, [1, 1]), tf.reshape(row, [1, -1]))
        self.count.assign_add(1)
        return index

    def _stage(self, row: tf.Tensor, keep: Any = None) -> tf.Tensor:
        k = self.staged_count.read_value()
        capacity = self._capacity_tensor()
        room = k < capacity
        wanted = tf.constant(True) if keep is None else tf.convert_to_tensor(keep)
        # The row goes to slot k by a mask over the table's rows, not by indexing the table with
        # k: under XLA an index read from a variable (``table[k]``) must be a compile-time
        # constant, so the step would be compiled anew for every staged count (up to 64
        # compiles of the whole train step, each holding JIT code for the process's lifetime).
        # A row that finds the table full (or is not wanted) writes nothing: it is counted in
        # ``overflow`` and the step's release is withheld by the caller (has_room).
        table = self.staged.read_value()
        at_slot = tf.logical_and(tf.equal(tf.range(capacity), k), room & wanted)
        # (a whole-table assign: mirrored variables under tf.distribute have no scatter update)
        self.staged.assign(
            tf.where(at_slot[:, None], tf.reshape(tf.cast(row, table.dtype), [1, -1]), table)
        )
        self.staged_count.assign_add(tf.where(room & wanted, tf.constant(1, tf.int64), 0))
        self.overflow.assign_add(tf.where(room | ~wanted, tf.constant(0, tf.int64), 1))
        return self.count.read_value() + k

    def _make_room(self) -> None:
        """In a (non-XLA) graph, before a direct append: moves staged rows (recorded by compiled
        steps) to ``data`` and makes room for one more row (the table doubles when full). One
        conditional for both: each costs the step's trace and every run of the step."""
        k = self.staged_count.read_value()
        n = self.count.read_value()
        # the shape alone: a read of the table would make the in-place update of append copy it
        capacity = _shape_rows(self.data)

        def rebuild():
            needed = n + k + 1  # the rows kept and the row about to be appended
            new_cap = tf.where(needed > capacity, tf.maximum(capacity, needed) * 2, capacity)
            cols = tf.shape(self.staged)[1]
            padded = tf.concat(
                [self.data[:n], self.staged[:k], tf.zeros([new_cap - n - k, cols], tf.float64)],
                axis=0,
            )
            self.data.assign(padded)
            self.count.assign(n + k)
            self.staged_count.assign(0)
            return tf.constant(0)

        tf.cond(tf.logical_or(k > 0, n >= capacity), rebuild, lambda: tf.constant(0))

    def flush(self) -> None:
        """Eagerly moves staged rows to ``data``; raises if rows were dropped for lack of room."""
        dropped = int(self.overflow.numpy())
        k = int(self.staged_count.numpy())
        if k:
            # the staged rows are written in place after the recorded ones (the table doubles
            # when full): a flush costs O(staged rows), not O(rows recorded so far)
            n = int(self.count.numpy())
            rows = self.staged.numpy()[:k]
            capacity = _capacity(self.data)
            if n + k > capacity:
                grown = max(2 * capacity, _capacity_for(n + k))
                self.data.assign(tf.concat(
                    [self.data.read_value(),
                     tf.zeros([grown - capacity, int(self.data.shape[1])], tf.float64)], axis=0))
            self.write(n, rows)
            self.count.assign(n + k)
            self.staged_count.assign(0)
        self._left = 0
        if dropped:
            self.overflow.assign(0)
            raise LedgerOverflowError(
                f"{dropped} ledger row(s) could not be recorded inside a compiled (XLA) step "
                f"because the staging table ({self.staging_capacity} rows) was full; those steps "
                "released nothing (their updates were withheld). Flush the ledger "
                "(ledger.flush()) between compiled calls, or give it room with "
                "ledger.reserve(steps_per_call)"
            )

    def reserve(self, rows: int) -> None:
        """Eagerly makes room for ``rows`` staged rows (flushes first); from then on a flush
        leaves staged rows in place while ``rows`` more still fit (:meth:`needs_move`)."""
        self.flush()
        if rows > self.staging_capacity:
            self.staged.assign(tf.zeros([int(rows), self.staged.shape[1]], tf.float64))
        self.call_rows = int(rows)

    def needs_move(self, staged: int, known: Optional[Mapping[Any, int]] = None) -> bool:
        """Whether, with ``staged`` rows staged, a flush must move them to ``data``: nothing
        was reserved, or the next compiled call's rows (as many as reserved, or as the most
        one call staged so far) would not fit after them. Called once per flush: if it says no,
        the rows stay staged."""
        if self.call_rows > 0:
            self.call_rows = max(self.call_rows, staged - self._left)
        if staged == 0:
            self._left = 0
            return False
        if self.call_rows <= 0 or staged + self.call_rows > _capacity(self.staged, known):
            return True
        self._left = staged
        return False

    def tail_in_graph(self, k: int) -> tf.Tensor:
        """Graph ops: the last ``k`` rows (recorded, then staged), float64 ``[k, cols]``; where
        fewer than ``k`` rows exist, the missing leading rows are row 0's or zeros (for
        :meth:`rows` after the function that ran a step: :meth:`PrivacyLedger.journal_tails`)."""
        n = self.count.read_value()
        index = n + self.staged_count.read_value() - k + tf.range(k, dtype=tf.int64)
        index = tf.maximum(index, 0)

        def gather(table, i):
            var = first_component(table)
            last = tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64)[0] - 1
            return tf.raw_ops.ResourceGather(resource=var.handle, indices=tf.clip_by_value(
                i, 0, tf.maximum(last, 0)), dtype=tf.float64)

        staged = index >= n
        return tf.where(staged[:, None], gather(self.staged, index - n), gather(self.data, index))

    def rows(self, start: int, stop: int, recorded: int,
             tail: Optional[np.ndarray] = None, total: int = -1) -> np.ndarray:
        """Rows ``start:stop`` of all rows, the ``recorded`` rows of ``data`` followed by the
        staged ones, eagerly: one gather per table touched; none if ``tail``, the last rows of
        the ``total`` rows (:meth:`tail_in_graph`, read with that total), holds them."""
        if tail is not None and stop == total and stop - start <= len(tail):
            return np.array(tail[len(tail) - (stop - start):], dtype=np.float64)
        parts = []
        if start < recorded:
            parts.append(_read_rows(self.data, start, min(stop, recorded)))
        if stop > recorded:
            parts.append(_read_rows(self.staged, max(start, recorded) - recorded, stop - recorded))
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts or [np.zeros([0, int(self.data.shape[1])])], axis=0)

    def numpy(self) -> np.ndarray:
        """The recorded rows (flushed, then staged), read without copying the spare capacity."""
        n = int(self.count.numpy())
        k = int(self.staged_count.numpy())
        if k == 0:
            return _read_rows(self.data, 0, n)
        return np.concatenate([_read_rows(self.data, 0, n), self.staged.numpy()[:k]], axis=0)

    def load(self, table: np.ndarray) -> None:
        """Replaces the rows with ``table``."""
        self.allocate(table.shape[0])
        self.write(0, table)
        self.set_count(table.shape[0])

    def allocate(self, rows: int) -> None:
        """Replaces the table with a zero table of capacity for ``rows`` rows, to be filled in
        place by :meth:`write` and committed by :meth:`set_count` (no full-length host copy)."""
        cap = _capacity_for(rows)
        cols = int(self.data.shape[1])
        self.data.assign(tf.zeros([1, cols], tf.float64))  # frees the old table first
        self.data.assign(tf.zeros([cap, cols], tf.float64))
        self.count.assign(0)

    def write(self, start: int, rows: np.ndarray) -> None:
        """Writes ``rows`` at row ``start`` of the allocated table, in place."""
        if not rows.shape[0]:
            return
        index = np.arange(start, start + rows.shape[0])
        table = self.data
        # under tf.distribute, every component holds the same rows
        for var in table.values if isinstance(table, tf.distribute.DistributedValues) else [table]:
            tf.raw_ops.ResourceScatterUpdate(resource=var.handle, indices=index, updates=rows)

    def set_count(self, rows: int) -> None:
        self.count.assign(rows)
        self.staged_count.assign(0)
        self.overflow.assign(0)
        self._left = 0


def _capacity_for(rows: int) -> int:
    """Table capacity for ``rows`` rows: the next power of two, at least the initial one."""
    return max(_INITIAL_CAPACITY, 1 << int(np.ceil(np.log2(max(rows, 1)))))


def _shape_rows(table: tf.Variable) -> tf.Tensor:
    """Rows a table variable holds (an int64 tensor), from its shape alone: ``tf.shape`` would
    read the table, and an in-place update while that read is alive copies the whole table."""
    return tf.raw_ops.VariableShape(input=table.handle, out_type=tf.int64)[0]


def first_component(variable: Any) -> Any:
    """``variable``, or its first component under tf.distribute (every component of a ledger
    variable holds the same value)."""
    if isinstance(variable, tf.distribute.DistributedValues):
        return variable.values[0]
    return variable


def _capacity(table: tf.Variable, known: Optional[Mapping[Any, int]] = None) -> int:
    """:func:`_shape_rows`, eagerly, in one op (of the first component under tf.distribute);
    ``known``: as :func:`read_int`'s (a table's entry there is its number of rows)."""
    var = first_component(table)
    if known is not None:
        value = known.get(counter_key(var))
        if value is not None:
            return value
    return int(tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64).numpy()[0])


def read_int(counter: tf.Variable, known: Optional[Mapping[Any, int]] = None) -> int:
    """An int64 scalar variable's value, eagerly, in one op (``counter.numpy()`` takes two, a
    read and a copy: a flush after every compiled call reads several), of the first component
    under tf.distribute (every component holds the same value).

    ``known``: values read in the graph that ran the last step (:func:`counter_snapshot`), by
    :func:`counter_key`; a counter found there is not read again. Pass it only to reads that
    happen before anything writes the counter."""
    counter = first_component(counter)
    if known is not None:
        value = known.get(counter_key(counter))
        if value is not None:
            return value
    return int(tf.raw_ops.ReadVariableOp(resource=counter.handle, dtype=tf.int64).numpy())


def counter_key(counter: tf.Variable) -> Any:
    """The key of ``counter`` (an int64 scalar variable, or a table) in a ``known`` mapping of
    :func:`read_int`: its ``id`` (a mapping lives for one flush, while the ledger holds the
    variable)."""
    return id(first_component(counter))


def counter_snapshot(counters: Sequence[tf.Variable]) -> tf.Tensor:
    """Graph ops: the values of ``counters`` (int64 scalar variables; for a table, a variable of
    rank 2, its number of rows) stacked in one int64 vector, read at the end of the function
    that ran a compiled step, so that the flush after it finds them in the function's output
    instead of reading each with an eager op (:func:`known_counters`)."""
    if not counters:
        return tf.zeros([0], tf.int64)
    values = []
    for c in counters:
        var = first_component(c)
        if var.shape.rank == 2:
            values.append(tf.raw_ops.VariableShape(input=var.handle, out_type=tf.int64)[0])
        else:
            values.append(tf.raw_ops.ReadVariableOp(resource=var.handle, dtype=tf.int64))
    return tf.stack(values)


def known_counters(counters: Sequence[tf.Variable], values: Any) -> dict:
    """The ``known`` mapping of :func:`read_int` from :func:`counter_snapshot`'s ``values``."""
    values = np.asarray(values)
    return {counter_key(c): int(v) for c, v in zip(counters, values)}


def _to_entries(samples: np.ndarray, queries: np.ndarray, first: int = 0) -> list[SampleEntry]:
    """Sample-table rows (steps ``first, first + 1, ...``) and their query-table rows as
    :class:`SampleEntry` objects."""
    per_sample: list[list[SumQueryEvent]] = [[] for _ in range(samples.shape[0])]
    for idx, sens, std, mech, r, seed, grid in queries:
        i = int(idx) - first
        if not 0 <= i < len(per_sample):
            raise ValueError(
                "ledger holds a sum query recorded before any sampling event; "
                "call record_sampling first"
            )
        mech_name = MECHANISMS[int(mech)]
        per_sample[i].append(
            SumQueryEvent(
                # Stored as float64: values recorded at run time are the float32 values the
                # step used (exactly representable); values restored from a file stay exact.
                l2_sensitivity=float(sens),
                noise_stddev=float(std),
                mechanism=mech_name,
                jl_projections=int(r) if mech_name == "jl" else None,
                noise_seed=None if np.isnan(seed) else int(seed),
                tree_step=int(r) if mech_name == "tree" else None,
                noise_grid=None if np.isnan(grid) else float(grid),
                mf_strategy=mf_strategy_of_code(int(r)) if mech_name == "mf" else None,
            )
        )
    return [
        SampleEntry(
            sampling=SamplingEvent(
                population_size=int(round(n)),
                selection_probability=float(q),
                policy=SAMPLING_POLICIES[int(p)],
                pass_start=bool(start) and SAMPLING_POLICIES[int(p)] in PASS_POLICIES,
                origin=SAMPLING_ORIGINS[int(origin)],
                unit=PRIVACY_UNITS[int(unit)],
                records_per_unit=int(k) if PRIVACY_UNITS[int(unit)] == "user" else None,
                max_batch_size=(int(b) if SAMPLING_POLICIES[int(p)] == "truncated_poisson"
                                else None),
                num_parts=int(b) if SAMPLING_POLICIES[int(p)] == "cyclic_poisson" else None,
            ),
            queries=tuple(qs),
        )
        for (n, q, p, start, origin, unit, k, b), qs in zip(samples, per_sample)
    ]


def _same(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise equality of two float tables, NaN equal to NaN (a missing seed or grid)."""
    return np.all((a == b) | (np.isnan(a) & np.isnan(b)), axis=1)


class _RowEntries:
    """The :class:`SampleEntry` of each distinct table row (a sample row and its query rows), each
    built and validated once, with the codes of :class:`EntryCodes` (equal entries, e.g. rows that
    differ only in a column an entry ignores, share a code). One instance shared by the pieces of
    one read makes equal steps the same object throughout."""

    def __init__(self) -> None:
        self.codes = EntryCodes()
        self._by_row: dict[bytes, int] = {}

    def run_codes(self, samples: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """The code of each sample row with its query rows (index column renumbered ``0, 1,
        ...``, ordered): rows are grouped by their bytes with ``np.unique`` (vectorised), and only
        the distinct ones are turned into entries."""
        n = samples.shape[0]
        index = queries[:, 0].astype(np.int64)
        per = np.bincount(index, minlength=n)
        first_row = np.cumsum(per) - per
        out = np.empty(n, np.int64)
        for p in np.unique(per).tolist():
            steps = np.flatnonzero(per == p)
            rows = first_row[steps][:, None] + np.arange(p)
            key = np.ascontiguousarray(
                np.concatenate([samples[steps], queries[rows, 1:].reshape(len(steps), -1)], axis=1)
            )
            key = key.view(np.dtype((np.void, key.dtype.itemsize * key.shape[1]))).ravel()
            uniq, where, inverse = np.unique(key, return_index=True, return_inverse=True)
            codes = np.empty(len(uniq), np.int64)
            for u, (k, i) in enumerate(zip(uniq.tolist(), where.tolist())):
                code = self._by_row.get(k)
                if code is None:
                    step_queries = queries[rows[i]].copy()
                    step_queries[:, 0] = 0
                    (entry,) = _to_entries(samples[steps[i] : steps[i] + 1], step_queries)
                    code = self._by_row[k] = self.codes.code(entry)
                codes[u] = code
            out[steps] = codes[inverse.ravel()]
        return out


def _tables_to_runs(
    samples: np.ndarray, queries: np.ndarray, rows: Optional[_RowEntries] = None
) -> list[tuple[SampleEntry, int]]:
    """The tables as runs ``[(entry, count), ...]`` (what ``compress(_to_entries(...))`` gives),
    in time O(rows) of vectorised numpy, O(runs) of list building and O(distinct rows) of
    entry building (``rows``: the entries of the rows seen so far, shared between pieces).

    A step starts a new run unless its sample row equals the previous step's and it has as many
    query rows as the previous step, each equal (apart from the sample-index column) to the
    query row of the previous step at the same position."""
    n = samples.shape[0]
    if n == 0:
        if len(queries):
            _to_entries(samples, queries)  # raises: a query before any sampling event
        return []
    index = queries[:, 0]
    if len(queries) and (
        np.any(index < 0) or np.any(index >= n) or np.any(np.diff(index) < 0)
        or np.any(index != np.round(index))
    ):
        _to_entries(samples, queries)  # raises, naming the problem
        raise ValueError("ledger query table is not ordered by sample index")
    per = np.bincount(index.astype(np.int64), minlength=n)  # query rows of each step
    starts = np.ones(n, bool)
    starts[1:] = _same(samples[1:], samples[:-1]) == 0
    starts[1:] |= per[1:] != per[:-1]
    if len(queries):
        shift = per[index.astype(np.int64)]  # a step's query r pairs with row r - shift
        prev = np.arange(len(queries)) - shift
        ok = prev >= 0
        prev = np.where(ok, prev, 0)
        equal = ok.copy()
        for col in range(1, _QUERY_COLS):  # column by column: no [rows, cols] temporaries
            a, b = queries[:, col], queries[prev, col]
            equal &= (a == b) | (np.isnan(a) & np.isnan(b))
        differs = np.bincount(index[~equal].astype(np.int64), minlength=n) > 0
        starts |= differs
        starts[0] = True
    first = np.flatnonzero(starts)
    counts = np.diff(np.append(first, n))
    sub_queries = queries[starts[index.astype(np.int64)]]  # the query rows of run starts
    if len(sub_queries):  # renumber the kept steps 0, 1, ...
        sub_queries[:, 0] = np.searchsorted(first, sub_queries[:, 0])
    rows = _RowEntries() if rows is None else rows
    codes = rows.run_codes(samples[first], sub_queries)
    # rows that differ only in ignored columns (e.g. pass_start of a Poisson draw) are equal
    # entries (one code): merge them as compress() would
    keep = np.ones(len(codes), bool)
    keep[1:] = codes[1:] != codes[:-1]
    kept = np.flatnonzero(keep)
    totals = np.add.reduceat(counts, kept)
    entries = rows.codes.entries
    return [(entries[c], t) for c, t in zip(codes[kept].tolist(), totals.tolist())]


def _entry_rows(entries: Sequence[SampleEntry]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Table rows of distinct entries: ``(sample_rows [entries, cols], query_rows [queries,
    cols - 1] without the index column, queries_per_entry)``; raises ValueError (naming the
    field) for an entry that has no table form."""
    sample_rows = np.array(
        [
            [e.sampling.population_size, e.sampling.selection_probability,
             policy_code(e.sampling.policy), float(e.sampling.pass_start),
             origin_code(e.sampling.origin), unit_code(e.sampling.unit),
             e.sampling.records_per_unit or 0,
             e.sampling.max_batch_size or e.sampling.num_parts or 0]
            for e in entries
        ],
        np.float64,
    ).reshape(-1, _SAMPLE_COLS)
    query_rows = np.array(
        [
            [q.l2_sensitivity, q.noise_stddev, mechanism_code(q.mechanism),
             q.jl_projections or q.tree_step
             or (mf_strategy_code(q.mf_strategy) if q.mechanism == "mf" else 0),
             float("nan") if q.noise_seed is None else float(q.noise_seed),
             float("nan") if q.noise_grid is None else float(q.noise_grid)]
            for e in entries
            for q in e.queries
        ],
        np.float64,
    ).reshape(-1, _QUERY_COLS - 1)
    return sample_rows, query_rows, np.array([len(e.queries) for e in entries], np.int64)


def _step_tables(
    rows: tuple[np.ndarray, np.ndarray, np.ndarray], step_codes: np.ndarray, first_step: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """The sample and query tables of steps ``first_step, first_step + 1, ...`` whose entries are
    ``step_codes`` (indices into the entries of ``rows``, from :func:`_entry_rows`), built with
    numpy indexing (no per-step Python work)."""
    sample_rows, query_rows, per_entry = rows
    per_step = per_entry[step_codes]
    total = int(per_step.sum())
    step = np.repeat(np.arange(len(step_codes)), per_step)
    first_row_of_step = np.cumsum(per_step) - per_step
    position = np.arange(total) - first_row_of_step[step]
    entry_first_row = np.cumsum(per_entry) - per_entry
    queries = np.empty([total, _QUERY_COLS], np.float64)
    queries[:, 0] = step + first_step
    queries[:, 1:] = query_rows[entry_first_row[step_codes[step]] + position]
    return sample_rows[step_codes], queries


_CHUNK_ROWS = 1 << 16  # steps per chunk when tables are written or read in pieces
_TAIL_ROWS = 64  # most new steps a keeping-up reader turns into entries one by one


def _joined(
    head: list[tuple[SampleEntry, int]], tail: list[tuple[SampleEntry, int]]
) -> list[tuple[SampleEntry, int]]:
    """``head + tail``, a run crossing the boundary merged (consecutive runs always differ)."""
    if head and tail and head[-1][0] == tail[0][0]:
        return head[:-1] + [(head[-1][0], head[-1][1] + tail[0][1])] + tail[1:]
    return head + tail


def _drop_steps(
    runs: list[tuple[SampleEntry, int]], start: int
) -> list[tuple[SampleEntry, int]]:
    """``runs`` without their first ``start`` steps."""
    out: list[tuple[SampleEntry, int]] = []
    seen = 0
    for entry, count in runs:
        if seen + count > start:
            out.append((entry, min(count, seen + count - start)))
        seen += count
    return out


def _read_rows(table: tf.Variable, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a ledger table, eagerly: one gather op, O(rows) (slicing a
    variable eagerly reads the whole table, and ``sparse_read`` costs several times the op);
    under ``tf.distribute`` from the first component (every component holds the same rows)."""
    table = first_component(table)
    if stop - start == 1:  # one row (a flush after every step): a scalar index converts faster
        row = tf.raw_ops.ResourceGather(resource=table.handle, indices=start, dtype=tf.float64)
        return row.numpy()[None, :]
    rows = tf.raw_ops.ResourceGather(
        resource=table.handle, indices=np.arange(start, stop), dtype=tf.float64
    )
    return rows.numpy()


class LedgerOverflowError(RuntimeError):
    """Steps recorded inside compiled calls did not fit the ledger's staging table."""


class PrivacyLedger(tf.Module):
    """Record of sampling events and sum-query events, readable as ``SampleEntry`` objects.

    Recording methods take tensors and are meant to run inside the training step; reading methods
    (:meth:`samples`, :meth:`save`) run eagerly. Normally you do not call the recording methods
    yourself: :class:`QueryWithLedger` (and the Keras DP optimizers, which use it) do.
    """

    def __init__(self, name: str = "privacy_ledger"):
        super().__init__(name=name)
        self._samples = _Buffer(_SAMPLE_COLS, "samples")
        self._queries = _Buffer(_QUERY_COLS, "queries")
        # The run prefix (steps 0 .. base - 1, restored from runs): one row per run, the sample
        # columns then the run's step count; its query rows carry the run's index. The step
        # tables above hold the steps recorded after it (their indices relative to ``base``).
        self._prefix = _Buffer(_SAMPLE_COLS + 1, "prefix_runs", staging_capacity=1)
        self._prefix_queries = _Buffer(_QUERY_COLS, "prefix_queries", staging_capacity=1)
        with tf.init_scope():
            self._base = ledger_variable(tf.constant(0, tf.int64), name="prefix_steps")
        self._journal: Optional[LedgerJournal] = None
        self._journal_queries = 0  # query rows already in the journal
        self._journal_key = b""  # the rows last appended to the journal...
        self._journal_runs = ""  # ...and their encoding
        #: False when the content was loaded from tables saved without their checksum (files
        #: written before ledger checksums): privacy statements computed from it say so.
        self.verified = True
        self._trained_steps = 0  # steps the loaded weights were trained with (see missing_steps)
        self._file_metadata = "{}"  # JSON: informative metadata :meth:`save` always writes

    # -- compiled (XLA) steps ----------------------------------------------------------------------

    def has_room(self, queries_per_sample: int = 1) -> tf.Tensor:
        """Whether one more sample (with ``queries_per_sample`` sum queries) can be recorded in the
        current context. Always true outside XLA; inside an XLA-compiled step, true while the
        staging tables have room. A step must release nothing when this is false."""
        return tf.logical_and(
            self._samples.has_room(1), self._queries.has_room(queries_per_sample)
        )

    def reserve(self, samples: int, queries_per_sample: int = 1) -> None:
        """Eagerly sizes the staging tables for ``samples`` compiled steps between two flushes
        (the Keras integration reserves ``steps_per_execution``)."""
        self._samples.reserve(int(samples))
        self._queries.reserve(int(samples) * max(1, int(queries_per_sample)))

    def flush(self) -> None:
        """Between compiled calls (eager only): raises :class:`LedgerOverflowError` if steps
        were withheld for lack of room, makes room in the staging tables for the next compiled
        call, and appends the steps recorded since the last flush to the attached journal, if
        any.

        Rows recorded inside XLA-compiled steps are moved into the ledger proper when the
        staging tables could not hold another call's reserved rows (:meth:`reserve`; at every
        flush if nothing was reserved), so that a flush after each call costs a few reads; every
        reading method (:meth:`runs`, :meth:`samples`, :attr:`num_samples`, :meth:`save`...)
        sees the staged rows too. The Keras integration flushes after every compiled call.

        Example (a custom loop with an XLA-compiled step that records one sample per call)::

            ledger.reserve(1)          # room for one step per compiled call
            for batch in batches:
                train_step(batch)      # tf.function(jit_compile=True)
                ledger.flush()
        """
        self.flush_known(None)

    def flush_counters(self) -> list:
        """The int64 counters (and staging tables, by their rows) :meth:`flush` reads before it
        writes anything (for :func:`counter_snapshot`)."""
        s, q = self._samples, self._queries
        return [s.staged_count, q.staged_count, s.overflow, q.overflow, s.staged, q.staged,
                self._base, s.count, q.count]

    def journal_tails(self, steps: int, query_rows: int,
                      journaled: Optional[bool] = None) -> tuple:
        """Graph ops for the end of the function that ran ``steps`` steps of ``query_rows`` sum
        query rows each: the last rows of the sample and query tables, what the journal's
        append after the step reads; nothing (``()``) if not ``journaled`` (default: whether a
        journal is attached when this is traced; a function that can run with and without one
        takes it as an argument, traced once for each). Pass them to :meth:`flush_known`
        through ``known`` (:meth:`known_tails`)."""
        if not (self._journal is not None if journaled is None else journaled):
            return ()
        return self._samples.tail_in_graph(steps), self._queries.tail_in_graph(query_rows)

    def known_tails(self, rows: np.ndarray, steps: int) -> dict:
        """:meth:`journal_tails`'s values for ``steps`` steps, stacked (the sample rows, then
        the query rows; columns beyond a table's own are ignored), as entries of a ``known``
        mapping of :meth:`flush_known`."""
        return {("tail", counter_key(self._samples.data)): rows[:steps, :_SAMPLE_COLS],
                ("tail", counter_key(self._queries.data)): rows[steps:, :_QUERY_COLS]}

    def flush_known(self, known: Optional[Mapping[Any, int]]) -> None:
        """:meth:`flush`, with the values of :meth:`flush_counters` read in the graph that ran
        the last compiled step (:func:`known_counters`; ``None``: read them here)."""
        s, q = self._samples, self._queries
        staged = read_int(s.staged_count, known), read_int(q.staged_count, known)
        if (
            read_int(s.overflow, known) == 0 and read_int(q.overflow, known) == 0
            and not s.needs_move(staged[0], known) and not q.needs_move(staged[1], known)
        ):
            self._sync_journal(staged, known)  # nothing to move (or room for another call)
            return
        self._flush_all()

    def _flush_all(self) -> None:
        """Moves every staged row into the ledger proper (what the readers of ``data`` need),
        appends to the journal, and raises if rows were dropped."""
        overflow: Optional[LedgerOverflowError] = None
        for buffer in (self._samples, self._queries):
            try:
                buffer.flush()
            except LedgerOverflowError as e:
                overflow = overflow or e
        self._sync_journal((0, 0))
        if overflow is not None:
            raise overflow

    # -- journal (eager) -------------------------------------------------------------------------

    @property
    def journal(self) -> Optional[LedgerJournal]:
        """The attached :class:`~tf_dp.ledger.journal.LedgerJournal`, or None."""
        return self._journal

    def attach_journal(self, path: str | os.PathLike, fsync: bool = False) -> LedgerJournal:
        """Journals every step of this ledger to the append-only file ``path``.

        The journal at ``path`` (if any) and this ledger are first made to agree: if one records
        a prefix of the other's steps, both become the longer one (a ledger restored from an
        older checkpoint takes the steps that ran after it, so a resumed run charges every step
        that ran); if they record different steps, ValueError. From then on every
        :meth:`flush` (the Keras integration flushes after every compiled train call) appends
        the new steps. ``fsync=True`` waits for the disk at each append (see
        :class:`~tf_dp.ledger.journal.LedgerJournal`).

        :class:`tf_dp.keras.callbacks.BackupAndRestore` attaches a journal in its backup
        directory by itself; call this for a custom loop or checkpointing scheme (and call
        :meth:`flush` after each step there).

        Example::

            ledger.attach_journal("run/privacy_journal.jsonl")
            for batch in batches:
                train_step(batch)
                ledger.flush()
        """
        self.detach_journal()
        self._flush_all()
        journal = LedgerJournal(path, fsync=fsync)
        try:
            journaled = journal.runs()
            current = self.runs()
            n_journaled = sum(c for _, c in journaled)
            n_current = sum(c for _, c in current)
            if runs_are_prefix(journaled, current):
                if n_current > n_journaled:
                    journal.append_runs(_drop_steps(current, n_journaled), start=n_journaled)
            elif runs_are_prefix(current, journaled):
                self.restore_runs(journaled)
            else:
                raise ValueError(
                    f"the journal {journal.path!r} ({n_journaled} steps) and this ledger "
                    f"({n_current} steps) record different steps: they belong to different "
                    "runs. Attach a new journal path, or restore this run's ledger first"
                )
        except BaseException:
            journal.close()
            raise
        self._journal = journal
        self._journal_queries = int(self._queries.count.numpy())
        return journal

    def detach_journal(self) -> None:
        """Stops journaling (after a last flush) and closes the journal file."""
        if self._journal is None:
            return
        try:
            self.flush()
        finally:
            self._journal.close()
            self._journal = None

    def _sync_journal(self, staged: tuple[int, int] = (0, 0),
                      known: Optional[Mapping[Any, int]] = None) -> None:
        """Appends the rows recorded since the last append to the journal (after a flush);
        ``staged``: the rows still staged in the sample and query tables (read just before);
        ``known``: as :func:`read_int`'s, only when nothing was moved since it was read."""
        journal = self._journal
        if journal is None or not tf.executing_eagerly():
            return
        base = read_int(self._base, known)
        n, m = read_int(self._samples.count, known), read_int(self._queries.count, known)
        start, stop = journal.num_samples, base + n + staged[0]
        if stop == start:
            return
        if start < base:  # steps of the run prefix (restored content): appended as runs
            journal.append_runs(_drop_steps(self._prefix_runs(), start), start=start)
            start, self._journal_queries = base, 0
            if stop == start:
                return
        s0, s1 = start - base, stop - base  # rows of the step tables (recorded, then staged)
        q0, q1 = self._journal_queries, m + staged[1]
        tails = {} if known is None else known
        samples = self._samples.rows(s0, s1, n, tails.get(("tail", counter_key(
            self._samples.data))), n + staged[0])
        queries = self._queries.rows(q0, q1, m, tails.get(("tail", counter_key(
            self._queries.data))), m + staged[1])
        relative = queries.copy()
        relative[:, 0] -= s0
        key = f"{len(samples)},{len(relative)}:".encode() + samples.tobytes() + relative.tobytes()
        if key != self._journal_key:  # steps unlike the last ones: encode them
            self._journal_runs = encode_runs(_to_entries(samples, relative))
            self._journal_key = key
        journal.append_encoded(self._journal_runs, s1 - s0, start=start)
        self._journal_queries = q1

    # -- recording (graph-safe) ------------------------------------------------------------------

    def record_sampling(
        self, population_size, selection_probability, policy, pass_start=False, keep=None,
        origin="declared", unit="example", records_per_unit=0, max_batch_size=0,
    ) -> tf.Tensor:
        """Starts a new sample. ``policy`` is a name or its code (0 poisson, 1 shuffle, 2
        truncated_poisson, 3 balls_in_bins);
        ``pass_start`` (bool or 0/1) marks the first draw of a new pass over the data;
        ``origin`` (name or code: 0 declared, 1 sampled) says who drew the batch; ``unit`` (name
        or code: 0 example, 1 user) the unit of privacy, with ``records_per_unit`` (``k``, 0
        for examples); ``max_batch_size`` the truncation ``B`` of a ``truncated_poisson`` draw (0
        for other policies). Python or numpy numbers are checked here (population an integer
        in [1, 2**53], rate in (0, 1]); tensors are the caller's (a traced step's values)."""
        _check_recorded_sampling(population_size, selection_probability)
        if isinstance(policy, str):
            policy = policy_code(policy)
        if isinstance(origin, str):
            origin = origin_code(origin)
        if isinstance(unit, str):
            unit = unit_code(unit)
        row = tf.stack(
            [
                _f64(population_size),
                _f64(selection_probability),
                _f64(policy),
                tf.cast(pass_start, tf.float64),
                _f64(origin),
                _f64(unit),
                _f64(0 if records_per_unit is None else records_per_unit),
                _f64(0 if max_batch_size is None else max_batch_size),
            ]
        )
        return self._samples.append(row, keep)

    def record_sum_query(
        self, l2_sensitivity, noise_stddev, mechanism="gaussian", jl_projections=0,
        noise_seed: Optional[int] = None,
        noise_grid: Any = None,
        keep: Any = None,
    ) -> tf.Tensor:
        """Records one sum query of the current sample (values as used at run time).

        ``jl_projections`` holds the leaf index ``tree_step`` for a ``tree`` query (one column
        serves both: a query is never both).

        ``noise_seed`` is the explicit seed of the noise generator, if the user gave one (the
        noise is then predictable and the run has no privacy guarantee; statements say so).

        ``noise_grid`` is the grid spacing of grid-mode noise (None: continuous float noise)."""
        if isinstance(mechanism, str):
            mechanism = mechanism_code(mechanism)
        sample_index = self._samples.total() - 1
        seed = float("nan") if noise_seed is None else float(noise_seed)
        row = tf.stack(
            [
                _f64(sample_index),
                _f64(l2_sensitivity),
                _f64(noise_stddev),
                _f64(mechanism),
                _f64(jl_projections),
                _f64(seed),
                _f64(float("nan") if noise_grid is None else noise_grid),
            ]
        )
        return self._queries.append(row, keep)

    # -- reading (eager) -------------------------------------------------------------------------

    def recorded_samples(self) -> tf.Tensor:
        """The number of samples recorded so far, as an int64 tensor (graph-safe)."""
        return self._base.read_value() + self._samples.total()

    @property
    def num_samples(self) -> int:
        return self._base_steps() + int(self._samples.total().numpy())

    def _base_steps(self) -> int:
        """Steps of the run prefix (eager)."""
        return int(self._base.numpy())

    def _prefix_runs(self) -> list[tuple[SampleEntry, int]]:
        """The run prefix as runs ``[(entry, count), ...]`` (consecutive equal entries merged),
        read in time and memory proportional to its runs."""
        r = int(self._prefix.count.numpy())
        if r == 0:
            return []
        table = _read_rows(self._prefix.data, 0, r)
        queries = _read_rows(self._prefix_queries.data, 0, int(self._prefix_queries.count.numpy()))
        rows = _RowEntries()
        codes = rows.run_codes(np.ascontiguousarray(table[:, :_SAMPLE_COLS]), queries)
        counts = table[:, _SAMPLE_COLS].astype(np.int64)
        keep = np.flatnonzero(np.r_[True, codes[1:] != codes[:-1]])
        totals = np.add.reduceat(counts, keep)
        entries = rows.codes.entries
        return [(entries[c], t) for c, t in zip(codes[keep].tolist(), totals.tolist())]

    def samples(self) -> list[SampleEntry]:
        """The recorded samples, in order, each with its sum queries (one entry per step;
        :meth:`runs` gives the same steps without listing them)."""
        return [entry for entry, count in self.runs() for _ in range(count)]

    def runs(self) -> list[tuple[SampleEntry, int]]:
        """The recorded samples as runs of identical consecutive steps, ``[(entry, count),
        ...]`` in order (consecutive runs always differ), in time and memory proportional to
        the number of runs apart from vectorised passes over the tables.

        Example::

            runs = ledger.runs()
            steps = sum(count for _, count in runs)          # == ledger.num_samples
            tf_dp.accounting.compute_epsilon(runs, delta=1e-5)
        """
        if tf.executing_eagerly():
            self._flush_all()
        return _joined(self._prefix_runs(), self._runs_from(0))

    def runs_from(self, start: int) -> list[tuple[SampleEntry, int]]:
        """The runs of the steps from index ``start`` on (``runs()`` without the first ``start``
        steps), reading only those steps' rows: a reader that keeps up with the ledger (e.g. a
        callback at each epoch end) does work proportional to the new steps.

        Args:
          start: a step index, ``0 <= start <= num_samples``.

        Example::

            seen = ledger.num_samples
            ...  # train
            new_runs = ledger.runs_from(seen)   # only the steps recorded since
        """
        if isinstance(start, bool) or not isinstance(start, (int, np.integer)):
            raise TypeError(f"start must be an int step index, got {type(start).__name__}")
        start = int(start)
        base = self._base_steps()
        if tf.executing_eagerly():
            tail = self._read_tail(start - base) if start >= base else None
            if tail is not None:
                return tail
            self._flush_all()
        n = base + int(self._samples.count.numpy())
        if not 0 <= start <= n:
            raise ValueError(f"start must be in [0, num_samples={n}], got {start}")
        if start >= base:  # only steps recorded after the run prefix
            return self._runs_from(start - base)
        return _joined(_drop_steps(self._prefix_runs(), start), self._runs_from(0))

    def _read_tail(self, start: int) -> Optional[list[tuple[SampleEntry, int]]]:
        """:meth:`runs_from` for a reader that keeps up (``start``, a row of the step tables, is
        where the previous read ended, a few steps ago): the counters and then the new rows (the query row before them
        included, to check the tables were not replaced), about eight small eager reads. None
        (the caller reads the usual way) whenever that would not be the whole answer: rows
        still staged or dropped (a flush is due), a journal to append to, tables replaced, or
        more than ``_TAIL_ROWS`` new steps."""
        hint_step, hint_row = getattr(self, "_runs_cursor", (0, 0))
        if self._journal is not None or start != hint_step or start == 0:
            return None
        buffers = (self._samples, self._queries)
        if any(int(b.staged_count.numpy()) or int(b.overflow.numpy()) for b in buffers):
            return None
        n, m = (int(b.count.numpy()) for b in buffers)
        if not (start <= n <= start + _TAIL_ROWS and 0 < hint_row <= m):
            return None
        if n == start and m == hint_row:
            return []
        queries = _read_rows(self._queries.data, hint_row - 1, m)
        index = queries[:, 0]
        if not index[0] < start or (index.size > 1 and (
            index[1] < start or index[-1] >= n or np.any(np.diff(index) < 0)
            or np.any(index != np.round(index))
        )):
            return None  # tables replaced, or malformed: the usual reader sorts it out
        self._runs_cursor = (n, m)
        queries = queries[1:]
        queries[:, 0] -= start
        return compress(_to_entries(_read_rows(self._samples.data, start, n), queries))

    def _index_column(self, first: int, stop: int) -> np.ndarray:
        """Sample-index column of query rows ``first:stop``, read in pieces."""
        return np.concatenate(
            [np.zeros(0)] + [
                _read_rows(self._queries.data, a, min(a + _CHUNK_ROWS, stop))[:, 0].copy()
                for a in range(first, stop, _CHUNK_ROWS)
            ]
        )

    @without_gc
    def _runs_from(self, start: int) -> list[tuple[SampleEntry, int]]:
        """Runs of the steps from index ``start`` on (after a flush), read a piece of steps at a
        time: memory O(piece + runs), never a copy of the whole tables; work O(steps from
        ``start``) when ``start`` is at or after the previous call's."""
        n = int(self._samples.count.numpy())
        m = int(self._queries.count.numpy())
        # First query row that may belong to step `start`: the previous call's position, if
        # the row before it still belongs to an earlier step (checked: tables may be replaced).
        hint_step, hint_row = getattr(self, "_runs_cursor", (0, 0))
        if not (0 < hint_step <= start and hint_row <= m and (
            hint_row == 0 or _read_rows(self._queries.data, hint_row - 1, hint_row)[0, 0]
            < hint_step
        )):
            hint_row = 0
        index = self._index_column(hint_row, m)
        q_start = hint_row + int(np.searchsorted(index, start))
        index = index[q_start - hint_row :]
        if (hint_row == 0 and q_start > 0 and index.size and index[0] < start) or (
            index.size and (index[0] < start or index[-1] >= n or np.any(np.diff(index) < 0)
                            or np.any(index != np.round(index)))
        ) or (start == 0 and q_start > 0):
            # malformed tables: the whole-table reader names the problem
            runs = _tables_to_runs(self._samples.numpy(), self._queries.numpy())
            return _drop_steps(runs, start)
        self._runs_cursor = (n, m)  # every query row is of a step before n
        out: list[tuple[SampleEntry, int]] = []
        rows = _RowEntries()  # shared by the pieces: equal steps are one entry object
        for s0 in range(start, n, _CHUNK_ROWS):
            s1 = min(s0 + _CHUNK_ROWS, n)
            q0, q1 = np.searchsorted(index, [s0, s1]) + q_start
            queries = _read_rows(self._queries.data, int(q0), int(q1))
            queries[:, 0] -= s0
            piece = _tables_to_runs(_read_rows(self._samples.data, s0, s1), queries, rows)
            if out and piece and out[-1][0] is piece[0][0]:  # a run crossing the boundary
                out[-1] = (out[-1][0], out[-1][1] + piece[0][1])
                piece = piece[1:]
            out.extend(piece)
        return out

    def save(
        self,
        path: str | os.PathLike,
        metadata: Optional[Mapping[str, Any]] = None,
        overwrite: bool = False,
    ) -> None:
        """Writes the ledger to a versioned, checksummed JSON file (atomically).

        Refuses (:class:`~tf_dp.ledger.ledger_file.LedgerOverwriteError`) to replace a ledger
        file that records more steps than this ledger, unless ``overwrite=True``. Refuses
        (``ValueError``) a ledger with :attr:`missing_steps`: the file would read as the whole
        account of weights trained for more steps than it records.
        """
        if self.missing_steps:
            raise ValueError(
                f"tf_dp: this ledger lacks {self.missing_steps} of the {self.trained_steps} steps "
                "its weights were trained with (their ledger is missing), so a ledger file "
                "written from it would under-state the privacy spent; restore the run's ledger "
                "first (ledger.restore_entries(tf_dp.ledger.read_ledger_file(path)))"
            )
        metadata = {**json.loads(self._file_metadata), **dict(metadata or {})}
        write_ledger_runs(path, self.runs(), metadata, overwrite=overwrite)

    def set_file_metadata(self, key: str, value: Any) -> None:
        """Metadata (informative, JSON) that :meth:`save` writes into every ledger file, e.g.
        the mechanism settings that the events do not hold (a partition selection's threshold)."""
        extra = json.loads(self._file_metadata)
        extra[str(key)] = value
        self._file_metadata = json.dumps(extra)

    @classmethod
    def load(cls, path: str | os.PathLike, name: str = "privacy_ledger") -> "PrivacyLedger":
        """Reads a ledger file (rejecting corrupted files) into a new ledger."""
        try:
            entries, codes, counts = read_ledger_codes(path)  # no object per run
        except UnicodeDecodeError as e:  # binary garbage: not a ledger file either
            raise LedgerFileError(
                f"ledger file {os.fspath(path)!r} is not valid UTF-8 JSON ({e.reason} at byte "
                f"{e.start})"
            ) from None
        ledger = cls(name=name)
        ledger._write_coded(entries, codes, counts)
        return ledger

    def restore_entries(self, entries: Sequence[SampleEntry]) -> None:
        """Replaces the ledger's content with ``entries`` (e.g. to resume from a saved file).

        With a journal attached, ``entries`` must extend the journaled steps (a journaled step
        is never forgotten): otherwise ValueError, and the ledger is unchanged.
        """
        self.restore_runs(compress(list(entries)))

    @without_gc
    def restore_runs(self, runs: Sequence[tuple[SampleEntry, int]]) -> None:
        """:meth:`restore_entries` from runs ``[(entry, count), ...]`` (as :meth:`runs` or
        :func:`~tf_dp.ledger.read_ledger_runs` give them), without listing the steps.

        Example::

            ledger.restore_runs(tf_dp.ledger.read_ledger_runs("run.ledger.json"))
        """
        runs = as_runs(runs)  # validates the items and merges consecutive identical runs
        journaled: list[tuple[SampleEntry, int]] = []
        if self._journal is not None:
            journaled = self._journal.runs()
            if not runs_are_prefix(journaled, runs):
                n_runs = sum(c for _, c in runs)
                raise ValueError(
                    f"this ledger is journaled to {self._journal.path!r} "
                    f"({sum(c for _, c in journaled)} steps that ran); the {n_runs} entries "
                    "being restored do not extend them, so journaled steps would be forgotten. "
                    "Detach the journal first (ledger.detach_journal()) if they did not touch "
                    "this run's data"
                )
        codes = EntryCodes()
        run_codes = np.fromiter(map(codes.code, map(itemgetter(0), runs)), np.int64, len(runs))
        counts = np.fromiter(map(itemgetter(1), runs), np.int64, len(runs))
        self._write_coded(codes.entries, run_codes, counts)
        if self._journal is not None:
            self._journal_queries = 0  # the step tables are empty: every step is in the prefix
            self._sync_journal()

    def _write_coded(
        self, entries: Sequence[SampleEntry], run_codes: np.ndarray, counts: np.ndarray
    ) -> None:
        """Replaces the content with runs given as codes (indices into the distinct
        ``entries``) and step counts: they become the run prefix (one row per run, memory
        proportional to the runs, whatever the step count) and the step tables are emptied.
        Every entry converts first (nothing changes if one cannot)."""
        rows = _entry_rows(entries)
        run_codes = np.asarray(run_codes, np.int64)
        counts = np.asarray(counts, np.int64)
        total = int(counts.sum()) if counts.size else 0
        if counts.size and (int(counts.min()) < 1 or total > MAX_FILE_SAMPLES):
            raise ValueError(
                f"run counts must be >= 1 and total at most {MAX_FILE_SAMPLES:.0e} steps, got "
                f"counts in [{int(counts.min())}, {int(counts.max())}] totalling {total}"
            )
        prefix, queries = _step_tables(rows, run_codes)  # one "step" per run
        self._prefix.load(np.concatenate([prefix, counts[:, None].astype(np.float64)], axis=1))
        self._prefix_queries.load(queries)
        self._base.assign(total)
        for buffer in (self._samples, self._queries):
            buffer.allocate(0)
            buffer.set_count(0)
        self._runs_cursor = (0, 0)

    def tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The raw sample and query tables (float64), one sample row per step (the run prefix
        listed step by step). Files store :meth:`run_tables` (by runs) instead."""
        self.flush()
        samples, queries = self._samples.numpy().copy(), self._queries.numpy().copy()
        r = int(self._prefix.count.numpy())
        if r == 0:
            return samples, queries
        prefix = self._prefix.numpy()
        prefix_queries = self._prefix_queries.numpy()
        counts = prefix[:, _SAMPLE_COLS].astype(np.int64)
        per_run = np.bincount(prefix_queries[:, 0].astype(np.int64), minlength=r)
        head, head_queries = _step_tables(
            (prefix[:, :_SAMPLE_COLS], prefix_queries[:, 1:], per_run),
            np.repeat(np.arange(r), counts),
        )
        queries[:, 0] += head.shape[0]
        return np.concatenate([head, samples]), np.concatenate([head_queries, queries])

    def run_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The raw tables by runs (float64): what ``.keras`` and weights files store.

        ``samples`` has one row per run of identical consecutive steps (:meth:`runs`), its
        ``RUN_SAMPLE_COLS`` columns the step columns of :meth:`tables` and, last, the run's step
        count; ``queries`` has the sum queries of each run's step, column 0 the run's index.
        Memory and size go by runs, not steps; :meth:`load_tables` reads both forms and
        :func:`table_steps` counts the steps of either.

        Example::

            samples, queries = ledger.run_tables()
            copy = PrivacyLedger()
            copy.load_tables(samples, queries)     # copy.runs() == ledger.runs()
        """
        runs = self.runs()
        codes = EntryCodes()
        run_codes = np.fromiter(map(codes.code, map(itemgetter(0), runs)), np.int64, len(runs))
        counts = np.fromiter(map(itemgetter(1), runs), np.int64, len(runs))
        samples, queries = _step_tables(_entry_rows(codes.entries), run_codes)
        return np.concatenate([samples, counts[:, None].astype(np.float64)], axis=1), queries

    @property
    def missing_steps(self) -> int:
        """Steps the loaded weights were trained with that this ledger does not record (e.g.
        private weights loaded from a file whose ledger was removed): while positive, the
        privacy spent is unknown and ``compute_epsilon`` refuses the ledger."""
        return max(0, self._trained_steps - self.num_samples)

    @property
    def trained_steps(self) -> int:
        """Steps the weights this ledger goes with are known to have been trained for (0 when
        nothing was declared; see :meth:`expect_trained_steps` and :attr:`missing_steps`)."""
        return self._trained_steps

    def expect_trained_steps(self, steps: int) -> None:
        """Declares that the weights this ledger goes with were trained for ``steps`` steps."""
        self._trained_steps = max(self._trained_steps, int(steps))

    def reset_trained_steps(self, steps: int) -> None:
        """Sets :attr:`trained_steps` back to ``steps`` (undoing a failed load only: never use it
        to hide steps the weights were trained with)."""
        self._trained_steps = int(steps)

    def load_tables(
        self, samples: np.ndarray, queries: np.ndarray, *, verified: bool = True
    ) -> None:
        """Replaces the content with tables from :meth:`tables` (one row per step) or
        :meth:`run_tables` (one row per run, ``RUN_SAMPLE_COLS`` columns: memory by runs),
        validated through the events; ``verified=False`` for tables whose checksum could not be
        checked (:attr:`verified`)."""
        samples = np.asarray(samples, np.float64)
        if not np.all(np.isfinite(samples)):
            raise ValueError(
                "ledger tables: the sample table holds a value that is not finite (NaN or inf): "
                "every population size, rate, code and count must be a finite number"
            )
        if samples.ndim == 2 and samples.shape[1] == RUN_SAMPLE_COLS:
            self._load_run_tables(samples, np.asarray(queries, np.float64))
            self.verified = bool(verified)
            return
        if samples.ndim == 2 and 3 <= samples.shape[1] < _SAMPLE_COLS:
            # tables saved before a column existed (pass starts; origin, unit and k): zeros,
            # i.e. no pass starts, sampling declared (not checked), example-level
            missing = _SAMPLE_COLS - samples.shape[1]
            samples = np.concatenate([samples, np.zeros([samples.shape[0], missing])], axis=1)
        samples = samples.reshape(-1, _SAMPLE_COLS)
        queries = np.asarray(queries, np.float64)
        if queries.ndim == 2 and queries.shape[1] == _QUERY_COLS - 1:  # saved before noise_grid
            queries = np.concatenate([queries, np.full([len(queries), 1], np.nan)], axis=1)
        queries = queries.reshape(-1, _QUERY_COLS)
        self.restore_runs(_tables_to_runs(samples, queries))  # every event is validated on the way
        self.verified = bool(verified)

    def reset(self) -> None:
        """Forgets every recorded event (refused while a journal is attached: see
        :meth:`restore_entries`)."""
        self.restore_entries([])

    def __repr__(self) -> str:
        return f"PrivacyLedger(num_samples={self.num_samples})"

    def _load_run_tables(self, samples: np.ndarray, queries: np.ndarray) -> None:
        """:meth:`load_tables` of :meth:`run_tables`: the runs' rows are validated through their
        distinct entries and become the run prefix (no per-step rows)."""
        counts = samples[:, -1]
        if counts.size and not (
            np.all(np.isfinite(counts)) and np.all(counts >= 1)
            and np.all(counts == np.round(counts)) and float(counts.sum()) <= MAX_FILE_SAMPLES
        ):
            raise ValueError(
                "ledger run table: every run's step count (last column) must be an integer >= 1 "
                f"and the total at most {MAX_FILE_SAMPLES:.0e} steps"
            )
        queries = queries.reshape(-1, _QUERY_COLS) if queries.size else queries.reshape(
            0, _QUERY_COLS)
        index = queries[:, 0]
        if len(queries) and (np.any(np.diff(index) < 0) or not np.all(np.isfinite(index))):
            raise ValueError("ledger run table: the query table is not ordered by run index")
        try:  # one entry per run row (validated by the events), then the runs' counts
            entries = _to_entries(samples[:, :-1], queries)
        except (IndexError, OverflowError, TypeError) as e:
            raise ValueError(f"ledger run table holds a value out of range: {e}") from None
        self.restore_runs([(e, int(c)) for e, c in zip(entries, counts)])

