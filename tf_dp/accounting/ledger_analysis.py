"""From a privacy ledger (or plain DP-SGD hyperparameters) to a privacy statement.

Each sample of the ledger is reduced to its *effective noise multiplier* ``z`` (McMahan et al.
2018, Eq. (1): several Gaussian sum queries on one sample act as one Gaussian query with
sensitivity ``sqrt(sum_g (S_g/sigma_g)^2)``), its sampling rate ``q`` and policy, and its JL
dimension if any.  Identical consecutive samples are composed at once (``compress``).

Sampling policies (design invariant 5):

* ``poisson``: each record is included independently with probability ``q``; privacy amplification
  by subsampling is applied (Abadi et al. 2016 Sec. 3.1; Bu et al. 2019 Sec. 3.1).
* ``shuffle``: every epoch the ``n`` records are shuffled and cut into ``ceil(n / b)`` batches of
  ``b = q * n`` records (the last one smaller when ``b`` does not divide ``n``), as Keras does with
  in-memory arrays and as ``Dataset.shuffle(n).batch(b)`` does; each record is used once per
  epoch.  Neighbouring datasets replace one record (sensitivity ``2C``), and no amplification is
  assumed: every epoch counts as one full-batch Gaussian mechanism with half the effective noise
  multiplier, counted per pass over the data (:func:`shuffle_epoch_runs`): a pass starts at every
  draw the ledger marks ``pass_start`` (each ``fit`` epoch, each ``train_on_batch`` call), and
  holds ``ceil(steps / ceil(n / b))`` epochs (a partial epoch counts as a full one).  Inputs
  whose epochs have fewer steps (``drop_remainder=True``) should declare the population
  ``b * (n // b)``: epochs of ``n // b`` steps, which counts them exactly or conservatively.
  ``repeat()`` before ``batch()`` is not covered: a batch straddling two shuffles can hold a
  record twice (batch before repeating).
* ``truncated_poisson``: Poisson sampling at rate ``q`` cut to at most ``B`` records (the ledger
  records ``B``): each step is charged as the mixture of :mod:`tf_dp.accounting.truncated`
  (``rdp`` and ``pld``; the worse of the two neighbours, smaller and larger, over the whole run).
  ``gdp`` refuses it.
* ``balls_in_bins``: every pass assigns each record to one of ``T = round(1 / q)`` steps; an added
  record changes one step of its pass. Certified bound: each epoch (``T`` steps from a pass start,
  counted as for ``shuffle``) is one Gaussian mechanism with the effective noise multiplier,
  add/remove adjacency, no amplification. The amplification is only *estimated*
  (:func:`tf_dp.accounting.balls_in_bins_estimate`).

Non-private samples (a query without noise) give ``epsilon = inf``.

Example (a ledger file's path, a ``PrivacyLedger`` or its runs, here 14063 identical steps; the
result prints as a plain-words statement):

>>> from tf_dp.accounting import compute_epsilon
>>> from tf_dp.ledger import SampleEntry, SamplingEvent, SumQueryEvent
>>> step = SampleEntry(
...     sampling=SamplingEvent(population_size=60000, selection_probability=256 / 60000),
...     queries=(SumQueryEvent(l2_sensitivity=1.0, noise_stddev=1.1),))
>>> result = compute_epsilon([(step, 14063)], delta=1e-5)
>>> round(result.epsilon, 3), result.certified
(2.597, True)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional, Sequence

import numpy as np

from tf_dp._progress import working
from tf_dp.accounting import gdp as _gdp
from tf_dp.accounting import jl as _jl
from tf_dp.accounting import matrix_sensitivity as _mf
from tf_dp.accounting import pld as _pld
from tf_dp.accounting import rdp as _rdp
from tf_dp.accounting import tree as _tree
from tf_dp.accounting import truncated as _truncated
from tf_dp.ledger.events import (
    MAX_SENSITIVITY_TO_NOISE,
    SampleEntry,
    SamplingEvent,
    SumQueryEvent,
    distinct_runs,
)
from tf_dp.ledger.ledger_file import as_entries, as_runs

__all__ = [
    "ACCOUNTANTS",
    "MAX_STEPS",
    "MIN_NOISE_MULTIPLIER",
    "PrivacyResult",
    "compute_epsilon",
    "compute_delta",
    "effective_noise_multipliers",
    "sampling_claims",
    "dp_sgd_entries",
    "dp_sgd_epsilon",
    "dp_sgd_run",
    "shuffle_epochs",
    "poisson_steps_per_epoch",
    "shuffle_steps_per_epoch",
    "shuffle_epoch_runs",
]

#: Accountants that analyse a ledger.  ``gdp`` is an approximation (privacy CLT).
ACCOUNTANTS = ("rdp", "moments", "pld", "gdp")

_KIND_TEXT = {
    "rdp": "Renyi-DP accountant with the tight RDP-to-(eps, delta) conversion "
    "(Canonne-Kamath-Steinke 2020): a certified upper bound",
    "moments": "moments accountant with the tail bound of Abadi et al. 2016: a certified upper "
    "bound (looser than 'rdp')",
    "pld": "privacy-loss-distribution accountant (FFT composition, pessimistic discretisation; "
    "close noise multipliers rounded down to a common one): a certified upper bound, close to "
    "the exact value",
    "gdp": "Gaussian-DP via the privacy central limit theorem (Bu et al. 2019): an ASYMPTOTIC "
    "APPROXIMATION, not a certified bound",
}


_PLD_CAP_NOTE = "privacy losses above the PLD loss cap"

_UNVERIFIED_NOTE = (
    "UNVERIFIED LEDGER: it was loaded from a file saved by a tf_dp version before ledger "
    "checksums, so it could not be verified; the figure holds only if that ledger is intact."
)


def _check_provenance(ledger) -> bool:
    """Whether ``ledger`` (anything; a ``PrivacyLedger`` carries ``verified`` and
    ``missing_steps``) is verified; raises if trained steps are missing from it."""
    missing = getattr(ledger, "missing_steps", 0)
    if isinstance(missing, int) and missing > 0:
        raise ValueError(
            f"privacy spent unknown: the ledger of {missing} trained steps is missing (the "
            "weights were loaded from a file saved without their ledger, or with part of it), "
            "so no epsilon can be stated and 0 would be false. Restore the run's ledger "
            "(ledger.restore_entries(tf_dp.ledger.read_ledger_file(path)))"
        )
    return getattr(ledger, "verified", True) is not False


@dataclasses.dataclass(frozen=True)
class PrivacyResult:
    """A privacy statement.

    Attributes:
      accountant: one of :data:`ACCOUNTANTS`.
      epsilon, delta: the ``(epsilon, delta)`` pair (``epsilon`` may be ``inf``).
      certified: True when ``epsilon`` is a proven upper bound (up to floating point).
      assumptions: plain-words assumptions (adjacency, sampling, what the number is).
      order: optimal Renyi order (``rdp`` / ``moments``; moments ``lambda = order - 1``).
      mu: the GDP parameter (``gdp`` only).
      steps: number of samples (steps) analysed.
      verified: False when the ledger came from a file whose checksum could not be checked.
    """

    accountant: str
    epsilon: float
    delta: float
    certified: bool
    assumptions: str
    order: Optional[float] = None
    mu: Optional[float] = None
    steps: int = 0
    noise_seeds: tuple = ()
    verified: bool = True

    def __str__(self) -> str:
        if not math.isinf(self.epsilon):
            eps = f"{self.epsilon:.4g}"
        elif "JL clipping" in self.assumptions:
            eps = (f"infinite: above the JL accountant's loss cap ({_jl.JL_LOSS_CAP:g}), i.e. no "
                   "useful guarantee")
        elif _PLD_CAP_NOTE in self.assumptions:
            eps = (f"infinite: above the PLD accountant's loss cap ({_pld._LOSS_CAP:g}), i.e. no "
                   "useful guarantee")
        else:
            eps = "infinite (no privacy guarantee)"
        lines = [f"[{self.accountant}] epsilon = {eps} at delta = {self.delta:.3g} over "
                 f"{self.steps} steps."]
        if self.noise_seeds:
            seeds = ", ".join(str(s) for s in self.noise_seeds)
            lines.append(
                f"NOT A PRIVACY GUARANTEE: the noise was drawn from a known seed (noise_seed="
                f"{seeds}), so it is predictable and can be subtracted. The figure is what an "
                "unseeded run with the same settings would give."
            )
        elif math.isinf(self.epsilon):
            pass  # no bound to qualify: the first line says there is no guarantee
        elif self.certified:
            lines.append("This epsilon is a proven upper bound on the privacy loss.")
        else:
            lines.append("This epsilon is an APPROXIMATION (not a proven bound).")
        if not self.verified:
            lines.append(_UNVERIFIED_NOTE)
        if self.order is not None:
            lines.append(f"Optimal Renyi order: {self.order:g}.")
        if self.mu is not None:
            lines.append(f"mu-GDP parameter: mu = {self.mu:.4g}.")
        lines.append(f"Assumptions: {self.assumptions}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = {"epsilon": None if math.isinf(self.epsilon) else self.epsilon, "delta": self.delta,
             "certified": self.certified, "assumptions": self.assumptions}
        if self.noise_seeds:
            d["noise_seeds"] = list(self.noise_seeds)
        if not self.verified:
            d["verified"] = False
        if self.order is not None:
            d["order"] = self.order
        if self.mu is not None:
            d["mu"] = self.mu
        return d


@dataclasses.dataclass(frozen=True)
class _Unit:
    """``count`` identical mechanisms: subsampled (rate q) Gaussian/JL with noise multiplier z."""

    q: float
    z: float
    r: Optional[int]
    count: int
    policy: str
    population_size: Optional[int] = None  # truncated_poisson: n and B
    max_batch_size: Optional[int] = None


#: Policies counted per epoch of a pass over the data (order-dependent).
_PASS_POLICIES = ("shuffle", "balls_in_bins")


def effective_noise_multipliers(ledger) -> list[float]:
    """Per-sample effective noise multiplier (McMahan et al. 2018, Eq. (1)); 0.0 = non-private."""
    return [e.effective_noise_multiplier() for e in as_entries(ledger)]


def shuffle_steps_per_epoch(population_size: int, selection_probability: float) -> int:
    """Steps of one epoch of shuffled fixed-size batches: ``ceil(n / b)`` with ``b = q * n``.

    The last batch of an epoch holds the ``n mod b`` records left over (Keras with in-memory
    arrays; ``Dataset.shuffle(n).batch(b)``).  ``b`` is snapped to the nearest integer when ``q``
    was stored with float round-off.
    """
    n = population_size
    b = selection_probability * n
    if b <= 0:
        raise ValueError(f"selection_probability must be > 0, got {selection_probability!r}")
    if abs(b - round(b)) <= 1e-6 * max(1.0, b):
        b = float(round(b))
    if b < 1:
        raise ValueError(
            f"a shuffled batch holds selection_probability * population_size records, which must "
            f"be >= 1; got {selection_probability!r} * {n} = {b:g}")
    return max(1, int(math.ceil(n / b - 1e-9)))


def poisson_steps_per_epoch(selection_probability: float) -> int:
    """Steps of one epoch of Poisson-family batches: ``round(1 / q)``, at least 1.

    The one count that :func:`tf_dp.data.poisson_batches`, :func:`tf_dp.data.poisson_sample`,
    :func:`tf_dp.data.truncated_poisson_batches` and :func:`tf_dp.data.truncated_poisson_sample`
    run per ``fit`` epoch by default, and that :func:`dp_sgd_run` plans with ``epochs`` (so a
    plan of ``E`` epochs is the ``E * round(1 / q)`` steps the samplers run).

    Example: ``poisson_steps_per_epoch(100 / 260)`` is 3 (``1 / q = 2.6``).
    """
    q = selection_probability
    if isinstance(q, bool) or not isinstance(q, (int, float)) or not (
            math.isfinite(q) and 0.0 < q <= 1.0):
        raise ValueError(f"sampling_probability must be in (0, 1], got {q!r}")
    return max(1, int(round(1.0 / q)))


def shuffle_epochs(steps: int, population_size: int, selection_probability: float) -> int:
    """Epochs touched by ``steps`` steps of shuffled fixed-size batches (a partial epoch counts)."""
    per_epoch = shuffle_steps_per_epoch(population_size, selection_probability)
    return max(1, -(-int(steps) // per_epoch))


def shuffle_epoch_runs(
    runs: Sequence[tuple[SampleEntry, int]], policy: str = "shuffle"
) -> list[tuple[SampleEntry, int]]:
    """The epochs of the ``shuffle`` runs of ``runs``: ``[(entry, epochs), ...]`` (of the
    ``balls_in_bins`` runs with ``policy="balls_in_bins"``: epochs of ``round(1 / q)`` steps)."""
    return _epoch_runs(runs, policy)


def _epoch_runs(runs: Sequence[tuple[SampleEntry, int]], policy: str
                ) -> list[tuple[SampleEntry, int]]:
    """The epochs of the ``policy`` runs of ``runs`` (see :func:`shuffle_epoch_runs`).

    A pass over the data starts at every draw marked ``pass_start``, at the ledger's first draw,
    and wherever the sampling declaration (``n``, ``q``) changes or a non-``shuffle`` or
    tree-aggregation step intervenes. Within a pass, epochs are consecutive windows of
    ``s = ceil(n / b)`` steps from the pass's start, and each record is used at most once per
    window, so a window costs one participation at its worst step. A window whose steps all
    record the same mechanism counts once with it; a window holding several (e.g. a clip schedule
    changing mid-epoch) counts once with each, and a pass cut short counts as a full epoch: both
    over-count, never under-count. Other runs are skipped.

    Example: three ``fit(x, y, batch_size=5, steps_per_epoch=2)`` calls on ``n = 20`` records are
    three passes of 2 steps: 3 epochs (one continuous count of the 6 steps would give 2).
    """
    out: list[tuple[SampleEntry, int]] = []
    open_keys: list[SampleEntry] = []  # distinct mechanisms of the window still open
    open_window = None
    key = None
    position = 0

    def emit(entry: SampleEntry, epochs: int) -> None:
        if out and out[-1][0] == entry:
            out[-1] = (entry, out[-1][1] + epochs)
        else:
            out.append((entry, epochs))

    def close() -> None:
        for e in open_keys:
            emit(e, 1)
        open_keys.clear()

    for entry, count in runs:
        s = entry.sampling
        if s.policy != policy or entry.tree_step is not None:
            close()
            key = None
            continue
        if policy == "balls_in_bins":
            spe = max(1, int(round(1.0 / s.selection_probability)))
        else:
            spe = shuffle_steps_per_epoch(s.population_size, s.selection_probability)
        plain = dataclasses.replace(entry, sampling=dataclasses.replace(s, pass_start=False))
        if s.pass_start or (s.population_size, s.selection_probability) != key:
            close()
            if s.pass_start and count > 1:  # each step of the run is a pass of its own
                emit(plain, count - 1)
                count = 1
            position, open_window = 0, 0
        first, last = position // spe, (position + count - 1) // spe
        if first != open_window:
            close()
        if plain not in open_keys:
            open_keys.append(plain)
        if last > first:
            close()
            if last - first > 1:
                emit(plain, last - first - 1)
            open_keys.append(plain)
        open_window = last
        position += count
        key = (s.population_size, s.selection_probability)
    close()
    return out


def composable_units(
    runs: Sequence[tuple[SampleEntry, int]],
    distinct: Optional[Sequence[tuple[SampleEntry, int]]] = None,
) -> tuple[list[_Unit], bool, set]:
    """Reduces runs of identical entries to independently composable units (each with ``q``,
    ``z``, ``count``; shuffle epochs and tree windows already counted); returns ``(units,
    any_non_private, policies)``. Used by every reader of runs (accountants, dp_events,
    ``PrivacyBudget``). ``distinct``: ``distinct_runs(runs)``, if the caller has it."""
    units: list[_Unit] = []
    non_private = False
    policies = set()
    distinct = distinct_runs(runs) if distinct is None else distinct
    if any(q.mechanism == "mf" for e, _ in distinct for q in e.queries):
        # correlated noise (matrix factorization): its steps are one mechanism over the run's C,
        # rewritten as the Gaussian mechanism(s) it is equivalent to (accounting.matrix_
        # factorization); the other steps compose with it
        runs, mf_units, mf_policies, non_private = _mf.ledger_mf_units(runs)
        units += [_Unit(q, z, None, count, policy) for q, z, count, policy in mf_units]
        policies |= mf_policies
        distinct = distinct_runs(runs)
    if not any(e.sampling.policy in _PASS_POLICIES or e.tree_step is not None
               for e, _ in distinct):
        # Only Poisson steps (each its own subsampled mechanism, whatever its neighbours):
        # composition does not depend on their order, so equal entries compose with their
        # total count. Shuffle epochs and tree windows depend on the order: read in order.
        runs = distinct
    # Tree aggregation (Kairouz et al. 2021): each tree / epoch window is a full-batch Gaussian
    # mechanism (tf_dp.accounting.tree); Poisson-sampled tree steps are refused there.
    shuffle_units = shuffle_epoch_runs(runs)  # (entry, epochs) of the shuffle runs
    bins_units = _epoch_runs(runs, "balls_in_bins")
    runs, tree_mechanisms = _tree.split_runs(runs, shuffle_steps_per_epoch)
    runs = [(e, c) for e, c in runs if e.sampling.policy not in _PASS_POLICIES]
    runs += shuffle_units + bins_units
    for z, count in tree_mechanisms:
        policies.add("tree")
        if math.isinf(z):
            continue
        if z == 0:
            non_private = True
            continue
        units.append(_Unit(1.0, z, None, count, "shuffle"))
    for entry, count in runs:
        q = float(entry.sampling.selection_probability)
        policy = entry.sampling.policy
        policies.add(policy)
        z = entry.effective_noise_multiplier()
        r = entry.jl_projections
        if q == 0 or math.isinf(z):
            continue  # no record can be touched / no sensitivity: no privacy spent
        if z == 0:
            non_private = True
            continue
        if policy == "shuffle":
            # Fixed-size shuffled batches keep the dataset size fixed, so the neighbouring
            # datasets differ by replacing one record (adding one would shift every later batch).
            # Replacing a record changes its clipped contribution by up to 2C: sensitivity 2C,
            # i.e. half the effective noise multiplier, once per epoch (``count`` epochs here),
            # no amplification.
            units.append(_Unit(1.0, z / 2.0, r, count, policy))
        elif policy == "balls_in_bins":
            # An added (removed) record is in exactly one step of each epoch and changes no other
            # step's batch: per epoch one Gaussian mechanism, sensitivity C, no amplification.
            units.append(_Unit(1.0, z, r, count, policy))
        elif policy == "truncated_poisson":
            if r is not None:
                raise ValueError(
                    "the ledger has JL steps under truncated_poisson sampling; no tf_dp "
                    "accountant analyses JL clipping with truncation; use poisson_batches"
                )
            units.append(_Unit(q, z, r, count, policy, entry.sampling.population_size,
                               entry.sampling.max_batch_size))
        else:
            units.append(_Unit(q, z, r, count, policy))
    return units, non_private, policies


def _assumptions(accountant: str, policies: set, has_jl: bool, extra: str = "") -> str:
    parts = []
    if not policies or policies - {"shuffle", "tree", "mf_replace"}:
        parts.append("add/remove-one adjacency (both directions)")
    if "poisson" in policies:
        parts.append("Poisson sampling with the recorded rate q (amplification by subsampling "
                     "applied)")
    if "cyclic_poisson" in policies:
        parts.append("cyclic Poisson sampling (the records in b fixed parts, each step a Poisson "
                     "sample at the recorded rate q of one part): each step charged as Poisson "
                     "sampling of the whole data set at rate q (an upper bound: a record can take "
                     "part in one step of b only)")
    if "truncated_poisson" in policies:
        parts.append("truncated Poisson sampling (rate q, at most B records kept, as recorded): "
                     "each step charged as a mixture, with public index, of the subsampled "
                     "Gaussian at rate q (the other records leave room) and, with probability "
                     "P[Binomial(m, q) >= B], the subsampled Gaussian with sensitivity 2C at the "
                     "kept record's rate (a dropped record may be swapped); the worse of the "
                     "smaller and the larger neighbour (m = n - 1, n) over the whole run")
    if "balls_in_bins" in policies:
        parts.append("balls-in-bins batches (each record in exactly one of the round(1/q) steps "
                     "of an epoch): each epoch counted as one full-batch Gaussian mechanism with "
                     "the effective noise multiplier, NO amplification assumed (an epoch is "
                     "round(1/q) steps from the start of a pass, as recorded in the ledger; a "
                     "partial epoch counts as a full one)")
    if "shuffle" in policies:
        parts.append("shuffled fixed-size batches: replace-one adjacency (the dataset size is "
                     "fixed; a replaced record's clipped gradient moves by up to 2C) and NO "
                     "amplification assumed; each epoch (each record used once) counted as one "
                     "full-batch Gaussian mechanism with half the effective noise multiplier "
                     "(an epoch is ceil(n/b) steps from the start of a pass over the data, as "
                     "recorded in the ledger, its last batch partial; a partial epoch counts as "
                     "a full one)")
    if "mf_amplified" in policies:
        parts.append("correlated-noise (matrix factorization) steps: a b-banded C with cyclic "
                     "Poisson sampling over b parts (b-min-separated participations), accounted "
                     "as ceil(n/b) Poisson-subsampled Gaussian mechanisms with sensitivity C's "
                     "largest column norm (amplified BandMF, Choquette-Choo et al. 2023, Thm. 4)")
    elif "mf" in policies or "mf_replace" in policies:
        parts.append("correlated-noise (matrix factorization) steps: the run's releases C X + Z "
                     "(n steps, the recorded strategy's C) counted as one Gaussian mechanism "
                     "with sensitivity max ||C u|| over a record's possible participations u "
                     "(Choquette-Choo et al. 2023), NO amplification: a record may take part in "
                     "every step ("
                     + ("shuffled batches: replace-one adjacency, twice that sensitivity"
                        if "mf_replace" in policies else
                        "or every p-th step under cyclic Poisson over p parts")
                     + ")")
    if "tree" in policies:
        parts.append("tree-aggregation steps (Kairouz et al. 2021, Appendix D) accounted without "
                     "amplification: replace-one adjacency (leaf sensitivity 2C), each record in "
                     "at most one leaf per epoch; per epoch window the worst tree counts as one "
                     "Gaussian mechanism with noise multiplier z / (2 sqrt(ceil(log2(T + 1)))) "
                     "for a tree of T steps, and a tree spanning several epochs counts with the "
                     "sensitivity of all the record's leaves in it")
    if has_jl:
        parts.append("JL clipping steps accounted as the mixture mechanism of Bu et al. 2020 "
                     "(Lemma 4.3 / Thm 4.1), heavy tail of the norm estimate included; privacy "
                     f"losses above {_jl.JL_LOSS_CAP:g} count as infinite, so epsilon = inf means "
                     f"epsilon > {_jl.JL_LOSS_CAP:g} or no guarantee")
    parts.append(_KIND_TEXT[accountant])
    if extra:
        parts.append(extra)
    return "; ".join(parts) + "."


def _check_accountant(accountant: str) -> None:
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")


def _has_truncated(units: list[_Unit]) -> bool:
    return any(u.policy == "truncated_poisson" for u in units)


def _pld_mechanisms(units: list[_Unit], neighbour: str = "smaller"):
    has_jl = any(u.r is not None for u in units)
    mechs = []
    for u in units:
        if u.policy == "truncated_poisson":
            mechs.append((_truncated.pld_mechanism(u.population_size, u.q, u.max_batch_size,
                                                   u.z, neighbour), u.count))
        elif u.r is None:
            mechs.append((_pld.SubsampledGaussian(u.q, u.z), u.count))
        else:
            mechs.append((_jl.jl_mechanism(u.q, u.z, int(u.r)), u.count))
    if has_jl:
        total = sum(c for _, c in mechs)
        return mechs, dict(h=_jl._default_h(total), loss_cap=_jl.JL_LOSS_CAP)
    if _has_truncated(units):  # the grid from plain stand-ins (sensitivity 2C: the wider spread)
        proxy = [(_pld.SubsampledGaussian(u.q, u.z / 2.0 if u.max_batch_size else u.z), u.count)
                 for u in units]
        return mechs, dict(h=_pld._auto_h(proxy))
    return mechs, {}


def _refuse_jl(units: list[_Unit], accountant: str) -> None:
    if any(u.r is not None for u in units):
        why = ("the privacy CLT does not apply to the JL mechanism (Bu et al. 2020, Prop. B.5)"
               if accountant == "gdp" else "no RDP bound for the JL mechanism is implemented")
        raise ValueError(
            f"the ledger has JL steps (jl_projections set); accountant={accountant!r} cannot "
            f"analyse them ({why}); use accountant='pld'"
        )


def _refuse_truncated_gdp(units: list[_Unit]) -> None:
    if _has_truncated(units):
        raise ValueError(
            "the ledger has truncated_poisson steps; accountant='gdp' has no analysis of "
            "truncation; use accountant='rdp' or 'pld'"
        )


def _truncated_rdp(units: list[_Unit], orders, target: float, what: str, conversion: str):
    """``(value, order)`` of the RDP accountant for runs with truncated_poisson units: the
    composed curve for each neighbour (smaller, larger), the worse of the two results."""
    o = np.asarray(orders, dtype=np.float64)
    plain = [u for u in units if u.policy != "truncated_poisson"]
    base = _rdp.rdp_curve([u.q for u in plain], [u.z for u in plain],
                          [u.count for u in plain], o) if plain else np.zeros(o.size)
    worst = None
    for neighbour in _truncated.NEIGHBOURS:
        curve = base.copy()
        for u in units:
            if u.policy == "truncated_poisson":
                curve = curve + u.count * _truncated.rdp_curve(
                    u.population_size, u.q, u.max_batch_size, u.z, o, neighbour)
        if what == "epsilon":
            got = _rdp.epsilon_from_rdp(o, curve, target, conversion)
        else:
            got = _rdp.delta_from_rdp(o, curve, target, conversion)
        if worst is None or got[0] > worst[0]:
            worst = got
    return worst


def _gdp_mu(units: list[_Unit]) -> float:
    return math.sqrt(_gdp.mu_squared([u.q for u in units], [u.z for u in units],
                                     [u.count for u in units]))


def _seeded(result: PrivacyResult, runs: Sequence[tuple[SampleEntry, int]]) -> PrivacyResult:
    """Marks a result whose run drew its noise from an explicit seed: no guarantee holds
    (``runs`` in any order, e.g. :func:`~tf_dp.ledger.events.distinct_runs`)."""
    seeds = tuple(sorted({s for e, _ in runs for s in e.noise_seeds}))
    if not seeds:
        return result
    return dataclasses.replace(result, certified=False, noise_seeds=seeds)


def compute_epsilon(
    ledger, delta: float, accountant: str = "rdp", *, orders: Optional[Sequence[float]] = None,
    discretization: Optional[float] = None,
) -> PrivacyResult:
    """Epsilon at ``delta`` for a ledger: a path, a ``PrivacyLedger``, a list of ``SampleEntry``
    or of ``(SampleEntry, count)`` runs (as ``tf_dp.ledger.read_ledger_runs`` returns; a ledger
    file is read as runs, so memory grows with its distinct runs, not its steps).

    A run whose noise came from an explicit ``noise_seed`` gets ``certified=False`` and a
    statement that says no guarantee holds (the seed is in ``noise_seeds``). A ledger loaded
    from a file saved before ledger checksums (``ledger.verified`` False) gives a result with
    ``verified=False`` whose statement says "UNVERIFIED LEDGER". A ledger missing steps its
    weights were trained with (``ledger.missing_steps`` > 0: trained private weights loaded
    without their ledger) raises ValueError: the privacy spent is unknown, never 0.

    Args:
      ledger: the run's record.
      delta: target delta in (0, 1).
      accountant: ``"rdp"`` (default), ``"moments"``, ``"pld"`` or ``"gdp"`` (approximation).
      orders: RDP orders (``rdp``/``moments``); default :data:`rdp.DEFAULT_ORDERS`.
      discretization: PLD grid spacing (default: automatic, 1e-4 for typical runs).
    """
    _check_accountant(accountant)
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    verified = _check_provenance(ledger)
    runs = as_runs(ledger)
    steps = sum(c for _, c in runs)
    # a long ledger can take seconds to minutes: progress lines past 5 s (tf_dp.set_progress)
    with working(f"computing epsilon of a {steps}-step ledger ({len(runs)} runs, {accountant} "
                 "accountant)"):
        result = _epsilon_of_runs(runs, steps, delta, accountant, orders, discretization)
    return result if verified else dataclasses.replace(result, verified=False)


def _epsilon_of_runs(runs, steps, delta, accountant, orders=None, discretization=None):
    distinct = distinct_runs(runs)  # what the order-independent readers need
    result = _seeded(
        _epsilon(runs, steps, delta, accountant, orders, discretization, distinct), distinct
    )
    note = " ".join(t for t in (_noise_mode_note(distinct), sampling_claims(distinct)) if t)
    if note:
        result = dataclasses.replace(result, assumptions=f"{result.assumptions} {note}")
    return result


def sampling_claims(runs: Sequence[tuple[SampleEntry, int]]) -> str:
    """The unit of privacy and who vouches for the sampling, in words, for every distinct claim
    of the run (``SamplingEvent.describe``): e.g. "Unit and sampling: user-level (add/remove one
    user, at most 4 records per user); sampling performed by tf_dp." Ledgers written before the
    origin was recorded read as declared.

    Example::

        sampling_claims(tf_dp.ledger.read_ledger_runs("run.ledger.json"))
    """
    seen: list[str] = []
    samplings = {id(e.sampling): e.sampling for e, _ in distinct_runs(runs)}  # in order
    for sampling in samplings.values():
        text = sampling.describe()
        if text not in seen:
            seen.append(text)
    if not seen:
        return ""
    steps = "" if len(seen) == 1 else " (the run's steps differ: each claim below holds for some)"
    return f"Unit and sampling{steps}: " + " | ".join(seen) + "."


def _which_queries(continuous: int, noisy: int, per_step: set) -> str:
    """Which noised queries had continuous float noise, by their count (distinct per run)."""
    if continuous == noisy:
        return "the sum query" if per_step == {1} else "every noised query"
    return f"{continuous} of the {noisy} distinct noised queries"


def _noise_mode_note(runs: Sequence[tuple[SampleEntry, int]]) -> str:
    """Which noise mode the run's Gaussian sum queries used (grid or continuous), in words."""
    grids = sorted({q.noise_grid for e, _ in runs for q in e.queries if q.noise_grid is not None})
    noisy = [q.noise_grid is None for e, _ in runs for q in e.queries
             if q.mechanism != "none" and q.l2_sensitivity > 0 and q.noise_stddev > 0]
    continuous = sum(noisy)
    # distinct kinds of query per step: 1 when every step makes the same single query
    per_step = {sum(1 for q in e.queries if q.mechanism != "none" and q.l2_sensitivity > 0
                    and q.noise_stddev > 0) for e, _ in runs}
    parts = []
    if grids:
        shown = ", ".join(f"{g:.6g}" for g in grids[:3]) + (", ..." if len(grids) > 3 else "")
        parts.append(
            f"Noise on a grid of {shown} (snapping: every released value is a multiple of the "
            "grid, so its low bits carry nothing about the data); the sensitivity charged is the "
            "clip's plus the rounding term g sqrt(d)."
        )
    if continuous:
        parts.append(
            f"Continuous floating-point noise on {_which_queries(continuous, len(noisy), per_step)}"
            ": the guarantee covers the ideal "
            "real-valued Gaussian mechanism; the low bits of the released floats are not "
            "covered (Mironov 2012)."
        )
    return " ".join(parts)


