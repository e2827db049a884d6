"""One DP step, from a batch to the noised mean gradient: :class:`DPEngine`.

The step, in order (:meth:`DPEngine.step` runs it whole; :meth:`DPEngine.private_gradients`
stops before the update):

1. schedules: the clip and noise of this step (a clip or noise schedule's value at ``step``);
2. clipped sum: the gradient clipper computes the sum of per-record clipped gradients, with the
   clipping rule of the query (``tf_dp.gradients``);
3. noise and record: the query adds noise (``get_noised_result``) and the ledger records the
   step's sampling and every sum query; the query's new global state is kept by the engine;
4. all-reduce: under ``tf.distribute``, the replicas' clipped sums are summed with one draw of
   noise (replica 0's);
5. divide by the public denominator: the expected batch size ``q * n`` of the declared
   :class:`~tf_dp.engine.Sampling` (Poisson), the number of records of the batch (shuffled
   batches) or of microbatches, 1 for a ``NormalizedQuery``;
6. gradients that do not depend on the data (weight regularisers') are added, after the noise;
7. :meth:`DPEngine.apply` applies the result with the caller's update function, only when it is
   finite and was recorded.

TensorFlow only: the Keras optimizers (``tf_dp.keras``) and custom training loops
(``tf_dp.keras.DPTrainStep``) both run this step.

Example (a custom per-example loss and a plain ``tf.Variable``)::

    engine = DPEngine(PrivacyConfig(l2_norm_clip=1.0, noise_multiplier=1.1))
    engine.set_sampling(Sampling(60_000, 256 / 60_000))
    w = tf.Variable(tf.zeros([3]))
    def loss_fn(x, y, sample_weight):            # per-example losses [B] and predictions
        pred = tf.linalg.matvec(x, w)
        return tf.square(pred - y), pred
    sgd = lambda g, v: [vi.assign_sub(0.1 * gi) for gi, vi in zip(g, v)]
    engine.step(loss_fn, (x, y, None), [w], step=0, apply_fn=sgd)
    engine.flush()                               # between compiled calls
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, Callable, Optional

import numpy as np
import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.gaussian_query import GaussianGlobalState, GaussianSumQuery
from tf_dp.dp_query.noise import DEFAULT_NOISE_MODE
from tf_dp.dp_query.normalized_query import NormalizedQuery
from tf_dp.dp_query.partition_selection import PartitionSelectionQuery
from tf_dp.dp_query.xla import in_xla_context
from tf_dp.engine import validation
from tf_dp.engine.config import PrivacyConfig, SpeedConfig, check_combination
from tf_dp.data.sampling import Sampling
from tf_dp.gradients import ClippedGradients, GradientClipper, make_clipper
from tf_dp.gradients.base import as_tf_variables
from tf_dp.gradients.embedding_rows import sparse_table_names
from tf_dp.gradients.per_user import for_users
from tf_dp.gradients.physical_batches import PhysicalBatches
from tf_dp.ledger.privacy_ledger import (
    PrivacyLedger,
    counter_snapshot,
    known_counters,
    ledger_variable,
    read_int,
    table_steps,
)
from tf_dp.ledger.query_with_ledger import QueryWithLedger

_logger = logging.getLogger("tf_dp")

#: A caller's update: ``apply_fn(gradients, variables)`` (e.g. a base optimizer's ``apply``).
ApplyFn = Callable[[list, list], Any]


class DPEngine:
    """The owner of one DP step: query, ledger, global state, schedules, clipper, denominator.

    Args:
      privacy: the privacy parameters (:class:`~tf_dp.engine.PrivacyConfig`).
      speed: how the clipped sum is computed (:class:`~tf_dp.engine.SpeedConfig`).
      name: prefix of the ledger's name.
      owner: the name of the class that uses the engine, for error messages.
      placeholder_state: for a query whose global state needs the records' structure (tree
        aggregation): the state to report before :meth:`build_state` (no state variables until
        then). The query may then be a tree-aggregation query: the engine carries its tree.
    """

    def __init__(
        self,
        privacy: PrivacyConfig,
        speed: Optional[SpeedConfig] = None,
        name: str = "dp",
        owner: str = "the DP optimizer",
        placeholder_state: Any = None,
    ) -> None:
        speed = SpeedConfig() if speed is None else speed
        check_combination(privacy, speed)
        self.privacy, self.speed = privacy, speed
        self._schedules: Optional[tuple[tf.Variable, tf.Variable]] = None
        query = privacy.query
        if query is None:
            query = self._build_query(privacy)
        else:
            _refuse_query(query, owner, allow_tree=placeholder_state is not None)
        if privacy.sparse_embeddings is not None:  # DP-AdaFEST on the embedding tables
            query = PartitionSelectionQuery(query, privacy.sparse_embeddings, privacy.noise_seed)
        self.ledger = PrivacyLedger(name=f"{name}_ledger")
        if privacy.sparse_embeddings is not None:  # the threshold is in no event: say it
            self.ledger.set_file_metadata("sparse_embeddings",
                                          privacy.sparse_embeddings.get_config())
        self.recorder = QueryWithLedger(query, self.ledger)
        self.query = query
        self._normalized = isinstance(query, NormalizedQuery)
        self._grid_noise = _snaps_to_grid(query)
        self._placeholder = placeholder_state
        self._global_state = None
        if placeholder_state is None:
            self.build_state()
        self.clipper: Optional[GradientClipper] = None
        self.sampling: Optional[Sampling] = None
        with tf.init_scope():
            # the public denominator of the declared sampling: q * n (Poisson) or the batch's
            # records (shuffle); before any declaration n = 1, q = 1 (as the ledger records)
            self._expected_batch = ledger_variable(tf.constant(1.0, tf.float32))
            self._poisson = ledger_variable(tf.constant(True))
            # DP steps whose update was withheld because it was not finite (still recorded)
            self._skipped = ledger_variable(tf.constant(0, tf.int64), name="dp_skipped_steps")
            # the most units a batch may hold (shuffle: the declared batch size; 0: no limit),
            # whether the last batch fitted, and the compiled steps refused for a larger batch
            self._batch_limit = ledger_variable(tf.constant(0, tf.int64))
            self._batch_fits = ledger_variable(tf.constant(True))
            self._oversized = ledger_variable(tf.constant(0, tf.int64))
        self._skipped_reported = 0
        self._oversized_reported = 0
        self._batch_checked_by_mask = False  # set by check_batch_size while tracing under XLA
        self.unrecorded_steps = 0  # steps a previous optimizer applied but did not record

    # -- configuration -----------------------------------------------------------------------

    def _build_query(self, privacy: PrivacyConfig) -> DPQuery:
        mode = DEFAULT_NOISE_MODE if privacy.noise_mode is None else privacy.noise_mode
        if not privacy.has_schedules:
            return GaussianSumQuery(
                privacy.l2_norm_clip, privacy.noise_stddev_value, seed=privacy.noise_seed,
                noise_mode=mode,
            )
        clip0, _, std0 = self.values_at_tensors(0)
        with tf.init_scope():
            clip_var, std_var = (
                ledger_variable(tf.constant(v, tf.float32), name=n)
                for v, n in ((clip0, "dp_l2_norm_clip"), (std0, "dp_noise_stddev"))
            )
        self._schedules = (clip_var, std_var)
        return GaussianSumQuery(clip_var, std_var, seed=privacy.noise_seed, noise_mode=mode)

    @property
    def global_state(self) -> Any:
        """The query's global state as the engine carries it (variables read at each step)."""
        return self._placeholder if self._global_state is None else self._global_state

    @property
    def state_built(self) -> bool:
        return self._global_state is not None

    def build_state(self) -> None:
        """Creates the variables that carry the query's global state (once)."""
        if self._global_state is None:
            with tf.init_scope():  # also when first called while a step is traced
                self._global_state = _in_variables(self.query.initial_global_state())

    def set_global_state(self, state: Any) -> None:
        """Assigns ``state`` (e.g. a restarted tree) to the engine's state variables (eager)."""
        self.build_state()
        _keep_state(self._global_state, state)

    @property
    def has_schedules(self) -> bool:
        return self._schedules is not None

    def set_sampling(self, sampling: Sampling) -> None:
        """Declares how batches are drawn: recorded, and the public denominator, from the next
        step on."""
        if not isinstance(sampling, Sampling):
            raise TypeError(f"sampling must be a tf_dp.engine.Sampling, got {sampling!r}")
        self.recorder.set_sampling(sampling)
        expected = np.float32(sampling.population_size) * np.float32(
            sampling.selection_probability
        )
        if sampling.policy == "cyclic_poisson":  # a Poisson sample of one part
            expected = np.float32(sampling.expected_batch_size)
        self._expected_batch.assign(expected)
        # every policy but shuffle has batches of varying (private) size: divide by q * n
        self._poisson.assign(sampling.policy != "shuffle")
        self._batch_limit.assign(max_batch_units(sampling) or 0)
        self.sampling = sampling

    @property
    def user_level(self) -> bool:
        """Whether the declared sampling is of users (each user's records clipped together)."""
        return self.sampling is not None and self.sampling.unit == "user"

    def start_pass(self) -> None:
        """Marks the next step as the first of a new pass over the data (eager)."""
        self.recorder.start_pass()

    def clipper_for(self, model: Any) -> GradientClipper:
        """Resolves (once) the gradient clipper for ``model``; logs the choice."""
        if self.clipper is not None:
            return self.clipper
        if model is not None and getattr(model, "built", False) and not model.trainable_variables:
            raise ValueError(
                "the model has no trainable variables, so DP training has nothing to train (every "
                "layer frozen; e.g. keras-hub's backbone.enable_lora(r) found no layer named as in "
                "backbone.default_lora_layer_names(): pass target_layer_names=)"
            )
        speed = self.speed
        options = {}
        if speed.jl_projections is not None:
            options = {"jl_projections": speed.jl_projections, "jl_method": speed.jl_method}
        sparse = self.privacy.sparse_embeddings
        strategy = make_clipper(
            "ghost" if sparse is not None else speed.gradient_mode, model=model, num_microbatches=self.privacy.num_microbatches,
            seed=self.privacy.noise_seed, **options,
        )
        if speed.max_physical_batch_size is not None:
            strategy = PhysicalBatches(strategy, speed.max_physical_batch_size)
        reason = strategy.supports(model)
        if reason is not None:
            raise ValueError(
                f"gradient_mode={speed.gradient_mode!r} cannot train this model: {reason}"
            )
        if (not strategy.exact or strategy.name in ("ghost", "jl")) and (
            not self.recorder.supports_norm_clipping
        ):
            raise TypeError(
                f"gradient clipper {strategy.name!r} needs a query with a norm-based "
                f"clipping rule; {type(self.query).__name__} has none"
            )
        if sparse is not None:  # the tables' clipped rows come back as tf.IndexedSlices
            self._sparse_names = sparse_table_names(model, sparse)
            strategy.sparse_keys = frozenset(self._sparse_names)
        self.clipper = strategy
        _logger.info(
            "tf_dp: gradient_mode=%r uses the %r clipper", speed.gradient_mode, strategy.name
        )
        return strategy

    # -- schedules -----------------------------------------------------------------------------

    def values_at_tensors(self, step: Any):
        """``(clip, noise argument, noise stddev)`` of the step numbered ``step`` (tensors)."""
        p = self.privacy
        return validation.schedule_values(
            p.l2_norm_clip, p.noise_multiplier, p.noise_stddev, tf.cast(step, tf.int64)
        )

    def values_at(self, step: int) -> tuple[float, float]:
        """``(clip, noise stddev)`` of the step numbered ``step``, eagerly; ValueError naming the
        argument when a schedule gives a value out of range."""
        if self.privacy.query is not None:
            raise ValueError("the optimizer was built from an explicit dp_sum_query")
        clip, noise, std = self.values_at_tensors(tf.constant(int(step), tf.int64))
        validation.raise_if_out_of_range(self.privacy.noise_name, int(step), clip, noise, std)
        return float(clip.numpy()), float(std.numpy())

    def update_schedules(self, step: Any) -> None:
        """Sets the query's clip and noise stddev to the schedules' values at ``step`` (before
        clipping, so clipping, noise and the ledger all use them). Eagerly a bad value raises; in
        a graph it fails the step before anything is recorded; under XLA (no assertions) the
        values become NaN, the update is withheld and the ledger cannot be analysed."""
        if self._schedules is None:
            return
        clip_var, std_var = self._schedules
        step = tf.cast(tf.convert_to_tensor(step), tf.int64)
        clip, noise, std = self.values_at_tensors(step)
        name = self.privacy.noise_name
        if tf.executing_eagerly():
            validation.raise_if_out_of_range(name, int(step.numpy()), clip, noise, std)
            clip_var.assign(clip)
            std_var.assign(std)
            return
        ok = validation.values_in_range(clip, noise, std)
        checks = []
        if not in_xla_context():
            checks.append(tf.debugging.Assert(ok, [
                f"tf_dp: a clip or noise schedule gave a value out of range (l2_norm_clip must be "
                f"a finite number > 0, {name} a finite number >= 0) at step", step,
                "l2_norm_clip:", clip, f"{name}:", noise,
            ]))
        with tf.control_dependencies(checks):
            nan = tf.constant(float("nan"), tf.float32)
            clip_var.assign(tf.where(ok, clip, nan))
            std_var.assign(tf.where(ok, std, nan))

    # -- the step ------------------------------------------------------------------------------

    def private_gradients(
        self,
        loss_fn: Any,
        data: Any,
        variables: list,
        step: Any,
        model: Any = None,
        check: Optional[Callable[[ClippedGradients], None]] = None,
    ) -> tuple[ClippedGradients, list]:
        """One DP step up to the update: ``(clipped, noised mean gradients)``.

        ``loss_fn(x, y, sample_weight) -> (per-example losses [B], predictions)``; ``data`` is
        ``(x, y, sample_weight)``; ``step`` numbers the step for schedules; ``model`` is what
        the clipper is chosen for (``gradient_mode='auto'``); ``check(clipped)``, if given,
        runs before anything is noised or recorded (it may raise).

        Traced in a ``tf.function``, the step clips with the unit of privacy (examples, or users
        of ``k`` records) declared when it was traced. Run after :meth:`set_sampling` changed the
        unit or ``k``, it records nothing, releases zeros and :meth:`apply` applies nothing: it
        fails with ``InvalidArgumentError`` (a graph) or at the next :meth:`flush` (XLA). Build a
        new ``tf.function`` after such a change.
        """
        checks = self.check_batch_size(data)  # nothing runs on a batch larger than declared
        with tf.control_dependencies(checks):
            self.update_schedules(step)                                      # 1. schedules
        clipper = self.clipper_for(model)
        if self.user_level:  # each user's summed gradient is one clipped record
            clipper = for_users(clipper, self.sampling.records_per_unit)
        params = self.recorder.derive_sample_params(self.global_state)
        extra = {"model": model} if getattr(clipper, "needs_model", False) else {}
        if getattr(clipper, "needs_step", False):
            # keys a seeded clipper's public randomness: a number that no other step of this
            # engine had (a withheld step does not move ``step``, but it is counted)
            extra["step"] = tf.cast(step, tf.int64) + self._skipped
        clipped = clipper.clipped_sum(loss_fn, data, variables, self.recorder, params, **extra)
        if self.privacy.sparse_embeddings is not None:  # the sparse tables' names, in order
            names = getattr(self, "_sparse_names", {})
            self._sparse_order = [
                names[id(v)] for v in as_tf_variables(variables) if id(v) in names]
        if check is not None:
            check(clipped)
        if self._batch_checked_by_mask:
            # under XLA (no assertions) a batch larger than declared records and releases
            # nothing: its sensitivity is made NaN, which the ledger's recorder masks; apply
            # withholds the update and the next flush raises
            fits = self._batch_fits.read_value()
            clipped.sensitivity_multiplier = tf.where(
                fits, tf.cast(clipped.sensitivity_multiplier, tf.float32), float("nan"))
        with tf.control_dependencies(checks):
            return clipped, self.noised_mean(clipped)                        # 3.-5.

    def check_batch_size(self, data: Any) -> list:
        """Refuses a batch of more units than the declared ``shuffle`` sampling's batch size
        ``b = q * n`` (rounded down; :func:`max_batch_units`): the accounting of shuffled batches
        counts ``ceil(n / b)`` steps as one pass, each unit in at most one batch of it, which a
        larger batch breaks. Eagerly it raises ``ValueError``; in a graph it returns an
        assertion that fails the step before anything is recorded or applied; under XLA the
        step records and applies nothing and the next :meth:`flush` raises. Poisson sampling
        has no limit. Under ``tf.distribute`` the global batch (the sum of the replicas' shares)
        is checked.
        """
        self._batch_checked_by_mask = False
        eager = tf.executing_eagerly()
        if self.sampling is None or (eager and max_batch_units(self.sampling) is None):
            return []  # (a traced step checks the limit in force when it runs)
        rows = tf.cast(tf.shape(tf.nest.flatten(data[0])[0])[0], tf.int64)
        k = self.sampling.records_per_unit or 1
        units = (rows + k - 1) // k
        if _replicas_in_sync() > 1:  # the limit is on the global batch: every replica's share
            units = _all_reduce_sum(units)
        limit = self._batch_limit.read_value()
        fits = tf.logical_or(tf.equal(limit, 0), units <= limit)
        if eager:
            if not bool(fits):
                raise ValueError(_oversized_message(int(units), self.sampling))
            return []
        if not in_xla_context():
            def fail():  # the message's string ops run only in a step that fails
                with tf.control_dependencies([tf.debugging.Assert(fits, [
                    "tf_dp: batch size: a batch of", tf.strings.as_string(units),
                    "units (rows / records_per_unit) is larger than the declared shuffle "
                    "sampling's batch size (selection_probability * population_size, accepted "
                    "1 ..", tf.strings.as_string(limit),
                    "); nothing was recorded or applied. Feed batches of at most that size, or "
                    "declare the sampling that produced them",
                ])]):
                    return tf.constant(False)

            return [tf.cond(fits, lambda: tf.constant(True), fail)]
        self._batch_checked_by_mask = True
        self._batch_fits.assign(fits)
        self._oversized.assign_add(tf.cast(tf.logical_not(fits), tf.int64))
        return []

    def step(
        self,
        loss_fn: Any,
        data: Any,
        variables: list,
        step: Any,
        apply_fn: ApplyFn,
        model: Any = None,
        check: Optional[Callable[[ClippedGradients], None]] = None,
        extra_gradients: Optional[Callable[[], Optional[list]]] = None,
    ) -> ClippedGradients:
        """One whole DP step: :meth:`private_gradients`, then ``extra_gradients()`` (called
        after the noise: gradients that do not depend on the data, such as weight regularisers',
        one per variable, or None) added, then :meth:`apply` with ``apply_fn``. Returns the clipped
        gradients (per-example losses and predictions).

        Example::

            clipped = engine.step(loss_fn, (x, y, None), [w], step=0, apply_fn=sgd_update)
        """
        clipped, grads = self.private_gradients(loss_fn, data, variables, step, model, check)
        extra = extra_gradients() if extra_gradients is not None else None
        if extra is not None:
            grads = [g + tf.cast(e, g.dtype) for g, e in zip(grads, extra)]
        self.apply(grads, variables, apply_fn)
        return clipped

    def noised_mean(self, clipped: ClippedGradients) -> list:
        """Noise and record (query + ledger), all-reduce with one noise draw, divide by the
        public denominator (see the module docstring)."""
        q = self.recorder
        q.sensitivity_multiplier.assign(tf.cast(clipped.sensitivity_multiplier, tf.float32))
        q.set_jl_projections(clipped.jl_projections)
        after = clipped.noise_after_sum and not tf.executing_eagerly()
        # a query whose sample state holds more than the clipped sum (adaptive clipping's count
        # of unclipped records) completes it from the per-record norms; others return it as is
        sums = list(clipped.clipped_sum)
        sparse_at = [i for i, g in enumerate(sums) if isinstance(g, tf.IndexedSlices)]
        if sparse_at:  # the sparse tables are noised by the partition selection, not here
            _refuse_sparse_context(self.privacy.sparse_embeddings)
            sums = [tf.zeros([0], g.values.dtype) if i in sparse_at else g
                    for i, g in enumerate(sums)]
        state = q.accumulate_norms(
            q.derive_sample_params(self.global_state), sums, clipped.norms,
            getattr(clipped, "record_mask", None),
        )
        replicas = _replicas_in_sync()
        grid_replicas = replicas > 1 and self._grid_noise
        if grid_replicas:  # grid noise is snapped with the global sum it is added to
            state = _all_reduce_sum(state)
        deps = tf.nest.flatten(clipped.clipped_sum, expand_composites=True) if after else []
        with tf.control_dependencies(deps):
            noised, new_state = q.get_noised_result(state, self.global_state)
        if sparse_at:  # after the step was recorded (both sum queries)
            noised = self._noised_rows(clipped, noised, sparse_at)
        keep = _keep_state(self.global_state, new_state)
        records = tf.cast(clipped.num_records, tf.float32)
        if replicas > 1:
            others = tf.nest.map_structure(
                lambda t: tf.zeros_like(tf.convert_to_tensor(t)), noised
            ) if grid_replicas else clipped.clipped_sum
            noised, records = _all_reduce_with_one_noise(others, noised, records)
        with tf.control_dependencies(keep):
            if self._normalized:
                return _share([tf.identity(g) for g in noised], replicas)
            if self.privacy.num_microbatches is not None and (
                self.clipper is not None and self.clipper.name == "microbatch"
            ) and not self.user_level:
                denominator = records
            else:
                denominator = tf.where(self._poisson, self._expected_batch, records)
            denominator = tf.maximum(denominator, 1e-12)
            return _share([_divide(g, denominator) for g in noised], replicas)

    def _noised_rows(self, clipped: ClippedGradients, noised: list, sparse_at: list) -> list:
        """``noised`` with the sparse tables' entries replaced by their DP-AdaFEST releases:
        rows selected from the contribution map of the batch's real records, the query's noise
        on those rows only (:meth:`PartitionSelectionQuery.noised_rows`)."""
        slices = [clipped.clipped_sum[i] for i in sparse_at]
        mask = clipped.record_mask
        b = tf.shape(tf.reshape(slices[0].indices, [-1]))[0] if mask is None else tf.shape(mask)[0]
        real = tf.ones([b], tf.bool) if mask is None else tf.cast(mask, tf.bool)
        ids = [tf.where(real[:, None], tf.reshape(tf.cast(s.indices, tf.int64), [b, -1]),
                        tf.constant(-1, tf.int64)) for s in slices]
        with tf.control_dependencies(tf.nest.flatten(noised)):
            rows = self.query.noised_rows(self.global_state, ids, slices,
                                          getattr(self, "_sparse_order", None))
        noised = list(noised)
        for i, r in zip(sparse_at, rows):
            noised[i] = r
        return noised

    def apply(self, grads: list, variables: list, apply_fn: ApplyFn) -> None:
        """Applies ``grads`` with ``apply_fn`` unless they are not finite (the step stays in
        the ledger: a conservative record; counted in :attr:`skipped_steps`), the ledger had
        no room to record the step inside a compiled call (nothing released or recorded), or the
        step was traced for another unit of privacy than the one declared when it runs (see
        :meth:`private_gradients`)."""
        room = self.recorder.step_released(self.global_state)
        finite = tf.reduce_all(tf.stack([
            all_finite(g.values if isinstance(g, tf.IndexedSlices) else g)
            for g in grads if g is not None
        ]))

        def update():
            apply_fn(grads, variables)
            return tf.constant(True)

        def withhold():
            self._skipped.assign_add(tf.where(room, tf.constant(1, tf.int64),
                                              tf.constant(0, tf.int64)))
            return tf.constant(False)

        ok = tf.logical_and(room, finite)
        if self._batch_checked_by_mask:  # under XLA (check_batch_size)
            fits = self._batch_fits.read_value()
            ok = tf.logical_and(ok, fits)
            room = tf.logical_and(room, fits)  # a refused step is not counted as withheld
        if tf.executing_eagerly():
            update() if bool(ok) else withhold()
            return
        # a step traced for another unit of privacy than declared now fails before its update
        # (outside XLA; under XLA ``room`` is false and the next flush raises)
        with tf.control_dependencies(self.recorder.unit_checks()):
            if _in_replica_step():
                # the update all-reduces across replicas (a merge_call, even with one replica),
                # which cannot sit inside a conditional: a withheld step applies zeros instead
                # (nothing about the data)
                self._skipped.assign_add(tf.cast(tf.logical_and(room, tf.logical_not(finite)),
                                                 tf.int64))
                apply_fn([_zero_unless(ok, g) for g in grads], variables)
            else:
                tf.cond(ok, update, withhold)

    # -- between steps (eager) -----------------------------------------------------------------

    def prefetch_noise(self) -> None:
        """Draws the noise of the next XLA-compiled step outside XLA (eager, between compiled
        calls; :class:`tf_dp.dp_query.noise.PrefetchedNoise`). A no-op until a step was traced
        under XLA; a step that finds no fresh noise draws its own."""
        for prefetch in _prefetches(self.query):
            prefetch.refill()

    def reserve(self, steps: int) -> None:
        """Room in the ledger's staging table for ``steps`` steps of one compiled call."""
        self.ledger.reserve(int(steps), len(self.recorder.sum_query_specs(self.global_state)))

    def after_step_in_graph(self, journaled: Optional[bool] = None) -> tf.Tensor:
        """Graph ops for the end of a (not compiled) function that has just called a
        DP step (XLA-compiled or not): draws the next XLA step's noise (:meth:`prefetch_noise`,
        without an eager call of its own) and returns what :meth:`flush` reads (pass it as
        ``counters``), in one float64 matrix (one tensor to convert after the call): row 0 the
        counters (:meth:`flush_counters`; integers, exact in float64 below 2**53), then the
        journal's new rows (:meth:`PrivacyLedger.journal_tails` for one step, with
        ``journaled``), each row padded with zeros to the widest."""
        for prefetch in _prefetches(self.query):
            prefetch.refill_in_graph()
        query_rows = len(self.recorder.sum_query_specs(self.global_state))
        parts = [tf.cast(counter_snapshot(self.flush_counters()), tf.float64)[None, :]]
        parts += list(self.ledger.journal_tails(1, query_rows, journaled))
        width = max(int(p.shape[1]) for p in parts)
        return tf.concat([tf.pad(p, [[0, 0], [0, width - int(p.shape[1])]]) for p in parts], 0)

    def flush_counters(self) -> list:
        """The int64 counters :meth:`flush` reads before it writes any."""
        return (self.ledger.flush_counters() + [self._oversized, self._skipped]
                + self.recorder.flush_counters())

    def flush(self, counters: Any = None) -> None:
        """After a compiled call: flushes the ledger's staging table, raises if a compiled step
        met a non-finite clip or noise (it recorded nothing) or a batch larger than the declared
        one (:meth:`check_batch_size`), logs withheld steps. ``counters``: the values of
        :meth:`flush_counters` read by :meth:`after_step_in_graph` in the function that ran the
        step (else they are read here)."""
        known = None
        if counters is not None:  # row 0 the counters, then the journal's rows
            packed = np.asarray(counters)
            names = self.flush_counters()
            known = known_counters(names, packed[0, :len(names)])
            if len(packed) > 1:
                known.update(self.ledger.known_tails(packed[1:], steps=1))
        self.ledger.flush_known(known)
        oversized = read_int(self._oversized, known)
        if oversized > self._oversized_reported:
            new, self._oversized_reported = oversized - self._oversized_reported, oversized
            try:  # the recorder counted the same steps as steps with a non-finite sensitivity
                self.recorder.check_values(known)
            except ValueError:
                pass
            raise ValueError(
                f"{new} compiled DP step(s) ran on a batch larger than "
                + _oversized_message(None, self.sampling)
            )
        self.recorder.check_values(known)
        skipped = read_int(self._skipped, known)
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
        return int(self._skipped.numpy())

    # -- the ledger across optimizers and files (eager) -----------------------------------------

    def restore_ledger_tables(
        self, samples: np.ndarray, queries: np.ndarray, verified: bool = True
    ) -> None:
        """Restores a saved ledger (tables from ``ledger.tables()``), never losing steps: the
        current ledger is kept if it already records more steps (e.g. older weights loaded into
        a model that trained on), so the ledger can over-count but never under-count."""
        steps = table_steps(samples)
        if steps >= self.ledger.num_samples:
            self.ledger.load_tables(samples, queries, verified=verified)
        else:
            _logger.warning(
                "tf_dp: kept the optimizer's ledger (%d steps) rather than the saved one (%d "
                "steps): a ledger never forgets recorded steps on load",
                self.ledger.num_samples, steps,
            )

    def continue_ledger(self, previous: "DPEngine", previous_applied: int) -> None:
        """Continues ``previous``'s ledger; ``previous_applied`` steps ran under it (those it
        does not record stay counted as unrecorded)."""
        previous.ledger.flush()
        self.unrecorded_steps = max(
            0, previous_applied + previous.unrecorded_steps - previous.ledger.num_samples
        )
        # what is known of the weights' training travels with the ledger: steps it does not
        # record keep the privacy spent unknown, and an unverified ledger stays unverified
        self.ledger.expect_trained_steps(previous.ledger.trained_steps)
        if previous.ledger.num_samples:
            self.ledger.restore_runs(previous.ledger.runs())  # by runs, not steps
            self.ledger.verified = self.ledger.verified and previous.ledger.verified
            _logger.info(
                "tf_dp: the new optimizer continues the model's ledger (%d recorded steps)",
                self.ledger.num_samples,
            )

    def check_ledger_covers(self, applied: int) -> None:
        """Raises if ``applied`` steps (plus unrecorded ones inherited) exceed the ledger's."""
        applied = int(applied) + self.unrecorded_steps
        recorded = self.ledger.num_samples
        if applied > recorded:
            raise ValueError(
                f"this DP optimizer has applied {applied} steps but its ledger records only "
                f"{recorded}: the privacy already spent is unknown, so training cannot continue "
                "with a budget that ignores it. Restore the run's ledger "
                "(model.optimizer.ledger.restore_entries(tf_dp.ledger.read_ledger_file(path))), "
                "or, if those steps did not touch private data, compile the model with a new DP "
                "optimizer (a fresh optimizer starts at step 0)"
            )

    def next_sample_entry(self, step: int, steps_ahead: int = 0):
        """The :class:`~tf_dp.ledger.events.SampleEntry` the step numbered ``step +
        steps_ahead`` will record (eager; a microbatched run before its first step is taken at
        the worst-case sensitivity 2). A pass start pending now is recorded by the next step
        only: later steps of the pass are predicted without it."""
        multiplier = None
        if self.privacy.num_microbatches is not None and self.ledger.num_samples == 0:
            multiplier = 2.0
        jl = self._jl_now()  # JL steps: known from the mode before the first step
        state = self.global_state
        if self._schedules is not None:
            state = GaussianGlobalState(*self.values_at(step + int(steps_ahead)))
        entry = self.recorder.next_sample_entry(state, multiplier, jl)
        return entry if int(steps_ahead) == 0 else _within_pass(entry)

    def next_sample_entries(self, step: int, count: int) -> list:
        """The entries of the steps numbered ``step, ..., step + count - 1`` (eager): what
        :meth:`next_sample_entry` gives for each, with the query's variables read once and the
        schedules evaluated in numpy when they have a numpy path (``numpy_values``, e.g.
        :class:`tf_dp.keras.schedules.DecreasingClip`); other schedules are evaluated step by
        step. ValueError naming the argument when a schedule gives a value out of range.

        Example::

            engine.next_sample_entries(int(optimizer.iterations), 64)   # the next 64 entries
        """
        step, count = int(step), int(count)
        if count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count}")
        if self._schedules is None:
            first = self.next_sample_entry(step)
            return [first] + [_within_pass(first)] * (count - 1)
        p = self.privacy
        steps = np.arange(step, step + count, dtype=np.int64)
        values = validation.schedule_values_numpy(
            p.l2_norm_clip, p.noise_multiplier, p.noise_stddev, steps)
        if values is None or self._grid_noise:  # no numpy path (or grid sensitivities)
            return [self.next_sample_entry(step, i) for i in range(count)]
        clip, noise, std = values
        for i in np.nonzero(~_in_range(clip, noise, std))[0][:1]:
            validation.raise_if_out_of_range(p.noise_name, step + int(i), clip[i], noise[i],
                                             std[i])
        first = self.recorder.next_sample_entry(
            GaussianGlobalState(float(clip[0]), float(std[0])),
            2.0 if p.num_microbatches is not None and self.ledger.num_samples == 0 else None,
            self._jl_now(),
        )
        (event,) = first.queries  # the engine's GaussianSumQuery: one sum query
        later = _within_pass(first)
        if event.mechanism == "none":
            return [first] + [later] * (count - 1)
        # the recorded sensitivity: the clip times the multiplier, as the step computes it
        multiplier = np.float32(self.recorder.sensitivity_multiplier.numpy())
        sens = (clip * multiplier).astype(np.float64)
        if p.num_microbatches is not None and self.ledger.num_samples == 0:
            sens = sens / float(multiplier) * 2.0
        return [first] + [
            dataclasses.replace(later, queries=(dataclasses.replace(
                event, l2_sensitivity=float(sens[i]), noise_stddev=float(std[i])),))
            for i in range(1, count)
        ]

    def _jl_now(self) -> Optional[int]:
        if self.clipper is not None:
            return int(getattr(self.clipper, "jl_projections", None) or 0)
        if self.speed.gradient_mode == "jl":
            return int(self.speed.jl_projections)
        return None


