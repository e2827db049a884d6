"""DP Keras optimizers: a Keras 3 optimizer that aggregates per-example gradients privately.

Keras 3 trainers hand optimizers batch-averaged gradients, too late for per-example clipping. So
the per-example work happens in the DP model's ``train_step`` (``make_private`` / ``DPSequential``
/ ``DPModel``) and the DP optimizer carries the privacy configuration: the DP query (clip and
noise), the :class:`~tf_dp.PrivacyLedger`, the gradient mode, and the aggregation step
(:meth:`DPOptimizerMixin.dp_aggregate`: noise through the query, record in the ledger, normalise).
A DP optimizer handed ordinary gradients (a model that was not made private) raises instead of
training without privacy.

Example::

    model = tf_dp.keras.make_private(model)
    model.compile(
        optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.15),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x, y, batch_size=256, epochs=3)
    model.optimizer.ledger.save("ledger.json")
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.gaussian_query import GaussianGlobalState, GaussianSumQuery
from tf_dp.dp_query.noise import DEFAULT_NOISE_MODE, check_noise_mode
from tf_dp.dp_query.normalized_query import NormalizedQuery
from tf_dp.dp_query.serialization import deserialize_query, serialize_query
from tf_dp.dp_query.xla import in_xla_context
from tf_dp.data.sampling import Sampling
from tf_dp.gradients import ClippedGradients, GradientStrategy, gradient_modes, make_strategy
from tf_dp.gradients.physical_batches import PhysicalBatches, check_max_physical_batch_size
from tf_dp.gradients.jl import METHODS as JL_METHODS
from tf_dp.keras import ledger_store
from tf_dp.ledger.privacy_ledger import PrivacyLedger
from tf_dp.ledger.query_with_ledger import QueryWithLedger

_logger = logging.getLogger("tf_dp")


class DPOptimizerMixin:
    """Privacy configuration and private aggregation shared by every DP optimizer class."""

    _tf_dp_optimizer = True

    def _init_dp(
        self,
        l2_norm_clip: Optional[float],
        noise_multiplier: Optional[float],
        num_microbatches: Optional[int],
        gradient_mode: str,
        jl_projections: Optional[int],
        dp_sum_query: Optional[DPQuery],
        noise_seed: Optional[int],
        jl_method: str = "auto",
        noise_stddev: Any = None,
        max_physical_batch_size: Optional[int] = None,
        noise_mode: Optional[str] = None,
    ) -> None:
        if noise_mode is not None:
            check_noise_mode(noise_mode)
            if dp_sum_query is not None:
                raise ValueError(
                    "noise_mode applies to the query the optimizer builds from l2_norm_clip; "
                    "with dp_sum_query, pass noise_mode to the query instead"
                )
        mode = DEFAULT_NOISE_MODE if noise_mode is None else noise_mode
        self._dp_schedules: Optional[tuple[tf.Variable, tf.Variable]] = None
        l2_norm_clip, noise_multiplier, noise_stddev = (
            _python_number(v) for v in (l2_norm_clip, noise_multiplier, noise_stddev)
        )
        if dp_sum_query is None:
            if l2_norm_clip is None:
                raise ValueError(
                    "pass l2_norm_clip (a finite number > 0 or a schedule) with exactly one of "
                    "noise_multiplier and noise_stddev, or an explicit dp_sum_query"
                )
            if noise_multiplier is None and noise_stddev is None:
                raise ValueError(
                    "pass exactly one of noise_multiplier (noise stddev relative to the clip: "
                    "noise_multiplier * l2_norm_clip) and noise_stddev (absolute noise stddev); "
                    "got neither"
                )
            if noise_multiplier is not None and noise_stddev is not None:
                raise ValueError(
                    "pass exactly one of noise_multiplier (noise stddev relative to the clip: "
                    "noise_multiplier * l2_norm_clip) and noise_stddev (absolute noise stddev), "
                    "not both"
                )
            noise_name = "noise_multiplier" if noise_stddev is None else "noise_stddev"
            noise = noise_multiplier if noise_stddev is None else noise_stddev
            if _is_schedule(l2_norm_clip) or _is_schedule(noise):
                _check_schedule_arg("l2_norm_clip", l2_norm_clip, positive=True)
                _check_schedule_arg(noise_name, noise, positive=False)
                # Evaluated now at step 0: a schedule that fails or is out of range fails here
                clip0, z0, std0 = _schedule_tensors(
                    l2_norm_clip, noise_multiplier, noise_stddev, tf.constant(0, tf.int64)
                )
                _raise_if_invalid(noise_name, 0, clip0, z0, std0)
                with tf.init_scope():
                    clip_var, std_var = (
                        tf.Variable(
                            tf.constant(v, tf.float32), trainable=False, name=name,
                            synchronization=tf.VariableSynchronization.ON_WRITE,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                        )
                        for v, name in ((clip0, "dp_l2_norm_clip"), (std0, "dp_noise_stddev"))
                    )
                self._dp_schedules = (clip_var, std_var)
                query: DPQuery = GaussianSumQuery(
                    clip_var, std_var, seed=noise_seed, noise_mode=mode
                )
            else:
                _check_number("l2_norm_clip", l2_norm_clip, positive=True)
                _check_number(noise_name, noise, positive=False)
                stddev = (
                    float(noise_multiplier) * float(l2_norm_clip)
                    if noise_stddev is None else float(noise_stddev)
                )
                _check_float32("l2_norm_clip", float(l2_norm_clip))
                _check_float32(noise_name, float(noise))
                if noise_stddev is None:
                    _check_float32("noise_multiplier * l2_norm_clip (the noise stddev)", stddev)
                query = GaussianSumQuery(l2_norm_clip, stddev, seed=noise_seed, noise_mode=mode)
        else:
            if l2_norm_clip is not None or noise_multiplier is not None or (
                noise_stddev is not None
            ):
                raise ValueError(
                    "pass either dp_sum_query or (l2_norm_clip, noise_multiplier or "
                    "noise_stddev), not both"
                )
            if not isinstance(dp_sum_query, DPQuery):
                raise TypeError(
                    f"dp_sum_query must be a tf_dp DPQuery, got {type(dp_sum_query).__name__}"
                )
            if isinstance(dp_sum_query, QueryWithLedger):
                raise TypeError(
                    "pass the bare query as dp_sum_query; the optimizer wraps it with its own "
                    "ledger (available as optimizer.ledger)"
                )
            from tf_dp.dp_query.tree_aggregation import TreeCumulativeSumQuery

            if isinstance(dp_sum_query, TreeCumulativeSumQuery):
                raise TypeError(
                    "a tree-aggregation query must carry its tree from step to step, which "
                    f"{type(self).__name__} does not do: use tf_dp.keras.DPKerasFTRLOptimizer "
                    "(DP-FTRL: SGD or momentum on a TreeResidualSumQuery)"
                )
            query = dp_sum_query
        if num_microbatches is not None and (
            isinstance(num_microbatches, bool)
            or not isinstance(num_microbatches, int)
            or num_microbatches < 1
        ):
            raise ValueError(
                f"num_microbatches must be None or an integer >= 1, got {num_microbatches!r}"
            )
        modes = gradient_modes()
        if gradient_mode not in modes:
            raise ValueError(f"gradient_mode must be one of {modes}, got {gradient_mode!r}")
        if gradient_mode == "microbatch" and num_microbatches is None:
            raise ValueError("gradient_mode='microbatch' needs num_microbatches (an integer >= 1)")
        if num_microbatches is not None and gradient_mode not in ("microbatch", "auto"):
            raise ValueError(
                f"num_microbatches is only used with gradient_mode='microbatch' or 'auto', "
                f"got gradient_mode={gradient_mode!r}"
            )
        if gradient_mode == "jl":
            if (
                isinstance(jl_projections, bool)
                or not isinstance(jl_projections, int)
                or jl_projections < 1
            ):
                raise ValueError(
                    "gradient_mode='jl' needs jl_projections, an integer >= 1 "
                    f"(got {jl_projections!r})"
                )
            if jl_method not in JL_METHODS:
                raise ValueError(f"jl_method must be one of {JL_METHODS}, got {jl_method!r}")
        elif jl_projections is not None:
            raise ValueError("jl_projections is only used with gradient_mode='jl'")
        elif jl_method != "auto":
            raise ValueError("jl_method is only used with gradient_mode='jl'")
        self._l2_norm_clip = _number_or_schedule(l2_norm_clip)
        self._noise_multiplier = _number_or_schedule(noise_multiplier)
        self._noise_stddev = _number_or_schedule(noise_stddev)
        max_physical_batch_size = check_max_physical_batch_size(max_physical_batch_size)
        if max_physical_batch_size is not None and (
            num_microbatches is not None or gradient_mode in ("microbatch", "jl")
        ):
            raise ValueError(
                "max_physical_batch_size splits a batch of per-example gradients; it cannot be "
                f"combined with gradient_mode={gradient_mode!r} / num_microbatches="
                f"{num_microbatches!r} (use 'auto', 'vectorized' or 'ghost' without microbatches)"
            )
        self._max_physical_batch_size = max_physical_batch_size
        self._num_microbatches = num_microbatches
        self._gradient_mode = gradient_mode
        self._jl_projections = jl_projections
        self._jl_method = jl_method
        self._custom_query = dp_sum_query is not None
        self._normalized = isinstance(query, NormalizedQuery)
        self._ledger = PrivacyLedger(name=f"{self.name}_ledger")
        self._dp_query = QueryWithLedger(query, self._ledger)
        self._dp_global_state = query.initial_global_state()
        self._sampling_configured = False
        self._sampling_from_fit = False
        self._noise_seed = noise_seed
        self._noise_mode = noise_mode
        self._grid_noise = _snaps_to_grid(query)
        self._strategy: Optional[GradientStrategy] = None
        self._dp_applying = False
        with tf.init_scope():
            # DP steps whose update was withheld because it was not finite (still recorded).
            self._dp_skipped_steps = tf.Variable(
                tf.constant(0, tf.int64), trainable=False, name="dp_skipped_steps",
                synchronization=tf.VariableSynchronization.ON_WRITE,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
        self._skipped_reported = 0
        self._inherited_unrecorded = 0  # steps a previous optimizer applied but did not record

    # -- configuration --------------------------------------------------------------------------

    @property
    def ledger(self) -> PrivacyLedger:
        """The :class:`~tf_dp.PrivacyLedger` this optimizer records every DP step in."""
        return self._ledger

    @property
    def dp_query(self) -> QueryWithLedger:
        return self._dp_query

    @property
    def gradient_mode(self) -> str:
        return self._gradient_mode

    @property
    def noise_multiplier(self) -> Any:
        """The ``noise_multiplier`` given (a number or a schedule), or None."""
        return self._noise_multiplier

    @property
    def noise_stddev(self) -> Any:
        """The absolute ``noise_stddev`` given (a number or a schedule), or None."""
        return self._noise_stddev

    @property
    def l2_norm_clip(self) -> Any:
        """The ``l2_norm_clip`` given (a number or a schedule), or None (explicit query)."""
        return self._l2_norm_clip

    @property
    def has_dp_schedules(self) -> bool:
        """True when the clip or the noise is a schedule (values set at every step)."""
        return self._dp_schedules is not None

    def dp_values_at(self, step: int) -> tuple[float, float]:
        """``(clip, noise stddev)`` that the step numbered ``step`` (``optimizer.iterations`` when
        it runs) uses, as float32 values, computed eagerly. Raises ValueError naming the argument
        when a schedule gives a value out of range; TypeError when it cannot be evaluated."""
        if self._custom_query:
            raise ValueError("the optimizer was built from an explicit dp_sum_query")
        clip, noise, std = _schedule_tensors(
            self._l2_norm_clip, self._noise_multiplier, self._noise_stddev,
            tf.constant(int(step), tf.int64),
        )
        _raise_if_invalid(self._noise_name(), int(step), clip, noise, std)
        return float(clip.numpy()), float(std.numpy())

    def _noise_name(self) -> str:
        return "noise_multiplier" if self._noise_stddev is None else "noise_stddev"

    def update_dp_schedules(self) -> None:
        """Sets the query's clip and noise stddev to the schedules' values at this step.

        Called by the DP train step before clipping (so clipping, noise and the ledger all use
        the step's values); the step is ``self.iterations``, as for Keras learning-rate schedules.
        Graph- and XLA-safe: the values are computed with TensorFlow ops and assigned to the
        query's variables. A value out of range raises ValueError (eager) or fails the step with
        ``InvalidArgumentError`` before anything is recorded (graph); under XLA, where assertions
        do not run, the step gets NaN values instead, so its update is withheld and the ledger
        cannot be analysed (Keras ``fit`` checks the values eagerly before each compiled call,
        see :meth:`check_dp_schedules`). Does nothing without schedules.
        """
        if self._dp_schedules is None:
            return
        clip_var, std_var = self._dp_schedules
        step = tf.cast(tf.convert_to_tensor(self.iterations), tf.int64)  # type: ignore[attr-defined]
        clip, noise, std = _schedule_tensors(
            self._l2_norm_clip, self._noise_multiplier, self._noise_stddev, step
        )
        if tf.executing_eagerly():
            _raise_if_invalid(self._noise_name(), int(step.numpy()), clip, noise, std)
            clip_var.assign(clip)
            std_var.assign(std)
            return
        ok = _valid(clip, noise, std)
        checks = []
        if not in_xla_context():
            checks.append(tf.debugging.Assert(ok, [
                f"tf_dp: a clip or noise schedule gave a value out of range (l2_norm_clip must be "
                f"a finite number > 0, {self._noise_name()} a finite number >= 0) at step", step,
                "l2_norm_clip:", clip, f"{self._noise_name()}:", noise,
            ]))
        with tf.control_dependencies(checks):
            nan = tf.constant(float("nan"), tf.float32)
            clip_var.assign(tf.where(ok, clip, nan))
            std_var.assign(tf.where(ok, std, nan))

    def check_dp_schedules(self, steps: int = 1) -> None:
        """Eagerly checks the schedules' values for the next ``steps`` steps (raises ValueError
        naming the argument and the step). ``fit`` calls it before every compiled call, so that
        a bad value fails before anything runs or is recorded, also under XLA."""
        if self._dp_schedules is None:
            return
        first = int(self.iterations.numpy())  # type: ignore[attr-defined]
        for step in range(first, first + max(1, int(steps))):
            self.dp_values_at(step)

    @property
    def max_physical_batch_size(self) -> Optional[int]:
        """Examples clipped at once (``None``: the whole sampled batch)."""
        return self._max_physical_batch_size

    @property
    def num_microbatches(self) -> Optional[int]:
        return self._num_microbatches

    @property
    def gradient_strategy(self) -> Optional[GradientStrategy]:
        """The strategy in use (resolved from ``gradient_mode`` on the first training step)."""
        return self._strategy

    def set_sampling(
        self,
        population_size: Any,
        selection_probability: Optional[float] = None,
        sampling_policy: str = "poisson",
    ) -> None:
        """Declares how batches are drawn (recorded in the ledger from the next step on).

        ``model.fit`` of a private model sets this itself for in-memory arrays (``shuffle``) and
        for :func:`tf_dp.data.poisson_batches` (``poisson``, example- or user-level); call it
        yourself for other inputs. ``population_size`` may be a :class:`tf_dp.data.Sampling`
        (e.g. ``Sampling(n_users, q, unit="user", records_per_unit=k)``). A sampling declared
        here is recorded as ``declared`` (tf_dp cannot check it), whatever its ``origin`` says.

        Example::

            opt.set_sampling(60000, 256 / 60000, "poisson")
        """
        from_fit = getattr(self, "_declaring_from_fit", False)
        origin = "sampled" if from_fit else "declared"
        self._set_sampling(population_size, selection_probability, sampling_policy, origin)
        self._sampling_configured = True
        self._sampling_from_fit = from_fit

    def _set_sampling(self, population_size, selection_probability, sampling_policy, origin):
        if isinstance(population_size, Sampling):
            self._dp_query.set_sampling(dataclasses.replace(population_size, origin=origin))
        else:  # the query validates and names a bad argument
            self._dp_query.set_sampling(
                population_size, selection_probability, sampling_policy, origin=origin
            )
        self._records_per_user = self._dp_query.records_per_user

    @property
    def records_per_user(self) -> Optional[int]:
        """``k`` when the sampling in force is user-level (each user's records clipped
        together), else None."""
        return getattr(self, "_records_per_user", None)

    def start_pass(self) -> None:
        """Marks the next DP step as the first of a new pass over the data (eager).

        ``fit`` calls it at the start of every epoch and ``train_on_batch`` before every call,
        so the ledger records where each pass (each new shuffle of the data) starts, and the
        ``shuffle`` accounting counts one epoch per pass window from there. Call it yourself in
        a custom training loop wherever your loop starts a new pass over its data.
        """
        self._dp_query.start_pass()

    def _declare_fit_sampling(
        self, population_size: Any, selection_probability: Optional[float] = None,
        sampling_policy: str = "poisson",
    ) -> None:
        """A sampling ``fit`` derived from its own input (tf_dp drew or batched the data itself,
        so it is recorded as ``sampled``): valid for that ``fit`` only."""
        self._declaring_from_fit = True
        try:  # through set_sampling, so that subclasses' checks (DP-FTRL's policy) apply
            self.set_sampling(population_size, selection_probability, sampling_policy)
        finally:
            self._declaring_from_fit = False

    def _end_fit(self) -> None:
        """Called when a ``fit`` returns: forgets the sampling that ``fit`` derived from its input
        (a later ``fit`` on another input must declare its own) and reports withheld steps."""
        if self._sampling_from_fit:
            self._sampling_configured = False
            self._sampling_from_fit = False
        self.after_compiled_call()

    def after_compiled_call(self) -> None:
        """Flushes the ledger's staging table and logs DP steps withheld as non-finite (eager);
        raises if a compiled step met a non-finite clip or noise (it recorded nothing)."""
        self._ledger.flush()
        self._dp_query.check_values()
        skipped = int(self._dp_skipped_steps.numpy())
        if skipped > self._skipped_reported:
            _logger.warning(
                "tf_dp: %d DP step(s) so far produced a non-finite update; their updates were "
                "withheld (nothing applied) and the steps were still recorded in the ledger",
                skipped,
            )
            self._skipped_reported = skipped

    @property
    def skipped_steps(self) -> int:
        """DP steps whose noised update was not finite: withheld, but recorded in the ledger."""
        return int(self._dp_skipped_steps.numpy())

    @property
    def noise_seed(self) -> Optional[int]:
        """The explicit noise seed (tests and debugging; it voids the guarantee), or None."""
        return self._noise_seed

    def next_sample_entry(self, steps_ahead: int = 0):
        """The :class:`~tf_dp.ledger.events.SampleEntry` the next DP step will record.

        Computed from the declared sampling, the query's clip and noise and the current
        sensitivity multiplier. Before the first step of a microbatched run the multiplier is not
        known yet (it depends on the microbatch size); it is then taken as 2, the worst case.
        With clip or noise schedules, the clip and noise are the schedules' values at the next
        step (``iterations``), or ``steps_ahead`` steps after it.
        Used by :class:`tf_dp.keras.PrivacyBudget` to stop before a step that would overspend.
        """
        multiplier = None
        if self._num_microbatches is not None and self._ledger.num_samples == 0:
            multiplier = 2.0
        # JL steps are a different mechanism: known from the mode before the first step sets it
        jl = None
        if self._strategy is not None:
            jl = int(getattr(self._strategy, "jl_projections", None) or 0)
        elif self._gradient_mode == "jl":
            jl = int(self._jl_projections)
        state = self._dp_global_state
        if self._dp_schedules is not None:
            step = int(self.iterations.numpy()) + int(steps_ahead)  # type: ignore[attr-defined]
            state = GaussianGlobalState(*self.dp_values_at(step))
        return self._dp_query.next_sample_entry(state, multiplier, jl)

    @property
    def sampling_configured(self) -> bool:
        return self._sampling_configured

    def strategy_for(self, model: Any) -> GradientStrategy:
        """Resolves (once) the gradient strategy for ``model``; logs the choice."""
        if self._strategy is None:
            options = {}
            if self._jl_projections is not None:
                options["jl_projections"] = self._jl_projections
                options["jl_method"] = self._jl_method
            strategy = make_strategy(
                self._gradient_mode, model=model, num_microbatches=self._num_microbatches, **options
            )
            if self._max_physical_batch_size is not None:
                strategy = PhysicalBatches(strategy, self._max_physical_batch_size)
            reason = strategy.supports(model)
            if reason is not None:
                raise ValueError(
                    f"gradient_mode={self._gradient_mode!r} cannot train this model: {reason}"
                )
            if not strategy.exact or strategy.name in ("ghost", "jl"):
                if not self._dp_query.supports_norm_clipping:
                    raise TypeError(
                        f"gradient strategy {strategy.name!r} needs a query with a norm-based "
                        f"clipping rule; {type(self._dp_query.query).__name__} has none"
                    )
            self._strategy = strategy
            _logger.info(
                "tf_dp: gradient_mode=%r uses the %r strategy", self._gradient_mode, strategy.name
            )
        return self._strategy

    # -- the private aggregation -----------------------------------------------------------------

    def dp_aggregate(self, clipped: ClippedGradients) -> list[tf.Tensor]:
        """Noises the clipped sum through the query (recording the step in the ledger) and
        normalises it to an average gradient.

        The denominator is public: with microbatches, the number of microbatches ``M`` (under
        any sampling); otherwise the expected batch size ``q * n`` under Poisson sampling and the
        number of examples of the batch for shuffled batches; and 1 when the query is a
        ``NormalizedQuery`` (it divides by its own denominator).
        """
        q = self._dp_query
        q.sensitivity_multiplier.assign(tf.cast(clipped.sensitivity_multiplier, tf.float32))
        q._jl_projections.assign(int(clipped.jl_projections))
        after = clipped.noise_after_sum and not tf.executing_eagerly()
        # A query whose sample state holds more than the clipped sum (adaptive clipping's count
        # of unclipped records) completes it from the per-record norms; others return it as is.
        state = q.accumulate_norms(
            q.derive_sample_params(self._dp_global_state),
            clipped.clipped_sum,
            clipped.norms,
            getattr(clipped, "record_mask", None),
        )
        replicas = _replicas_in_sync()
        grid_replicas = replicas > 1 and self._grid_noise
        if grid_replicas:
            # Grid noise is snapped with the sum it is added to: noise the global clipped sum
            # (every replica reduces first, then releases the same value; replica 0's is kept).
            state = _all_reduce_sum(state)
        with tf.control_dependencies(
            tf.nest.flatten(clipped.clipped_sum, expand_composites=True) if after else []
        ):
            noised, _ = q.get_noised_result(state, self._dp_global_state)
        records = tf.cast(clipped.num_records, tf.float32)
        if replicas > 1:
            others = tf.nest.map_structure(
                lambda t: tf.zeros_like(tf.convert_to_tensor(t)), noised
            ) if grid_replicas else clipped.clipped_sum
            noised, records = _all_reduce_with_one_noise(others, noised, records)
        if self._normalized:
            return _share(list(noised), replicas)
        if self._num_microbatches is not None and self._strategy is not None and (
            self._strategy.name == "microbatch"
        ) and self.records_per_user is None:
            denominator = records
        else:
            expected = tf.cast(q._population_size, tf.float32) * tf.cast(
                q._selection_probability, tf.float32
            )
            denominator = tf.where(tf.equal(q._policy, 0), expected, records)
        denominator = tf.maximum(denominator, 1e-12)
        return _share(
            [
                tf.IndexedSlices(
                    g.values / tf.cast(denominator, g.values.dtype), g.indices, g.dense_shape
                )
                if isinstance(g, tf.IndexedSlices)
                else g / tf.cast(denominator, g.dtype)
                for g in noised
            ],
            replicas,
        )

    def apply_dp_gradients(self, grads, trainable_variables) -> None:
        """Applies gradients produced by :meth:`dp_aggregate` (the only way in).

        The update is withheld (nothing applied, ``iterations`` unchanged) when it is not finite
        (the step is still in the ledger: a conservative record) or when the ledger had no room
        to record the step inside a compiled call (nothing released, nothing recorded; the next
        flush raises). Non-finite steps are counted in :attr:`skipped_steps` and logged.
        """
        if not self.built:  # build outside the conditional update below
            self.build(trainable_variables)  # type: ignore[attr-defined]
        room = self._dp_query.has_room(self._dp_global_state)
        finite = tf.reduce_all(
            tf.stack(
                [
                    tf.reduce_all(tf.math.is_finite(
                        g.values if isinstance(g, tf.IndexedSlices) else g
                    ))
                    for g in grads
                    if g is not None
                ]
            )
        )

        def update():
            self._dp_applying = True
            try:
                super(DPOptimizerMixin, self).apply(grads, trainable_variables)  # type: ignore[misc]
            finally:
                self._dp_applying = False
            return tf.constant(True)

        def withhold():
            self._dp_skipped_steps.assign_add(
                tf.where(room, tf.constant(1, tf.int64), tf.constant(0, tf.int64))
            )
            return tf.constant(False)

        ok = tf.logical_and(room, finite)
        if tf.executing_eagerly():
            update() if bool(ok) else withhold()
        elif _replicas_in_sync() > 1:
            # The update all-reduces across replicas, which cannot sit inside a conditional: a
            # withheld step applies zeros instead (nothing about the data; the base optimizer's
            # own state, e.g. momentum, still advances as for any step).
            self._dp_skipped_steps.assign_add(
                tf.cast(tf.logical_and(room, tf.logical_not(finite)), tf.int64)
            )
            grads = [
                tf.IndexedSlices(tf.where(ok, g.values, tf.zeros_like(g.values)), g.indices,
                                 g.dense_shape)
                if isinstance(g, tf.IndexedSlices) else tf.where(ok, g, tf.zeros_like(g))
                for g in grads
            ]
            update()
        else:
            tf.cond(ok, update, withhold)

    def apply(self, grads, trainable_variables=None):
        if not self._dp_applying:
            raise RuntimeError(
                f"{type(self).__name__} was handed batch-averaged gradients: the model was not "
                "made private, so per-example clipping and noise cannot happen. Wrap the model "
                "with tf_dp.keras.make_private(model) (or use tf_dp.keras.DPSequential / DPModel)."
            )
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

    # -- the ledger travels with the model ------------------------------------------------------

    def save_own_variables(self, store) -> None:
        """Saves the optimizer's variables and its ledger with its checksum (``.keras`` files,
        ``save_weights``, ``keras.callbacks.BackupAndRestore`` and ``ModelCheckpoint`` all go
        through here)."""
        super().save_own_variables(store)  # type: ignore[misc]
        ledger_store.write_ledger(store, *self._ledger.tables())

    def load_own_variables(self, store) -> None:
        """Restores the optimizer's variables and its ledger (see :meth:`restore_ledger_tables`).

        The ledger's checksum is checked first: a saved ledger that was corrupted or edited
        raises :class:`tf_dp.ledger.LedgerFileError` before anything is restored.
        """
        tables = ledger_store.read_ledger(store)
        if tables is not None:
            self.restore_ledger_tables(*tables)
        super().load_own_variables(ledger_store.without_ledger(store))  # type: ignore[misc]

    def restore_ledger_tables(self, samples: np.ndarray, queries: np.ndarray) -> None:
        """Restores a saved ledger (tables from ``ledger.tables()``), never losing steps.

        The restored ledger replaces the current one unless the current one already records more
        steps (e.g. older weights loaded into a model that trained on): the ledger never loses
        recorded steps on load, so it can over-count but never under-count.
        """
        if samples.shape[0] >= self._ledger.num_samples:
            self._ledger.load_tables(samples, queries)
        else:
            _logger.warning(
                "tf_dp: kept the optimizer's ledger (%d steps) rather than the saved one (%d "
                "steps): a ledger never forgets recorded steps on load",
                self._ledger.num_samples, samples.shape[0],
            )

    def inherit_ledger(self, previous: "DPOptimizerMixin") -> None:
        """Continues ``previous``'s ledger (a private model recompiled with a new DP optimizer)."""
        previous._ledger.flush()
        self._inherited_unrecorded = max(
            0,
            int(previous.iterations.numpy())  # type: ignore[attr-defined]
            + previous._inherited_unrecorded
            - previous._ledger.num_samples,
        )
        if previous._ledger.num_samples:
            self._ledger.restore_entries(previous._ledger.samples())
            _logger.info(
                "tf_dp: the new optimizer continues the model's ledger (%d recorded steps)",
                self._ledger.num_samples,
            )

    def check_ledger_covers_steps(self) -> None:
        """Raises if the optimizer applied more steps than its ledger records.

        That happens when a model was trained privately and then reloaded from a file that has
        no ledger, or its ledger was reset: continuing would print a budget that ignores the
        steps already taken.
        """
        applied = int(self.iterations.numpy()) + self._inherited_unrecorded  # type: ignore
        recorded = self._ledger.num_samples
        if applied > recorded:
            raise ValueError(
                f"this DP optimizer has applied {applied} steps but its ledger records only "
                f"{recorded}: the privacy already spent is unknown, so training cannot continue "
                "with a budget that ignores it. Restore the run's ledger "
                "(model.optimizer.ledger.restore_entries(tf_dp.ledger.read_ledger_file(path))), "
                "or, if those steps did not touch private data, compile the model with a new DP "
                "optimizer (a fresh optimizer starts at step 0)"
            )

    # -- serialisation -------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Keras config. With ``dp_sum_query``, the query's config (``serialize_query``: the
        Gaussian, automatic, adaptive, nested and normalized queries; an adaptive query's current
        clip included); NotImplementedError naming the query class for the others."""
        config = super().get_config()  # type: ignore[misc]
        if self._custom_query:
            config["dp_sum_query"] = serialize_query(self._dp_query.query)
        config.update(
            {
                "l2_norm_clip": _serialize_value(self._l2_norm_clip),
                "noise_multiplier": _serialize_value(self._noise_multiplier),
                "noise_stddev": _serialize_value(self._noise_stddev),
                "num_microbatches": self._num_microbatches,
                "gradient_mode": self._gradient_mode,
                "jl_projections": self._jl_projections,
                "jl_method": self._jl_method,
                "max_physical_batch_size": self._max_physical_batch_size,
                "noise_mode": self._noise_mode,
            }
        )
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None):
        """Rebuilds the optimizer; clip and noise schedules are deserialised like Keras's
        learning-rate schedules."""
        config = dict(config)
        if isinstance(config.get("dp_sum_query"), dict):
            config["dp_sum_query"] = deserialize_query(config["dp_sum_query"])
        for key in ("l2_norm_clip", "noise_multiplier", "noise_stddev"):
            if isinstance(config.get(key), dict):
                config[key] = keras.saving.deserialize_keras_object(
                    config[key], custom_objects=custom_objects
                )
        return super().from_config(config, custom_objects=custom_objects)  # type: ignore[misc]


def _replicas_in_sync() -> int:
    """Replicas of the current ``tf.distribute`` step (1 outside one)."""
    if not tf.distribute.has_strategy():
        return 1
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def _snaps_to_grid(query: Any) -> bool:
    """Whether any Gaussian sum query inside ``query`` uses grid-mode noise."""
    if getattr(query, "noise_mode", None) == "grid":
        return True
    inner = [getattr(query, "numerator_query", None)]
    if hasattr(query, "queries"):
        inner += tf.nest.flatten(query.queries)
    return any(q is not None and _snaps_to_grid(q) for q in inner)


def _all_reduce_sum(state: Any) -> Any:
    """The SUM over replicas of every leaf of ``state`` (dense)."""
    ctx = tf.distribute.get_replica_context()
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(state)]
    return tf.nest.pack_sequence_as(state, ctx.all_reduce(tf.distribute.ReduceOp.SUM, leaves))


def _all_reduce_with_one_noise(clipped_sum, noised, records):
    """Across replicas: the sum of every replica's clipped sum plus the noise of replica 0 only.

    Each replica noised its own clipped sum; replica 0 contributes its noised sum and the others
    their clipped sums, so one SUM all-reduce gives every replica the same global clipped sum
    with exactly one draw of noise (variance sigma^2 C^2, not k times that, and not k copies).
    In grid mode the replicas noised the global sum already and the others pass zeros, so the
    sum is replica 0's grid value exactly.
    The record counts are summed too (the global batch).
    """
    ctx = tf.distribute.get_replica_context()
    first = tf.equal(ctx.replica_id_in_sync_group, 0)

    def pick(n, c):
        if isinstance(n, tf.IndexedSlices):
            n, c = tf.convert_to_tensor(n), tf.convert_to_tensor(c)
        return tf.where(first, n, tf.cast(c, n.dtype))

    local = [pick(n, c) for n, c in zip(tf.nest.flatten(noised), tf.nest.flatten(clipped_sum))]
    total = ctx.all_reduce(tf.distribute.ReduceOp.SUM, local)
    return tf.nest.pack_sequence_as(noised, total), ctx.all_reduce(
        tf.distribute.ReduceOp.SUM, records
    )


def _share(grads: list, replicas: int) -> list:
    """Every replica holds the same global update; Keras's apply sums the replicas' gradients, so
    each passes ``1/replicas`` of it."""
    if replicas == 1:
        return grads
    return [g / tf.cast(replicas, g.dtype) for g in grads]


def _python_number(value: Any) -> Any:
    """A numpy scalar (``np.float32(1.0)``, ``np.int64(2)``, a 0-d array) as the Python number of
    the same value; anything else unchanged (checked by ``_check_number``)."""
    if isinstance(value, np.number) or (
        isinstance(value, np.ndarray) and value.ndim == 0 and np.issubdtype(value.dtype, np.number)
    ):
        return value.item()
    return value


def _check_number(name: str, value: Any, positive: bool) -> None:
    accepted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be {accepted}, got {type(value).__name__}")
    if math.isnan(value) or math.isinf(value) or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} must be {accepted}, got {value}")


_F32_MAX = float(np.finfo(np.float32).max)
_F32_TINY = float(np.finfo(np.float32).tiny)


def _check_float32(name: str, value: float) -> None:
    """The step computes in float32: a value it cannot represent (overflow to inf, or a positive
    value that rounds to 0 or loses its precision) is refused, naming the float32 range."""
    if value != 0 and not _F32_TINY <= value <= _F32_MAX:
        raise ValueError(
            f"{name} must be 0 or in [{_F32_TINY:.4g}, {_F32_MAX:.4g}] (the float32 range the "
            f"step computes in), got {value:g}"
        )


def _is_schedule(value: Any) -> bool:
    return callable(value) and not isinstance(value, type)


def _number_or_schedule(value: Any) -> Any:
    if value is None or _is_schedule(value):
        return value
    return float(value)


def _check_schedule_arg(name: str, value: Any, positive: bool) -> None:
    """A number in range, or a schedule (a callable ``step -> value``)."""
    if _is_schedule(value):
        return
    accepted = "a finite number > 0" if positive else "a finite number >= 0"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(
            f"{name} must be {accepted} or a schedule (a callable step -> value, e.g. a "
            f"keras.optimizers.schedules.LearningRateSchedule), got {type(value).__name__}"
        )
    _check_number(name, value, positive)


def _evaluate(name: str, value: Any, step: tf.Tensor) -> tf.Tensor:
    """A number or a schedule's value at ``step``, as a float32 scalar tensor."""
    if not _is_schedule(value):
        return tf.constant(float(value), tf.float32)
    try:
        out = tf.convert_to_tensor(value(step))
    except Exception as e:  # noqa: BLE001 -- name the argument, keep the cause
        raise TypeError(
            f"the {name} schedule {value!r} could not be evaluated at a step (it is called with "
            f"the step count, a scalar int64 tensor, and must use TensorFlow ops): {e}"
        ) from e
    if out.shape.rank not in (0, None):
        raise ValueError(f"the {name} schedule must return a scalar, got shape {out.shape}")
    if not (out.dtype.is_floating or out.dtype.is_integer):
        raise TypeError(f"the {name} schedule must return a number, got dtype {out.dtype.name}")
    return tf.reshape(tf.cast(out, tf.float32), [])