def _epsilon(runs, steps, delta, accountant, orders, discretization, distinct=None
             ) -> PrivacyResult:
    units, non_private, policies = composable_units(runs, distinct)
    has_jl = any(u.r is not None for u in units)
    certified = accountant != "gdp" or all(u.q >= 1.0 for u in units)
    assumptions = _assumptions(accountant, policies, has_jl)
    if accountant == "gdp" and certified and units:
        assumptions = assumptions.replace(
            "an ASYMPTOTIC APPROXIMATION, not a certified bound",
            "exact here, since without subsampling the composition of Gaussian mechanisms is "
            "exactly mu-GDP",
        )
    common = dict(accountant=accountant, delta=float(delta), steps=steps,
                  assumptions=assumptions)
    if non_private:
        return PrivacyResult(epsilon=math.inf, certified=True, **common,
                             **({"mu": math.inf} if accountant == "gdp" else {}))
    if not units:
        return PrivacyResult(epsilon=0.0, certified=True, **common,
                             **({"mu": 0.0} if accountant == "gdp" else {}))
    if accountant in ("rdp", "moments") and _has_truncated(units):
        _refuse_jl(units, accountant)
        o = tuple(orders) if orders is not None else _rdp.DEFAULT_ORDERS
        eps, order = _truncated_rdp(units, o, delta, "epsilon", accountant)
        return PrivacyResult(epsilon=eps, certified=True, order=order, **common)
    if accountant in ("rdp", "moments"):
        _refuse_jl(units, accountant)
        o = tuple(orders) if orders is not None else _rdp.DEFAULT_ORDERS
        eps, order = _rdp.rdp_epsilon([u.q for u in units], [u.z for u in units],
                                      [u.count for u in units], delta, o, accountant)
        return PrivacyResult(epsilon=eps, certified=True, order=order, **common)
    if accountant == "gdp":
        _refuse_jl(units, accountant)
        _refuse_truncated_gdp(units)
        mu = _gdp_mu(units)
        return PrivacyResult(epsilon=_gdp.epsilon_from_mu(delta, mu), certified=certified, mu=mu,
                             **common)
    mechs, kw = _pld_mechanisms(units)
    if discretization is not None:
        kw["h"] = discretization
    eps = _pld.pld_epsilon(mechs, delta, **kw)
    if _has_truncated(units):  # the larger neighbour too; the worse of the two
        eps = max(eps, _pld.pld_epsilon(_pld_mechanisms(units, "larger")[0], delta, **kw))
    if math.isinf(eps) and not has_jl:
        common["assumptions"] = _assumptions(
            accountant, policies, has_jl,
            f"{_PLD_CAP_NOTE} ({_pld._LOSS_CAP:g}) count as infinite, so epsilon = inf means "
            f"that losses above {_pld._LOSS_CAP:g} have probability delta or more")
    return PrivacyResult(epsilon=eps, certified=True, **common)


