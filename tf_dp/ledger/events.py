"""Frozen event records: what accounting needs to know about one DP training run.

A run is a sequence of *samples*. Each sample is one draw from the data (a sampling event: the
population size ``n``, the selection probability ``q`` and the sampling policy) followed by one or
more *sum queries* over that draw (each with its L2 sensitivity and the standard deviation of the
Gaussian noise it added, plus mechanism-specific fields).

Several Gaussian sum queries on the same sample are, for accounting, one Gaussian mechanism with
sensitivity ``S* = sqrt(sum_g (S_g / sigma_g)^2)`` and unit noise (McMahan et al. 2018, Eq. (1)),
so each sample reduces to a single *effective noise multiplier*
``z = (sum_g (S_g / sigma_g)^2)^(-1/2)``.

These records are pure Python (no TensorFlow) so that the accountants in ``tf_dp.accounting`` can
consume them without importing TensorFlow.

Example:

>>> from tf_dp.ledger.events import SampleEntry, SamplingEvent, SumQueryEvent
>>> entry = SampleEntry(
...     sampling=SamplingEvent(population_size=60000, selection_probability=256 / 60000),
...     queries=(SumQueryEvent(l2_sensitivity=1.0, noise_stddev=1.1),),
... )
>>> round(entry.effective_noise_multiplier(), 6)
1.1
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import json
import math
from operator import itemgetter
from typing import Any, Callable, Optional, Sequence, TypeVar

import numpy as np

_F = TypeVar("_F", bound=Callable)


def without_gc(fn: _F) -> _F:
    """Runs ``fn`` with Python's cyclic garbage collector paused (restored after, as it was).

    For functions that build lists of millions of run tuples (which create no reference
    cycles): otherwise every few thousand new tuples trigger a collection that, with millions
    of objects alive, scans them again (about half the time of such a build).
    """

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        enabled = gc.isenabled()
        gc.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            if enabled:
                gc.enable()

    return wrapper  # type: ignore[return-value]

#: Sampling policies the ledger knows. ``poisson``: every example is selected independently with
#: probability ``q`` (privacy amplification by subsampling applies). ``shuffle``: the data are
#: shuffled and cut into fixed-size batches (each example used once per epoch); accountants report
#: the bound that does not assume amplification for it. ``truncated_poisson``: a Poisson sample
#: (rate ``q``) cut to at most ``max_batch_size`` records by keeping a uniformly random subset
#: (Chua et al. 2024, arXiv 2411.04205). ``balls_in_bins``: every pass assigns each record to one
#: of ``round(1 / q)`` batches uniformly at random (Chua et al. 2025); each record is in exactly one
#: batch per pass. ``cyclic_poisson``: the records are split into ``num_parts`` fixed parts and
#: step ``t`` draws a Poisson sample (rate ``q``) of part ``t mod num_parts`` only, so a record
#: takes part at most once every ``num_parts`` steps (``tf_dp.data.cyclic_poisson_batches``; the
#: b-min-separation of amplified BandMF). Codes are the positions in this tuple: new policies are
#: appended.
SAMPLING_POLICIES = ("poisson", "shuffle", "truncated_poisson", "balls_in_bins", "cyclic_poisson")

#: Policies whose draws are grouped in passes over the data (``pass_start`` is recorded).
PASS_POLICIES = ("shuffle", "balls_in_bins")

#: Who performed the sampling. ``declared``: the user declared it (``set_sampling``); tf_dp
#: records the claim and cannot check it. ``sampled``: a tf_dp sampler drew the batches (or
#: ``fit`` batched in-memory arrays itself), so the claim holds by construction. Codes are the
#: positions in this tuple (0, the code of a table that predates the column, is ``declared``).
SAMPLING_ORIGINS = ("declared", "sampled")

#: The unit of privacy. ``example``: neighbouring data sets differ in one record. ``user``: they
#: differ in all the records of one user (add/remove-one-user adjacency); the population and the
#: rate are those of users. Codes are the positions in this tuple.
PRIVACY_UNITS = ("example", "user")

#: Sum-query mechanisms. ``gaussian``: exact clipping plus Gaussian noise. ``jl``: clipping weights
#: from Johnson-Lindenstrauss norm estimates (Bu et al. 2020) plus Gaussian noise; the event carries
#: ``jl_projections``. ``none``: no noise (a non-private query); any sample that contains one has
#: infinite epsilon. ``tree``: one leaf of a tree-aggregation (binary tree mechanism) release,
#: Kairouz et al. 2021: ``noise_stddev`` is the stddev of every tree node and the event carries
#: ``tree_step``, the leaf's 0-based index in its tree (0: first step after a (re)start), from
#: which the accountants rebuild the trees (``tf_dp.accounting.tree``). Codes are the positions in
#: this tuple: new mechanisms are appended, so older ledgers keep their meaning. ``mf``: one
#: release of a correlated-noise (DP matrix factorization) run, the clipped sum plus the step's row
#: of ``C^{-1} Z``: ``noise_stddev`` is the stddev of each entry of ``Z`` and the event carries
#: ``mf_strategy``, the strategy's config (``C``) as canonical JSON; consecutive ``mf`` steps are
#: the rows of one ``C`` (``tf_dp.accounting.matrix_factorization``).
MECHANISMS = ("gaussian", "jl", "none", "tree", "mf")

_MF_CODES: dict[str, int] = {}
_MF_STRATEGIES: list[str] = []


def mf_strategy_json(config: Any) -> str:
    """The canonical JSON text of a strategy's ``to_config()`` dict (validated), as
    ``SumQueryEvent.mf_strategy`` holds it."""
    MatrixFactorizationEvent(config, 1.0, 1.0)  # validates the config
    return json.dumps(config, sort_keys=True, separators=(",", ":"), allow_nan=False)


@functools.lru_cache(maxsize=64)
def _is_mf_strategy_json(text: str) -> bool:
    try:
        return mf_strategy_json(json.loads(text)) == text
    except (ValueError, TypeError):
        return False


def mf_strategy_code(strategy: str) -> int:
    """A small integer for ``strategy`` (an ``mf_strategy`` JSON text), the same for the process's
    lifetime: what a ledger table stores in place of the text (:func:`mf_strategy_of_code`)."""
    code = _MF_CODES.get(strategy)
    if code is None:
        code = _MF_CODES[strategy] = len(_MF_STRATEGIES)
        _MF_STRATEGIES.append(strategy)
    return code


def mf_strategy_of_code(code: int) -> str:
    """The ``mf_strategy`` text of a :func:`mf_strategy_code`."""
    return _MF_STRATEGIES[int(code)]

#: Largest ``l2_sensitivity / noise_stddev`` of a noisy sum query: its square, which the
#: accountants compose, stays far inside the float64 range. (A float32 step cannot exceed it:
#: the largest float32 over the smallest positive one is about 2.4e83.)
MAX_SENSITIVITY_TO_NOISE = 1e150

#: Largest population size, records per user or batch bound a sampling event may hold: the
#: ledger's step table holds them as float64, exact up to 2**53 (larger integers would be
#: rounded, and beyond int64 TensorFlow cannot take them at all).
MAX_COUNT = 2**53


def _show(value: object) -> str:
    """``repr(value)``; an integer beyond 1e20 by its size only (it may have thousands of
    digits)."""
    if isinstance(value, int) and abs(value) >= 10**20:
        return f"an integer of about 10**{int(abs(value).bit_length() * math.log10(2))}"
    return repr(value)


@dataclasses.dataclass(frozen=True)
class SamplingEvent:
    """One draw of a sample from a population.

    Attributes:
      population_size: ``n``, the number of records the sample was drawn from (>= 1).
      selection_probability: ``q`` in [0, 1]; for ``poisson`` the per-record inclusion probability,
        for ``shuffle`` the batch size divided by ``n``.
      policy: one of :data:`SAMPLING_POLICIES`.
      pass_start: True when this draw is the first of a new pass over the data (a new shuffle of
        the records: every ``fit`` epoch, every ``train_on_batch`` call, or an explicit
        ``optimizer.start_pass()``). ``shuffle`` accounting counts epochs, and tree aggregation
        cuts its epoch windows, from these boundaries; the first draw of a ledger always starts a
        pass. Recorded for ``shuffle`` draws only (Poisson draws have no passes).
      origin: one of :data:`SAMPLING_ORIGINS`: ``sampled`` when tf_dp drew the batches,
        ``declared`` when the user declared the sampling (not checked by tf_dp). Ledgers written
        before the origin was recorded read as ``declared``.
      unit: one of :data:`PRIVACY_UNITS`; under ``user``, ``population_size`` and
        ``selection_probability`` count users and neighbouring data sets differ in all the
        records of one user (added or removed under ``poisson``).
      records_per_unit: ``k``, the most records one sampled user contributes to a batch (an
        integer >= 1 with ``unit="user"``, None with ``unit="example"``).
      max_batch_size: ``B``, the most units a ``truncated_poisson`` batch keeps (an integer >= 1;
        None for every other policy).
      num_parts: ``b``, the parts of a ``cyclic_poisson`` draw (an integer >= 1; None for every
        other policy); ``population_size`` is the whole data set, ``selection_probability`` the
        rate within the part drawn from.
    """

    population_size: int
    selection_probability: float
    policy: str = "poisson"
    pass_start: bool = False
    origin: str = "declared"
    unit: str = "example"
    records_per_unit: Optional[int] = None
    max_batch_size: Optional[int] = None
    num_parts: Optional[int] = None

    def __post_init__(self):
        n = self.population_size
        if isinstance(n, bool) or not (isinstance(n, int) and 1 <= n <= MAX_COUNT):
            raise ValueError(
                f"population_size must be an integer >= 1 and <= 2**53 (the ledger holds counts "
                f"exactly as float64), got {_show(n)}"
            )
        q = self.selection_probability
        if isinstance(q, bool) or not (
            isinstance(q, (int, float)) and math.isfinite(q) and 0.0 <= q <= 1.0
        ):
            raise ValueError(f"selection_probability must be in [0, 1], got {q!r}")
        if self.policy not in SAMPLING_POLICIES:
            raise ValueError(f"policy must be one of {SAMPLING_POLICIES}, got {self.policy!r}")
        if not isinstance(self.pass_start, bool):
            raise ValueError(f"pass_start must be a bool, got {self.pass_start!r}")
        if self.origin not in SAMPLING_ORIGINS:
            raise ValueError(f"origin must be one of {SAMPLING_ORIGINS}, got {self.origin!r}")
        if self.unit not in PRIVACY_UNITS:
            raise ValueError(f"unit must be one of {PRIVACY_UNITS}, got {self.unit!r}")
        k = self.records_per_unit
        if self.unit == "user":
            if isinstance(k, bool) or not (isinstance(k, int) and 1 <= k <= MAX_COUNT):
                raise ValueError(
                    f"records_per_unit must be an integer >= 1 (and <= 2**53) with unit='user', "
                    f"got {_show(k)}"
                )
        elif k is not None:
            raise ValueError(f"records_per_unit must be None with unit='example', got {k!r}")
        b = self.max_batch_size
        if self.policy == "truncated_poisson":
            if isinstance(b, bool) or not (isinstance(b, int) and 1 <= b <= MAX_COUNT):
                raise ValueError(
                    f"max_batch_size must be an integer >= 1 (and <= 2**53) with "
                    f"policy='truncated_poisson', got {_show(b)}"
                )
        elif b is not None:
            raise ValueError(
                f"max_batch_size must be None unless policy='truncated_poisson', got {b!r}"
            )
        parts = self.num_parts
        if self.policy == "cyclic_poisson":
            if isinstance(parts, bool) or not (isinstance(parts, int) and 1 <= parts <= n):
                raise ValueError(
                    f"num_parts must be an integer in [1, population_size] with "
                    f"policy='cyclic_poisson', got {_show(parts)}"
                )
        elif parts is not None:
            raise ValueError(f"num_parts must be None unless policy='cyclic_poisson', got {parts!r}")

    def describe(self) -> str:
        """What a privacy statement says about this draw: the unit and who vouches for it (the
        adjacency, add/remove or replace-one, follows from the policy and is stated with it).

        Example::

            SamplingEvent(1000, 0.01, origin="sampled", unit="user", records_per_unit=4).describe()
            # 'user-level (one user's records, at most 4 per batch); sampling performed
            #  by tf_dp'
        """
        if self.unit == "user":
            unit = f"user-level (one user's records, at most {self.records_per_unit} per batch)"
        else:
            unit = "example-level (one example)"
        if self.origin == "sampled":
            who = "sampling performed by tf_dp"
        else:
            who = "sampling declared by the user, not checked by tf_dp"
        return f"{unit}; {who}"


@dataclasses.dataclass(frozen=True)
class SumQueryEvent:
    """One Gaussian sum query (clip then add noise) over a sample.

    Attributes:
      l2_sensitivity: the L2 sensitivity of the sum under add/remove-one adjacency, as used at run
        time (the clip ``C`` for one example per record; ``2C`` for microbatches of several).
      noise_stddev: standard deviation of the Gaussian noise added to the sum (>= 0).
      mechanism: one of :data:`MECHANISMS`.
      jl_projections: for ``mechanism == "jl"``, the number ``r`` of JL projections; else None.
      noise_seed: the explicit seed of the noise generator when the user gave one (tests and
        debugging): the noise is then predictable, and no privacy guarantee holds for the run.
        ``None`` (noise keyed from OS entropy) for real training.
      tree_step: for ``mechanism == "tree"``, the 0-based index of this step's leaf in its tree
        (an integer >= 0; 0 starts a new tree); else None. ``noise_stddev`` is then the stddev of
        each tree node.
      noise_grid: the grid spacing ``g`` of grid-mode noise (every released value a multiple of
        ``g``; ``l2_sensitivity`` then includes the rounding term ``g sqrt(d)``); None for
        continuous floating-point noise.
      mf_strategy: for ``mechanism == "mf"``, the strategy's config as canonical JSON
        (:func:`mf_strategy_json`); else None. ``noise_stddev`` is then the stddev of each entry
        of ``Z``.
    """

    l2_sensitivity: float
    noise_stddev: float
    mechanism: str = "gaussian"
    jl_projections: Optional[int] = None
    noise_seed: Optional[int] = None
    tree_step: Optional[int] = None
    noise_grid: Optional[float] = None
    mf_strategy: Optional[str] = None

    def __post_init__(self):
        seed = self.noise_seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise ValueError(f"noise_seed must be an integer or None, got {seed!r}")
        s, sd = self.l2_sensitivity, self.noise_stddev
        if isinstance(s, bool) or not (isinstance(s, (int, float)) and math.isfinite(s) and s >= 0):
            raise ValueError(f"l2_sensitivity must be >= 0, got {s!r}")
        if isinstance(sd, bool) or not (
            isinstance(sd, (int, float)) and math.isfinite(sd) and sd >= 0
        ):
            raise ValueError(f"noise_stddev must be >= 0, got {sd!r}")
        if sd > 0 and s / sd > MAX_SENSITIVITY_TO_NOISE:
            raise ValueError(
                f"l2_sensitivity / noise_stddev must be <= {MAX_SENSITIVITY_TO_NOISE:g} (a noise "
                f"so small gives no privacy; record noise_stddev=0 for no noise), got {s!r} / "
                f"{sd!r}"
            )
        if self.mechanism not in MECHANISMS:
            raise ValueError(f"mechanism must be one of {MECHANISMS}, got {self.mechanism!r}")
        if self.mechanism == "jl":
            r = self.jl_projections
            if isinstance(r, bool) or not (isinstance(r, int) and r >= 1):
                raise ValueError(f"jl_projections must be an integer >= 1 for a jl event, got {r!r}")
        elif self.jl_projections is not None:
            raise ValueError("jl_projections is only allowed for mechanism='jl'")
        if self.mechanism == "tree":
            t = self.tree_step
            if isinstance(t, bool) or not (isinstance(t, int) and t >= 0):
                raise ValueError(f"tree_step must be an integer >= 0 for a tree event, got {t!r}")
        elif self.tree_step is not None:
            raise ValueError("tree_step is only allowed for mechanism='tree'")
        if self.mechanism == "mf":
            m = self.mf_strategy
            if not (isinstance(m, str) and _is_mf_strategy_json(m)):
                raise ValueError(f"mf_strategy must be a strategy config's canonical JSON "
                                 f"(mf_strategy_json) for an mf event, got {m!r}")
        elif self.mf_strategy is not None:
            raise ValueError("mf_strategy is only allowed for mechanism='mf'")
        g = self.noise_grid
        if g is not None and (
            isinstance(g, bool) or not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0)
        ):
            raise ValueError(f"noise_grid must be None or a finite number > 0, got {g!r}")

    @property
    def private(self) -> bool:
        """False when this query gives no privacy (no noise while the sensitivity is positive)."""
        if self.mechanism == "none":
            return False
        return self.noise_stddev > 0 or self.l2_sensitivity == 0


@dataclasses.dataclass(frozen=True)
class SampleEntry:
    """A sampling event together with the sum queries run on that sample."""

    sampling: SamplingEvent
    queries: tuple[SumQueryEvent, ...]

    def effective_noise_multiplier(self) -> float:
        """``z = (sum_g (S_g / sigma_g)^2)^(-1/2)`` (McMahan et al. 2018, Eq. (1)).

        Returns ``0.0`` when any query is non-private (infinite epsilon), or when the noise is so
        small next to the sensitivity that ``(S_g / sigma_g)^2`` exceeds the float64 range (no
        finite guarantee is then expressible; treating it as non-private is a valid bound), and
        ``math.inf`` when no query touches the data (zero sensitivity everywhere; no privacy is
        spent).
        """
        total = 0.0
        for q in self.queries:
            if not q.private:
                return 0.0
            if q.l2_sensitivity == 0:
                continue
            ratio = q.l2_sensitivity / q.noise_stddev  # inf (not an exception) on overflow
            total += ratio * ratio
        if math.isinf(total):
            return 0.0
        return math.inf if total == 0 else total ** -0.5

    @property
    def jl_projections(self) -> Optional[int]:
        """The JL dimension ``r`` of this sample, or None for exact clipping.

        Raises ValueError when queries of one sample mix JL dimensions (no accountant handles it).
        """
        rs = {q.jl_projections for q in self.queries if q.mechanism == "jl"}
        if not rs:
            return None
        if len(rs) > 1 or any(q.mechanism == "gaussian" and q.l2_sensitivity > 0 for q in self.queries):
            raise ValueError(
                f"a sample mixes JL dimensions {sorted(rs)} or JL with exact clipping; "
                "the accountants support one JL dimension per sample"
            )
        return rs.pop()

    @property
    def tree_step(self) -> Optional[int]:
        """The tree-aggregation leaf index of this sample, or None when it has no tree query.

        Raises ValueError when a sample mixes tree queries with other private queries or tree
        queries at different leaves (no accountant handles it).
        """
        steps = {q.tree_step for q in self.queries if q.mechanism == "tree"}
        if not steps:
            return None
        others = [q for q in self.queries if q.mechanism != "tree" and q.l2_sensitivity > 0]
        if len(steps) > 1 or others:
            raise ValueError(
                f"a sample mixes tree-aggregation leaves {sorted(steps)} or tree aggregation with "
                "other sum queries; the accountants support one tree leaf index per sample and "
                "only tree queries in it"
            )
        return steps.pop()

    @property
    def private(self) -> bool:
        return all(q.private for q in self.queries)

    @property
    def noise_seeds(self) -> tuple[int, ...]:
        """Explicit noise seeds of this sample's queries (empty for real, unseeded training)."""
        return tuple(q.noise_seed for q in self.queries if q.noise_seed is not None)