def _schedule_tensors(clip: Any, noise_multiplier: Any, noise_stddev: Any, step: tf.Tensor):
    """``(clip, noise argument, noise stddev)`` at ``step`` as float32 tensors; the stddev is
    ``noise_multiplier * clip`` or ``noise_stddev``."""
    c = _evaluate("l2_norm_clip", clip, step)
    if noise_stddev is None:
        noise = _evaluate("noise_multiplier", noise_multiplier, step)
        return c, noise, noise * c
    noise = _evaluate("noise_stddev", noise_stddev, step)
    return c, noise, noise


def _valid(clip: tf.Tensor, noise: tf.Tensor, std: tf.Tensor) -> tf.Tensor:
    finite = tf.logical_and(tf.math.is_finite(clip), tf.math.is_finite(noise))
    finite = tf.logical_and(finite, tf.math.is_finite(std))
    return tf.logical_and(finite, tf.logical_and(clip > 0, tf.logical_and(noise >= 0, std >= 0)))


def _raise_if_invalid(noise_name: str, step: int, clip, noise, std) -> None:
    c, z, s = float(clip.numpy()), float(noise.numpy()), float(std.numpy())
    if not (math.isfinite(c) and c > 0):
        raise ValueError(
            f"the l2_norm_clip schedule gave {c} at step {step}; the clip must be a finite "
            "number > 0"
        )
    if not (math.isfinite(z) and z >= 0):
        raise ValueError(
            f"the {noise_name} schedule gave {z} at step {step}; {noise_name} must be a finite "
            "number >= 0"
        )
    if not (math.isfinite(s) and s >= 0):
        raise ValueError(
            f"the noise stddev at step {step} ({noise_name} {z} x clip {c}) is {s}; it must be "
            "a finite number >= 0"
        )