def compute_delta(
    ledger, epsilon: float, accountant: str = "rdp", *, orders: Optional[Sequence[float]] = None,
    discretization: Optional[float] = None,
) -> PrivacyResult:
    """Delta at ``epsilon`` for a ledger (see :func:`compute_epsilon`)."""
    _check_accountant(accountant)
    if not (isinstance(epsilon, (int, float)) and epsilon >= 0 and not math.isnan(epsilon)):
        raise ValueError(f"epsilon must be >= 0, got {epsilon!r}")
    verified = _check_provenance(ledger)
    runs = as_runs(ledger)
    distinct = distinct_runs(runs)
    result = _seeded(
        _delta(runs, sum(c for _, c in runs), epsilon, accountant, orders, discretization,
               distinct),
        distinct,
    )
    note = sampling_claims(distinct)
    if note:
        result = dataclasses.replace(result, assumptions=f"{result.assumptions} {note}")
    return result if verified else dataclasses.replace(result, verified=False)


def _delta(runs, steps, epsilon, accountant, orders, discretization, distinct=None
           ) -> PrivacyResult:
    units, non_private, policies = composable_units(runs, distinct)
    has_jl = any(u.r is not None for u in units)
    certified = accountant != "gdp" or all(u.q >= 1.0 for u in units)

    def result(delta, **kw):
        return PrivacyResult(accountant=accountant, epsilon=float(epsilon), delta=float(delta),
                             certified=certified, steps=steps,
                             assumptions=_assumptions(accountant, policies, has_jl), **kw)

    if non_private:
        return result(1.0)
    if not units:
        return result(0.0)
    if accountant in ("rdp", "moments") and _has_truncated(units):
        _refuse_jl(units, accountant)
        o = tuple(orders) if orders is not None else _rdp.DEFAULT_ORDERS
        d, order = _truncated_rdp(units, o, epsilon, "delta", accountant)
        return result(d, order=order)
    if accountant in ("rdp", "moments"):
        _refuse_jl(units, accountant)
        o = tuple(orders) if orders is not None else _rdp.DEFAULT_ORDERS
        d, order = _rdp.rdp_delta([u.q for u in units], [u.z for u in units],
                                  [u.count for u in units], epsilon, o, accountant)
        return result(d, order=order)
    if accountant == "gdp":
        _refuse_jl(units, accountant)
        _refuse_truncated_gdp(units)
        mu = _gdp_mu(units)
        return result(_gdp.delta_from_mu(epsilon, mu), mu=mu)
    mechs, kw = _pld_mechanisms(units)
    if discretization is not None:
        kw["h"] = discretization
    d = _pld.pld_delta(mechs, epsilon, **kw)
    if _has_truncated(units):  # the larger neighbour too; the worse of the two
        d = max(d, _pld.pld_delta(_pld_mechanisms(units, "larger")[0], epsilon, **kw))
    return result(d)


