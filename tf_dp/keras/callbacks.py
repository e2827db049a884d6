"""Keras callbacks for DP training: privacy per epoch, a privacy budget, ledger persistence.

All of them read the DP optimizer's :class:`~tf_dp.PrivacyLedger` (what actually ran) and ask an
accountant of :mod:`tf_dp.accounting` for the guarantee.

- :class:`PrivacyReport` puts ``epsilon`` (spent so far) into the epoch ``logs``, so it lands in
  ``History.history["epsilon"]`` and in every ``keras.callbacks.TensorBoard`` of the ``fit``, in
  either order.
- :class:`PrivacyBudget` is the ``DPTrain`` loop of Abadi et al. 2016: it stops training *before*
  the step that would take epsilon over the budget.
- :class:`BackupAndRestore` is ``keras.callbacks.BackupAndRestore`` that also backs up and restores
  the ledger, so an interrupted run resumes with the same ledger (and the same spent budget).
- :class:`LedgerCheckpoint` writes the ledger file next to your ``ModelCheckpoint`` files.

Example::

    from tf_dp.keras import callbacks as dp_callbacks

    callbacks = [
        dp_callbacks.BackupAndRestore("backup/"),        # weights + ledger
        dp_callbacks.PrivacyBudget(target_epsilon=3.0, delta=1e-5),
        dp_callbacks.PrivacyReport(delta=1e-5),
        keras.callbacks.ModelCheckpoint("ckpt/model-{epoch:02d}.keras"),
        dp_callbacks.LedgerCheckpoint("ckpt/ledger-{epoch:02d}.json"),
        keras.callbacks.TensorBoard("logs/"),
    ]
    model.fit(tf_dp.data.poisson_batches(x, y, sampling_probability=0.01), epochs=50,
              callbacks=callbacks)
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import string
from typing import Any, Optional, Sequence

import keras

from tf_dp.keras.optimizers import DPOptimizerMixin
from tf_dp.ledger.events import SampleEntry, runs_are_prefix
from tf_dp.ledger.ledger_file import read_ledger_runs

_logger = logging.getLogger("tf_dp")

#: Ledger file name inside a BackupAndRestore backup directory.
LEDGER_BACKUP_NAME = "privacy_ledger.json"
#: Journal file name inside a BackupAndRestore backup directory.
JOURNAL_NAME = "privacy_journal.jsonl"


def _dp_optimizer(model: keras.Model, who: str):
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or not isinstance(optimizer, DPOptimizerMixin):
        raise TypeError(
            f"{who} needs a model compiled with a tf_dp DP optimizer (e.g. "
            f"tf_dp.keras.DPKerasSGDOptimizer), got {type(optimizer).__name__}"
        )
    return optimizer


def _check_delta(delta: Any) -> float:
    if isinstance(delta, bool) or not isinstance(delta, (int, float)):
        raise TypeError(f"delta must be a number in (0, 1), got {type(delta).__name__}")
    if not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    return float(delta)


def _check_accountant(accountant: Any) -> str:
    from tf_dp.accounting import ACCOUNTANTS  # no TensorFlow import

    if not isinstance(accountant, str) or accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    return accountant


def _check_can_analyse(optimizer, delta: float, accountant: str, who: str) -> None:
    """Fails at the start of ``fit``, not after an epoch, when ``accountant`` cannot analyse the
    ledger as it will be after one more step (e.g. JL steps with ``accountant="rdp"``)."""
    entries: list = list(optimizer.ledger.runs())
    upcoming = predicted_next_entry(optimizer)
    if upcoming is not None:
        entries.append(upcoming)
    try:
        compute_epsilon(entries, delta, accountant)
    except ValueError as e:
        raise ValueError(f"{who}(accountant={accountant!r}): {e}") from e


#: Accountants whose epsilon a :class:`PrivacyBudget` may stop on for subsampled steps (certified
#: upper bounds). ``gdp`` is accepted only where it is exact: no step subsampled.
BUDGET_ACCOUNTANTS = ("rdp", "moments", "pld")


def _refuse_approximate_budget(rates: Sequence[float]) -> None:
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


def _refuse_approximate_budget_for(entries: Sequence[Any]) -> None:
    """:func:`_refuse_approximate_budget` for ledger entries and/or runs (as the accountant
    composes them: shuffle epochs and tree windows count with rate 1)."""
    from tf_dp.accounting.ledger_analysis import composable_units
    from tf_dp.ledger.ledger_file import as_runs

    runs = as_runs(list(entries))
    if runs:
        _refuse_approximate_budget([u.q for u in composable_units(runs)[0]])


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


def _calling_callback_list(callback, max_depth: int = 8):
    """The ``keras.callbacks.CallbackList`` that is calling ``callback``'s hook right now (found on
    the call stack: ``fit`` dispatches every hook through one), or None (a custom loop calling the
    hook directly)."""
    import inspect

    frame = inspect.currentframe()
    try:
        for _ in range(max_depth):
            frame = frame.f_back if frame is not None else None
            if frame is None:
                return None
            owner = frame.f_locals.get("self")
            if isinstance(owner, keras.callbacks.CallbackList) and any(
                c is callback for c in owner.callbacks
            ):
                return owner
        return None
    finally:
        del frame


class PrivacyReport(keras.callbacks.Callback):
    """Adds ``epsilon`` (privacy spent so far, from the ledger) to each epoch's ``logs``.

    Keras's ``History`` (``model.fit(...).history["epsilon"]``) records it, and so does every
    ``keras.callbacks.TensorBoard`` of the same ``fit``, in whichever order the callbacks are
    listed: a ``TensorBoard`` listed after this one reads it from the epoch's ``logs``; for one
    listed before (it has already written that epoch's logs), this callback writes the scalar
    ``epoch_<log_key>`` itself, at step ``epoch``, into that callback's ``<log_dir>/train``, as
    ``TensorBoard`` writes its own epoch scalars (this needs the ``tensorboard`` package:
    ``pip install tensorboard``, part of the ``tutorials`` extra). Epsilon is computed at ``delta``
    by ``accountant`` from the optimizer's ledger of everything recorded so far (earlier ``fit``
    calls and a restored ledger included). ``statements`` keeps the accountant's full statement
    per epoch.

    Args:
      delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
      accountant: an accountant name of :func:`tf_dp.accounting.compute_epsilon` ("rdp", "pld"...).
      log_key: the logs key (default ``"epsilon"``).
      verbose: print the statement at the end of each epoch.

    Example::

        history = model.fit(batches, epochs=5, callbacks=[
            keras.callbacks.TensorBoard("logs/"), dp_callbacks.PrivacyReport(1e-5)])
        history.history["epsilon"]     # [0.41, 0.58, ...]; also "epoch_epsilon" in logs/train
    """

    def __init__(
        self, delta: float, accountant: str = "rdp", log_key: str = "epsilon", verbose: bool = False
    ):
        super().__init__()
        self.delta = _check_delta(delta)
        self.accountant = _check_accountant(accountant)
        self.log_key = log_key
        self.verbose = verbose
        self.statements: list[str] = []
        # TensorBoard callbacks that run before this one at each epoch end, and our writers to them
        self._tensorboards_before: list[Any] = []
        self._writers: dict[str, Any] = {}

    def on_train_begin(self, logs=None):
        optimizer = _dp_optimizer(self.model, "PrivacyReport")
        _check_can_analyse(optimizer, self.delta, self.accountant, "PrivacyReport")
        self._close_writers()
        self._tensorboards_before = []
        callback_list = _calling_callback_list(self)
        if callback_list is not None:
            for callback in callback_list.callbacks:
                if callback is self:
                    break
                if isinstance(callback, keras.callbacks.TensorBoard):
                    self._tensorboards_before.append(callback)

    def on_epoch_end(self, epoch, logs=None):
        ledger = _dp_optimizer(self.model, "PrivacyReport").ledger
        epsilon, result = compute_epsilon(ledger.runs(), self.delta, self.accountant)
        if logs is not None:
            logs[self.log_key] = epsilon
        self._write_to_tensorboards_before(epoch, epsilon)
        statement = str(result) if result is not None else "no DP step recorded: epsilon = 0"
        self.statements.append(statement)
        if self.verbose:
            print(f"\nEpoch {epoch + 1}: {statement}")

    def on_train_end(self, logs=None):
        self._close_writers()

    def _write_to_tensorboards_before(self, epoch: int, epsilon: float) -> None:
        if not self._tensorboards_before:
            return
        import tensorflow as tf

        for callback in self._tensorboards_before:
            train_dir = os.path.join(callback.log_dir, "train")
            writer = self._writers.get(train_dir)
            if writer is None:
                writer = self._writers[train_dir] = tf.summary.create_file_writer(train_dir)
            with writer.as_default():
                tf.summary.scalar(f"epoch_{self.log_key}", epsilon, step=epoch)
            writer.flush()

    def _close_writers(self) -> None:
        for writer in self._writers.values():
            writer.close()
        self._writers = {}


def predicted_next_entry(optimizer) -> Optional[SampleEntry]:
    """``optimizer.next_sample_entry()``, or None when an unusual query cannot predict it (the
    callers then fall back to the last recorded entry)."""
    try:
        return optimizer.next_sample_entry()
    except Exception as e:  # noqa: BLE001 -- an unusual query: fall back to the ledger
        _logger.debug("tf_dp: cannot predict the next ledger entry: %s", e)
        return None


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
      composed: a subsampled step raises (:func:`_refuse_approximate_budget`).
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

                _refuse_approximate_budget(added[0])
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

            _refuse_approximate_budget(added[0])
            return epsilon_from_mu(self.delta, math.sqrt(self.mu_squared + mu_squared(*added))) * pad
        if self.accountant == "pld" and at_most is None:
            return None
        stop = None if at_most is None else at_most / (pad * (1.0 + 1e-12))
        eps = self.rdp.epsilon(*added, at_most=stop) * pad
        if self.accountant == "pld" and eps > at_most:
            return None  # the RDP bound is not enough: the PLD of the whole ledger decides
        return eps


#: Relative rise of each predicted step's sensitivity when :class:`PrivacyBudget` checks a window
#: of predicted steps with the whole-ledger accountant: a step then recorded (or predicted
#: again) a few float32 ulps away from the prediction is still covered by the check.
_CHECK_SLACK = 2.0**-21


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


class BudgetExhaustedError(RuntimeError):
    """Raised by :class:`PrivacyBudget` when ``fit`` starts with no budget left for one step."""


#: Relative margin the budget keeps below ``target_epsilon`` for steps predicted from clip or
#: noise schedules (their compiled float32 arithmetic may differ from the prediction by an ulp).
SCHEDULE_MARGIN = 1e-6


class PrivacyBudget(keras.callbacks.Callback):
    """Stops training before the step that would spend more than ``target_epsilon``.

    The ``DPTrain`` loop of Abadi et al. 2016 (Algorithm 1 with the accountant's stopping rule):
    after each step, ask whether *one more step of the kind about to run* (the optimizer's current
    sampling, clip and noise) would take the ledger's epsilon at ``delta`` above
    ``target_epsilon``; if so, set ``model.stop_training`` so that step never runs. Epsilon after
    training is therefore ``<= target_epsilon`` (also across ``fit`` calls and resumed runs: the
    ledger holds all previous steps). With ``accountant="pld"`` a step may also run because the
    RDP epsilon, a certified bound too, is within the budget; the PLD's epsilon is then lower
    in every case we know of (RDP's conversion loses more than the PLD's discretisation).

    The budget stops on a certified upper bound only (design invariant 3): ``accountant`` is
    ``"rdp"`` (default), ``"moments"`` or ``"pld"`` (the tightest). ``"gdp"`` is accepted only
    when no step is subsampled (shuffled fixed-size batches, tree aggregation, full batches),
    where the composition is exactly mu-GDP; for Poisson-subsampled steps (rate < 1) its epsilon
    is the privacy-CLT approximation, which can be below the true epsilon (q = 0.1, noise
    multiplier 1, delta 1e-5: 30 steps are 2.99 by GDP, 4.18 by PLD), so ``fit`` raises
    ``ValueError`` naming the accountants to use, before any such step runs.

    Cost: with the ``rdp`` or ``moments`` accountant and Poisson sampling, the callback keeps the
    composition of the ledger's steps (:class:`tf_dp.accounting.rdp.ComposedRdp`; with ``gdp``
    and full batches the sum of their ``mu^2``; with ``pld`` the RDP composition, whose
    epsilon, a certified bound too, decides while it is within the budget, the PLD of the
    whole ledger deciding past that point) and adds only the steps recorded since its last check (``ledger.runs_from``); composing the ledger's
    earlier steps happens once per ``fit``, in time proportional to their distinct runs. The
    number of further steps of one kind that the budget allows is computed once (a search over
    step counts on that composition) and then counted down, so a batch costs a few variable
    reads. It is recomputed when the kind of step changes or when the steps recorded since,
    checked at each epoch end, include one of another kind. With clip or noise schedules (each
    step possibly of another kind, e.g. :class:`~tf_dp.keras.schedules.DecreasingClip` with a
    fixed ``noise_stddev``, where later steps cost less), the entries of the next
    ``LOOK_AHEAD`` (64) steps are predicted in one call (``optimizer.next_sample_entries``:
    the query's variables read once, schedules with a ``numpy_values`` method evaluated in
    numpy) and their RDP evaluated in one call
    (:meth:`tf_dp.accounting.rdp.ComposedRdp.prefetch`); every batch checks the kept
    composition plus the next call's predicted steps, so training goes on exactly until the
    budget is spent. Where the kept composition cannot decide (``pld`` past the RDP bound,
    shuffle, tree or JL steps), the whole ledger plus the predicted window is searched for how
    many of its steps fit (each checked with its sensitivity raised by ``2^-21``), and checked
    again only when a step is recorded or predicted costlier than that. The window is predicted again when a sampling is declared, a pass starts,
    the mechanism is set, or a step is recorded with another entry than predicted (a restored
    ledger). A check stops its order search at the first order within the budget (the same
    decision as the optimum), so far from the budget the first check of a ``fit`` evaluates the
    ledger's distinct steps at a few orders only. Shuffle sampling, tree aggregation and JL
    steps are accounted from the whole ledger at each check (their epochs and windows span
    runs). With ``steps_per_execution = s > 1`` Keras runs ``s`` steps between two checks, so
    training stops once fewer than ``s`` steps are left (the budget is never exceeded).
    ``epsilon_spent`` is the epsilon of the whole ledger as it was when ``fit`` ended, computed
    the first time it is read (a ``fit`` does not pay for it unless it is read or printed).

    If ``fit`` starts with not even one step left, it raises :class:`BudgetExhaustedError` from
    ``on_train_batch_begin`` (no step runs) unless ``raise_if_exhausted=False``, in which case the
    first step is replaced by a no-op and training stops.

    Args:
      target_epsilon: the budget, a finite number > 0.
      delta: the delta of the (epsilon, delta) guarantee, in (0, 1).
      accountant: ``"rdp"``, ``"moments"`` or ``"pld"``; ``"gdp"`` only for steps without
        subsampling (see above).
      raise_if_exhausted: raise :class:`BudgetExhaustedError` when ``fit`` starts with no step
        left (else run no step and stop).
      verbose: print the spent epsilon when the budget stops training.

    Attributes:
      stopped: True once the callback stopped training.
      epsilon_spent: epsilon of the ledger when training ended.

    Example::

        budget = dp_callbacks.PrivacyBudget(target_epsilon=3.0, delta=1e-5)
        model.fit(batches, epochs=1000, callbacks=[budget])   # stops when the budget is spent
    """

    LOOK_AHEAD = 64  # scheduled steps whose RDP is evaluated together
    VERIFY_AHEAD = 1024  # scheduled steps checked at once by the whole-ledger accountant

    def __init__(
        self,
        target_epsilon: float,
        delta: float,
        accountant: str = "rdp",
        raise_if_exhausted: bool = True,
        verbose: bool = True,
    ):
        super().__init__()
        if isinstance(target_epsilon, bool) or not isinstance(target_epsilon, (int, float)):
            raise TypeError(f"target_epsilon must be a number > 0, got {type(target_epsilon).__name__}")
        if not (math.isfinite(target_epsilon) and target_epsilon > 0):
            raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon}")
        self.target_epsilon = float(target_epsilon)
        self.delta = _check_delta(delta)
        self.accountant = _check_accountant(accountant)
        self.raise_if_exhausted = raise_if_exhausted
        self.verbose = verbose
        self.stopped = False
        self._spent: Optional[float] = None
        self._spent_steps: Optional[tuple[Any, int]] = None  # (ledger, steps) when fit ended
        self._composed = _ComposedCurve(self.delta, self.accountant)
        self._reset_plan()

    # -- planning ------------------------------------------------------------------------------

    def _reset_plan(self) -> None:
        self._ahead: dict[int, SampleEntry] = {}  # step -> entry predicted and prefetched
        self._ahead_key: Any = None  # what the predictions depend on (see _predicted)
        self._ahead_step = self._ahead_base = 0  # optimizer step, ledger step of the window
        self._plan_kind: Optional[SampleEntry] = None
        self._plan_base = 0  # ledger.num_samples when the plan was made
        self._plan_headroom = 0  # further steps of _plan_kind the budget allows
        # (ledger steps, optimizer step, entries): the ledger as it was plus these entries, from
        # that optimizer step on, were checked to fit (_verify_window)
        self._verified: tuple[int, int, list] = (0, 0, [])
        self._step_now = 0  # the optimizer step at the last _predicted call

    def _epsilon(self, entries: Sequence[Any]) -> float:
        if self.accountant == "gdp":
            _refuse_approximate_budget_for(entries)
        return compute_epsilon(entries, self.delta, self.accountant)[0]

    def _fits(self, ledger, upcoming: Sequence[tuple[SampleEntry, int]],
              margin: float = 0.0, update: bool = True) -> bool:
        """Whether the ledger followed by ``upcoming`` runs stays within the budget less a
        relative ``margin``: from the composed curve kept up to date incrementally when the
        steps compose independently (its order search stops at the first order within the
        budget), else from the whole ledger. ``update=False``: the composition was brought up to
        date in this hook call."""
        target = self.target_epsilon * (1.0 - margin)
        eps = self._composed.epsilon_with(ledger, upcoming, at_most=target, update=update)
        if eps is None:
            eps = self._epsilon([*ledger.runs(), *upcoming])
        return eps <= target

    def _cap(self) -> int:
        params = getattr(self, "params", None) or {}
        steps, epochs = params.get("steps"), params.get("epochs")
        if steps and epochs:
            return int(steps) * int(epochs) + 1
        return 1 << 20

    def headroom(self, entries: Sequence[Any], kind: SampleEntry, cap: int) -> int:
        """Largest ``k <= cap`` such that ``entries + [kind] * k`` stays within the budget
        (``entries``: :class:`SampleEntry` items and/or ``(SampleEntry, count)`` runs)."""
        entries = list(entries)

        def fits(k: int) -> bool:
            return self._epsilon([*entries, (kind, k)]) <= self.target_epsilon

        return self._search(fits, cap)

    @staticmethod
    def _search(fits, cap: int) -> int:
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

    def _plan(self, optimizer, kind: SampleEntry) -> None:
        ledger = optimizer.ledger
        self._plan_kind = kind
        if self._composed.covers(ledger, [(kind, 1)]):
            # the kept composition of the ledger plus k steps of `kind`
            self._plan_base = self._composed.steps
            self._plan_headroom = self._search(lambda k: self._fits(ledger, [(kind, k)]),
                                               self._cap())
            return
        entries = ledger.runs()
        self._plan_base = sum(count for _, count in entries)
        self._plan_headroom = self.headroom(entries, kind, self._cap())

    def steps_left(self) -> Optional[int]:
        """Further steps the budget allows (as last computed), or None before training."""
        optimizer = _dp_optimizer(self.model, "PrivacyBudget")
        if self._plan_kind is None:
            return None
        return max(0, self._plan_headroom - (optimizer.ledger.num_samples - self._plan_base))

    def _next_call_fits_schedule(self, optimizer, needed: int) -> Optional[bool]:
        """With clip or noise schedules every step may be of another kind: check the next
        ``needed`` steps exactly as the schedules give them (one accountant call), or None when
        they cannot be predicted."""
        upcoming = self._predicted(optimizer, needed)
        if upcoming is None:
            return None
        ledger = optimizer.ledger
        step = self._step_now  # read by _predicted
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
                optimizer, step, needed, target)
        self._plan_kind = upcoming[0]
        self._plan_base = self._composed.steps
        self._plan_headroom = needed if fits else 0
        return fits

    def _verify_window(self, optimizer, step: int, needed: int, target: float) -> bool:
        """Whether the next ``needed`` predicted steps fit, by the accountant on the whole
        ledger (the kept composition could not decide). The next ``VERIFY_AHEAD`` steps are
        predicted, and the largest ``m`` such that the ledger plus the first ``m`` of them
        fits is found (one accountant call when they all fit, else a search of about
        ``2 log2(m)`` calls) and remembered: later batches, while the steps are recorded and
        predicted as checked or cheaper, need no call."""
        try:  # further ahead than the window: one call covers more steps
            ahead = optimizer.next_sample_entries(self.VERIFY_AHEAD)
        except Exception as e:  # noqa: BLE001 -- e.g. past a schedule's end: the window's
            _logger.debug("tf_dp: cannot predict the next %d steps: %s", self.VERIFY_AHEAD, e)
            window = self._ahead
            ahead = [window[s] for s in range(step, self._ahead_step + len(window))]
        # each step checked a hair less private than predicted (_CHECK_SLACK), so that a step
        # recorded or predicted again one float32 ulp away stays covered (_covered)
        ahead = [_pessimistic(e) for e in ahead]
        runs = optimizer.ledger.runs()

        def fits(m: int) -> bool:
            return self._epsilon([*runs, *((e, 1) for e in ahead[:m])]) <= target

        if len(ahead) < needed:
            m = 0
        elif fits(len(ahead)):  # usually the whole window fits: one accountant call
            m = len(ahead)
        else:
            m = self._search(fits, len(ahead) - 1)
        # the ledger's steps then, the optimizer step, the entries that fit after them
        self._verified = (self._composed.steps, step, ahead[:m])
        return m >= needed

    def _predicted(self, optimizer, needed: int) -> Optional[list[SampleEntry]]:
        """The entries of the next ``needed`` steps, from the window of ``LOOK_AHEAD`` steps
        predicted in one call (``optimizer.next_sample_entries``), whose RDP is prefetched in
        one evaluation. The window is predicted again when the steps asked for leave it, when
        what the predictions depend on changed (a sampling declared, a pass started, the
        mechanism set, the gradient clipper resolved, the first step recorded) or when a step
        was recorded with another entry than predicted (e.g. a restored ledger). None when the
        steps cannot be predicted."""
        self._composed.update(optimizer.ledger)
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
        step = self._step_now = int(optimizer.iterations.numpy())
        engine = optimizer.engine
        key = (engine.recorder.settings_version, id(engine.clipper), self._composed.steps == 0)
        window = self._ahead
        if key != self._ahead_key or any(step + i not in window for i in range(needed)):
            ahead = None
            for count in (max(needed, self.LOOK_AHEAD), needed):
                try:
                    ahead = optimizer.next_sample_entries(count)
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

    def _next_step_allowed(self) -> bool:
        optimizer = _dp_optimizer(self.model, "PrivacyBudget")
        # Keras runs steps_per_execution steps per call between two callback hooks.
        needed = int(getattr(self.model, "steps_per_execution", 1) or 1)
        if getattr(optimizer, "has_dp_schedules", False):
            fits = self._next_call_fits_schedule(optimizer, needed)
            if fits is not None:
                return fits
        kind = predicted_next_entry(optimizer)
        if kind is None:
            entries = optimizer.ledger.runs()
            if not entries:
                _logger.warning(
                    "tf_dp PrivacyBudget: cannot predict the first step; it is checked after it runs"
                )
                return True
            kind = entries[-1][0]
        n = optimizer.ledger.num_samples
        if kind != self._plan_kind or n < self._plan_base:
            self._plan(optimizer, kind)
        return self._plan_headroom - (n - self._plan_base) >= needed

    # -- Keras hooks ---------------------------------------------------------------------------

    def on_train_begin(self, logs=None):
        optimizer = _dp_optimizer(self.model, "PrivacyBudget")
        self.stopped = False
        self._first_batch = True
        self._reset_plan()  # the ledger may have been restored (BackupAndRestore) since
        self._composed.reset()
        upcoming = predicted_next_entry(optimizer)
        if self.accountant == "gdp":  # before any step runs: gdp is exact only unsubsampled
            _refuse_approximate_budget_for(
                [*optimizer.ledger.runs(), *([] if upcoming is None else [upcoming])])
        # Poisson-sampled Gaussian steps compose (the RDP accountant analyses them): the
        # composition the first check needs is built here, from the ledger's runs, once
        if upcoming is None or not self._composed.covers(optimizer.ledger, [(upcoming, 1)]):
            _check_can_analyse(optimizer, self.delta, self.accountant, "PrivacyBudget")

    def on_train_batch_begin(self, batch, logs=None):
        if not self._first_batch:
            return
        self._first_batch = False
        if self._next_step_allowed():
            return
        self._stop()
        message = (
            f"PrivacyBudget: the privacy budget epsilon={self.target_epsilon:g} at "
            f"delta={self.delta:g} is spent (ledger: {self._epsilon_now():.4g}); not even one "
            "more step can run"
        )
        if self.raise_if_exhausted:
            raise BudgetExhaustedError(message)
        _logger.warning("tf_dp %s", message)
        original = self.model.train_function
        self._original_train_function = original
        self.model.train_function = lambda iterator: {}

    def on_train_batch_end(self, batch, logs=None):
        if not self.stopped and not self._next_step_allowed():
            self._stop()

    def on_epoch_end(self, epoch, logs=None):
        # Check the counted plan against the ledger as recorded: every step since the plan was
        # made must be of the planned kind; otherwise plan again from the real entries.
        optimizer = _dp_optimizer(self.model, "PrivacyBudget")
        if self._plan_kind is None:
            return
        if getattr(optimizer, "has_dp_schedules", False):
            # every batch checks the recorded ledger plus the scheduled next steps
            if not self.stopped and not (
                self._next_step_allowed() and self._next_epoch_allowed(optimizer)
            ):
                self._stop()
            return
        ledger = optimizer.ledger
        # only the steps recorded since the plan was made are read
        changed = ledger.num_samples < self._plan_base or _steps_differ_since(
            ledger.runs_from(self._plan_base), 0, self._plan_kind)
        if changed:
            kind = predicted_next_entry(optimizer)
            if kind is None and ledger.num_samples:
                kind = ledger.runs_from(ledger.num_samples - 1)[-1][0]
            self._plan(optimizer, kind or self._plan_kind)
        if not self.stopped and not (
            self._next_step_allowed() and self._next_epoch_allowed(optimizer)
        ):
            self._stop()

    def _next_epoch_allowed(self, optimizer) -> bool:
        """Whether the next epoch's first compiled call fits the budget. ``fit`` starts a new
        pass over the data at every epoch, so under ``shuffle`` sampling its first step opens a
        new epoch window even when the last epoch ended mid-window (``steps_per_epoch`` shorter
        than an epoch): the plan, which continues the current pass, would let it overspend."""
        kind = predicted_next_entry(optimizer)
        if kind is None or kind.sampling.policy != "shuffle" or kind.sampling.pass_start:
            return True
        needed = int(getattr(self.model, "steps_per_execution", 1) or 1)
        upcoming = [kind] * needed
        if getattr(optimizer, "has_dp_schedules", False):
            try:
                upcoming = optimizer.next_sample_entries(needed)
            except Exception as e:  # noqa: BLE001 -- keep the unscheduled prediction
                _logger.debug("tf_dp: cannot predict the next scheduled steps: %s", e)
        first = upcoming[0]
        upcoming[0] = dataclasses.replace(
            first, sampling=dataclasses.replace(first.sampling, pass_start=True)
        )
        return self._epsilon(optimizer.ledger.runs() + upcoming) <= self.target_epsilon

    def on_train_end(self, logs=None):
        original = getattr(self, "_original_train_function", None)
        if original is not None:
            self.model.train_function = original
            self._original_train_function = None
        ledger = _dp_optimizer(self.model, "PrivacyBudget").ledger
        self._spent, self._spent_steps = None, (ledger, ledger.num_samples)
        if self.stopped and self.verbose:
            from tf_dp.accounting import sampling_claims

            claim = sampling_claims(self.model.optimizer.ledger.runs())
            print(
                f"PrivacyBudget: stopped after {self.model.optimizer.ledger.num_samples} DP steps "
                f"(epsilon {self.epsilon_spent:.4g} <= {self.target_epsilon:g} at "
                f"delta={self.delta:g}); one more step would exceed the budget. {claim}"
            )

    def _stop(self) -> None:
        self.stopped = True
        self.model.stop_training = True

    def _epsilon_now(self) -> float:
        return self._epsilon(_dp_optimizer(self.model, "PrivacyBudget").ledger.runs())

    @property
    def epsilon_spent(self) -> Optional[float]:
        """Epsilon of the ledger's first steps up to the end of the last ``fit`` (None before
        one ended), computed on first read."""
        if self._spent is None and self._spent_steps is not None:
            ledger, steps = self._spent_steps
            runs, left = [], steps
            for entry, count in ledger.runs():
                if left <= 0:
                    break
                runs.append((entry, min(count, left)))
                left -= count
            self._spent = self._epsilon(runs)
        return self._spent


class BackupAndRestore(keras.callbacks.BackupAndRestore):
    """``keras.callbacks.BackupAndRestore`` that also backs up, journals and keeps the ledger.

    Same arguments as the Keras callback (use it instead), and the same backups: the weights and
    the epoch at each epoch end (or every ``save_freq`` batches). What it adds, for the privacy
    ledger:

    - **Backups.** Each backup writes the optimizer's ledger to ``backup_dir/privacy_ledger.json``
      *before* the weights, so a crash in between leaves a ledger that over-counts (a valid
      bound), never one that under-counts.
    - **Journal.** During ``fit`` the ledger is journaled to ``backup_dir/privacy_journal.jsonl``
      (:meth:`tf_dp.PrivacyLedger.attach_journal`): every step is appended after the compiled
      call that ran it, before any callback sees its results. ``journal_fsync=True`` also waits
      for the disk at each append (a machine crash, not only a killed process).
    - **Resume.** ``fit`` restores the weights and the epoch (Keras), and the ledger: the longest
      of the backed-up ledger and the journal, so steps that ran after the last backup and were
      discarded by a kill are still charged (the resumed ledger may exceed
      ``optimizer.iterations``). A :class:`PrivacyBudget` sees the budget already spent.
    - **A finished run keeps its ledger.** When training ends, the weights and epoch are deleted
      as in Keras (``delete_checkpoint=True``), but ``privacy_ledger.json`` stays, marked
      ``"finished"``. Running the same ``fit`` again with the same ``backup_dir`` trains from
      epoch 0 with new weights and *continues* that ledger: the second run's steps are counted
      on top of the first's, and a :class:`PrivacyBudget` stops it when the budget is spent
      (at once, with :class:`BudgetExhaustedError`, if nothing is left). A genuinely new run on
      other data needs a new ``backup_dir``. With ``delete_checkpoint=False`` the weights and
      epoch stay as well, and a rerun resumes after the last epoch (no step runs).
    - The ledger restored from ``backup_dir`` and the optimizer's own must record the same run
      (one a prefix of the other): otherwise ``fit`` raises before any step runs.

    Example::

        model.fit(batches, epochs=30, callbacks=[
            dp_callbacks.BackupAndRestore("/tmp/backup"),
            dp_callbacks.PrivacyBudget(3.0, 1e-5)])
        # killed at epoch 12 (or mid-epoch); run the same script again: it resumes at epoch 12
        # with every step that ran in its ledger
    """

    def __init__(
        self,
        backup_dir: str,
        save_freq: Any = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
        journal_fsync: bool = False,
    ):
        super().__init__(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
            delete_checkpoint=delete_checkpoint,
        )
        if not isinstance(journal_fsync, bool):
            raise TypeError(f"journal_fsync must be True or False, got {journal_fsync!r}")
        self.journal_fsync = journal_fsync

    @property
    def ledger_path(self) -> str:
        return os.path.join(self.backup_dir, LEDGER_BACKUP_NAME)

    @property
    def journal_path(self) -> str:
        return os.path.join(self.backup_dir, JOURNAL_NAME)

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)  # weights, epoch and the backed-up ledger (_load_model)
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        before = optimizer.ledger.num_samples
        optimizer.ledger.attach_journal(self.journal_path, fsync=self.journal_fsync)
        if optimizer.ledger.num_samples > before:
            _logger.warning(
                "tf_dp: the journal %s records %d steps that ran after the last backup; the "
                "resumed ledger charges them (%d steps)",
                self.journal_path, optimizer.ledger.num_samples - before,
                optimizer.ledger.num_samples,
            )

    def _save_model(self):
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        optimizer.ledger.save(
            self.ledger_path, metadata={"epoch": self._current_epoch, "backup": True}
        )
        super()._save_model()

    def _load_model(self):
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
        has_ledger = os.path.exists(self.ledger_path)
        if not has_ledger and os.path.exists(self._weights_path):
            raise FileNotFoundError(
                f"backup {self.backup_dir!r} holds weights but no {LEDGER_BACKUP_NAME}: resuming "
                "would forget the privacy already spent (was it written by "
                "keras.callbacks.BackupAndRestore?)"
            )
        backed_up = read_ledger_runs(self.ledger_path) if has_ledger else []
        super()._load_model()  # the weights (their own copy of the ledger) and the epoch
        ledger = optimizer.ledger
        current = ledger.runs()
        n_backed_up = sum(count for _, count in backed_up)
        n_current = sum(count for _, count in current)
        if runs_are_prefix(current, backed_up):
            if n_backed_up > n_current:
                ledger.restore_runs(backed_up)
        elif not runs_are_prefix(backed_up, current):
            raise ValueError(
                f"the ledger in {self.ledger_path!r} ({n_backed_up} steps) and the "
                f"optimizer's ledger ({n_current} steps) record different runs; use a new "
                "backup_dir for a new run"
            )
        if has_ledger:
            _logger.info(
                "tf_dp: restored %d ledger entries from %s", n_backed_up, self.ledger_path
            )
            with open(self.ledger_path) as f:
                finished = json.load(f)["metadata"].get("finished", False)
            if finished and not os.path.exists(self._training_metadata_path):
                _logger.warning(
                    "tf_dp: %s holds the ledger of a finished run (%d steps); this fit starts "
                    "again from epoch 0 and continues that ledger, so both runs are charged. "
                    "Use a new backup_dir for a new run on other data",
                    self.backup_dir, n_backed_up,
                )

    def on_train_end(self, logs=None):
        optimizer = _dp_optimizer(self.model, "tf_dp BackupAndRestore")
        os.makedirs(self.backup_dir, exist_ok=True)
        optimizer.ledger.save(
            self.ledger_path,
            metadata={"epoch": self._current_epoch, "backup": True, "finished": True},
        )
        optimizer.ledger.detach_journal()
        if not self.delete_checkpoint:
            return
        # The finished ledger holds every step: the journal and Keras's files can go.
        for path in (
            self.journal_path,
            self._weights_path,
            self._prev_weights_path,
            self._training_metadata_path,
            self._prev_training_metadata_path,
        ):
            if os.path.exists(path):
                os.remove(path)


class LedgerCheckpoint(keras.callbacks.Callback):
    """Saves the optimizer's ledger file alongside ``keras.callbacks.ModelCheckpoint``.

    ``filepath`` may hold ``{epoch}`` (and any ``logs`` key), formatted like ModelCheckpoint's
    (``epoch`` is 1-based). Written at each epoch end (or every ``save_freq`` batches) and at
    the end of training; the file is what ``tf_dp.accounting`` and ``compute_dp_sgd_privacy`` read.
    To resume from a ModelCheckpoint file, restore its ledger too:
    ``model.optimizer.ledger.restore_runs(tf_dp.ledger.read_ledger_runs(path))``.

    A file at ``filepath`` that records more steps than the ledger being written is not
    replaced: :class:`~tf_dp.ledger.ledger_file.LedgerOverwriteError` (naming the path and both
    step counts) stops training, e.g. a second run of a script whose earlier run wrote more
    steps there. ``overwrite=True`` replaces it anyway (only for files that do not belong to
    this data).

    The arguments are checked when the callback is made, not after an epoch of training: an
    empty ``filepath``, one that is not a format string of named fields (``{}``, ``{0}``,
    ``{epoch.x}``, an unclosed brace) or whose format specs do not apply (``{epoch:q}``), and
    ``metadata`` that is not a JSON object of finite values raise ``ValueError`` (``TypeError``
    for a wrong type). A field other than ``epoch`` must be a key of the training logs: it is
    checked at the first batch's end (``val_*`` keys at the first epoch's end).

    Example::

        callbacks = [keras.callbacks.ModelCheckpoint("ckpt/model-{epoch:02d}.keras"),
                     dp_callbacks.LedgerCheckpoint("ckpt/ledger-{epoch:02d}.json")]
    """

    def __init__(
        self,
        filepath: str,
        save_freq: Any = "epoch",
        metadata: Optional[dict] = None,
        overwrite: bool = False,
    ):
        super().__init__()
        if not isinstance(overwrite, bool):
            raise TypeError(f"overwrite must be True or False, got {overwrite!r}")
        self.overwrite = overwrite
        if save_freq != "epoch" and (
            isinstance(save_freq, bool) or not isinstance(save_freq, int) or save_freq < 1
        ):
            raise ValueError(f"save_freq must be 'epoch' or an integer >= 1, got {save_freq!r}")
        self.filepath = _checked_filepath(filepath)
        self._log_keys = sorted(
            {name for _, name, _, _ in string.Formatter().parse(self.filepath) if name}
            - {"epoch"}
        )
        self.save_freq = save_freq
        self.metadata = _checked_metadata(metadata)
        self._epoch = 0
        self._batches = 0
        self._keys_checked = False
        self.last_path: Optional[str] = None

    def _check_log_keys(self, logs: Optional[dict], at_epoch_end: bool) -> None:
        missing = [
            k for k in self._log_keys
            if k not in (logs or {}) and (at_epoch_end or not k.startswith("val_"))
        ]
        if missing:
            raise ValueError(
                f"LedgerCheckpoint filepath {self.filepath!r} names {missing} but the training "
                f"logs hold {sorted(logs or {})} (and epoch): use those keys"
            )

    def _save(self, epoch: int, logs: Optional[dict]) -> None:
        optimizer = _dp_optimizer(self.model, "LedgerCheckpoint")
        self._check_log_keys(logs, at_epoch_end=True)
        path = self.filepath.format(epoch=epoch + 1, **(logs or {}))
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        optimizer.ledger.save(
            path, metadata={**self.metadata, "epoch": epoch + 1}, overwrite=self.overwrite
        )
        self.last_path = path

    def on_epoch_begin(self, epoch, logs=None):
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if not self._keys_checked:  # the first batch's logs: every key but val_*
            self._keys_checked = True
            self._check_log_keys(logs, at_epoch_end=False)
        if self.save_freq != "epoch":
            self._batches += 1
            if self._batches % self.save_freq == 0:
                self._save(self._epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        if self.save_freq == "epoch":
            self._save(epoch, logs)

    def on_train_end(self, logs=None):
        self._save(self._epoch, logs)


def _checked_filepath(filepath: Any) -> str:
    """``filepath`` as a str, if it is a non-empty format string of named fields whose format
    specs apply to ``epoch`` (an int) and to log values (floats); else ValueError/TypeError."""
    if not isinstance(filepath, (str, os.PathLike)):
        raise TypeError(f"filepath must be a str or path, got {type(filepath).__name__}")
    path = os.fspath(filepath)
    if not isinstance(path, str):
        raise TypeError(f"filepath must be a str path, got {type(path).__name__}")
    if not path.strip():
        raise ValueError("filepath must be a non-empty path, e.g. 'ckpt/ledger-{epoch:02d}.json'")
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(path) if f is not None]
    except ValueError as e:
        raise ValueError(
            f"filepath {path!r} is not a valid format string ({e}); write a literal brace as "
            "'{{' or '}}'"
        ) from None
    for field in fields:
        if not field.isidentifier():
            raise ValueError(
                f"filepath {path!r}: every {{field}} must be a name ('epoch' or a key of the "
                f"training logs, e.g. 'loss'), got {{{field}}}"
            )
    values = {f: (1 if f == "epoch" else 0.5) for f in fields}
    try:
        path.format(**values)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise ValueError(
            f"filepath {path!r}: its format specs do not apply to epoch (an integer) and log "
            f"values (floats): {e}"
        ) from None
    return path


def _checked_metadata(metadata: Any) -> dict:
    """``metadata`` as a dict, if it is a JSON object with string keys and finite numbers."""
    if metadata is None:
        return {}
    if not isinstance(metadata, dict):
        raise TypeError(f"metadata must be a dict (a JSON object), got {type(metadata).__name__}")
    try:
        json.dumps(metadata, allow_nan=False)
    except ValueError as e:  # NaN or infinity
        raise ValueError(
            f"metadata must hold finite numbers only (JSON has no NaN/inf): {e}"
        ) from None
    except (TypeError, RecursionError) as e:
        raise ValueError(
            f"metadata must be JSON-serialisable (str keys; str, numbers, bools, None, lists, "
            f"dicts): {e}"
        ) from None
    if any(not isinstance(k, str) for k in metadata):
        raise ValueError(f"metadata keys must be strings, got {[k for k in metadata]!r}")
    return dict(metadata)