def max_batch_units(sampling: Sampling) -> Optional[int]:
    """The most units (records, or users with ``unit='user'``) one batch may hold under
    ``sampling``: for ``shuffle``, the declared batch size ``b = q * n`` rounded down (the
    accounting counts ``ceil(n / b)`` steps as one pass); None (no limit) for ``poisson``.

    >>> from tf_dp.engine import Sampling
    >>> max_batch_units(Sampling(24, 4 / 24, policy="shuffle"))
    4
    """
    if sampling.policy != "shuffle":
        return None
    # rounded down: a batch of at most floor(q n) units makes a pass of at least ceil(n / b)
    # steps, so no unit takes part twice within the steps the ledger counts as one pass
    return max(1, int(math.floor(sampling.expected_batch_size + 1e-9)))


def _oversized_message(units: Optional[int], sampling: Sampling) -> str:
    b = max_batch_units(sampling)
    got = "" if units is None else f"batch size: a batch of {units} units is larger than "
    return (
        f"{got}the declared shuffle sampling's batch size (selection_probability * "
        f"population_size = {sampling.selection_probability:g} * {sampling.population_size}; "
        f"accepted: 1 to {b} units per batch, a unit being a record, or a user of up to "
        "records_per_unit rows with unit='user'); nothing was recorded or applied. Feed "
        "batches of at most that size, or declare the sampling that produced them (e.g. "
        "Sampling(n, batch_size / n, policy='shuffle'))"
    )


