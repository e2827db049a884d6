"""DP Keras optimizers: Keras 3 optimizers whose updates come from the DP engine.

Keras 3 trainers hand optimizers batch-averaged gradients, too late for per-example clipping. So
the per-example work happens in the DP model's ``train_step`` (``make_private`` / ``DPSequential``
/ ``DPModel``) or in a custom loop's :class:`tf_dp.keras.DPTrainStep`, both through the
optimizer's :class:`~tf_dp.engine.DPEngine` (:attr:`DPOptimizerMixin.engine`): clip, noise and
record, divide by the public denominator. The optimizer holds the engine, keeps the Keras names,
arguments and saved config (``optimizer_saving.py``), hands the engine the base optimizer's
update, and carries the ledger in its saved variables; sampling declarations are in
``optimizer_sampling.py``. A DP optimizer handed ordinary gradients (a model that
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

import logging
from typing import Any, Callable, Optional

import keras
import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.engine import DPEngine, PrivacyConfig, SpeedConfig
from tf_dp.gradients import ClippedGradients
from tf_dp.keras.optimizer_sampling import OptimizerSampling
from tf_dp.keras.optimizer_settings import OptimizerSettings
from tf_dp.keras.optimizer_saving import OptimizerSaving

_logger = logging.getLogger("tf_dp")


class DPOptimizerMixin(OptimizerSettings, OptimizerSampling, OptimizerSaving):
    """The Keras side of every DP optimizer class: an engine and the DP step; from its bases,
    the settings read from the engine (``optimizer_settings.py``), sampling declarations
    (``optimizer_sampling.py``) and saving (``optimizer_saving.py``)."""

    #: False for optimizers whose steps are not accounted as DP-SGD steps (DP-FTRL's tree)
    _calibrates_as_dp_sgd = True

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
        sparse_embeddings: Any = None,
    ) -> None:
        privacy = PrivacyConfig(
            l2_norm_clip, noise_multiplier, noise_stddev, dp_sum_query, noise_mode,
            num_microbatches, noise_seed, sparse_embeddings,
        )
        speed = SpeedConfig(gradient_mode, max_physical_batch_size, jl_projections, jl_method)
        self._engine = DPEngine(
            privacy, speed, name=self.name, owner=type(self).__name__,
            placeholder_state=placeholder_state,
        )
        self._custom_query = dp_sum_query is not None
        self._sampling_from_fit = False
        self._dp_applying = False

    # -- target epsilon in, noise out ---------------------------------------------------------

    @classmethod
    def for_target_epsilon(
        cls,
        target_epsilon: float,
        delta: float,
        *,
        n: int,
        batch_size: int,
        epochs: Optional[float] = None,
        steps: Optional[int] = None,
        accountant: str = "rdp",
        **kwargs: Any,
    ):
        """This DP optimizer with the smallest noise multiplier that keeps a DP-SGD run within
        ``(target_epsilon, delta)``: the noise comes from
        :func:`tf_dp.accounting.calibrate_noise_multiplier` (same arguments; the run it plans
        draws Poisson batches of expected size ``batch_size`` from ``n`` examples, for
        ``epochs`` expected passes, ``ceil(epochs * n / batch_size)`` steps, or for ``steps``).

        Train with ``tf_dp.data.poisson_batches(x, y, sampling_probability=batch_size / n)``
        for at most that many steps (``PrivacyBudget(target_epsilon, delta)`` stops a run that
        would go further). ``kwargs`` are the optimizer's other arguments (``l2_norm_clip`` is
        required; ``noise_multiplier``, ``noise_stddev`` and ``dp_sum_query`` are refused, the
        calibration sets the noise). With ``num_microbatches`` the calibration assumes
        microbatches of several examples (sensitivity ``2C``); with ``gradient_mode="jl"`` it
        counts the ``jl_projections`` norm releases; with ``sparse_embeddings`` (DP-AdaFEST) the
        calibration is of the step's two Gaussians together, and ``noise_multiplier`` is the
        gradient's share ``sigma2`` (``sigma1^-2 + sigma2^-2 = sigma^-2``); with DP-FEST's fixed
        ``rows`` the step is the gradient's Gaussian alone. The calibrated value is
        ``optimizer.noise_multiplier``.

        Example::

            opt = tf_dp.keras.DPKerasSGDOptimizer.for_target_epsilon(
                3.0, 1e-5, n=60000, batch_size=256, epochs=15,
                l2_norm_clip=1.0, learning_rate=0.15)
            opt.noise_multiplier     # 0.774...
        """
        from tf_dp.accounting import calibrate_noise_multiplier

        for name in ("noise_multiplier", "noise_stddev", "dp_sum_query"):
            if kwargs.get(name) is not None:
                raise ValueError(
                    f"{cls.__name__}.for_target_epsilon sets the noise from target_epsilon: "
                    f"{name} must not be given, got {name}={kwargs[name]!r}"
                )
        if not cls._calibrates_as_dp_sgd:
            raise TypeError(
                f"{cls.__name__} is not accounted as DP-SGD steps; calibrate its noise with its "
                "own accountant"
            )
        if kwargs.get("l2_norm_clip") is None:
            raise ValueError(
                f"{cls.__name__}.for_target_epsilon needs l2_norm_clip (a finite number > 0, or "
                "a schedule)"
            )
        num_microbatches = kwargs.get("num_microbatches")
        jl_projections = kwargs.get("jl_projections")
        sigma = calibrate_noise_multiplier(
            target_epsilon, delta, n, batch_size, epochs=epochs, steps=steps,
            accountant=accountant, sampling="poisson",
            microbatch_size=None if num_microbatches is None else 2,
            jl_projections=jl_projections if kwargs.get("gradient_mode") == "jl" else None,
        )
        sparse = kwargs.get("sparse_embeddings")
        if sparse is not None and getattr(sparse, "rows", None) is None:
            # the step is two Gaussians of one sample: the calibrated sigma is their combined
            # multiplier (sigma1^-2 + sigma2^-2 = sigma^-2), and the gradient gets sigma2
            sigma1 = float(getattr(sparse, "selection_noise_multiplier", 0.0))
            if not sigma1 > sigma:
                raise ValueError(
                    f"{cls.__name__}.for_target_epsilon: sparse_embeddings' "
                    f"selection_noise_multiplier ({sigma1:g}) alone costs more than the target "
                    f"allows (the whole step may have a combined noise multiplier of {sigma:.6g}"
                    "); accepted: selection_noise_multiplier > that value")
            sigma = (sigma**-2 - sigma1**-2) ** -0.5
        _logger.info(
            "tf_dp: noise_multiplier=%.6g keeps %s at epsilon <= %g, delta=%g (%s accountant; "
            "Poisson batches of expected size %d of %d examples)", sigma, cls.__name__,
            target_epsilon, delta, accountant, batch_size, n,
        )
        return cls(noise_multiplier=sigma, **kwargs)

    # -- the private step ----------------------------------------------------------------------

    def dp_step(
        self,
        loss_fn: Any,
        data: Any,
        variables: list,
        model: Any = None,
        check: Any = None,
        extra_gradients: Optional[Callable[[], Optional[list]]] = None,
    ) -> ClippedGradients:
        """One whole DP step at ``self.iterations`` (:meth:`tf_dp.engine.DPEngine.step`): clip,
        noise and record, divide, add ``extra_gradients()`` (called after the noise: gradients
        that do not depend on the data, one per variable, or None),
        apply with the base optimizer's update. Returns the clipped gradients (losses,
        predictions). ``check(clipped)`` runs before anything is noised or recorded.

        Example::

            clipped = opt.dp_step(PerExampleLoss(model), (x, y, None), model.trainable_variables)
        """
        def before_apply():
            # after the clipped sum (the graph's op order, hence seeded draws, as with
            # private_gradients + apply_dp_gradients): the extra gradients, then the optimizer's
            # slots, built outside the conditional update
            extra = extra_gradients() if extra_gradients is not None else None
            self._build_for(variables)
            return extra

        return self._engine.step(
            loss_fn, data, variables, self.iterations, self._base_apply,  # type: ignore
            model=model, check=check, extra_gradients=before_apply,
        )

    def private_gradients(
        self, loss_fn: Any, data: Any, variables: list, model: Any = None, check: Any = None
    ):
        """The engine's DP step at ``self.iterations`` without the update: ``(clipped, noised mean
        gradients)`` (``check(clipped)`` runs before anything is noised or recorded); apply them
        with :meth:`apply_dp_gradients`."""
        return self._engine.private_gradients(
            loss_fn, data, variables, self.iterations, model, check  # type: ignore[attr-defined]
        )

    def dp_aggregate(self, clipped: ClippedGradients) -> list[tf.Tensor]:
        """Noise and record, all-reduce, divide by the public denominator (the engine's)."""
        return self._engine.noised_mean(clipped)

    def apply_dp_gradients(self, grads, trainable_variables) -> None:
        """Applies gradients produced by the engine (the only way in); a non-finite update, or
        one the ledger had no room to record, is withheld (see ``DPEngine.apply``)."""
        self._build_for(trainable_variables)
        self._engine.apply(grads, trainable_variables, self._base_apply)

    def _build_for(self, variables: list) -> None:
        if not self.built:  # type: ignore[attr-defined]  # outside the conditional update
            self.build(variables)  # type: ignore[attr-defined]

    def _base_apply(self, grads: list, variables: list) -> None:
        """The base Keras optimizer's update (the engine calls it; :meth:`apply` refuses others)."""
        self._dp_applying = True
        try:
            super(DPOptimizerMixin, self).apply(grads, variables)  # type: ignore[misc]
        finally:
            self._dp_applying = False

    def apply(self, grads, trainable_variables=None):
        if not self._dp_applying:
            raise RuntimeError(
                f"{type(self).__name__} was handed batch-averaged gradients: the model was not "
                "made private, so per-example clipping and noise cannot happen. Wrap the model "
                "with tf_dp.keras.make_private(model) (or use tf_dp.keras.DPSequential / DPModel)."
            )
        return super().apply(grads, trainable_variables)  # type: ignore[misc]

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
        sparse_embeddings: Any = None,
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
            sparse_embeddings=sparse_embeddings,
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
        "  sparse_embeddings: None, or a tf_dp.keras.SparseEmbeddingConfig: the model's\n"
        "    keras.layers.Embedding tables get DP-AdaFEST updates (noise only on privately\n"
        "    selected rows, applied as tf.IndexedSlices); see docs/sparse_embeddings.md.\n"
    )
    cls = type(name, (DPOptimizerMixin, optimizer_class), {"__init__": __init__, "__doc__": doc})
    cls.__module__ = __name__
    cls = keras.saving.register_keras_serializable(package="tf_dp", name=name)(cls)
    _CLASS_CACHE[optimizer_class] = cls
    return cls


DPKerasSGDOptimizer = make_dp_optimizer_class(keras.optimizers.SGD)
DPKerasAdamOptimizer = make_dp_optimizer_class(keras.optimizers.Adam)
DPKerasAdagradOptimizer = make_dp_optimizer_class(keras.optimizers.Adagrad)