def compress(entries: Sequence[SampleEntry]) -> list[tuple[SampleEntry, int]]:
    """Run-length encodes consecutive identical entries: ``[(entry, count), ...]``.

    Accountants use it to compose ``count`` identical steps at once.
    """
    out: list[tuple[SampleEntry, int]] = []
    for e in entries:
        if out and out[-1][0] == e:
            out[-1] = (e, out[-1][1] + 1)
        else:
            out.append((e, 1))
    return out


class EntryCodes:
    """Numbers distinct :class:`SampleEntry` values in order of first appearance, hashing each
    distinct *object* once (objects are looked up by identity first), so that a long sequence of
    runs that reuses a few entry objects costs one dict lookup per run.

    Example::

        codes = EntryCodes()
        [codes.code(e) for e, _ in runs]   # equal entries get equal codes
        codes.entries                      # the distinct entries, in order of first appearance
    """

    def __init__(self) -> None:
        self.entries: list[SampleEntry] = []
        self._by_value: dict[SampleEntry, int] = {}
        # id -> (code, entry): the entry is kept alive, so its id is never reused meanwhile
        self._by_id: dict[int, tuple[int, SampleEntry]] = {}

    def code(self, entry: SampleEntry) -> int:
        """The code of ``entry`` (a new one for a value not seen before)."""
        hit = self._by_id.get(id(entry))
        if hit is not None:
            return hit[0]
        code = self._by_value.get(entry)
        if code is None:
            code = self._by_value[entry] = len(self.entries)
            self.entries.append(entry)
        self._by_id[id(entry)] = (code, entry)
        return code


