"""DP-FTRL: private training by tree aggregation, without sampling amplification.

Kairouz, McMahan, Song, Thakkar, Thakurta and Xu, "Practical and private (deep) learning without
sampling or shuffling" (ICML 2021). DP-FTRL (without regulariser) sets
``theta_m = theta_0 - lr * S_m`` where ``S_m`` is the noised sum of the first ``m`` clipped batch
gradients, released by the binary tree mechanism (:class:`tf_dp.TreeCumulativeSumQuery`). Plain
SGD on the differences ``S_m - S_{m-1}`` (:class:`tf_dp.TreeResidualSumQuery`) reaches exactly the
same parameters, and SGD with momentum on them is the paper's momentum variant (DP-FTRLM), so
:class:`DPKerasFTRLOptimizer` is a DP SGD optimizer whose sum query is the residual tree query,
with the tree's state (a fixed-depth stack of node noises) carried by the optimizer's engine as the
query's global state (``tf_dp.engine.DPEngine`` keeps the state ``get_noised_result`` returns).

Privacy does not come from sampling: batches are fixed-size, each example used once per epoch,
shuffled or in a fixed order, and the ledger records them as such (policy ``shuffle``, no
amplification). Poisson-sampled input is refused (no accountant analyses tree aggregation under
it). The tree restarts every epoch by default (``restart_every="epoch"``): the setting the paper's
multi-epoch accounting is stated for (``tf_dp.accounting.tree``).

Example::

    model = tf_dp.keras.make_private(model)
    model.compile(
        optimizer=tf_dp.keras.DPKerasFTRLOptimizer(
            l2_norm_clip=1.0, noise_multiplier=2.0, learning_rate=0.5, momentum=0.9),
        loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=250, epochs=5)         # in-memory arrays: fixed-size batches
    tf_dp.accounting.compute_epsilon(model.optimizer.ledger, delta=1e-5)
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Union

import keras
import tensorflow as tf

from tf_dp.dp_query.tree_aggregation import MAX_DEPTH, TreeResidualSumQuery, TreeState, tree_depth
from tf_dp.engine import Sampling
from tf_dp.engine.validation import check_number, python_number
from tf_dp.keras.optimizers import DPOptimizerMixin

_logger = logging.getLogger("tf_dp")

__all__ = ["DPKerasFTRLOptimizer"]


def _spec_of(g: Any) -> tf.TensorSpec:
    if not isinstance(g, (tf.Tensor, tf.IndexedSlices, tf.TensorSpec)):  # a variable
        return tf.TensorSpec(tf.TensorShape(g.shape), tf.as_dtype(g.dtype))
    if isinstance(g, tf.IndexedSlices):
        shape = tf.get_static_value(g.dense_shape)
        if shape is None:
            raise ValueError("DPKerasFTRLOptimizer needs gradients of static shape")
        return tf.TensorSpec(tf.TensorShape([int(d) for d in shape]), g.values.dtype)
    return tf.TensorSpec(g.shape, g.dtype)


class StatefulNoiseSGD(DPOptimizerMixin, keras.optimizers.SGD):
    """What the SGD optimizers with stateful, correlated noise share (DP-FTRL's tree,
    :class:`tf_dp.keras.DPKerasMFOptimizer`'s matrix factorization): the argument checks, the
    noise state sized from the trainable variables on the first step (eager or traced) and built
    once, and the common config. A subclass names its mechanism (``_mechanism``, for messages)
    and builds its state in :meth:`_build_noise_state`."""

    #: the mechanism, in messages ("tree aggregation", "matrix factorization")
    _mechanism = ""
    _calibrates_as_dp_sgd = False  # correlated noise: not DP-SGD's accounting

    def _check_noise_arguments(self, l2_norm_clip: Any, noise_multiplier: Any,
                               gradient_mode: str, kwargs: dict) -> tuple[float, float]:
        """Checks the arguments every such optimizer takes (before anything is built) and returns
        ``(l2_norm_clip, noise_multiplier)`` as floats; ``kwargs`` loses ``nesterov``."""
        name = type(self).__name__
        if kwargs.get("nesterov"):
            raise ValueError(f"{name} does not offer nesterov momentum")
        kwargs.pop("nesterov", None)
        for arg in ("dp_sum_query", "jl_projections"):
            if arg in kwargs:
                raise TypeError(f"{name} does not take {arg}")
        l2_norm_clip, noise_multiplier = python_number(l2_norm_clip), python_number(noise_multiplier)
        if l2_norm_clip is None or noise_multiplier is None:
            raise ValueError(
                f"{name} needs l2_norm_clip (a finite number > 0) and "
                "noise_multiplier (a finite number >= 0)"
            )
        check_number("l2_norm_clip", l2_norm_clip, positive=True)
        check_number("noise_multiplier", noise_multiplier, positive=False)
        if gradient_mode == "jl":
            raise ValueError(
                f"gradient_mode='jl' cannot be used with {name}: no accountant "
                f"analyses {self._mechanism} with JL clipping; use 'auto', 'vectorized', "
                "'microbatch' or 'ghost'"
            )
        return float(l2_norm_clip), float(noise_multiplier)  # the subclass keeps them, after
        # keras's __init__, as _noise_clip and _noise_z

    @property
    def l2_norm_clip(self) -> float:
        return self._noise_clip

    @property
    def noise_multiplier(self) -> float:
        return self._noise_z

    def _build_noise_state(self, records: list) -> None:
        """Builds the noise state for ``records`` (one per trainable variable), once."""
        raise NotImplementedError

    def build(self, variables) -> None:
        super().build(variables)
        self._build_noise_state(list(variables))

    def private_gradients(self, loss_fn, data, variables, model=None, check=None):
        # the first (traced) step, before Keras builds the optimizer: size the state from the
        # variables (variables created on the first trace are allowed by tf.function)
        self._build_noise_state(list(variables))
        return super().private_gradients(loss_fn, data, variables, model, check)

    def dp_step(self, loss_fn, data, variables, model=None, check=None, extra_gradients=None):
        self._build_noise_state(list(variables))  # as in private_gradients
        return super().dp_step(loss_fn, data, variables, model, check, extra_gradients)

    def dp_aggregate(self, clipped):
        # the first (traced) step, before Keras builds the optimizer: size the state from the
        # clipped sum (one tensor per trainable variable)
        self._build_noise_state(tf.nest.flatten(clipped.clipped_sum))
        return super().dp_aggregate(clipped)

    def _noise_config(self) -> dict[str, Any]:
        """SGD's config (without ``nesterov``) and the arguments every such optimizer takes."""
        config = keras.optimizers.SGD.get_config(self)
        config.pop("nesterov", None)
        config.update(
            {
                "l2_norm_clip": self._noise_clip,
                "noise_multiplier": self._noise_z,
                "num_microbatches": self.num_microbatches,
                "gradient_mode": self.gradient_mode,
                "max_physical_batch_size": self.max_physical_batch_size,
            }
        )
        return config


@keras.saving.register_keras_serializable(package="tf_dp", name="DPKerasFTRLOptimizer")
class DPKerasFTRLOptimizer(StatefulNoiseSGD):
    """DP-FTRL (Kairouz et al. 2021): SGD, optionally with momentum, on tree-aggregated gradients.

    Every step clips the per-example gradients to ``l2_norm_clip``, adds the batch's clipped sum
    as the next leaf of a binary tree whose nodes carry ``N(0, (noise_multiplier *
    l2_norm_clip)^2)`` noise, and applies the residual ``S_m - S_{m-1}`` of the noised prefix sums
    (divided by the batch size) as the gradient. With ``momentum=0`` the parameters after ``m``
    steps of a tree are exactly ``theta_0 - lr / b * S_m`` (DP-FTRL); with momentum, DP-FTRLM.

    Args:
      learning_rate, momentum: as for ``keras.optimizers.SGD`` (``nesterov`` is not offered).
      l2_norm_clip: per-example L2 clip ``C`` (finite, > 0).
      noise_multiplier: ``z``; every tree node gets noise of stddev ``z * C`` (finite, >= 0).
      restart_every: ``"epoch"`` (default: a new tree at the start of every epoch, from the
        sampling that ``fit`` declares, ``ceil(n / batch_size)`` steps) or a number of steps
        (an integer >= 1).
      max_epoch_steps: with ``restart_every="epoch"``, the most steps an epoch may have
        (sizes the node stack, ``ceil(log2(max_epoch_steps + 1))`` levels); default: the first
        declared epoch's length.
      num_microbatches, gradient_mode: as for the other DP optimizers (``"jl"`` is refused: no
        accountant analyses tree aggregation with JL clipping).
      noise_seed: tests and debugging only (a known seed voids the guarantee).

    The tree's state (``depth`` copies of the model's trainable variables) is carried by the
    optimizer's engine but is not saved with it: a resumed run starts a new tree, which the
    ledger records (``tree_step`` 0).
    """

    _mechanism = "tree aggregation"

    def __init__(
        self,
        learning_rate: Any = 0.01,
        momentum: float = 0.0,
        *,
        l2_norm_clip: Optional[float] = None,
        noise_multiplier: Optional[float] = None,
        restart_every: Union[str, int] = "epoch",
        max_epoch_steps: Optional[int] = None,
        num_microbatches: Optional[int] = None,
        gradient_mode: str = "auto",
        noise_seed: Optional[int] = None,
        max_physical_batch_size: Optional[int] = None,
        **kwargs: Any,
    ) -> None:
        l2_norm_clip, noise_multiplier = self._check_noise_arguments(
            l2_norm_clip, noise_multiplier, gradient_mode, kwargs)
        if restart_every != "epoch" and (
            isinstance(restart_every, bool)
            or not isinstance(restart_every, int)
            or not 1 <= restart_every <= 2**MAX_DEPTH - 1
        ):
            raise ValueError(
                f"restart_every must be 'epoch' or an integer in [1, 2**{MAX_DEPTH} - 1] (steps "
                f"per tree), got {restart_every!r}"
            )
        if max_epoch_steps is not None:
            if restart_every != "epoch":
                raise ValueError("max_epoch_steps is only used with restart_every='epoch'")
            if isinstance(max_epoch_steps, bool) or not isinstance(max_epoch_steps, int) or not (
                1 <= max_epoch_steps <= 2**MAX_DEPTH - 1
            ):
                raise ValueError(
                    f"max_epoch_steps must be an integer in [1, 2**{MAX_DEPTH} - 1], got "
                    f"{max_epoch_steps!r}"
                )
        keras.optimizers.SGD.__init__(self, learning_rate, momentum=momentum, **kwargs)
        period = restart_every if restart_every != "epoch" else (max_epoch_steps or 1)
        tree = TreeResidualSumQuery(
            l2_norm_clip, noise_multiplier * l2_norm_clip,
            restart_every=period, seed=noise_seed,
        )
        self._tree = tree
        self._init_dp(
            None, None, num_microbatches, gradient_mode, None, tree, noise_seed,
            max_physical_batch_size=max_physical_batch_size,
            placeholder_state=TreeState(0, [], (), tree.l2_norm_clip, tree.stddev),
        )
        # DP-FTRL has its own configuration (not an arbitrary dp_sum_query): serialisable.
        self._custom_query = False
        self._noise_clip, self._noise_z = l2_norm_clip, noise_multiplier
        self._restart_every = restart_every
        self._max_epoch_steps = max_epoch_steps
        self._epoch_steps: Optional[int] = None

    # -- tree structure ----------------------------------------------------------------------------

    @property
    def restart_every(self) -> Union[str, int]:
        return self._restart_every

    @property
    def tree_restart_period(self) -> int:
        """Steps per tree in use (the epoch length for ``restart_every='epoch'``, once known)."""
        return self._tree.restart_every

    @property
    def tree_depth(self) -> int:
        return self._tree.depth

    def start_pass(self) -> None:
        """Marks a new pass over the data; with ``restart_every='epoch'`` the tree restarts too,
        so no tree spans two passes (each record is in at most one leaf of a tree)."""
        super().start_pass()
        if self._restart_every == "epoch":
            self.restart_tree()

    @property
    def tree_step(self) -> int:
        """Leaves of the current tree so far (0 before its first step)."""
        if not self._engine.state_built:
            return 0
        return int(self._engine.global_state.step.numpy())

    def restart_tree(self) -> None:
        """Starts a new tree at the next step (eager; recorded as ``tree_step`` 0)."""
        if self._engine.state_built:
            self._engine.set_global_state(self._tree.restart(self._engine.global_state))

    def set_sampling(
        self,
        population_size: Union[int, Sampling],
        selection_probability: Optional[float] = None,
        sampling_policy: str = "shuffle",
    ) -> None:
        """Declares the batches: fixed-size (``shuffle`` policy, shuffled or in a fixed order).

        Tree aggregation gets no amplification, and no accountant analyses it under Poisson
        sampling, so ``sampling_policy='poisson'`` (e.g. ``tf_dp.data.poisson_batches``) is
        refused. With ``restart_every='epoch'`` the tree restarts every ``ceil(n / b)`` steps.
        ``population_size`` may be a :class:`tf_dp.data.Sampling` (its policy is checked).
        """
        claim = population_size
        if isinstance(claim, Sampling):
            population_size, selection_probability, sampling_policy = (
                claim.population_size, claim.selection_probability, claim.policy
            )
        if sampling_policy != "shuffle":
            raise ValueError(
                "DPKerasFTRLOptimizer (tree aggregation) needs sampling_policy='shuffle' "
                "(fixed-size batches, each example once per epoch, shuffled or in a fixed order), "
                f"got {sampling_policy!r}: no accountant analyses tree aggregation under Poisson "
                "sampling. Feed in-memory arrays or a batched dataset and declare it with "
                "set_sampling(n, batch_size / n, 'shuffle')"
            )
        if isinstance(claim, Sampling):
            super().set_sampling(claim)
        else:
            super().set_sampling(population_size, selection_probability, sampling_policy)
        from tf_dp.accounting.ledger_analysis import shuffle_steps_per_epoch

        steps = shuffle_steps_per_epoch(population_size, float(selection_probability))
        self._epoch_steps = steps
        tree = self._tree
        if self._restart_every == "epoch":
            if not self._engine.state_built:
                tree.resize(steps, max(steps, self._max_epoch_steps or 0))
            elif tree_depth(steps) > tree.depth:
                raise ValueError(
                    f"an epoch now has {steps} steps but the tree state was built for epochs of "
                    f"at most {2**tree.depth - 1} steps; construct the optimizer with "
                    f"max_epoch_steps >= {steps}"
                )
            else:
                tree.resize(steps, 2**tree.depth - 1)
        elif self._restart_every > steps:
            _logger.warning(
                "tf_dp: DPKerasFTRLOptimizer restarts its tree every %d steps but an epoch has %d: "
                "trees span several epochs, and the accountants use a looser bound for them "
                "(restart_every='epoch' gives the paper's bound)", self._restart_every, steps,
            )

    def _build_noise_state(self, records: list) -> None:
        """The tree's state (one node stack per variable), carried by the engine (once)."""
        if not self._engine.state_built:
            self._tree.set_record_specs([_spec_of(r) for r in records])
            self._engine.build_state()

    def get_config(self) -> dict[str, Any]:
        config = self._noise_config()
        config.update(
            {"restart_every": self._restart_every, "max_epoch_steps": self._max_epoch_steps}
        )
        return config