def _within_pass(entry: Any) -> Any:
    """``entry`` as a step after the first of its pass records it (no pass start)."""
    if not entry.sampling.pass_start:
        return entry
    return dataclasses.replace(entry, sampling=dataclasses.replace(entry.sampling,
                                                                   pass_start=False))


def _in_range(clip: np.ndarray, noise: np.ndarray, std: np.ndarray) -> np.ndarray:
    """Per step: clip finite > 0, noise and stddev finite >= 0 (numpy)."""
    with np.errstate(invalid="ignore"):
        return (np.isfinite(clip) & np.isfinite(noise) & np.isfinite(std) & (clip > 0)
                & (noise >= 0) & (std >= 0))


def _refuse_query(query: DPQuery, owner: str, allow_tree: bool = False) -> None:
    from tf_dp.dp_query.tree_aggregation import TreeCumulativeSumQuery

    if isinstance(query, QueryWithLedger):
        raise TypeError(
            "pass the bare query as dp_sum_query; the optimizer wraps it with its own "
            "ledger (available as optimizer.ledger)"
        )
    if isinstance(query, TreeCumulativeSumQuery) and not allow_tree:
        raise TypeError(
            "a tree-aggregation query must carry its tree from step to step, which "
            f"{owner} does not do: use tf_dp.keras.DPKerasFTRLOptimizer "
            "(DP-FTRL: SGD or momentum on a TreeResidualSumQuery)"
        )