def _check_positive_int(name: str, value) -> int:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return value


#: The batch selections :func:`dp_sgd_run` (and so the calibration and the CLI) describe.
DP_SGD_SAMPLINGS = ("poisson", "shuffle", "truncated_poisson", "balls_in_bins")

#: Most steps :func:`dp_sgd_entries` lists (one list item per step); :func:`dp_sgd_epsilon`
#: composes up to :data:`MAX_STEPS` steps without listing them.
MAX_LISTED_STEPS = 10_000_000

#: Most steps a hyperparameter run may have (far beyond any real training; above it the
#: accountants' sums lose their meaning in floating point).
MAX_STEPS = 10**15

#: Smallest positive noise multiplier of a hyperparameter run: with sensitivity up to 2C (a
#: microbatch), ``sensitivity / noise`` stays within ``events.MAX_SENSITIVITY_TO_NOISE``.
MIN_NOISE_MULTIPLIER = 2.0 / MAX_SENSITIVITY_TO_NOISE


def dp_sgd_run(
    n: int,
    batch_size: int,
    noise_multiplier: float,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    sampling: str = "poisson",
    microbatch_size: Optional[int] = None,
    jl_projections: Optional[int] = None,
    max_batch_size: Optional[int] = None,
) -> tuple[SampleEntry, int]:
    """The one sample entry DP-SGD records at every step (clip C = 1, noise sigma*C), and the
    number of steps, for these hyperparameters.

    ``sampling`` is one of :data:`DP_SGD_SAMPLINGS`. With ``epochs``: ``poisson`` and
    ``truncated_poisson`` run ``round(n / batch_size)`` steps per epoch
    (:func:`poisson_steps_per_epoch`, what their samplers run per ``fit`` epoch),
    ``ceil(epochs * round(n / batch_size))`` in all (the expected batch size is ``batch_size``;
    ``truncated_poisson`` keeps at most ``max_batch_size`` examples a step, which it requires);
    ``shuffle`` runs ``ceil(n / batch_size)`` steps per epoch (the last batch of an epoch
    partial, as Keras does), ``ceil(epochs * ceil(n / batch_size))`` in all, so the accountants
    count exactly ``ceil(epochs)`` epochs; ``balls_in_bins`` runs
    ``T = ceil(n / batch_size)`` steps per epoch (as
    :func:`tf_dp.data.balls_in_bins_batches`), ``ceil(epochs) * T`` in all (whole epochs).
    ``microbatch_size > 1`` means several examples share one clipped gradient: the sensitivity
    is ``2C`` under add/remove adjacency, so
    the effective noise multiplier is halved.

    Example: ``entry, steps = dp_sgd_run(60000, 256, 1.1, epochs=60)``.
    """
    n = _check_positive_int("N (dataset size)", n)
    batch_size = _check_positive_int("batch_size", batch_size)
    if batch_size > n:
        raise ValueError(f"batch_size must be <= N ({n}), got {batch_size}")
    if not (isinstance(noise_multiplier, (int, float)) and math.isfinite(noise_multiplier)
            and (noise_multiplier == 0 or noise_multiplier >= MIN_NOISE_MULTIPLIER)):
        raise ValueError(f"noise_multiplier must be 0 (no noise) or a finite number >= "
                         f"{MIN_NOISE_MULTIPLIER:g}, got {noise_multiplier!r}")
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps or epochs")
    if sampling not in DP_SGD_SAMPLINGS:
        raise ValueError(f"sampling must be one of {DP_SGD_SAMPLINGS}, got {sampling!r}")
    if sampling == "truncated_poisson":
        if max_batch_size is None:
            raise ValueError("max_batch_size is required with sampling='truncated_poisson' (the "
                             "most examples a step keeps, an integer in [1, N])")
        max_batch_size = _check_positive_int("max_batch_size", max_batch_size)
        if max_batch_size > n:
            raise ValueError(f"max_batch_size must be in [1, N={n}], got {max_batch_size}")
    elif max_batch_size is not None:
        raise ValueError(f"max_batch_size applies only to sampling='truncated_poisson', got "
                         f"max_batch_size={max_batch_size!r} with sampling={sampling!r}")
    if epochs is not None:
        if not (isinstance(epochs, (int, float)) and epochs > 0 and math.isfinite(epochs)):
            raise ValueError(f"epochs must be a finite number > 0, got {epochs!r}")
        if sampling == "shuffle":
            per_epoch = shuffle_steps_per_epoch(n, batch_size / n)
        elif sampling == "balls_in_bins":
            per_epoch = math.ceil(n / batch_size)
        else:  # what the Poisson-family samplers run per epoch
            per_epoch = poisson_steps_per_epoch(batch_size / n)
        if epochs * per_epoch > MAX_STEPS:
            raise ValueError(
                f"epochs must be in (0, {MAX_STEPS / per_epoch:.4g}] for N={n} and batch_size="
                f"{batch_size} (at most {MAX_STEPS:.0e} steps), got {epochs!r}")
        if sampling == "balls_in_bins":
            steps = int(math.ceil(epochs - 1e-9)) * per_epoch
        else:
            steps = int(math.ceil(epochs * per_epoch - 1e-9))
    steps = _check_positive_int("steps", steps)
    if steps > MAX_STEPS:
        raise ValueError(f"steps must be in [1, {MAX_STEPS:.0e}], got {steps!r}")
    sensitivity = 1.0
    if microbatch_size is not None:
        microbatch_size = _check_positive_int("microbatch_size", microbatch_size)
        if microbatch_size > batch_size:
            raise ValueError(f"microbatch_size must be <= batch_size ({batch_size}), "
                             f"got {microbatch_size}")
        if microbatch_size > 1:
            sensitivity = 2.0
    if jl_projections is not None:
        jl_projections = _check_positive_int("jl_projections", jl_projections)
        query = SumQueryEvent(sensitivity, float(noise_multiplier), "jl", jl_projections)
    else:
        query = SumQueryEvent(sensitivity, float(noise_multiplier))
    q = batch_size / n
    if sampling == "balls_in_bins":
        q = 1.0 / math.ceil(n / batch_size)  # the sampler's (n, 1 / T)
    event = SamplingEvent(n, q, sampling, max_batch_size=max_batch_size)
    return SampleEntry(event, (query,)), steps


