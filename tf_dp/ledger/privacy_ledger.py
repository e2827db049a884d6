"""PrivacyLedger: records, inside the training graph, every sampling event and sum query as run.

McMahan et al. 2018, section 6: rather than fixing a privacy computation before training, record
what actually happened (population size, sampling probability, the clip and noise of every sum
query at every step) and analyse the record afterwards, with any accountant, now or later.

The ledger is a ``tf.Module`` holding growable ``tf.Variable`` buffers, so recording works inside
``tf.function`` and the ledger is saved by ``tf.train.Checkpoint`` (resumed training continues the
same ledger). Buffers double when full, so recording costs amortised O(1) per step.

Example::

    ledger = tf_dp.PrivacyLedger()
    query = tf_dp.QueryWithLedger(
        tf_dp.GaussianSumQuery(l2_norm_clip=1.0, stddev=1.1), ledger,
        population_size=60000, selection_probability=256 / 60000)
    ...  # train; every query.get_noised_result(...) call records one sample
    ledger.save("ledger.json")                 # versioned, checksummed JSON
    entries = tf_dp.PrivacyLedger.load("ledger.json").samples()
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import tensorflow as tf

from tf_dp.ledger.events import (
    MECHANISMS,
    SAMPLING_POLICIES,
    SampleEntry,
    SamplingEvent,
    SumQueryEvent,
)
from tf_dp.ledger.ledger_file import LedgerFileError, read_ledger_file, write_ledger_file

# Column layouts of the two buffers.
_SAMPLE_COLS = 3  # population_size, selection_probability, policy code
_QUERY_COLS = 5  # sample index, l2_sensitivity, noise_stddev, mechanism code, jl_projections
_INITIAL_CAPACITY = 64


def policy_code(policy: str) -> int:
    if policy not in SAMPLING_POLICIES:
        raise ValueError(f"sampling policy must be one of {SAMPLING_POLICIES}, got {policy!r}")
    return SAMPLING_POLICIES.index(policy)


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


class _Buffer(tf.Module):
    """A growable [rows, cols] float64 table with a row count, usable inside tf.function."""

    def __init__(self, cols: int, name: str):
        super().__init__(name=name)
        with tf.init_scope():
            self.data = tf.Variable(
                tf.zeros([_INITIAL_CAPACITY, cols], tf.float64),
                shape=tf.TensorShape([None, cols]),
                trainable=False,
                name="data",
            )
            self.count = tf.Variable(tf.constant(0, tf.int64), trainable=False, name="count")

    def append(self, row: tf.Tensor) -> tf.Tensor:
        """Appends ``row`` (float64 [cols]); returns the index it was written at."""
        index = self.count.read_value()
        capacity = tf.shape(self.data, out_type=tf.int64)[0]

        def grow():
            self.data.assign(tf.concat([self.data, tf.zeros_like(self.data)], axis=0))
            return tf.constant(0)

        tf.cond(index >= capacity, grow, lambda: tf.constant(0))
        self.data.scatter_nd_update(tf.reshape(index, [1, 1]), tf.reshape(row, [1, -1]))
        self.count.assign_add(1)
        return index

    def numpy(self) -> np.ndarray:
        n = int(self.count.numpy())
        return self.data.numpy()[:n]

    def load(self, table: np.ndarray) -> None:
        n = table.shape[0]
        cap = max(_INITIAL_CAPACITY, 1 << int(np.ceil(np.log2(max(n, 1)))))
        padded = np.zeros([cap, self.data.shape[1]], np.float64)
        padded[:n] = table
        self.data.assign(padded)
        self.count.assign(n)


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

    # -- recording (graph-safe) ------------------------------------------------------------------

    def record_sampling(self, population_size, selection_probability, policy) -> tf.Tensor:
        """Starts a new sample. ``policy`` is a name or its code (0 poisson, 1 shuffle)."""
        if isinstance(policy, str):
            policy = policy_code(policy)
        row = tf.stack(
            [
                _f64(population_size),
                _f64(selection_probability),
                _f64(policy),
            ]
        )
        return self._samples.append(row)

    def record_sum_query(
        self, l2_sensitivity, noise_stddev, mechanism="gaussian", jl_projections=0
    ) -> tf.Tensor:
        """Records one sum query of the current sample (values as used at run time)."""
        if isinstance(mechanism, str):
            mechanism = mechanism_code(mechanism)
        sample_index = self._samples.count.read_value() - 1
        row = tf.stack(
            [
                _f64(sample_index),
                _f64(l2_sensitivity),
                _f64(noise_stddev),
                _f64(mechanism),
                _f64(jl_projections),
            ]
        )
        return self._queries.append(row)

    # -- reading (eager) -------------------------------------------------------------------------

    @property
    def num_samples(self) -> int:
        return int(self._samples.count.numpy())

    def samples(self) -> list[SampleEntry]:
        """The recorded samples, in order, each with its sum queries."""
        samples = self._samples.numpy()
        queries = self._queries.numpy()
        per_sample: list[list[SumQueryEvent]] = [[] for _ in range(samples.shape[0])]
        for idx, sens, std, mech, r in queries:
            i = int(idx)
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
                )
            )
        return [
            SampleEntry(
                sampling=SamplingEvent(
                    population_size=int(round(n)),
                    selection_probability=float(q),
                    policy=SAMPLING_POLICIES[int(p)],
                ),
                queries=tuple(qs),
            )
            for (n, q, p), qs in zip(samples, per_sample)
        ]

    def save(self, path: str | os.PathLike, metadata: Optional[Mapping[str, Any]] = None) -> None:
        """Writes the ledger to a versioned, checksummed JSON file (atomically)."""
        write_ledger_file(path, self.samples(), metadata)

    @classmethod
    def load(cls, path: str | os.PathLike, name: str = "privacy_ledger") -> "PrivacyLedger":
        """Reads a ledger file (rejecting corrupted files) into a new ledger."""
        try:
            entries = read_ledger_file(path)
        except UnicodeDecodeError as e:  # binary garbage: not a ledger file either
            raise LedgerFileError(
                f"ledger file {os.fspath(path)!r} is not valid UTF-8 JSON ({e.reason} at byte "
                f"{e.start})"
            ) from None
        ledger = cls(name=name)
        ledger.restore_entries(entries)
        return ledger

    def restore_entries(self, entries: Sequence[SampleEntry]) -> None:
        """Replaces the ledger's content with ``entries`` (e.g. to resume from a saved file)."""
        samples = np.array(
            [
                [e.sampling.population_size, e.sampling.selection_probability,
                 policy_code(e.sampling.policy)]
                for e in entries
            ],
            np.float64,
        ).reshape(-1, _SAMPLE_COLS)
        queries = np.array(
            [
                [i, q.l2_sensitivity, q.noise_stddev, mechanism_code(q.mechanism),
                 q.jl_projections or 0]
                for i, e in enumerate(entries)
                for q in e.queries
            ],
            np.float64,
        ).reshape(-1, _QUERY_COLS)
        self._samples.load(samples)
        self._queries.load(queries)

    def reset(self) -> None:
        """Forgets every recorded event."""
        self.restore_entries([])

    def __repr__(self) -> str:
        return f"PrivacyLedger(num_samples={self.num_samples})"
