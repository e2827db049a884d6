"""DP-MF: SGD (optionally with momentum) on gradients noised with correlated noise.

DP matrix factorization (banded, "BandMF", Choquette-Choo et al. 2023; buffered linear Toeplitz,
"BLT", Dvijotham, McMahan et al. 2024) adds to step ``t``'s clipped sum the ``t``-th row of
``C^{-1} Z`` instead of fresh noise: the noise of later steps cancels part of the earlier steps'
noise in the model's parameters (prefix sums, or momentum's weighted sums, for which the strategy
was optimised). :class:`DPKerasMFOptimizer` is a DP SGD optimizer whose sum query is
:class:`tf_dp.correlated.noise_tf.CorrelatedNoiseSumQuery`, carried by the optimizer's engine as
the query's global state (the step counter and the strategy's buffers: ``b - 1`` model-sized
buffers for a band ``b``, ``d`` for a BLT of ``d`` buffers).

The noise state is saved with the optimizer (``.keras`` files, ``save_weights``,
``BackupAndRestore``, ``ModelCheckpoint``, ``tf.train.Checkpoint``) and restored before the
next step, so a resumed run continues the same correlated mechanism. The state holds past noise:
keep checkpoints as private as the training data (only the trained model is protected).

Example::

    strategy = tf_dp.correlated.strategies.BandedStrategy.optimize(num_steps=1000, bands=8)
    model = tf_dp.keras.make_private(model)
    model.compile(
        optimizer=tf_dp.keras.DPKerasMFOptimizer(
            l2_norm_clip=1.0, noise_multiplier=2.0, strategy=strategy, learning_rate=0.5),
        loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=250, epochs=5)
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp.correlated.noise_tf import CorrelatedNoiseState, CorrelatedNoiseSumQuery, recurrence_of
from tf_dp.keras.ftrl import StatefulNoiseSGD, _spec_of

__all__ = ["DPKerasMFOptimizer"]

#: keys of the noise state in a saved optimizer's variable store
_STEP_KEY = "tf_dp_mf_step"
_BUFFER_KEY = "tf_dp_mf_buffer_"


def _is_state_key(key: str) -> bool:
    return key == _STEP_KEY or key.startswith(_BUFFER_KEY)


def _recurrence_config(recurrence: Any) -> dict[str, Any]:
    if hasattr(recurrence, "coef"):
        return {"coef": np.asarray(recurrence.coef, np.float64).tolist()}
    return {
        "omega": np.asarray(recurrence.omega, np.float64).tolist(),
        "theta": np.asarray(recurrence.theta, np.float64).tolist(),
    }


class _Recurrence:
    """A recurrence rebuilt from a saved config (attributes as the strategies' dataclasses)."""

    def __init__(self, **arrays: Any) -> None:
        for name, value in arrays.items():
            setattr(self, name, np.asarray(value, np.float64))


@keras.saving.register_keras_serializable(package="tf_dp", name="DPKerasMFOptimizer")
class DPKerasMFOptimizer(StatefulNoiseSGD):
    """DP-MF: SGD, optionally with momentum, on gradients with correlated (matrix factorization)
    noise.

    Every step clips the per-example gradients to ``l2_norm_clip``, adds the batch's clipped sum
    and the step's row of ``C^{-1} Z`` (``Z`` i.i.d. ``N(0, (noise_multiplier *
    l2_norm_clip)^2)``) and divides by the batch size (the sampling's public denominator).

    Args:
      learning_rate, momentum: as for ``keras.optimizers.SGD`` (``nesterov`` is not offered).
      l2_norm_clip: per-example L2 clip ``C`` (finite, > 0).
      noise_multiplier: ``z``; each entry of ``Z`` has stddev ``z * C`` (finite, >= 0).
      strategy: a strategy of ``tf_dp.correlated.strategies`` (banded or BLT) or its
        ``noise_recurrence()``.
      num_microbatches, gradient_mode, max_physical_batch_size: as for the other DP optimizers
        (``"jl"`` is refused: no accountant analyses matrix factorization with JL clipping).
      noise_seed: tests and debugging only (a known seed voids the guarantee).
    """

    _mechanism = "matrix factorization"

    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        *,
        l2_norm_clip: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        strategy: Any = None,
        num_microbatches: Optional[int] = None,
        gradient_mode: str = "auto",
        noise_seed: Optional[int] = None,
        max_physical_batch_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        l2_norm_clip, noise_multiplier = self._check_noise_arguments(
            l2_norm_clip, noise_multiplier, gradient_mode, kwargs)
        if strategy is None:
            raise ValueError(
                "DPKerasMFOptimizer needs strategy: a banded or BLT strategy of "
                "tf_dp.correlated.strategies (or its noise_recurrence())"
            )
        recurrence_of(strategy)  # validates it before anything is built
        keras.optimizers.SGD.__init__(self, learning_rate, momentum=momentum, **kwargs)
        query = CorrelatedNoiseSumQuery(  # a strategy's config goes into every ledger row
            l2_norm_clip,
            noise_multiplier * l2_norm_clip,
            strategy,
            seed=noise_seed,
        )
        self._mf_query = query
        self._mf_strategy = strategy
        self._init_dp(
            None,
            None,
            num_microbatches,
            gradient_mode,
            None,
            query,
            noise_seed,
            max_physical_batch_size=max_physical_batch_size,
            placeholder_state=CorrelatedNoiseState(0, [], query.l2_norm_clip, query.stddev),
        )
        self._custom_query = False
        self._noise_clip, self._noise_z = l2_norm_clip, noise_multiplier
        self._pending_state: Optional[dict[str, np.ndarray]] = None

    @classmethod
    def for_target_epsilon(
        cls,
        target_epsilon: float,
        delta: float,
        *,
        strategy: Any,
        period: Optional[int] = None,
        sampling_probability: Optional[float] = None,
        accountant: str = "pld",
        **kwargs: Any,
    ) -> "DPKerasMFOptimizer":
        """This optimizer with the smallest noise multiplier whose run stays within
        ``(target_epsilon, delta)``, from
        :func:`tf_dp.accounting.matrix_factorization.calibrate_mf_noise`: without amplification
        for participations every ``period`` steps (fixed batches in a fixed order, ``period``
        batches per epoch; None: each record in one step), or, with ``sampling_probability``,
        amplified BandMF under cyclic Poisson sampling (:func:`tf_dp.data.cyclic_poisson_batches`
        with ``num_parts`` equal to the strategy's bands). ``kwargs``: the other arguments
        (``l2_norm_clip`` required; ``noise_multiplier`` is set here).

        The target holds for a run of at most ``strategy.num_steps`` steps: the noise is
        calibrated for that many releases, and later steps (which reuse the strategy's last row)
        spend more; ``mf_epsilon_from_ledger`` on the saved ledger always reports the run's own
        figure, for the steps it recorded.

        Example::

            strategy = BandedStrategy.optimize(num_steps=400, bands=8)
            opt = DPKerasMFOptimizer.for_target_epsilon(
                3.0, 1e-5, strategy=strategy, period=8, l2_norm_clip=1.0, learning_rate=0.5)
        """
        from tf_dp.accounting.matrix_factorization import calibrate_mf_noise

        if kwargs.get("noise_multiplier") is not None:
            raise ValueError(
                "DPKerasMFOptimizer.for_target_epsilon sets the noise from target_epsilon: "
                f"noise_multiplier must not be given, got {kwargs['noise_multiplier']!r}"
            )
        kwargs.pop("noise_multiplier", None)
        z = calibrate_mf_noise(
            strategy,
            target_epsilon,
            delta,
            period=period,
            sampling_probability=sampling_probability,
            accountant=accountant,
        )
        return cls(noise_multiplier=z, strategy=strategy, **kwargs)

    @property
    def strategy(self) -> Any:
        """The strategy (or recurrence) the noise comes from."""
        return self._mf_strategy

    @property
    def noise_query(self) -> CorrelatedNoiseSumQuery:
        return self._mf_query

    @property
    def mf_step(self) -> int:
        """Steps of correlated noise released so far (the next step uses row ``mf_step``)."""
        if not self._engine.state_built:
            pending = self._pending_state
            return 0 if pending is None else int(np.asarray(pending[_STEP_KEY]))
        return int(self._engine.global_state.step.numpy())

    # -- the mechanism for the ledger ----------------------------------------------------------

    def mf_event(
        self,
        participation: Optional[str] = None,
        period: Optional[int] = None,
        sampling_probability: Optional[float] = None,
    ):
        """The run's :class:`tf_dp.ledger.events.MatrixFactorizationEvent` (strategy config,
        noise, clip, participation), what the accountant needs beside the ledger's steps.

        By default the participation comes from the declared (or last recorded) sampling: cyclic
        Poisson batches
        (``tf_dp.data.cyclic_poisson_batches``) give ``cyclic_poisson`` with their parts and rate.
        Otherwise pass it: ``"periodic"`` with ``period`` (fixed batches in a fixed order,
        ``period`` per epoch) or ``"single"`` (each record in at most one step).
        """
        from tf_dp.ledger.events import MatrixFactorizationEvent

        strategy = self._mf_strategy
        if not hasattr(strategy, "to_config"):
            raise TypeError(
                "mf_event needs a strategy of tf_dp.correlated.strategies (with to_config()); "
                f"this optimizer was given a bare {type(strategy).__name__}"
            )
        sampling = self._engine.sampling
        runs = self._engine.ledger.runs()
        if sampling is None and runs:  # after fit: the sampling its input declared, as recorded
            sampling = runs[-1][0].sampling
        if participation is None:
            if sampling is None or sampling.policy != "cyclic_poisson":
                raise ValueError(
                    "participation is required unless the batches are cyclic Poisson: "
                    "'periodic' (with period: fixed batches in a fixed order) or 'single'; got "
                    f"a declared sampling {None if sampling is None else sampling.policy!r}"
                )
            participation, period = "cyclic_poisson", sampling.num_parts
            sampling_probability = sampling.selection_probability
        return MatrixFactorizationEvent(
            strategy.to_config(),
            self._noise_z,
            self._noise_clip,
            participation,
            period=period,
            sampling_probability=sampling_probability,
        )

    def save_ledger(self, path: Any, **participation: Any) -> None:
        """Saves the ledger with the run's :meth:`mf_event` in its (checksummed) metadata, the
        file ``tf_dp.accounting.matrix_factorization.mf_epsilon_from_ledger`` reads.

        Example::

            opt.save_ledger("run.ledger.json")          # cyclic Poisson batches
            mf_epsilon_from_ledger("run.ledger.json", delta=1e-5)
        """
        from tf_dp.ledger.events import MF_METADATA_KEY

        event = self.mf_event(**participation)
        self._engine.ledger.save(path, metadata={MF_METADATA_KEY: event.to_dict()})

    # -- the noise state -----------------------------------------------------------------------

    def _build_noise_state(self, records: list) -> None:
        """The noise state (one buffer stack per variable), carried by the engine (once)."""
        if self._engine.state_built:
            return
        self._mf_query.set_record_specs([_spec_of(r) for r in records])
        self._engine.build_state()
        state = self._engine.global_state
        # tracked by tf.train.Checkpoint through the optimizer
        self._mf_state_variables = [state.step] + list(tf.nest.flatten(state.buffers))
        if self._pending_state is not None:  # loaded before the state existed
            pending, self._pending_state = self._pending_state, None
            with tf.init_scope():  # once, also when first built while a step is traced
                self._assign_state(pending)

    def _state_arrays(self) -> dict[str, np.ndarray]:
        state = self._engine.global_state
        out = {_STEP_KEY: np.asarray(state.step.numpy())}
        for i, buf in enumerate(tf.nest.flatten(state.buffers)):
            out[f"{_BUFFER_KEY}{i}"] = buf.numpy()
        return out

    def _assign_state(self, arrays: dict[str, np.ndarray]) -> None:
        state = self._engine.global_state
        buffers = tf.nest.flatten(state.buffers)
        keys = [f"{_BUFFER_KEY}{i}" for i in range(len(buffers))]
        if sorted(keys) != sorted(k for k in arrays if k != _STEP_KEY):
            raise ValueError(
                f"the saved noise state has {len(arrays) - 1} buffer stacks, the model "
                f"{len(buffers)} trainable variables"
            )
        for key, buf in zip(keys, buffers):
            value = np.asarray(arrays[key])
            if tuple(value.shape) != tuple(buf.shape):
                raise ValueError(
                    f"the saved noise buffer {key} has shape {value.shape}, the optimizer's "
                    f"{tuple(buf.shape)} (another strategy or model?)"
                )
            buf.assign(value)
        state.step.assign(int(np.asarray(arrays[_STEP_KEY])))

    def save_own_variables(self, store) -> None:
        """Saves the optimizer's variables, its ledger and the noise state."""
        super().save_own_variables(store)
        if self._engine.state_built:
            for key, value in self._state_arrays().items():
                store[key] = value

    def load_own_variables(self, store) -> None:
        """Restores the optimizer's variables, its ledger and the noise state (the noise
        continues where the saved run stopped)."""
        arrays = {k: np.asarray(store[k]) for k in store.keys() if _is_state_key(k)}
        rest = {k: store[k] for k in store.keys() if not _is_state_key(k)}
        super().load_own_variables(rest)
        if arrays:
            if self._engine.state_built:
                self._assign_state(arrays)
            else:
                self._pending_state = arrays

    # -- config ----------------------------------------------------------------------------------

    def get_config(self) -> dict[str, Any]:
        config = self._noise_config()
        strategy = self._mf_strategy
        if hasattr(strategy, "to_config"):
            saved = {"class": type(strategy).__name__, "config": strategy.to_config()}
        else:
            saved = {"recurrence": _recurrence_config(self._mf_query.recurrence)}
        config["strategy"] = saved
        return config

    @classmethod
    def from_config(cls, config: dict[str, Any], custom_objects: Any = None):
        config = dict(config)
        if isinstance(config.get("learning_rate"), dict):
            config["learning_rate"] = keras.saving.deserialize_keras_object(
                config["learning_rate"], custom_objects=custom_objects
            )
        saved = config.get("strategy")
        if isinstance(saved, dict):
            if "recurrence" in saved:
                config["strategy"] = _Recurrence(**saved["recurrence"])
            else:
                from tf_dp.correlated import strategies

                config["strategy"] = getattr(strategies, saved["class"]).from_config(
                    saved["config"]
                )
        return cls(**config)