@without_gc
def distinct_runs(runs: Sequence[tuple[SampleEntry, int]]) -> list[tuple[SampleEntry, int]]:
    """The distinct entries of ``runs`` with their total step counts, ``[(entry, steps), ...]`` in
    order of first appearance (what an order-independent reader needs). Runs are grouped by entry
    object with numpy, and only the distinct objects are compared by value.

    Example::

        distinct_runs([(a, 2), (b, 1), (a, 3)])   # [(a, 5), (b, 1)]
    """
    runs = list(runs)
    if not runs:
        return []
    try:
        counts = np.fromiter(map(itemgetter(1), runs), np.int64, len(runs))
    except OverflowError:  # counts beyond int64: Python integers
        counts = np.array([c for _, c in runs], object)
    ids = np.fromiter(map(id, map(itemgetter(0), runs)), np.int64, len(runs))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    per_object = np.zeros(len(first), counts.dtype)
    np.add.at(per_object, inverse.ravel(), counts)
    codes = EntryCodes()
    totals: list[int] = []
    for i in np.argsort(first, kind="stable").tolist():  # objects in order of first appearance
        c = codes.code(runs[int(first[i])][0])
        if c == len(totals):
            totals.append(int(per_object[i]))
        else:
            totals[c] += int(per_object[i])
    return list(zip(codes.entries, totals))