def _in_variables(state: Any) -> Any:
    """The global state with every tensor leaf in an engine-owned variable (numbers and
    variables kept as they are), so that the state a step returns can be kept."""
    def hold(leaf):
        if isinstance(leaf, tf.Tensor) and not isinstance(leaf, tf.Variable):
            with tf.init_scope():
                return ledger_variable(leaf, name="dp_global_state")
        return leaf
    return tf.nest.map_structure(hold, state)


def _keep_state(held: Any, new: Any) -> list:
    """Assigns the new global state returned by ``get_noised_result`` to the engine's variables
    (leaves that are variables and were given a new value); returns the assignments."""
    ops = []
    for old, value in zip(tf.nest.flatten(held), tf.nest.flatten(new)):
        if isinstance(old, tf.Variable) and value is not old:
            ops.append(old.assign(tf.cast(value, old.dtype)))
    return ops


def _divide(g: Any, denominator: tf.Tensor) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values / tf.cast(denominator, g.values.dtype), g.indices,
                                g.dense_shape)
    return g / tf.cast(denominator, g.dtype)


def _zero_unless(ok: tf.Tensor, g: Any) -> Any:
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.where(ok, g.values, tf.zeros_like(g.values)), g.indices,
                                g.dense_shape)
    return tf.where(ok, g, tf.zeros_like(g))


