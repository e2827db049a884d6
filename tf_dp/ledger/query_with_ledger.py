"""QueryWithLedger: a DPQuery wrapper that records every sample in a PrivacyLedger."""

from __future__ import annotations

from typing import Any, Mapping, Optional

import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery, SumQuerySpec
from tf_dp.dp_query.validation import check_scalar
from tf_dp.dp_query.xla import in_xla_context
from tf_dp.ledger.events import (
    MECHANISMS,
    PRIVACY_UNITS,
    SAMPLING_ORIGINS,
    PASS_POLICIES,
    SAMPLING_POLICIES,
    SampleEntry,
    SamplingEvent,
    SumQueryEvent,
    mf_strategy_code,
    mf_strategy_of_code,
)
from tf_dp.ledger.privacy_ledger import (
    PrivacyLedger,
    _fixed_shape_context,
    ledger_variable,
    mechanism_code,
    origin_code,
    policy_code,
    read_int,
    unit_code,
)


class QueryWithLedger(DPQuery):
    """Wraps ``query`` so that each ``get_noised_result`` records one sample in ``ledger``.

    On every ``get_noised_result`` call, after the noised result is computed, the wrapper records a
    sampling event (population size ``n``, selection probability ``q``, sampling policy) followed by
    one sum-query event per sum query of the wrapped query, with the clip and noise values of that
    step multiplied by ``sensitivity_multiplier`` for the sensitivity.

    The sampling parameters, the sensitivity multiplier and the JL dimension are ``tf.Variable``s:
    change them with :meth:`set_sampling` / :meth:`set_mechanism` between steps (the Keras
    integration does this from the data it is given) and the ledger records the new values.

    Args:
      query: the DPQuery to wrap.
      ledger: the ``PrivacyLedger`` to record into (a new one by default).
      population_size: ``n`` (integer >= 1).
      selection_probability: ``q`` in (0, 1].
      sampling_policy: one of ``tf_dp.ledger.events.SAMPLING_POLICIES`` (``truncated_poisson``
        needs a :class:`tf_dp.data.Sampling` with ``max_batch_size``).

    Example (one sample of two records, recorded with the population and rate as given):

    >>> import tensorflow as tf, tf_dp
    >>> ledger = tf_dp.PrivacyLedger()
    >>> query = tf_dp.QueryWithLedger(tf_dp.GaussianSumQuery(1.0, 1.1), ledger,
    ...                               population_size=60000, selection_probability=0.004)
    >>> gs = query.initial_global_state()
    >>> state = query.initial_sample_state(tf.zeros([2]))
    >>> for record in ([1.0, 0.0], [0.0, 2.0]):
    ...     state = query.accumulate_record(query.derive_sample_params(gs), state,
    ...                                     tf.constant(record))
    >>> _ = query.get_noised_result(state, gs)
    >>> [(entry.sampling.population_size, round(entry.queries[0].noise_stddev, 6))
    ...  for entry in ledger.samples()]
    [(60000, 1.1)]
    """

    def __init__(
        self,
        query: DPQuery,
        ledger: Optional[PrivacyLedger] = None,
        population_size: int = 1,
        selection_probability: float = 1.0,
        sampling_policy: str = "poisson",
    ):
        if not isinstance(query, DPQuery):
            raise TypeError(f"query must be a DPQuery, got {type(query).__name__}")
        if ledger is None:
            ledger = PrivacyLedger()
        if not isinstance(ledger, PrivacyLedger):
            raise TypeError(f"ledger must be a PrivacyLedger, got {type(ledger).__name__}")
        self._query = query
        self._ledger = ledger
        with tf.init_scope():
            self._population_size = ledger_variable(tf.constant(1, tf.int64))
            self._selection_probability = ledger_variable(tf.constant(1.0, tf.float64))
            self._policy = ledger_variable(tf.constant(0, tf.int32))
            # who drew the batches (0 declared, 1 sampled), the unit (0 example, 1 user), k
            self._origin = ledger_variable(tf.constant(0, tf.int32))
            self._unit = ledger_variable(tf.constant(0, tf.int32))
            self._records_per_unit = ledger_variable(tf.constant(0, tf.int32))
            # truncated_poisson's B, cyclic_poisson's number of parts (0 for other policies)
            self._max_batch_size = ledger_variable(tf.constant(0, tf.int64))
            self._sensitivity_multiplier = ledger_variable(tf.constant(1.0, tf.float32))
            self._jl_projections = ledger_variable(tf.constant(0, tf.int32))
            # 1 until the next recorded draw: that draw starts a new pass over the data
            self._pass_start = ledger_variable(tf.constant(0, tf.int32))
            # compiled steps that met a non-finite or negative clip / noise: nothing recorded,
            # nothing released; check_values() raises for them between calls
            self._invalid_steps = ledger_variable(tf.constant(0, tf.int64))
            # traced steps that ran under another unit of privacy (or k) than they were traced
            # for: nothing recorded, nothing released; check_values() raises for them, naming
            # the unit (code, k) the last of them was traced for
            self._unit_mismatches = ledger_variable(tf.constant(0, tf.int64))
            self._mismatched_trace = ledger_variable(tf.constant([0, 0], tf.int32))
            # compiled steps: 1 if the last step's get_noised_result recorded and released
            # (room checked before its rows were staged), read by step_released()
            self._released = ledger_variable(tf.constant(1, tf.int32))
        self._invalid_reported = 0
        #: counts the eager calls that change what the next step records (set_sampling,
        #: start_pass, set_mechanism): a reader that caches predicted entries compares it
        self.settings_version = 0
        self._mismatches_reported = 0
        # (unit code, k or 0) of the sampling declared now, in Python: a step traced now clips
        # with this unit, and compares it with the recorded variables when it runs
        self._declared_unit = (0, 0)
        self.set_sampling(population_size, selection_probability, sampling_policy)

    @property
    def query(self) -> DPQuery:
        return self._query

    @property
    def ledger(self) -> PrivacyLedger:
        return self._ledger

    def set_sampling(
        self,
        population_size: Any,
        selection_probability: Optional[float] = None,
        sampling_policy: str = "poisson",
        origin: str = "declared",
        unit: str = "example",
        records_per_unit: Optional[int] = None,
        max_batch_size: Optional[int] = None,
        num_parts: Optional[int] = None,
    ) -> None:
        """Sets the sampling recorded from the next step on (validated first, all or nothing).

        ``population_size`` may instead be a :class:`tf_dp.data.Sampling` (any object with its
        fields), whose population, rate, policy, origin, unit and ``records_per_unit`` are used.

        Example::

            query.set_sampling(tf_dp.data.Sampling(60000, 256 / 60000, origin="sampled"))
        """
        if hasattr(population_size, "selection_probability") and hasattr(population_size, "origin"):
            s = population_size
            population_size, selection_probability = s.population_size, s.selection_probability
            sampling_policy, origin, unit = s.policy, s.origin, s.unit
            records_per_unit = s.records_per_unit
            max_batch_size = getattr(s, "max_batch_size", None)
            num_parts = getattr(s, "num_parts", None)
        if isinstance(population_size, bool) or not isinstance(population_size, int) or (
            population_size < 1
        ):
            raise ValueError(f"population_size must be an integer >= 1, got {population_size!r}")
        q = check_scalar("selection_probability", selection_probability, allow_zero=False)
        if q > 1:
            raise ValueError(f"selection_probability must be in (0, 1], got {q}")
        code = policy_code(sampling_policy)
        # validates origin, unit and k together (ValueError naming the field)
        event = SamplingEvent(population_size, q, sampling_policy, origin=origin, unit=unit,
                              records_per_unit=records_per_unit, max_batch_size=max_batch_size,
                              num_parts=num_parts)
        self._population_size.assign(population_size)
        self._selection_probability.assign(q)
        self._policy.assign(code)
        self._origin.assign(origin_code(event.origin))
        self._unit.assign(unit_code(event.unit))
        self._records_per_unit.assign(event.records_per_unit or 0)
        self._max_batch_size.assign(event.max_batch_size or event.num_parts or 0)
        self.settings_version += 1
        self._declared_unit = (unit_code(event.unit), event.records_per_unit or 0)

    def unit_as_traced(self) -> Optional[tf.Tensor]:
        """Inside a traced step: whether the unit of privacy and ``k`` declared when the step runs
        (the recorded variables) are those declared when it was traced (a bool tensor). A traced
        step clips with the unit of its trace (``tf_dp.engine.DPEngine``): when they differ the
        step records and releases nothing (:meth:`has_room` is false) and fails. None eagerly,
        where every step clips with the sampling declared at that moment."""
        if tf.executing_eagerly():
            return None
        unit, k = self._declared_unit
        return tf.logical_and(tf.equal(self._unit.read_value(), unit),
                              tf.equal(self._records_per_unit.read_value(), k))

    @property
    def records_per_user(self) -> Optional[int]:
        """``k`` when the declared sampling is user-level, else None (eager)."""
        if PRIVACY_UNITS[int(self._unit.numpy())] != "user":
            return None
        return int(self._records_per_unit.numpy())

    def start_pass(self) -> None:
        """Marks the next recorded draw as the first of a new pass over the data (eager).

        Call it wherever a new pass (a new shuffle, a new iterator over the data) begins; the
        Keras integration does at every ``fit`` epoch and every ``train_on_batch`` call. Under
        the ``shuffle`` policy the accountants count epochs from these marks; extra marks only
        make the count more conservative, missing ones under-count.
        """
        self._pass_start.assign(1)
        self.settings_version += 1

    @property
    def pass_start_pending(self) -> bool:
        """Whether the next recorded draw starts a pass."""
        return bool(int(self._pass_start.numpy()))

    def set_mechanism(self, sensitivity_multiplier: float = 1.0, jl_projections: int = 0) -> None:
        """Sets the L2 sensitivity multiplier (2 for microbatches of several examples under
        add/remove adjacency) and the JL dimension (0 for exact clipping)."""
        m = check_scalar("sensitivity_multiplier", sensitivity_multiplier, allow_zero=False)
        if isinstance(jl_projections, bool) or not isinstance(jl_projections, int) or (
            jl_projections < 0
        ):
            raise ValueError(f"jl_projections must be an integer >= 0, got {jl_projections!r}")
        self._sensitivity_multiplier.assign(m)
        self._jl_projections.assign(jl_projections)
        self.settings_version += 1

    def set_jl_projections(self, jl_projections: Any) -> None:
        """Sets the JL dimension recorded by the next step (0: exact clipping); graph-safe, for
        the step that knows it from its gradient clipper."""
        self._jl_projections.assign(tf.cast(jl_projections, tf.int32))

    @property
    def sensitivity_multiplier(self) -> tf.Variable:
        return self._sensitivity_multiplier

    # -- DPQuery protocol: delegate ----------------------------------------------------------------

    def initial_global_state(self) -> Any:
        return self._query.initial_global_state()

    def derive_sample_params(self, global_state: Any) -> Any:
        return self._query.derive_sample_params(global_state)

    def initial_sample_state(self, template: Any) -> Any:
        return self._query.initial_sample_state(template)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        return self._query.preprocess_record(params, record)

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        return self._query.accumulate_preprocessed_record(sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        return self._query.merge_sample_states(sample_state_1, sample_state_2)

    def derive_metrics(self, global_state: Any) -> dict[str, Any]:
        return self._query.derive_metrics(global_state)

    def sum_query_specs(self, global_state: Any) -> list[SumQuerySpec]:
        return self._query.sum_query_specs(global_state)

    @property
    def supports_norm_clipping(self) -> bool:
        return self._query.supports_norm_clipping

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        return self._query.clip_weights(params, squared_norms)

    def accumulate_norms(
        self, params: Any, sample_state: Any, norms: Any, record_mask: Any = None
    ) -> Any:
        return self._query.accumulate_norms(params, sample_state, norms, record_mask)

    def _event_values(self, specs: list[SumQuerySpec]) -> list[tuple[Any, ...]]:
        """(l2_sensitivity, noise_stddev, mechanism code, jl_projections, noise_seed, noise_grid)
        of each sum query, as the ledger records them: the clip times the sensitivity multiplier
        for private queries (plus the grid's rounding term ``g sqrt(d)`` in grid mode)."""
        jl = self._jl_projections.read_value()
        values = []
        for spec in specs:
            tree_step = getattr(spec, "tree_step", None)
            if spec.private and tree_step is not None:
                # one leaf of a tree-aggregation release: column 4 holds the leaf index. JL's
                # estimated clipping weights have no tree analysis: refuse rather than mislabel.
                check = _refuse_tree_with_jl(jl)
                with tf.control_dependencies(check):
                    sens = tf.cast(spec.l2_sensitivity, tf.float32) * self._sensitivity_multiplier
                values.append((_plus_grid(sens, spec), spec.noise_stddev,
                               tf.constant(mechanism_code("tree")), tree_step, spec.noise_seed,
                               getattr(spec, "noise_grid", None)))
                continue
            mf = getattr(spec, "mf_strategy", None)
            if spec.private and mf is not None:
                # one release of a correlated-noise run: column 4 holds the strategy's code
                sens = tf.cast(spec.l2_sensitivity, tf.float32) * self._sensitivity_multiplier
                values.append((sens, spec.noise_stddev, tf.constant(mechanism_code("mf")),
                               tf.constant(mf_strategy_code(mf)), spec.noise_seed, None))
                continue
            if spec.private and getattr(spec, "exact_gaussian", False):
                # e.g. a count of unclipped records: Gaussian whatever the gradient mode
                mech = tf.constant(mechanism_code("gaussian"))
                sens = tf.cast(spec.l2_sensitivity, tf.float32) * self._sensitivity_multiplier
            elif spec.private:
                mech = tf.where(jl > 0, mechanism_code("jl"), mechanism_code("gaussian"))
                sens = tf.cast(spec.l2_sensitivity, tf.float32) * self._sensitivity_multiplier
            else:
                mech = tf.constant(mechanism_code("none"))
                sens = tf.cast(spec.l2_sensitivity, tf.float32)
            grid = getattr(spec, "noise_grid", None) if spec.private else None
            values.append((_plus_grid(sens, spec) if grid is not None else sens,
                           spec.noise_stddev, mech, jl, spec.noise_seed, grid))
        return values

    def next_sample_entry(
        self,
        global_state: Any,
        sensitivity_multiplier: Optional[float] = None,
        jl_projections: Optional[int] = None,
    ) -> SampleEntry:
        """The entry the next ``get_noised_result`` would record, computed eagerly from the current
        sampling parameters, mechanism settings and ``global_state`` (e.g. to check a privacy
        budget before a step). ``sensitivity_multiplier`` and ``jl_projections`` (0: exact
        clipping) override the current settings, e.g. before the first step has set them."""
        entries = []
        spec_list = self._query.sum_query_specs(global_state)
        for sens, std, mech, jl, seed, grid in self._event_values(spec_list):
            name = MECHANISMS[int(mech)]
            exact = bool(getattr(spec_list[len(entries)], "exact_gaussian", False))
            if name == "tree" and jl_projections:
                _refuse_tree_with_jl(jl_projections)
            if jl_projections is not None and name not in ("none", "tree", "mf") and not exact:
                jl = jl_projections
                name = "jl" if jl_projections > 0 else "gaussian"
            sens = float(sens)
            if sensitivity_multiplier is not None and name != "none":
                spec = spec_list[len(entries)]
                extra = 0.0 if grid is None else float(spec.grid_sensitivity)
                sens = (sens - extra) / float(self._sensitivity_multiplier.numpy()) * (
                    sensitivity_multiplier) + extra
            entries.append(
                SumQueryEvent(
                    l2_sensitivity=sens,
                    noise_stddev=float(std),
                    mechanism=name,
                    jl_projections=int(jl) if name == "jl" else None,
                    noise_seed=seed,
                    tree_step=int(jl) if name == "tree" else None,
                    noise_grid=None if grid is None else float(grid),
                    mf_strategy=mf_strategy_of_code(int(jl)) if name == "mf" else None,
                )
            )
        policy = SAMPLING_POLICIES[int(self._policy.numpy())]
        sampling = SamplingEvent(
            population_size=int(self._population_size.numpy()),
            selection_probability=float(self._selection_probability.numpy()),
            policy=SAMPLING_POLICIES[int(self._policy.numpy())],
            pass_start=(self.pass_start_pending or self._ledger.num_samples == 0)
            and SAMPLING_POLICIES[int(self._policy.numpy())] in PASS_POLICIES,
            origin=SAMPLING_ORIGINS[int(self._origin.numpy())],
            unit=PRIVACY_UNITS[int(self._unit.numpy())],
            records_per_unit=self.records_per_user,
            max_batch_size=(int(self._max_batch_size.numpy()) or None) if policy != "cyclic_poisson"
            else None,
            num_parts=int(self._max_batch_size.numpy()) if policy == "cyclic_poisson" else None,
        )
        return SampleEntry(sampling, tuple(entries))

    def has_room(self, global_state: Any) -> tf.Tensor:
        """Whether the ledger can record the next step here (see ``PrivacyLedger.has_room``) and
        the step's clip and noise values can be recorded (finite, >= 0): a step for which this
        is false must release nothing."""
        specs = self._query.sum_query_specs(global_state)
        room = self._ledger.has_room(len(specs))
        same_unit = self.unit_as_traced()
        if same_unit is not None:
            room = tf.logical_and(room, same_unit)
        if not _fixed_shape_context():
            return room  # outside compiled steps bad values fail the step (_check_specs)
        return tf.logical_and(room, _valid_values(
            [(s.l2_sensitivity, s.noise_stddev) for s in specs]))

    def step_released(self, global_state: Any) -> tf.Tensor:
        """After this step's :meth:`get_noised_result`: whether the step was recorded and its
        result released (a step for which this is false must apply nothing). In a compiled step
        this is the room taken *before* the step's rows were staged (so the step that fills the
        staging table is applied as well as recorded); elsewhere :meth:`has_room`."""
        if not _fixed_shape_context():
            return self.has_room(global_state)
        return tf.equal(self._released.read_value(), 1)

    def flush_counters(self) -> list:
        """The int64 counters :meth:`check_values` reads (for
        :func:`tf_dp.ledger.privacy_ledger.counter_snapshot`)."""
        return [self._unit_mismatches, self._invalid_steps]

    def check_values(self, known: Optional[Mapping[Any, int]] = None) -> None:
        """Raises (eagerly, between compiled calls) if a compiled step met a clip or noise value
        that is not a finite number >= 0 (e.g. a ``tf.Variable`` clip set to inf), or ran under
        another unit of privacy than it was traced for (:meth:`unit_as_traced`): such steps
        recorded and released nothing. ``known``: as :func:`read_int`'s."""
        mismatched = read_int(self._unit_mismatches, known)
        if mismatched > self._mismatches_reported:
            self._mismatches_reported = mismatched
            traced = _describe_unit(*(int(v) for v in self._mismatched_trace.numpy()))
            raise ValueError(
                f"{mismatched} traced DP step(s) ran under a sampling of another unit of privacy "
                f"than the one they were traced for ({traced}; declared now: "
                f"{_describe_unit(*self._declared_unit)}): those steps recorded and applied "
                f"nothing. {UNIT_MISMATCH_ADVICE}"
            )
        bad = read_int(self._invalid_steps, known)
        if bad > self._invalid_reported:
            self._invalid_reported = bad
            raise ValueError(
                f"{bad} compiled DP step(s) met a clip (l2_norm_clip) or noise stddev that is not "
                "a finite number >= 0 in float32 (e.g. a tf.Variable clip set to inf or NaN): "
                "those steps recorded and released nothing. Set the clip and noise to finite "
                "values >= 0"
            )

    def get_noised_result(self, sample_state: Any, global_state: Any):
        """The wrapped query's noised result; records the sample and its sum queries.

        Inside an XLA-compiled step whose ledger has no room left, nothing is recorded and the
        result is all zeros (nothing about the data is released); the next ``ledger.flush()``
        raises. The DP optimizers withhold such a step's update altogether.
        """
        specs = self._query.sum_query_specs(global_state)
        checks = _check_specs(specs)
        room = self._ledger.has_room(len(specs))
        same_unit = self.unit_as_traced()
        if same_unit is not None:
            checks += self.unit_checks(same_unit)
            room = tf.logical_and(room, same_unit)
        result, new_state = self._query.get_noised_result(sample_state, global_state)
        # the values of the step (read before the result: an adaptive query updates its clip
        # there), with the grid of a grid-mode query, known once it has seen the sum's size
        later = self._query.sum_query_specs(global_state)
        specs = [
            s._replace(noise_grid=t.noise_grid, grid_sensitivity=t.grid_sensitivity)
            if t.noise_grid is not None else s
            for s, t in zip(specs, later)
        ]
        # Record only once the result exists (and the run-time clip and noise values passed their
        # checks): a step that fails, or a call that meets the end of its data before the step
        # runs, leaves the ledger unchanged. Every recording op, the sum queries' included,
        # depends on the result.
        with tf.control_dependencies(tf.nest.flatten(result) + checks):
            # the ledger's first draw always starts a pass
            pass_start = tf.logical_and(
                tf.logical_or(
                    tf.equal(self._pass_start.read_value(), 1),
                    tf.equal(self._ledger.recorded_samples(), 0),
                ),
                tf.reduce_any(tf.equal(self._policy.read_value(),
                                       [policy_code(p) for p in PASS_POLICIES])),
            )
            values = self._event_values(specs)
            keep = None
            if _fixed_shape_context():  # no assertion stops a compiled step: mask its record
                keep = _valid_values([(v[0], v[1]) for v in values])
                self._invalid_steps.assign_add(tf.cast(tf.logical_not(keep), tf.int64))
                if same_unit is not None:
                    keep = tf.logical_and(keep, same_unit)
                room = tf.logical_and(room, keep)
            if same_unit is not None:  # (outside XLA the assertion above failed the step first)
                self._count_mismatch(same_unit)
            index = self._ledger.record_sampling(
                self._population_size, self._selection_probability, self._policy, pass_start,
                keep=keep, origin=self._origin, unit=self._unit,
                records_per_unit=self._records_per_unit,
                max_batch_size=self._max_batch_size,
            )
            with tf.control_dependencies([index]):
                recorded = [
                    self._ledger.record_sum_query(sens, std, mech, jl, seed, noise_grid=grid,
                                                  keep=keep)
                    for sens, std, mech, jl, seed, grid in values
                ]
                with tf.control_dependencies(recorded):
                    # a step that recorded nothing leaves the pass mark for the next one
                    self._pass_start.assign(
                        0 if keep is None else tf.where(keep, 0, self._pass_start.read_value()))
        if _fixed_shape_context():  # what step_released() reads after this step
            self._released.assign(tf.cast(room, tf.int32))
        if not (isinstance(room, tf.Tensor) and tf.get_static_value(room) is True):
            if _fixed_shape_context():
                result = tf.nest.map_structure(lambda t: _where(room, t), result)
            else:
                # Outside XLA `room` is the unit check alone (the ledger grows), and `checks`
                # assert it: a step under another unit fails before the result exists, so the
                # result depends on them instead of being masked (a select and a zero fill over
                # every gradient).
                with tf.control_dependencies(checks):
                    result = tf.nest.map_structure(tf.identity, result, expand_composites=True)
            # nor does the query's state move on a step that released nothing
            new_state = _state_unless(room, new_state, global_state)
        return result, new_state

    def unit_checks(self, same_unit: Optional[tf.Tensor] = None) -> list[Any]:
        """In a graph outside XLA: an assertion that fails the step when it runs under another
        unit of privacy than it was traced for (:meth:`unit_as_traced`); the step's recording and
        update depend on it. Eagerly and under XLA: none (there the step is masked and counted)."""
        if same_unit is None:
            same_unit = self.unit_as_traced()
        if same_unit is None or in_xla_context():
            return []
        traced = _describe_unit(*self._declared_unit)
        return [tf.debugging.Assert(same_unit, [
            (f"tf_dp: this DP step was traced for {traced}, but the sampling declared now is of "
             "another unit of privacy (unit code 0 example / 1 user, records_per_unit):"),
            self._unit.read_value(), self._records_per_unit.read_value(),
            f"; nothing was recorded or applied. {UNIT_MISMATCH_ADVICE}",
        ])]

    def _count_mismatch(self, same_unit: tf.Tensor) -> None:
        """Counts a step that ran under another unit than traced (read by check_values)."""
        other = tf.logical_not(same_unit)
        self._unit_mismatches.assign_add(tf.cast(other, tf.int64))
        self._mismatched_trace.assign(
            tf.where(other, tf.constant(self._declared_unit, tf.int32),
                     self._mismatched_trace.read_value()))


#: What to do when a traced step meets a sampling of another unit of privacy.
UNIT_MISMATCH_ADVICE = (
    "A traced step clips with the unit of privacy (example or user, and records_per_unit) "
    "declared when it was traced: after changing it, build a new tf.function around the DP "
    "step (tf_dp.keras.DPTrainStep, optimizer.dp_step or the engine's step) and call that; "
    "fit and train_on_batch retrace by themselves"
)


def _describe_unit(unit: int, records_per_unit: int) -> str:
    """``(unit code, k)`` in words: ``user-level clipping (unit='user', records_per_unit=4)``."""
    if PRIVACY_UNITS[unit] == "user":
        return f"user-level clipping (unit='user', records_per_unit={records_per_unit})"
    return "example-level clipping (unit='example')"


def _state_unless(keep: tf.Tensor, new: Any, old: Any) -> Any:
    """The new global state where ``keep``, else the old one (tensor leaves of one dtype)."""
    tensors = (tf.Tensor, tf.Variable)

    def pick(n, o):
        if n is not o and isinstance(n, tensors) and isinstance(o, tensors) and n.dtype == o.dtype:
            return tf.where(keep, n, tf.convert_to_tensor(o))
        return n
    try:
        return tf.nest.map_structure(pick, new, old)
    except (TypeError, ValueError):  # a state whose structure changes: left as it is
        return new


def _plus_grid(sens: Any, spec: SumQuerySpec) -> Any:
    """The recorded sensitivity: ``sens`` plus the grid's rounding term (float64, rounded up)."""
    extra = getattr(spec, "grid_sensitivity", None)
    if extra is None:
        return sens
    total = tf.cast(sens, tf.float64) + tf.cast(extra, tf.float64)
    return tf.math.nextafter(total, tf.constant(float("inf"), tf.float64))


def _valid_values(pairs: list[tuple[Any, Any]]) -> tf.Tensor:
    """Whether every (sensitivity, stddev) pair is finite and >= 0 in float32 (a bool tensor)."""
    ok = tf.constant(True)
    for sens, std in pairs:
        for v in (sens, std):
            t = tf.cast(v, tf.float32)
            ok = tf.logical_and(ok, tf.reduce_all(tf.math.is_finite(t) & (t >= 0)))
    return ok


def _refuse_tree_with_jl(jl: Any) -> list[Any]:
    """Tree aggregation with JL clipping (estimated norms) has no privacy analysis: raises
    eagerly, or returns an assertion op that fails the step in a graph."""
    message = ("tree aggregation (TreeCumulativeSumQuery / TreeResidualSumQuery) cannot be used "
               "with gradient_mode='jl': no accountant analyses tree aggregation with JL clipping; "
               "use an exact gradient mode")
    if tf.executing_eagerly() or isinstance(jl, int):
        if int(jl) > 0:
            raise ValueError(message)
        return []
    return [tf.debugging.assert_equal(jl, tf.zeros_like(jl), message=message)]


def _where(keep: tf.Tensor, t: Any) -> Any:
    if isinstance(t, tf.IndexedSlices):
        return tf.IndexedSlices(tf.where(keep, t.values, tf.zeros_like(t.values)), t.indices,
                                t.dense_shape)
    return tf.where(keep, t, tf.zeros_like(t))


def _check_specs(specs: list[SumQuerySpec]) -> list[Any]:
    """Checks the run-time clip and noise values (a tensor clip may have been set to a bad value).

    Eagerly: raises ValueError naming the value. In a graph: returns one check that fails the
    step (``InvalidArgumentError`` naming the first bad value) before anything is recorded; the
    message is built only in the conditional's failing branch, so a good step runs no string ops.
    Under XLA: nothing (an assertion does not stop a compiled step;
    :meth:`QueryWithLedger.has_room` masks it).
    """
    if in_xla_context():
        return []  # no assertion stops a compiled step: has_room() withholds its release
    labels: list[str] = []
    values: list[Any] = []
    for i, spec in enumerate(specs):
        for name, value in (
            ("l2_sensitivity (the clip)", spec.l2_sensitivity),
            ("noise_stddev", spec.noise_stddev),
        ):
            label = f"sum query {i}: {name} must be a finite number >= 0"
            if tf.executing_eagerly():
                v = float(tf.convert_to_tensor(value).numpy())
                if not (v >= 0 and v != float("inf")):
                    raise ValueError(f"{label}, got {v} at run time")
            else:
                labels.append(label)
                values.append(tf.reshape(tf.cast(value, tf.float32), []))  # a scalar per value
    if not values:
        return []
    values = tf.stack(values)
    good = tf.logical_and(tf.math.is_finite(values), values >= 0)
    ok = tf.reduce_all(good)

    def fail():
        first_bad = tf.argmin(tf.cast(good, tf.int32))  # the first False
        message = tf.strings.join([tf.gather(tf.constant(labels), first_bad), ", got ",
                                   tf.strings.as_string(tf.gather(values, first_bad))])
        with tf.control_dependencies([tf.debugging.Assert(ok, [message])]):
            return tf.constant(False)

    return [tf.cond(ok, lambda: tf.constant(True), fail)]
