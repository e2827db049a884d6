"""A privacy budget for every training loop: :class:`BudgetPlanner` ("may the next k steps run?").

The ``DPTrain`` loop of Abadi et al. 2016 stops *before* the step that would take epsilon over
the budget. The planner answers that question from what it can know before a step runs: the
ledger of the steps that ran (:class:`~tf_dp.PrivacyLedger`) and the entries the next steps will
record (:meth:`tf_dp.engine.DPEngine.next_sample_entries`: the declared sampling, the clip and
noise, schedules included). ``fit`` asks it through :class:`tf_dp.keras.PrivacyBudget`; a custom
loop (:class:`tf_dp.keras.DPTrainStep`, :meth:`tf_dp.engine.DPEngine.step`) asks it itself.

Example (a custom loop; ``dp_step`` is a :class:`tf_dp.keras.DPTrainStep`)::

    budget = tf_dp.engine.BudgetPlanner(target_epsilon=3.0, delta=1e-5)
    for xb, yb in batches:
        if not budget.allows(dp_step):     # the DP optimizer, or (engine, step) work too
            break                          # the next step would spend more than 3.0
        train(xb, yb)
        dp_step.flush()

How it decides, and what it costs: with the ``rdp`` or ``moments`` accountant and Poisson
sampling it keeps the composition of the ledger's steps (:class:`_ComposedCurve`) and adds only
the steps recorded since its last check; the number of further steps of one kind that fit is
found once (a search over step counts) and counted down. With a fixed clip and noise the next
step's entry is remembered while what it depends on is unchanged (a sampling declared, a pass
started, the clipper, the query's state), so such a check reads one variable, the ledger's step
count (``bench/callback_overhead.py``). With clip or noise schedules the
entries of the next ``LOOK_AHEAD`` steps are predicted in one call and their RDP evaluated in
one call. Where the kept composition cannot decide (``pld`` past the RDP bound, shuffle, tree or
JL steps), the whole ledger plus a window of predicted steps is searched for how many fit.

It stops on a certified upper bound only (design invariant 3): ``rdp``, ``moments`` or ``pld``;
``gdp`` only when no step is subsampled (there it is exact).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional, Sequence

from tf_dp.ledger.events import SampleEntry

_logger = logging.getLogger("tf_dp")

__all__ = [
    "BUDGET_ACCOUNTANTS",
    "BudgetExhaustedError",
    "BudgetPlanner",
    "SCHEDULE_MARGIN",
    "compute_epsilon",
]

#: Accountants whose epsilon a budget may stop on for subsampled steps (certified upper
#: bounds). ``gdp`` is accepted only where it is exact: no step subsampled.
BUDGET_ACCOUNTANTS = ("rdp", "moments", "pld")

#: Relative margin the budget keeps below ``target_epsilon`` for steps predicted from clip or
#: noise schedules (their compiled float32 arithmetic may differ from the prediction by an ulp).
SCHEDULE_MARGIN = 1e-6

#: Relative rise of each predicted step's sensitivity when a window of predicted steps is
#: checked with the whole-ledger accountant: a step then recorded (or predicted again) a few
#: float32 ulps away from the prediction is still covered by the check.
_CHECK_SLACK = 2.0**-21


class BudgetExhaustedError(RuntimeError):
    """Raised when training starts with no budget left for one step
    (:class:`tf_dp.keras.PrivacyBudget` with ``raise_if_exhausted=True``)."""


def check_delta(delta: Any) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"delta must be a number in (0, 1), got {type(delta).__name__}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return float(delta)


def check_accountant(accountant: Any) -> str:
    from tf_dp.accounting import ACCOUNTANTS

    if not isinstance(accountant, str) or accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def compute_epsilon(entries: Sequence[Any], delta: float, accountant: str):
    """``(epsilon, result)`` for ``entries`` (:class:`SampleEntry` items and/or
    ``(SampleEntry, count)`` runs, as ``PrivacyLedger.runs()`` gives) from
    :func:`tf_dp.accounting.compute_epsilon`.

    No entries: nothing was released, epsilon is 0 (``result`` is None).
    """
    if len(entries) == 0:
        return 0.0, None
    from tf_dp import accounting

    result = accounting.compute_epsilon(list(entries), delta=delta, accountant=accountant)
    return float(getattr(result, "epsilon", result)), result


def refuse_approximate_budget(rates: Sequence[float]) -> None:
    """Raises when a ``gdp`` budget would stop on steps sampled at a rate below 1: there the GDP
    epsilon is the central-limit-theorem approximation, which can be below the true epsilon (a
    budget must stop on a certified bound, design invariant 3)."""
    subsampled = sorted({float(q) for q in rates if q < 1.0})
    if not subsampled:
        return
    shown = ", ".join(f"{q:.4g}" for q in subsampled[:3]) + (", ..." if len(subsampled) > 3 else "")
    raise ValueError(
        f"PrivacyBudget(accountant='gdp') cannot stop on subsampled steps (sampling rate "
        f"{shown} < 1): there the GDP epsilon is the privacy-CLT approximation (Bu et al. 2019), "
        "not a certified upper bound, and it can be below the true epsilon. accountant must be "
        f"one of {BUDGET_ACCOUNTANTS} for subsampled steps ('pld' is the tightest); 'gdp' is "
        "accepted only when no step is subsampled (shuffled fixed-size batches, tree "
        "aggregation, full batches), where its epsilon is exact"
    )


def refuse_approximate_budget_for(entries: Sequence[Any]) -> None:
    """:func:`refuse_approximate_budget` for ledger entries and/or runs (as the accountant
    composes them: shuffle epochs and tree windows count with rate 1)."""
    from tf_dp.accounting.ledger_analysis import composable_units
    from tf_dp.ledger.ledger_file import as_runs

    runs = as_runs(list(entries))
    if runs:
        refuse_approximate_budget([u.q for u in composable_units(runs)[0]])


def predicted_next_entry(engine, step: int) -> Optional[SampleEntry]:
    """``engine.next_sample_entry(step)``, or None when an unusual query cannot predict it (the
    callers then fall back to the last recorded entry)."""
    try:
        return engine.next_sample_entry(step)
    except Exception as e:  # noqa: BLE001 -- an unusual query: fall back to the ledger
        _logger.debug("tf_dp: cannot predict the next ledger entry: %s", e)
        return None


def check_can_analyse(engine, step: int, delta: float, accountant: str, who: str) -> None:
    """Fails before training, not after an epoch, when ``accountant`` cannot analyse the
    ledger as it will be after one more step (e.g. JL steps with ``accountant="rdp"``)."""
    entries: list = list(engine.ledger.runs())
    upcoming = predicted_next_entry(engine, step)
    if upcoming is not None:
        entries.append(upcoming)
    try:
        compute_epsilon(entries, delta, accountant)
    except ValueError as e:
        raise ValueError(f"{who}(accountant={accountant!r}): {e}") from e


def engine_and_step(source: Any, step: Optional[int] = None) -> tuple[Any, Callable[[], int]]:
    """``(engine, step)`` of a DP optimizer (its ``engine`` and ``iterations``), a
    :class:`tf_dp.keras.DPTrainStep` (its optimizer's), or a :class:`~tf_dp.engine.DPEngine` with
    ``step`` given (the number of the next step, as passed to ``engine.step``). The step is
    returned as a function, read only when needed."""
    from tf_dp.engine.step import DPEngine

    if isinstance(source, DPEngine):
        if step is None:
            raise ValueError(
                "step is required with a DPEngine: the number of the next step (an integer "
                ">= 0, the step= of engine.step)"
            )
    else:
        optimizer = getattr(source, "optimizer", None)
        if not hasattr(source, "engine") and optimizer is not None:
            source = optimizer  # a DPTrainStep
        engine = getattr(source, "engine", None)
        if not isinstance(engine, DPEngine) or not hasattr(source, "iterations"):
            raise TypeError(
                "source must be a tf_dp DP optimizer, a tf_dp.keras.DPTrainStep or a "
                f"tf_dp.engine.DPEngine (with step=), got {type(source).__name__}"
            )
        if step is None:
            iterations = source.iterations
            return engine, lambda: int(iterations.numpy())
        source = engine
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    return source, lambda: step


def _prediction_key(engine, recorded: int) -> Any:
    """What the next entry of ``engine`` depends on, when it is a plain Gaussian engine without
    schedules (else None): the recorder's settings version (a sampling declared, a pass started,
    the mechanism set), the gradient clipper (JL or exact), whether the ledger is empty (the
    first step marks a pass start; a microbatched run's first step is predicted at sensitivity
    2) and the values of the query's global state (clip and noise: numbers, constant for this
    query; read as they are, so a state held in variables is read too)."""
    from tf_dp.dp_query.gaussian_query import GaussianSumQuery

    if engine.has_schedules or type(engine.query) is not GaussianSumQuery:
        return None
    try:
        state = tuple(float(v) for v in engine.global_state)
    except (TypeError, ValueError):  # not scalar leaves: predict every time
        return None
    return (id(engine), engine.recorder.settings_version, id(engine.clipper), recorded == 0,
            state)


def _steps_differ_since(runs: Sequence[tuple[SampleEntry, int]], start: int, kind) -> bool:
    """Whether the runs hold fewer than ``start`` steps or a step from ``start`` on is not
    ``kind`` (in O(runs))."""
    seen = 0
    for entry, count in runs:
        if seen + count > start and entry != kind:
            return True
        seen += count
    return seen < start


class _ComposedCurve:
    """The composition of a ledger's steps, brought up to date from the steps recorded since
    the last update only (``ledger.runs_from``), so a check of "the ledger plus the next steps"
    costs O(new and upcoming runs), whatever the run length. What is kept depends on the
    accountant:

    - ``rdp``/``moments``: the RDP curve (:class:`tf_dp.accounting.rdp.ComposedRdp`).
    - ``gdp``: the sum of the steps' ``mu^2`` (:func:`tf_dp.accounting.gdp.mu_squared`); the
      accountant's epsilon is a function of it. Only steps with rate 1 (exactly mu-GDP) are
      composed: a subsampled step raises (:func:`refuse_approximate_budget`).
    - ``pld``: the RDP curve, as a fast *sufficient* check: when the RDP epsilon (a certified
      upper bound too) is within the budget, the steps fit; otherwise :meth:`epsilon_with`
      returns None and the caller asks the PLD accountant about the whole ledger.

    It covers runs that compose independently: Poisson-sampled steps without tree or JL queries.
    Shuffle epochs and tree windows span runs; for those :meth:`epsilon_with` returns None and
    the caller accounts the whole ledger."""

    def __init__(self, delta: float, accountant: str):
        self.delta = delta
        self.accountant = accountant
        self.conversion = (accountant if accountant in ("rdp", "moments")
                           else "rdp" if accountant == "pld" else None)
        self.reset()

    def reset(self) -> None:
        from tf_dp.accounting.rdp import ComposedRdp

        self.steps = 0
        self.unseen: list[tuple[int, list]] = []  # (first step, runs) read by update, not taken
        self.composable = self.conversion is not None or self.accountant == "gdp"
        self.mu_squared = 0.0  # gdp
        if self.conversion is not None:
            self.rdp = ComposedRdp(self.delta, conversion=self.conversion)

    @staticmethod
    def units_of(runs: Sequence[tuple[SampleEntry, int]]):
        """``(q, z, counts)`` of ``runs``, or None when they do not compose independently."""
        from tf_dp.accounting.ledger_analysis import composable_units

        for entry, _ in runs:
            if entry.sampling.policy != "poisson" or any(
                q.mechanism in ("tree", "jl") for q in entry.queries
            ):
                return None
        units, non_private, _ = composable_units(list(runs))
        q = [u.q for u in units] + ([1.0] if non_private else [])
        z = [u.z for u in units] + ([0.0] if non_private else [])  # z = 0: infinite RDP
        return q, z, [u.count for u in units] + ([1] if non_private else [])

    def update(self, ledger) -> None:
        """Adds the steps recorded since the last update (starts over if the ledger shrank).
        One read of the new steps (``runs_from``: usually one small ``tf.function`` call)."""
        if not self.composable:  # no composition kept: the new steps are read for `unseen`
            n = ledger.num_samples
            if n == self.steps:
                return
            if n < self.steps:
                self.reset()
        try:
            runs = ledger.runs_from(self.steps)
        except ValueError:
            if ledger.num_samples >= self.steps:
                raise  # not a shorter ledger: malformed tables
            self.reset()
            runs = ledger.runs_from(0)
        n = self.steps + sum(count for _, count in runs)
        if n > self.steps:
            self.unseen.append((self.steps, runs))
        if n > self.steps and self.composable:
            added = self.units_of(runs)
            if added is None:
                self.composable = False
            elif self.conversion is None:
                from tf_dp.accounting.gdp import mu_squared

                refuse_approximate_budget(added[0])
                self.mu_squared += mu_squared(*added)
            else:
                self.rdp.add(*added)
        self.steps = n

    def prefetch(self, entries: Sequence[SampleEntry]) -> None:
        """Evaluates the RDP of steps predicted to run (a schedule's next steps) in one call;
        they are looked up by value when asked about or added."""
        if not (self.composable and entries) or self.conversion is None:
            return
        units = self.units_of([(e, 1) for e in entries])
        if units is not None:
            self.rdp.prefetch(units[0], units[1])

    def take_unseen(self) -> list[tuple[int, list]]:
        """The ``(first step, runs)`` pieces of the ledger read since the last call."""
        unseen, self.unseen = self.unseen, []
        return unseen

    def covers(self, ledger, upcoming: Sequence[tuple[SampleEntry, int]]) -> bool:
        """Whether the ledger followed by ``upcoming`` composes independently (RDP, Poisson,
        neither tree nor JL steps): then :meth:`epsilon_with` answers."""
        self.update(ledger)
        return self.composable and self.units_of(upcoming) is not None

    def epsilon_with(self, ledger, upcoming: Sequence[tuple[SampleEntry, int]],
                     at_most: Optional[float] = None, update: bool = True) -> Optional[float]:
        """Epsilon of the ledger followed by ``upcoming`` runs, or None (not composable). With
        ``at_most``, the first epsilon found ``<= at_most`` when there is one (enough to decide
        a budget: :meth:`tf_dp.accounting.rdp.ComposedRdp.epsilon`). ``update=False`` skips
        reading the ledger (the caller has just called :meth:`update`)."""
        if update:
            self.update(ledger)
        if not self.composable:
            return None
        added = self.units_of(upcoming)
        if added is None:
            return None
        # padded for round-off: the curve is summed in another order than the full accountant's
        pad = 1.0 + 1e-9
        if self.conversion is None:  # gdp
            from tf_dp.accounting.gdp import epsilon_from_mu, mu_squared

            refuse_approximate_budget(added[0])
            return epsilon_from_mu(self.delta, math.sqrt(self.mu_squared + mu_squared(*added))) * pad
        if self.accountant == "pld" and at_most is None:
            return None
        stop = None if at_most is None else at_most / (pad * (1.0 + 1e-12))
        eps = self.rdp.epsilon(*added, at_most=stop) * pad
        if self.accountant == "pld" and eps > at_most:
            return None  # the RDP bound is not enough: the PLD of the whole ledger decides
        return eps


def _pessimistic(entry: SampleEntry) -> SampleEntry:
    """``entry`` with the sensitivity of each plain Gaussian query raised by ``_CHECK_SLACK``
    (a less private step: it dominates every step it covers, see :func:`_covered`)."""
    try:
        return dataclasses.replace(entry, queries=tuple(
            dataclasses.replace(q, l2_sensitivity=q.l2_sensitivity * (1.0 + _CHECK_SLACK))
            if q.mechanism == "gaussian" and q.noise_grid is None else q
            for q in entry.queries))
    except ValueError:  # past the largest sensitivity-to-noise ratio: check as predicted
        return entry


def _covered(entry: SampleEntry, checked: SampleEntry) -> bool:
    """Whether ``entry`` costs no more privacy than ``checked``: equal, or equal but for plain
    Gaussian queries with a noise multiplier (stddev / sensitivity) at least ``checked``'s."""
    if entry == checked:
        return True
    if entry.sampling != checked.sampling or len(entry.queries) != len(checked.queries):
        return False
    for q, c in zip(entry.queries, checked.queries):
        if q == c:
            continue
        plain = q.mechanism == c.mechanism == "gaussian" and q.noise_grid is c.noise_grid is None
        if not plain or dataclasses.replace(q, l2_sensitivity=c.l2_sensitivity,
                                            noise_stddev=c.noise_stddev) != c:
            return False
        if not q.noise_stddev * c.l2_sensitivity >= c.noise_stddev * q.l2_sensitivity:
            return False
    return True


def search_largest(fits: Callable[[int], bool], cap: int) -> int:
    """Largest ``k <= cap`` with ``fits(k)`` (``fits`` monotone), 0 if not even one."""
    if not fits(1):
        return 0
    lo, hi = 1, 2
    while hi <= cap and fits(hi):
        lo, hi = hi, hi * 2
    if hi > cap:
        if lo == cap or fits(cap):
            return cap
        hi = cap
    while hi - lo > 1:  # fits(lo) and not fits(hi)
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


class BudgetPlanner:
    """Answers "may the next ``k`` DP steps run?" for a privacy budget, in any training loop.

    A step is allowed when the ledger's epsilon at ``delta``, with that step and the ones before
    it in the call added as they will be recorded (the engine's current sampling, clip and
    noise, schedules included), stays ``<= target_epsilon`` by ``accountant``. Epsilon after
    training is therefore ``<= target_epsilon`` when the loop runs a step only after
    :meth:`allows` said yes (also across loops and resumed runs: the ledger holds all previous
    steps). With a clip or noise schedule the check keeps a relative margin
    ``SCHEDULE_MARGIN`` (1e-6) below the target, for the compiled float32 arithmetic.

    ``accountant``: ``"rdp"`` (default), ``"moments"`` or ``"pld"`` (the tightest; a step may
    also run because the RDP epsilon, a certified bound too, is within the budget). ``"gdp"``
    only when no step is subsampled, where it is exact; on subsampled steps it raises
    ``ValueError`` (its epsilon is then the CLT approximation, not a bound).

    A source is a tf_dp DP optimizer (its ``engine`` and ``iterations``), a
    :class:`tf_dp.keras.DPTrainStep`, or a :class:`~tf_dp.engine.DPEngine` with ``step=``, the
    number of the next step.

    Args:
      target_epsilon: the budget, a finite number > 0.
      delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
      accountant: ``"rdp"``, ``"moments"``, ``"pld"``; ``"gdp"`` only without subsampling.

    Example::

        budget = tf_dp.engine.BudgetPlanner(target_epsilon=3.0, delta=1e-5)
        while budget.allows(optimizer):          # may the next step run?
            train(next(batches))                 # one compiled DP step
            optimizer.after_compiled_call()
        budget.steps_left(optimizer)             # 0: one more step would exceed 3.0
    """

    LOOK_AHEAD = 64  # scheduled steps whose RDP is evaluated together
    VERIFY_AHEAD = 1024  # scheduled steps checked at once by the whole-ledger accountant

    def __init__(self, target_epsilon: float, delta: float, accountant: str = "rdp"):
        if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
            raise TypeError(
                f"target_epsilon must be a number > 0, got {type(target_epsilon).__name__}")
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
        self.target_epsilon = float(target_epsilon)
        self.delta = check_delta(delta)
        self.accountant = check_accountant(accountant)
        #: the most steps one search looks at (a loop's length when known)
        self.cap = 1 << 20
        self._composed = _ComposedCurve(self.delta, self.accountant)
        self._started: Any = None  # the engine the planner was started for
        self.reset()

    # -- public API ----------------------------------------------------------------------------

    def reset(self) -> None:
        """Forgets the plan (the next check starts over from the ledger)."""
        self._composed.reset()
        self._ahead: dict[int, SampleEntry] = {}  # step -> entry predicted and prefetched
        self._ahead_key: Any = None  # what the predictions depend on (see _predicted)
        self._ahead_step = self._ahead_base = 0  # optimizer step, ledger step of the window
        self._plan_kind: Optional[SampleEntry] = None
        self._plan_base = 0  # ledger.num_samples when the plan was made
        self._plan_headroom = 0  # further steps of _plan_kind the budget allows
        # (ledger steps, optimizer step, entries): the ledger as it was plus these entries, from
        # that optimizer step on, were checked to fit (_verify_window)
        self._verified: tuple[int, int, list] = (0, 0, [])
        self._step_now = 0  # the step at the last _predicted call
        self._kind_cache: tuple[Any, Optional[SampleEntry]] = (None, None)  # _next_kind's
        self._started = None

    def start(self, source: Any, step: Optional[int] = None) -> None:
        """Starts (or restarts) planning for ``source``: the ledger may have changed since (a
        restored backup). Refuses, before any step runs, an accountant that cannot analyse the
        next step or a ``gdp`` budget on subsampled steps. :meth:`allows` calls it on first use."""
        engine, step_of = engine_and_step(source, step)
        self.reset()
        self._started = engine
        upcoming = predicted_next_entry(engine, step_of())
        if self.accountant == "gdp":  # before any step runs: gdp is exact only unsubsampled
            refuse_approximate_budget_for(
                [*engine.ledger.runs(), *([] if upcoming is None else [upcoming])])
        # Poisson-sampled Gaussian steps compose (the RDP accountant analyses them): the
        # composition the first check needs is built here, from the ledger's runs, once
        if upcoming is None or not self._composed.covers(engine.ledger, [(upcoming, 1)]):
            check_can_analyse(engine, step_of(), self.delta, self.accountant, "PrivacyBudget")

    def allows(self, source: Any, steps: int = 1, step: Optional[int] = None) -> bool:
        """Whether the next ``steps`` DP steps of ``source`` may run within the budget (call it
        before running them, after any ``start_pass``/``set_sampling`` that applies to them).

        It first checks the steps recorded since the last call against the plan (a step of
        another kind than predicted: plan again), then the next ``steps``. ``step``: the number
        of the next step, with a :class:`~tf_dp.engine.DPEngine` source only.
        """
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        engine, step_of = engine_and_step(source, step)
        if self._started is not engine:
            self.start(engine, step_of())
        self.check_recorded(engine, step_of())
        return self.next_steps_allowed(engine, steps, step_of())

    def steps_left(self, source: Any, step: Optional[int] = None) -> Optional[int]:
        """Further steps the budget allows (as last computed), or None before the first check."""
        engine, _ = engine_and_step(source, step)
        if self._plan_kind is None:
            return None
        return max(0, self._plan_headroom - (engine.ledger.num_samples - self._plan_base))

    def epsilon(self, entries: Sequence[Any]) -> float:
        """Epsilon of ``entries`` (runs and/or entries) by the planner's accountant."""
        if self.accountant == "gdp":
            refuse_approximate_budget_for(entries)
        return compute_epsilon(entries, self.delta, self.accountant)[0]

    def headroom(self, entries: Sequence[Any], kind: SampleEntry, cap: int) -> int:
        """Largest ``k <= cap`` such that ``entries + [kind] * k`` stays within the budget
        (``entries``: :class:`SampleEntry` items and/or ``(SampleEntry, count)`` runs)."""
        entries = list(entries)

        def fits(k: int) -> bool:
            return self.epsilon([*entries, (kind, k)]) <= self.target_epsilon

        return search_largest(fits, cap)

    # -- the checks (the Keras callback calls them hook by hook) -------------------------------

    def next_steps_allowed(self, source: Any, steps: int = 1,
                           step: Optional[int] = None) -> bool:
        """Whether the next ``steps`` steps fit, from the plan (the steps recorded since it was
        made are taken to be of its kind; :meth:`check_recorded` verifies that)."""
        engine, step_of = engine_and_step(source, step)
        if engine.has_schedules:
            fits = self._next_call_fits_schedule(engine, step_of(), steps)
            if fits is not None:
                return fits
        n = engine.ledger.num_samples
        kind = self._next_kind(engine, step_of, n)
        if kind is None:
            return True
        if kind != self._plan_kind or n < self._plan_base:
            self._plan(engine, kind)
        return self._plan_headroom - (n - self._plan_base) >= steps

    def check_recorded(self, source: Any, step: Optional[int] = None) -> None:
        """Checks the counted plan against the ledger as recorded: every step since the plan was
        made must be of the planned kind; otherwise plans again from the real entries."""
        engine, step_of = engine_and_step(source, step)
        if self._plan_kind is None or engine.has_schedules:
            return  # with schedules every check reads the recorded ledger plus the next steps
        ledger = engine.ledger
        # only the steps recorded since the plan was made are read
        changed = ledger.num_samples < self._plan_base or _steps_differ_since(
            ledger.runs_from(self._plan_base), 0, self._plan_kind)
        if changed:
            kind = predicted_next_entry(engine, step_of())
            if kind is None and ledger.num_samples:
                kind = ledger.runs_from(ledger.num_samples - 1)[-1][0]
            self._plan(engine, kind or self._plan_kind)

    def next_pass_allowed(self, source: Any, steps: int = 1, step: Optional[int] = None) -> bool:
        """Whether the next ``steps`` steps fit when the first opens a new pass over the data
        (``fit`` starts one at every epoch): under ``shuffle`` sampling it opens a new epoch
        window even when the last pass ended mid-window, which a plan that continues the current
        pass would not see."""
        engine, step_of = engine_and_step(source, step)
        kind = self._predict(engine, step_of, engine.ledger.num_samples)
        if kind is None or kind.sampling.policy != "shuffle" or kind.sampling.pass_start:
            return True
        upcoming = [kind] * steps
        if engine.has_schedules:
            try:
                upcoming = engine.next_sample_entries(step_of(), steps)
            except Exception as e:  # noqa: BLE001 -- keep the unscheduled prediction
                _logger.debug("tf_dp: cannot predict the next scheduled steps: %s", e)
        first = upcoming[0]
        upcoming[0] = dataclasses.replace(
            first, sampling=dataclasses.replace(first.sampling, pass_start=True)
        )
        return self.epsilon(engine.ledger.runs() + upcoming) <= self.target_epsilon

    # -- internals -----------------------------------------------------------------------------

    def _predict(self, engine, step_of, recorded: int) -> Optional[SampleEntry]:
        """:func:`predicted_next_entry`, remembered while :func:`_prediction_key` is unchanged."""
        key = _prediction_key(engine, recorded)
        if key is not None and self._kind_cache[0] == key:
            return self._kind_cache[1]
        kind = predicted_next_entry(engine, step_of())
        # a pass start is recorded by one step only: not remembered
        if key is not None and kind is not None and not kind.sampling.pass_start:
            self._kind_cache = (key, kind)
        return kind

    def _next_kind(self, engine, step_of, recorded: int) -> Optional[SampleEntry]:
        """The entry the next step will record. For a plain Gaussian engine without schedules
        it is remembered, with what it depends on (:func:`_prediction_key`: a few cheap reads
        instead of a prediction's dozen), and predicted again only when one of those changed."""
        kind = self._predict(engine, step_of, recorded)
        if kind is None:
            entries = engine.ledger.runs()
            if not entries:
                _logger.warning(
                    "tf_dp PrivacyBudget: cannot predict the first step; it is checked after it runs"
                )
                return None
            kind = entries[-1][0]
        return kind

    def _fits(self, ledger, upcoming: Sequence[tuple[SampleEntry, int]],
              margin: float = 0.0, update: bool = True) -> bool:
        """Whether the ledger followed by ``upcoming`` runs stays within the budget less a
        relative ``margin``: from the composed curve kept up to date incrementally when the
        steps compose independently, else from the whole ledger."""
        target = self.target_epsilon * (1.0 - margin)
        eps = self._composed.epsilon_with(ledger, upcoming, at_most=target, update=update)
        if eps is None:
            eps = self.epsilon([*ledger.runs(), *upcoming])
        return eps <= target

    def _plan(self, engine, kind: SampleEntry) -> None:
        ledger = engine.ledger
        self._plan_kind = kind
        if self._composed.covers(ledger, [(kind, 1)]):
            # the kept composition of the ledger plus k steps of `kind`
            self._plan_base = self._composed.steps
            self._plan_headroom = search_largest(
                lambda k: self._fits(ledger, [(kind, k)]), self.cap)
            return
        entries = ledger.runs()
        self._plan_base = sum(count for _, count in entries)
        self._plan_headroom = self.headroom(entries, kind, self.cap)

    def _next_call_fits_schedule(self, engine, step: int, needed: int) -> Optional[bool]:
        """With clip or noise schedules every step may be of another kind: check the next
        ``needed`` steps exactly as the schedules give them (one accountant call), or None when
        they cannot be predicted."""
        upcoming = self._predicted(engine, step, needed)
        if upcoming is None:
            return None
        ledger = engine.ledger
        base, first, verified = self._verified
        done = step - first
        if (verified and 0 <= done and done + needed <= len(verified)
                and self._composed.steps == base + done
                and all(map(_covered, upcoming, verified[done:done + needed]))):
            fits = True  # checked (or steps costing more checked) by an earlier _verify_window
        else:
            # The compiled step may round a schedule's float32 arithmetic one ulp (relative
            # 6e-8) away from the prediction: the check keeps a relative margin well above that.
            # _predicted brought the composition up to date: no second read of the ledger.
            target = self.target_epsilon * (1.0 - SCHEDULE_MARGIN)
            eps = self._composed.epsilon_with(ledger, [(e, 1) for e in upcoming],
                                              at_most=target, update=False)
            fits = eps <= target if eps is not None else self._verify_window(
                engine, step, needed, target)
        self._plan_kind = upcoming[0]
        self._plan_base = self._composed.steps
        self._plan_headroom = needed if fits else 0
        return fits

    def _verify_window(self, engine, step: int, needed: int, target: float) -> bool:
        """Whether the next ``needed`` predicted steps fit, by the accountant on the whole
        ledger (the kept composition could not decide). The next ``VERIFY_AHEAD`` steps are
        predicted, and the largest ``m`` such that the ledger plus the first ``m`` of them
        fits is found (one accountant call when they all fit, else a search of about
        ``2 log2(m)`` calls) and remembered: later checks, while the steps are recorded and
        predicted as checked or cheaper, need no call."""
        try:  # further ahead than the window: one call covers more steps
            ahead = engine.next_sample_entries(step, self.VERIFY_AHEAD)
        except Exception as e:  # noqa: BLE001 -- e.g. past a schedule's end: the window's
            _logger.debug("tf_dp: cannot predict the next %d steps: %s", self.VERIFY_AHEAD, e)
            window = self._ahead
            ahead = [window[s] for s in range(step, self._ahead_step + len(window))]
        # each step checked a hair less private than predicted (_CHECK_SLACK), so that a step
        # recorded or predicted again one float32 ulp away stays covered (_covered)
        ahead = [_pessimistic(e) for e in ahead]
        runs = engine.ledger.runs()

        def fits(m: int) -> bool:
            return self.epsilon([*runs, *((e, 1) for e in ahead[:m])]) <= target

        if len(ahead) < needed:
            m = 0
        elif fits(len(ahead)):  # usually the whole window fits: one accountant call
            m = len(ahead)
        else:
            m = search_largest(fits, len(ahead) - 1)
        # the ledger's steps then, the optimizer step, the entries that fit after them
        self._verified = (self._composed.steps, step, ahead[:m])
        return m >= needed

    def _predicted(self, engine, step: int, needed: int) -> Optional[list[SampleEntry]]:
        """The entries of the next ``needed`` steps, from the window of ``LOOK_AHEAD`` steps
        predicted in one call (``engine.next_sample_entries``), whose RDP is prefetched in
        one evaluation. The window is predicted again when the steps asked for leave it, when
        what the predictions depend on changed (a sampling declared, a pass started, the
        mechanism set, the gradient clipper resolved, the first step recorded) or when a step
        was recorded with another entry than predicted (e.g. a restored ledger). None when the
        steps cannot be predicted."""
        self._composed.update(engine.ledger)
        lo, hi = self._ahead_base, self._ahead_base + len(self._ahead)  # ledger steps covered
        v_lo, _, verified = self._verified
        v_hi = v_lo + len(verified)
        for first, runs in self._composed.take_unseen():
            for entry, count in runs:  # the steps recorded since: as predicted?
                for j in range(max(first, lo), min(first + count, hi)):
                    if self._ahead[self._ahead_step + j - self._ahead_base] != entry:
                        self._ahead_key = None
                for j in range(max(first, v_lo), min(first + count, v_hi)):
                    if not _covered(entry, verified[j - v_lo]):  # costlier: check again
                        self._verified = (0, 0, [])
                first += count
        self._step_now = step
        key = (engine.recorder.settings_version, id(engine.clipper), self._composed.steps == 0)
        window = self._ahead
        if key != self._ahead_key or any(step + i not in window for i in range(needed)):
            ahead = None
            for count in (max(needed, self.LOOK_AHEAD), needed):
                try:
                    ahead = engine.next_sample_entries(step, count)
                    break
                except Exception as e:  # noqa: BLE001 -- e.g. past a schedule's end: fewer
                    _logger.debug("tf_dp: cannot predict the next %d steps: %s", count, e)
            if ahead is None:
                self._ahead, self._ahead_key = {}, None
                return None
            window = self._ahead = {step + i: e for i, e in enumerate(ahead)}
            # a pass start is recorded once: predictions made with one hold for this step only
            self._ahead_key = None if ahead[0].sampling.pass_start else key
            self._ahead_step, self._ahead_base = step, self._composed.steps
            self._composed.prefetch(ahead)
        return [window[step + i] for i in range(needed)]