def _refuse_sparse_context(config: Any = None) -> None:
    """DP-AdaFEST selects a data-dependent number of rows: not under XLA (DP-FEST's fixed rows
    are); no sparse release is all-reduced across replicas."""
    if in_xla_context() and getattr(config, "rows", None) is None:
        raise ValueError(
            "sparse_embeddings cannot run under XLA with a per-step selection (the number of "
            "selected rows varies from step to step): compile the model with jit_compile=False, "
            "or fix the rows (SparseEmbeddingConfig(rows=...), DP-FEST)")
    if tf.distribute.has_strategy() and not isinstance(
            tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy):
        raise ValueError(
            "sparse_embeddings does not support tf.distribute strategies (other than "
            "OneDeviceStrategy): train without a distribution strategy, or set "
            "sparse_embeddings=None")


def _replicas_in_sync() -> int:
    """Replicas of the current ``tf.distribute`` step (1 outside one)."""
    if not tf.distribute.has_strategy():
        return 1
    ctx = tf.distribute.get_replica_context()
    return 1 if ctx is None else int(ctx.num_replicas_in_sync)


def _in_replica_step() -> bool:
    """Inside a replica of a ``tf.distribute`` step, whatever the number of replicas (one under
    ``MirroredStrategy()`` on a machine with one GPU or none): variable updates there are
    ``merge_call``s, which cannot run inside a ``tf.cond``. ``OneDeviceStrategy`` keeps plain
    variables: not such a step."""
    return (
        tf.distribute.has_strategy()
        and tf.distribute.get_replica_context() is not None
        and not isinstance(tf.distribute.get_strategy(), tf.distribute.OneDeviceStrategy)
    )