def _serialize_value(value: Any) -> Any:
    """Numbers as they are; schedules as Keras serialises learning-rate schedules."""
    if value is None or not _is_schedule(value):
        return value
    return keras.saving.serialize_keras_object(value)


_CLASS_CACHE: dict[type, type] = {}


def make_dp_optimizer_class(optimizer_class: type) -> type:
    """Returns the DP version of a Keras 3 optimizer class.

    The returned class takes the base class's arguments plus ``l2_norm_clip``,
    ``noise_multiplier`` or ``noise_stddev`` (each a number or a schedule), ``num_microbatches=None``, ``gradient_mode="auto"``,
    ``max_physical_batch_size=None``,
    ``jl_projections=None``, ``dp_sum_query=None`` and ``noise_seed=None`` (tests only).

    Example::

        DPKerasRMSprop = tf_dp.keras.make_dp_optimizer_class(keras.optimizers.RMSprop)
        opt = DPKerasRMSprop(l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3)
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, keras.optimizers.Optimizer)):
        raise TypeError(
            f"optimizer_class must be a keras.optimizers.Optimizer subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, DPOptimizerMixin):
        raise TypeError(f"{optimizer_class.__name__} is already a DP optimizer")
    if optimizer_class in _CLASS_CACHE:
        return _CLASS_CACHE[optimizer_class]

    def __init__(
        self,
        *args: Any,
        l2_norm_clip: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        num_microbatches: Optional[int] = None,
        gradient_mode: str = "auto",
        jl_projections: Optional[int] = None,
        dp_sum_query: Optional[DPQuery] = None,
        noise_seed: Optional[int] = None,
        jl_method: str = "auto",
        noise_stddev: Any = None,
        max_physical_batch_size: Optional[int] = None,
        noise_mode: Optional[str] = None,
        **kwargs: Any,
    ) -> None:
        optimizer_class.__init__(self, *args, **kwargs)
        self._init_dp(
            l2_norm_clip,
            noise_multiplier,
            num_microbatches,
            gradient_mode,
            jl_projections,
            dp_sum_query,
            noise_seed,
            jl_method,
            noise_stddev,
            max_physical_batch_size,
            noise_mode,
        )

    name = f"DPKeras{optimizer_class.__name__}"
    if name.endswith("Optimizer"):
        name = name[: -len("Optimizer")]
    name += "Optimizer"
    doc = (
        f"Differentially private {optimizer_class.__name__}: the base optimizer's update applied to "
        "gradients clipped per example and noised by a Gaussian sum query, every step recorded in "
        "``self.ledger``. Use with a model made private by ``tf_dp.keras.make_private``.\n\n"
        "Args (in addition to the base optimizer's):\n"
        "  l2_norm_clip: per-example L2 clip ``C`` (finite, > 0), or a schedule: a callable\n"
        "    ``step -> C_t`` such as ``tf_dp.keras.schedules.DecreasingClip`` or any\n"
        "    ``keras.optimizers.schedules.LearningRateSchedule`` (evaluated at every step).\n"
        "  noise_multiplier: ``z``; noise stddev is ``z * C_t`` (finite, >= 0; or a schedule).\n"
        "  noise_stddev: instead of noise_multiplier (exactly one of the two): the absolute\n"
        "    noise stddev (finite, >= 0; or a schedule). With a decreasing clip, the effective\n"
        "    noise multiplier ``noise_stddev / C_t`` grows and later steps cost less privacy.\n"
        "  num_microbatches: None for per-example clipping, else the number of microbatches.\n"
        "  gradient_mode: one of 'auto', 'vectorized', 'microbatch', 'ghost', 'jl'.\n"
        "  jl_projections: JL dimension r for gradient_mode='jl'.\n"
        "  jl_method: 'auto', 'forward' (ForwardAccumulator) or 'double_vjp' (JL route).\n"
        "  dp_sum_query: an explicit tf_dp DPQuery instead of l2_norm_clip/noise_multiplier.\n"
        "  max_physical_batch_size: None, or clip each sampled batch in pieces of at most this\n"
        "    many examples (integer >= 1), one after another: the same clipped sum, noise and\n"
        "    ledger entry, with a step's memory bounded by the piece size (slower per step).\n"
        "  noise_mode: None (the default, 'continuous'), 'continuous' or 'grid': see\n"
        "    tf_dp.GaussianSumQuery. 'grid' releases multiples of a power of two g, so the low\n"
        "    bits of the update carry nothing about the data; the ledger charges C + g sqrt(d).\n"
        "  noise_seed: tests and debugging only (a known seed voids the guarantee).\n"
    )
    cls = type(name, (DPOptimizerMixin, optimizer_class), {"__init__": __init__, "__doc__": doc})
    cls.__module__ = __name__
    cls = keras.saving.register_keras_serializable(package="tf_dp", name=name)(cls)
    _CLASS_CACHE[optimizer_class] = cls
    return cls


DPKerasSGDOptimizer = make_dp_optimizer_class(keras.optimizers.SGD)
DPKerasAdamOptimizer = make_dp_optimizer_class(keras.optimizers.Adam)
DPKerasAdagradOptimizer = make_dp_optimizer_class(keras.optimizers.Adagrad)
