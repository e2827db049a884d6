"""DP Keras optimizers: Keras 3 optimizers whose updates come from the DP engine.

Keras 3 trainers hand optimizers batch-averaged gradients, too late for per-example clipping. So
the per-example work happens in the DP model's ``train_step`` (``make_private`` / ``DPSequential``
/ ``DPModel``) or in a custom loop's :class:`tf_dp.keras.DPTrainStep`, both through the
optimizer's :class:`~tf_dp.engine.DPEngine` (:attr:`DPOptimizerMixin.engine`): clip, noise and
record, divide by the public denominator. The optimizer holds the engine, keeps the Keras names,
arguments and saved config, applies the engine's result with the base optimizer's update, and
carries the ledger in its saved variables. A DP optimizer handed ordinary gradients (a model that
was not made private) raises instead of training without privacy.

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
import warnings
from typing import Any, Optional, Union

import keras
import numpy as np
import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.serialization import deserialize_query, serialize_query
from tf_dp.engine import DPEngine, PrivacyConfig, Sampling, SpeedConfig
from tf_dp.engine.validation import is_schedule
from tf_dp.gradients import ClippedGradients, GradientClipper
from tf_dp.keras import ledger_store
from tf_dp.ledger.privacy_ledger import PrivacyLedger
from tf_dp.ledger.query_with_ledger import QueryWithLedger

_logger = logging.getLogger("tf_dp")


class DPOptimizerMixin:
    """The Keras side of every DP optimizer class: an engine, its ledger, saving and loading."""

    _declaring_from_fit = False  # True while fit declares the sampling of its own input

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
        placeholder_state: Any = None,
    ) -> None:
        privacy = PrivacyConfig(
            l2_norm_clip, noise_multiplier, noise_stddev, dp_sum_query, noise_mode,
            num_microbatches, noise_seed,
        )
        speed = SpeedConfig(gradient_mode, max_physical_batch_size, jl_projections, jl_method)
        self._engine = DPEngine(
            privacy, speed, name=self.name, owner=type(self).__name__,
            placeholder_state=placeholder_state,
        )
        self._custom_query = dp_sum_query is not None
        self._sampling_from_fit = False
        self._dp_applying = False

    # -- configuration (read from the engine) ---------------------------------------------------

    @property
    def engine(self) -> DPEngine:
        """The :class:`~tf_dp.engine.DPEngine` that runs this optimizer's DP steps."""
        return self._engine

    @property
    def ledger(self) -> PrivacyLedger:
        """The :class:`~tf_dp.PrivacyLedger` this optimizer records every DP step in."""
        return self._engine.ledger

    @property
    def dp_query(self) -> QueryWithLedger:
        return self._engine.recorder

    @property
    def _dp_global_state(self) -> Any:
        return self._engine.global_state

    @property
    def gradient_mode(self) -> str:
        return self._engine.speed.gradient_mode

    @property
    def noise_multiplier(self) -> Any:
        """The ``noise_multiplier`` given (a number or a schedule), or None."""
        return self._engine.privacy.noise_multiplier

    @property
    def noise_stddev(self) -> Any:
        """The absolute ``noise_stddev`` given (a number or a schedule), or None."""
        return self._engine.privacy.noise_stddev

    @property
    def l2_norm_clip(self) -> Any:
        """The ``l2_norm_clip`` given (a number or a schedule), or None (explicit query)."""
        return self._engine.privacy.l2_norm_clip

    @property
    def max_physical_batch_size(self) -> Optional[int]:
        """Examples clipped at once (``None``: the whole sampled batch)."""
        return self._engine.speed.max_physical_batch_size

    @property
    def num_microbatches(self) -> Optional[int]:
        return self._engine.privacy.num_microbatches

    @property
    def noise_seed(self) -> Optional[int]:
        """The explicit noise seed (tests and debugging; it voids the guarantee), or None."""
        return self._engine.privacy.noise_seed

    @property
    def gradient_clipper(self) -> Optional[GradientClipper]:
        """The gradient clipper in use (resolved from ``gradient_mode`` on the first step)."""
        return self._engine.clipper

    @property
    def gradient_strategy(self) -> Optional[GradientClipper]:
        """Deprecated name of :attr:`gradient_clipper`."""
        warnings.warn(
            "DP optimizers' gradient_strategy is deprecated; use gradient_clipper",
            DeprecationWarning, stacklevel=2,
        )
        return self.gradient_clipper

    @property
    def has_dp_schedules(self) -> bool:
        """True when the clip or the noise is a schedule (values set at every step)."""
        return self._engine.has_schedules

    def dp_values_at(self, step: int) -> tuple[float, float]:
        """``(clip, noise stddev)`` of the step numbered ``step`` (``optimizer.iterations`` when
        it runs), computed eagerly; ValueError naming the argument when out of range."""
        return self._engine.values_at(step)

    def update_dp_schedules(self) -> None:
        """Sets the query's clip and noise to the schedules' values at ``self.iterations``."""
        self._engine.update_schedules(self.iterations)  # type: ignore[attr-defined]

    def check_dp_schedules(self, steps: int = 1) -> None:
        """Eagerly checks the schedules' values for the next ``steps`` steps (``fit`` calls it
        before every compiled call, so a bad value fails before anything runs, also under XLA)."""
        if not self._engine.has_schedules:
            return
        first = int(self.iterations.numpy())  # type: ignore[attr-defined]
        for step in range(first, first + max(1, int(steps))):
            self._engine.values_at(step)

    def set_sampling(
        self,
        population_size: Union[int, Sampling],
        selection_probability: Optional[float] = None,
        sampling_policy: str = "poisson",
    ) -> None:
        """Declares how batches are drawn (recorded in the ledger from the next step on): a
        :class:`tf_dp.data.Sampling`, or ``(population_size, selection_probability,
        sampling_policy)``.

        ``model.fit`` of a private model sets this itself for in-memory arrays (``shuffle``) and
        for tf_dp's samplers (:func:`tf_dp.data.poisson_batches`, example- or user-level, and the
        others of :mod:`tf_dp.data`); call it yourself for other inputs. A sampling declared here
        is recorded as ``declared`` (tf_dp cannot check it), whatever its ``origin`` says.

        Example::

            opt.set_sampling(tf_dp.data.Sampling(60_000, 256 / 60_000))
            opt.set_sampling(tf_dp.data.Sampling(5_000, 0.02, unit="user", records_per_unit=4))
        """
        if isinstance(population_size, Sampling):
            if selection_probability is not None:
                raise TypeError("pass a Sampling alone, or (population_size, selection_probability)")
            sampling = population_size
        else:
            sampling = _declared(population_size, selection_probability, sampling_policy)
        if not self._declaring_from_fit:
            sampling = dataclasses.replace(sampling, origin="declared")
        self._engine.set_sampling(sampling)
        self._sampling_from_fit = self._declaring_from_fit

    @property
    def records_per_user(self) -> Optional[int]:
        """``k`` when the sampling in force is user-level (each user's records clipped together),
        else None."""
        sampling = self._engine.sampling
        return sampling.records_per_unit if sampling is not None and sampling.unit == "user" else None

    @property
    def sampling(self) -> Optional[Sampling]:
        """The declared :class:`~tf_dp.engine.Sampling` (None before any declaration)."""
        return self._engine.sampling

    @property
    def sampling_configured(self) -> bool:
        return self._engine.sampling is not None

    def start_pass(self) -> None:
        """Marks the next DP step as the first of a new pass over the data (eager).

        ``fit`` calls it at the start of every epoch and ``train_on_batch`` before every call;
        call it yourself in a custom loop wherever the loop starts a new pass over its data.
        """
        self._engine.start_pass()

    def declare_fit_sampling(self, sampling: Sampling) -> None:
        """A sampling ``fit`` derived from its own input (tf_dp drew or batched the data itself:
        recorded with the sampling's own ``origin``): valid until :meth:`end_fit`."""
        self._declaring_from_fit = True
        try:  # through set_sampling, so that subclasses' checks (DP-FTRL's policy) apply
            self.set_sampling(sampling)
        finally:
            self._declaring_from_fit = False

    def end_fit(self) -> None:
        """Called when a ``fit`` returns: forgets the sampling that ``fit`` derived from its input
        (a later ``fit`` on another input must declare its own) and reports withheld steps."""
        if self._sampling_from_fit:
            self._engine.sampling = None
            self._sampling_from_fit = False
        self.after_compiled_call()

    def after_compiled_call(self) -> None:
        """Flushes the ledger's staging table and logs DP steps withheld as non-finite (eager);
        raises if a compiled step met a non-finite clip or noise (it recorded nothing)."""
        self._engine.flush()

    @property
    def skipped_steps(self) -> int:
        """DP steps whose noised update was not finite: withheld, but recorded in the ledger."""
        return self._engine.skipped_steps

    def next_sample_entry(self, steps_ahead: int = 0):
        """The :class:`~tf_dp.ledger.events.SampleEntry` the next DP step (``iterations``, or
        ``steps_ahead`` steps after it) will record; :class:`tf_dp.keras.PrivacyBudget` uses it
        to stop before a step that would overspend."""
        return self._engine.next_sample_entry(int(self.iterations.numpy()), steps_ahead)  # type: ignore

    def clipper_for(self, model: Any) -> GradientClipper:
        """Resolves (once) the gradient clipper for ``model``."""
        return self._engine.clipper_for(model)

    # -- the private step ----------------------------------------------------------------------

    def private_gradients(
        self, loss_fn: Any, data: Any, variables: list, model: Any = None, check: Any = None
    ):
        """The engine's DP step at ``self.iterations``: ``(clipped, noised mean gradients)``
        (``check(clipped)`` runs before anything is noised or recorded)."""
        return self._engine.private_gradients(
            loss_fn, data, variables, self.iterations, model, check  # type: ignore[attr-defined]
        )

    def dp_aggregate(self, clipped: ClippedGradients) -> list[tf.Tensor]:
        """Noise and record, all-reduce, divide by the public denominator (the engine's)."""
        return self._engine.noised_mean(clipped)

    def apply_dp_gradients(self, grads, trainable_variables) -> None:
        """Applies gradients produced by the engine (the only way in); a non-finite update, or
        one the ledger had no room to record, is withheld (see ``DPEngine.apply``)."""
        if not self.built:  # build outside the conditional update
            self.build(trainable_variables)  # type: ignore[attr-defined]

        def base_apply(g, v):
            self._dp_applying = True
            try:
                super(DPOptimizerMixin, self).apply(g, v)  # type: ignore[misc]
            finally:
                self._dp_applying = False

        self._engine.apply(grads, trainable_variables, base_apply)

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
        ledger_store.write_ledger(store, *self.ledger.tables())

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
        """Restores a saved ledger (tables from ``ledger.tables()``), never losing steps."""
        self._engine.restore_ledger_tables(samples, queries)

    def inherit_ledger(self, previous: "DPOptimizerMixin") -> None:
        """Continues ``previous``'s ledger (a private model recompiled with a new DP optimizer)."""
        self._engine.continue_ledger(previous.engine, int(previous.iterations.numpy()))

    def check_ledger_covers_steps(self) -> None:
        """Raises if the optimizer applied more steps than its ledger records (e.g. a model
        reloaded from a file without its ledger): the budget would ignore steps taken."""
        self._engine.check_ledger_covers(int(self.iterations.numpy()))  # type: ignore

    # -- serialisation -------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        """Keras config. With ``dp_sum_query``, the query's config (``serialize_query``: the
        Gaussian, automatic, adaptive, nested and normalized queries; an adaptive query's current
        clip included); NotImplementedError naming the query class for the others."""
        config = super().get_config()  # type: ignore[misc]
        privacy, speed = self._engine.privacy, self._engine.speed
        if self._custom_query:
            config["dp_sum_query"] = serialize_query(self._engine.query)
        config.update(
            {
                "l2_norm_clip": _serialize_value(privacy.l2_norm_clip),
                "noise_multiplier": _serialize_value(privacy.noise_multiplier),
                "noise_stddev": _serialize_value(privacy.noise_stddev),
                "num_microbatches": privacy.num_microbatches,
                "gradient_mode": speed.gradient_mode,
                "jl_projections": speed.jl_projections,
                "jl_method": speed.jl_method,
                "max_physical_batch_size": speed.max_physical_batch_size,
                "noise_mode": privacy.noise_mode,
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



def _declared(population_size: Any, selection_probability: Any, policy: str) -> Sampling:
    """The 3-argument declaration as a :class:`Sampling` (checked by the ledger's rules first,
    so the messages name the argument as before)."""
    from tf_dp.dp_query.validation import check_scalar
    from tf_dp.ledger.privacy_ledger import policy_code

    if isinstance(population_size, bool) or not isinstance(population_size, int) or (
        population_size < 1
    ):
        raise ValueError(f"population_size must be an integer >= 1, got {population_size!r}")
    q = check_scalar("selection_probability", selection_probability, allow_zero=False)
    if q > 1:
        raise ValueError(f"selection_probability must be in (0, 1], got {q}")
    policy_code(policy)
    return Sampling(population_size, float(q), policy=policy)


def _serialize_value(value: Any) -> Any:
    """Numbers as they are; schedules as Keras serialises learning-rate schedules."""
    if value is None or not is_schedule(value):
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