def _snaps_to_grid(query: Any) -> bool:
    """Whether any Gaussian sum query inside ``query`` uses grid-mode noise."""
    if getattr(query, "noise_mode", None) == "grid":
        return True
    inner = [getattr(query, "numerator_query", None)]
    if hasattr(query, "queries"):
        inner += tf.nest.flatten(query.queries)
    return any(q is not None and _snaps_to_grid(q) for q in inner)


def all_finite(t: tf.Tensor) -> tf.Tensor:
    """Whether every value of ``t`` is finite (a bool scalar).

    Under XLA a tensor of rank >= 2 and at least 4096 values is checked as
    ``isfinite(ones^T (t * 0) ones)``: ``t * 0`` is exactly 0 where ``t`` is finite and NaN where
    it is not (inf times 0 is NaN), and a NaN propagates through the sums; two products with ones
    instead of XLA's CPU reduction of the boolean mask
    (``python -m research.ghost.xla_reductions``). Elsewhere ``reduce_all(is_finite(t))``.

    Example::

        all_finite(tf.constant([[1.0, float("inf")]]))   # False
    """
    t = tf.convert_to_tensor(t)
    if (in_xla_context() and t.shape.rank is not None and t.shape.rank >= 2
            and t.shape.num_elements() is not None and t.shape.num_elements() >= 4096):
        zeros = tf.reshape(t * tf.zeros([], t.dtype), [-1, t.shape[-1]])
        rows = tf.linalg.matvec(zeros, tf.ones([t.shape[-1]], t.dtype))
        total = tf.tensordot(tf.ones([zeros.shape[0]], t.dtype), rows, 1)
        return tf.math.is_finite(total)
    return tf.reduce_all(tf.math.is_finite(t))