def runs_are_prefix(
    a: Sequence[tuple[SampleEntry, int]], b: Sequence[tuple[SampleEntry, int]]
) -> bool:
    """Whether the steps of runs ``a`` are a prefix of the steps of runs ``b`` (both merged, as
    :func:`compress` gives), in O(runs).

    Example::

        runs_are_prefix([(entry, 3)], [(entry, 5), (other, 1)])   # True
    """
    if len(a) > len(b):
        return False
    for i, (entry, count) in enumerate(a):
        other, other_count = b[i]
        if entry != other or count > other_count:
            return False
        if count < other_count and i != len(a) - 1:
            return False
    return True


#: Participation schemas of a matrix-factorization run (see :class:`MatrixFactorizationEvent`).
MF_PARTICIPATIONS = ("single", "periodic", "cyclic_poisson")

#: Key of the :class:`MatrixFactorizationEvent` in a ledger file's ``metadata`` (covered by the
#: file's checksum).
MF_METADATA_KEY = "matrix_factorization"


@dataclasses.dataclass(frozen=True)
class MatrixFactorizationEvent:
    """A correlated-noise (DP matrix factorization) run: the released step-``t`` sum is the clipped
    sum plus row ``t`` of ``C^{-1} Z``, ``Z`` i.i.d. ``N(0, (noise_multiplier * l2_norm_clip)^2)``.

    The event describes the mechanism once per run; the ledger's steps say how many ran. It is
    kept in a ledger file's metadata under :data:`MF_METADATA_KEY`
    (``ledger.save(path, metadata={MF_METADATA_KEY: event.to_dict()})``), and
    ``tf_dp.accounting.matrix_factorization.mf_epsilon_from_ledger`` recomputes epsilon from it.

    Attributes:
      strategy: the strategy's ``to_config()`` dict (``{"kind": "banded", "coefficients": [...],
        "num_steps": n}``: ``C`` lower-triangular Toeplitz with that first column; or ``{"kind":
        "blt", "omega": [...], "theta": [...], "num_steps": n}``: ``C^{-1}`` Toeplitz with first
        column ``1, sum_i omega_i theta_i^(k-1)``). Steps past ``num_steps`` continue the Toeplitz.
      noise_multiplier: ``z >= 0``.
      l2_norm_clip: the clip norm ``> 0``.
      participation: one of :data:`MF_PARTICIPATIONS`. ``single``: a record is in at most one
        step. ``periodic``: a record's steps are ``period`` apart (a fixed cyclic order). ``cyclic_
        poisson``: the records split into ``period`` parts, step ``t`` a Poisson sample at rate
        ``sampling_probability`` of part ``t mod period``.
      period: steps between a record's participations (``periodic``/``cyclic_poisson``; an integer
        >= 1), None for ``single``.
      sampling_probability: ``q`` in (0, 1] for ``cyclic_poisson``; else None.

    Example:

    >>> e = MatrixFactorizationEvent({"kind": "banded", "coefficients": [1.0, 0.5],
    ...                               "num_steps": 10}, 2.0, 1.0, "periodic", period=5)
    >>> MatrixFactorizationEvent.from_dict(e.to_dict()) == e
    True
    """

    strategy: dict
    noise_multiplier: float
    l2_norm_clip: float
    participation: str = "single"
    period: Optional[int] = None
    sampling_probability: Optional[float] = None

    def __post_init__(self):
        s = self.strategy
        if not isinstance(s, dict) or s.get("kind") not in ("banded", "blt"):
            raise ValueError(f"strategy must be a strategy's to_config() dict (kind 'banded' or "
                             f"'blt'), got {s!r}")
        keys = ("coefficients",) if s["kind"] == "banded" else ("omega", "theta")
        for key in keys:
            v = s.get(key)
            if not (isinstance(v, (list, tuple)) and len(v) >= (1 if key == "coefficients" else 0)
                    and all(isinstance(x, (int, float)) and not isinstance(x, bool)
                            and math.isfinite(x) for x in v)):
                raise ValueError(f"strategy[{key!r}] must be a list of finite numbers, got {v!r}")
        if s["kind"] == "banded" and not s["coefficients"][0] > 0:
            raise ValueError("strategy['coefficients'][0] must be > 0 (C's diagonal), got "
                             f"{s['coefficients'][0]!r}")
        if s["kind"] == "blt" and len(s["omega"]) != len(s["theta"]):
            raise ValueError("strategy['omega'] and strategy['theta'] must have the same length")
        n = s.get("num_steps")
        if isinstance(n, bool) or not (isinstance(n, int) and n >= 1):
            raise ValueError(f"strategy['num_steps'] must be an integer >= 1, got {n!r}")
        z, c = self.noise_multiplier, self.l2_norm_clip
        if isinstance(z, bool) or not (isinstance(z, (int, float)) and math.isfinite(z) and z >= 0):
            raise ValueError(f"noise_multiplier must be a finite number >= 0, got {z!r}")
        if isinstance(c, bool) or not (isinstance(c, (int, float)) and math.isfinite(c) and c > 0):
            raise ValueError(f"l2_norm_clip must be a finite number > 0, got {c!r}")
        if self.participation not in MF_PARTICIPATIONS:
            raise ValueError(f"participation must be one of {MF_PARTICIPATIONS}, got "
                             f"{self.participation!r}")
        p = self.period
        if self.participation == "single":
            if p is not None:
                raise ValueError("period is only allowed for participation 'periodic' or "
                                 "'cyclic_poisson'")
        elif isinstance(p, bool) or not (isinstance(p, int) and p >= 1):
            raise ValueError(f"period must be an integer >= 1 for participation "
                             f"{self.participation!r}, got {p!r}")
        q = self.sampling_probability
        if self.participation == "cyclic_poisson":
            if isinstance(q, bool) or not (isinstance(q, (int, float)) and 0 < q <= 1):
                raise ValueError(f"sampling_probability must be in (0, 1] for cyclic_poisson, "
                                 f"got {q!r}")
        elif q is not None:
            raise ValueError("sampling_probability is only allowed for participation "
                             "'cyclic_poisson'")

    def to_dict(self) -> dict:
        """A JSON-safe dict (:meth:`from_dict` reads it back)."""
        return {"strategy": dict(self.strategy), "noise_multiplier": self.noise_multiplier,
                "l2_norm_clip": self.l2_norm_clip, "participation": self.participation,
                "period": self.period, "sampling_probability": self.sampling_probability}

    @classmethod
    def from_dict(cls, d: dict) -> "MatrixFactorizationEvent":
        if not isinstance(d, dict) or set(d) - {
                "strategy", "noise_multiplier", "l2_norm_clip", "participation", "period",
                "sampling_probability"}:
            raise ValueError(f"not a MatrixFactorizationEvent dict: {d!r}")
        return cls(**d)