def dp_sgd_entries(
    n: int,
    batch_size: int,
    noise_multiplier: float,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    sampling: str = "poisson",
    microbatch_size: Optional[int] = None,
    jl_projections: Optional[int] = None,
    max_batch_size: Optional[int] = None,
) -> list[SampleEntry]:
    """The ledger DP-SGD would record for these hyperparameters, one entry per step (see
    :func:`dp_sgd_run`; at most :data:`MAX_LISTED_STEPS` steps)."""
    entry, steps = dp_sgd_run(n, batch_size, noise_multiplier, steps=steps, epochs=epochs,
                              sampling=sampling, microbatch_size=microbatch_size,
                              jl_projections=jl_projections, max_batch_size=max_batch_size)
    if steps > MAX_LISTED_STEPS:
        raise ValueError(
            f"{steps} steps are too many to list one entry per step (at most "
            f"{MAX_LISTED_STEPS}); use dp_sgd_epsilon or dp_sgd_run, which do not list them"
        )
    return [entry] * steps


def dp_sgd_epsilon(
    n: int,
    batch_size: int,
    noise_multiplier: float,
    delta: float,
    *,
    steps: Optional[int] = None,
    epochs: Optional[float] = None,
    accountant: str = "rdp",
    sampling: str = "poisson",
    microbatch_size: Optional[int] = None,
    jl_projections: Optional[int] = None,
    max_batch_size: Optional[int] = None,
) -> PrivacyResult:
    """Epsilon of DP-SGD from its hyperparameters (see :func:`dp_sgd_run`), for any number of
    steps (the steps are composed at once, never listed).

    Example: ``dp_sgd_epsilon(60000, 256, 1.1, 1e-5, epochs=60, accountant="pld")``.
    """
    _check_accountant(accountant)
    if not (isinstance(delta, (int, float)) and 0.0 < delta < 1.0):
        raise ValueError(f"delta must be in (0, 1), got {delta!r}")
    entry, steps = dp_sgd_run(n, batch_size, noise_multiplier, steps=steps, epochs=epochs,
                              sampling=sampling, microbatch_size=microbatch_size,
                              jl_projections=jl_projections, max_batch_size=max_batch_size)
    return _epsilon_of_runs([(entry, steps)], steps, delta, accountant)