def _prefetches(query: Any) -> list:
    """The :class:`~tf_dp.dp_query.noise.PrefetchedNoise` of every Gaussian sum query inside
    ``query``."""
    found = [query.prefetched_noise] if hasattr(query, "prefetched_noise") else []
    inner = [getattr(query, "numerator_query", None)]
    if hasattr(query, "queries"):
        inner += tf.nest.flatten(query.queries)
    for q in inner:
        if q is not None:
            found += _prefetches(q)
    return found


def _all_reduce_sum(state: Any) -> Any:
    """The SUM over replicas of every leaf of ``state`` (dense)."""
    ctx = tf.distribute.get_replica_context()
    leaves = [tf.convert_to_tensor(t) for t in tf.nest.flatten(state)]
    return tf.nest.pack_sequence_as(state, ctx.all_reduce(tf.distribute.ReduceOp.SUM, leaves))


def _all_reduce_with_one_noise(clipped_sum, noised, records):
    """Across replicas: the sum of every replica's clipped sum plus replica 0's noise only.

    Replica 0 contributes its noised sum and the others their clipped sums, so one SUM
    all-reduce gives every replica the same global clipped sum with exactly one draw of noise.
    In grid mode the others pass zeros (replica 0 noised the global sum already). The record
    counts are summed too (the global batch).
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
    """Every replica holds the same global update; a Keras apply sums the replicas' gradients,
    so each passes ``1/replicas`` of it."""
    if replicas == 1:
        return grads
    return [g / tf.cast(replicas, g.dtype) for g in grads]
