"""DP-FTRL: private training by tree aggregation, without sampling amplification.

Kairouz, McMahan, Song, Thakkar, Thakurta and Xu, "Practical and private (deep) learning without
sampling or shuffling" (ICML 2021). DP-FTRL (without regulariser) sets
``theta_m = theta_0 - lr * S_m`` where ``S_m`` is the noised sum of the first ``m`` clipped batch
gradients, released by the binary tree mechanism (:class:`tf_dp.TreeCumulativeSumQuery`). Plain
SGD on the differences ``S_m - S_{m-1}`` (:class:`tf_dp.TreeResidualSumQuery`) reaches exactly the
same parameters, and SGD with momentum on them is the paper's momentum variant (DP-FTRLM), so
:class:`DPKerasFTRLOptimizer` is a DP SGD optimizer whose sum query is the residual tree query,
with the tree's state (a fixed-depth stack of node noises) in the optimizer's variables.

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

from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.tree_aggregation import MAX_DEPTH, TreeResidualSumQuery, TreeState, tree_depth
from tf_dp.keras.optimizers import DPOptimizerMixin, _check_number, _python_number
from tf_dp.ledger.privacy_ledger import ledger_variable

_logger = logging.getLogger("tf_dp")

__all__ = ["DPKerasFTRLOptimizer"]


class _TreeStateInVariables(DPQuery):
    """Runs a tree query with its global state held in variables (created by :meth:`build`).

    The DP optimizers treat the query's global state as fixed (they do not carry the returned
    state from step to step), so this adapter reads the tree state from its variables on every
    :meth:`get_noised_result` and assigns the new state back. Its own global state is ``()``.
    """

    def __init__(self, tree: TreeResidualSumQuery):
        self._tree = tree
        self._step: Optional[tf.Variable] = None
        self._nodes: Optional[list] = None

    @property
    def tree(self) -> TreeResidualSumQuery:
        return self._tree

    @property
    def built(self) -> bool:
        return self._step is not None

    def build(self, variables: list) -> None:
        """Creates the state variables for records shaped like ``variables`` (eager)."""
        if self.built:
            return
        self._tree.set_record_specs(
            [v if isinstance(v, tf.TensorSpec)
             else tf.TensorSpec(tf.TensorShape(v.shape), tf.as_dtype(v.dtype)) for v in variables]
        )
        with tf.init_scope():
            init = self._tree.initial_global_state()
            self._step = ledger_variable(init.step, name="tree_step")
            self._nodes = [ledger_variable(n, name="tree_nodes") for n in init.nodes]

    def restart(self) -> None:
        """The next step starts a new tree."""
        if self.built:
            self._step.assign(0)

    def _state(self) -> TreeState:
        if not self.built:
            return TreeState(tf.constant(0, tf.int64), [], (), self._tree.l2_norm_clip,
                             self._tree.stddev)
        return TreeState(self._step.read_value(), [n.read_value() for n in self._nodes], (),
                         self._tree.l2_norm_clip, self._tree.stddev)

    # -- DPQuery protocol ------------------------------------------------------------------------

    def initial_global_state(self) -> Any:
        return ()

    def derive_sample_params(self, global_state: Any) -> Any:
        return self._tree.derive_sample_params(self._state())

    def initial_sample_state(self, template: Any) -> Any:
        return self._tree.initial_sample_state(template)

    def preprocess_record(self, params: Any, record: Any) -> Any:
        return self._tree.preprocess_record(params, record)

    def accumulate_preprocessed_record(self, sample_state: Any, preprocessed_record: Any) -> Any:
        return self._tree.accumulate_preprocessed_record(sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1: Any, sample_state_2: Any) -> Any:
        return self._tree.merge_sample_states(sample_state_1, sample_state_2)

    @property
    def supports_norm_clipping(self) -> bool:
        return True

    def clip_weights(self, params: Any, squared_norms: Any) -> Any:
        return self._tree.clip_weights(params, squared_norms)

    def get_noised_result(self, sample_state: Any, global_state: Any):
        if not self.built:
            raise RuntimeError(
                "DPKerasFTRLOptimizer: the tree state does not exist yet; the optimizer builds it "
                "from the model's variables (optimizer.build(model.trainable_variables))"
            )
        flat = list(tf.nest.flatten(sample_state))
        result, new = self._tree.get_noised_result(flat, self._state())
        assigns = [self._step.assign(new.step)]
        assigns += [v.assign(n) for v, n in zip(self._nodes, new.nodes)]
        with tf.control_dependencies(assigns):
            result = [tf.identity(r) for r in result]
        return tf.nest.pack_sequence_as(sample_state, result), global_state

    def sum_query_specs(self, global_state: Any):
        return self._tree.sum_query_specs(self._state())

    def derive_metrics(self, global_state: Any) -> dict[str, Any]:
        return self._tree.derive_metrics(self._state())


def _spec_of(g: Any) -> tf.TensorSpec:
    if isinstance(g, tf.IndexedSlices):
        shape = tf.get_static_value(g.dense_shape)
        if shape is None:
            raise ValueError("DPKerasFTRLOptimizer needs gradients of static shape")
        return tf.TensorSpec(tf.TensorShape([int(d) for d in shape]), g.values.dtype)
    return tf.TensorSpec(g.shape, g.dtype)


@keras.saving.register_keras_serializable(package="tf_dp", name="DPKerasFTRLOptimizer")
class DPKerasFTRLOptimizer(DPOptimizerMixin, keras.optimizers.SGD):
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

    The tree's state (``depth`` copies of the model's trainable variables) lives in the
    optimizer but is not saved with it: a resumed run starts a new tree, which the ledger records
    (``tree_step`` 0).
    """

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
        if kwargs.get("nesterov"):
            raise ValueError("DPKerasFTRLOptimizer does not offer nesterov momentum")
        kwargs.pop("nesterov", None)
        for name in ("dp_sum_query", "jl_projections"):
            if name in kwargs:
                raise TypeError(f"DPKerasFTRLOptimizer does not take {name}")
        l2_norm_clip, noise_multiplier = _python_number(l2_norm_clip), _python_number(noise_multiplier)
        if l2_norm_clip is None or noise_multiplier is None:
            raise ValueError(
                "DPKerasFTRLOptimizer needs l2_norm_clip (a finite number > 0) and "
                "noise_multiplier (a finite number >= 0)"
            )
        _check_number("l2_norm_clip", l2_norm_clip, positive=True)
        _check_number("noise_multiplier", noise_multiplier, positive=False)
        if gradient_mode == "jl":
            raise ValueError(
                "gradient_mode='jl' cannot be used with DPKerasFTRLOptimizer: no accountant "
                "analyses tree aggregation with JL clipping; use 'auto', 'vectorized', "
                "'microbatch' or 'ghost'"
            )
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
            float(l2_norm_clip), float(noise_multiplier) * float(l2_norm_clip),
            restart_every=period, seed=noise_seed,
        )
        self._tree_query = _TreeStateInVariables(tree)
        self._init_dp(
            None, None, num_microbatches, gradient_mode, None, self._tree_query, noise_seed,
            max_physical_batch_size=max_physical_batch_size,
        )
        # DP-FTRL has its own configuration (not an arbitrary dp_sum_query): serialisable.
        self._custom_query = False
        self._l2_norm_clip = float(l2_norm_clip)
        self._noise_multiplier = float(noise_multiplier)
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
        return self._tree_query.tree.restart_every

    @property
    def tree_depth(self) -> int:
        return self._tree_query.tree.depth

    def start_pass(self) -> None:
        """Marks a new pass over the data; with ``restart_every='epoch'`` the tree restarts too,
        so no tree spans two passes (each record is in at most one leaf of a tree)."""
        super().start_pass()
        if self._restart_every == "epoch":
            self.restart_tree()

    def restart_tree(self) -> None:
        """Starts a new tree at the next step (eager; recorded as ``tree_step`` 0)."""
        self._tree_query.restart()

    def set_sampling(
        self, population_size: Any, selection_probability: Optional[float] = None,
        sampling_policy: str = "shuffle",
    ) -> None:
        """Declares the batches: fixed-size (``shuffle`` policy, shuffled or in a fixed order).

        Tree aggregation gets no amplification, and no accountant analyses it under Poisson
        sampling, so ``sampling_policy='poisson'`` (e.g. ``tf_dp.data.poisson_batches``) is
        refused. With ``restart_every='epoch'`` the tree restarts every ``ceil(n / b)`` steps.
        ``population_size`` may be a :class:`tf_dp.data.Sampling` (its policy is checked).
        """
        claim = population_size
        if hasattr(claim, "selection_probability") and hasattr(claim, "policy"):
            population_size, selection_probability = (
                claim.population_size, claim.selection_probability)
            sampling_policy = claim.policy
        if sampling_policy != "shuffle":
            raise ValueError(
                "DPKerasFTRLOptimizer (tree aggregation) needs sampling_policy='shuffle' "
                "(fixed-size batches, each example once per epoch, shuffled or in a fixed order), "
                f"got {sampling_policy!r}: no accountant analyses tree aggregation under Poisson "
                "sampling. Feed in-memory arrays or a batched dataset and declare it with "
                "set_sampling(n, batch_size / n, 'shuffle')"
            )
        super().set_sampling(claim, selection_probability, sampling_policy)
        from tf_dp.accounting.ledger_analysis import shuffle_steps_per_epoch

        steps = shuffle_steps_per_epoch(population_size, float(selection_probability))
        self._epoch_steps = steps
        tree = self._tree_query.tree
        if self._restart_every == "epoch":
            if not self._tree_query.built:
                period = max(steps, self._max_epoch_steps or 0)
                self._resize_tree(period)
                tree._restart_every = steps
            elif tree_depth(steps) > tree.depth:
                raise ValueError(
                    f"an epoch now has {steps} steps but the tree state was built for epochs of "
                    f"at most {2**tree.depth - 1} steps; construct the optimizer with "
                    f"max_epoch_steps >= {steps}"
                )
            else:
                tree._restart_every = steps
        elif self._restart_every > steps:
            _logger.warning(
                "tf_dp: DPKerasFTRLOptimizer restarts its tree every %d steps but an epoch has %d: "
                "trees span several epochs, and the accountants use a looser bound for them "
                "(restart_every='epoch' gives the paper's bound)", self._restart_every, steps,
            )

    def _resize_tree(self, period: int) -> None:
        tree = self._tree_query.tree
        tree._restart_every = int(period)
        tree._depth = tree_depth(int(period))

    def build(self, variables) -> None:
        super().build(variables)
        self._tree_query.build(list(variables))

    def dp_aggregate(self, clipped):
        if not self._tree_query.built:
            # The first (traced) step, before Keras builds the optimizer: size the tree state
            # from the clipped sum (one tensor per trainable variable). Variables created on the
            # first trace are allowed by tf.function.
            self._tree_query.build([_spec_of(g) for g in tf.nest.flatten(clipped.clipped_sum)])
        return super().dp_aggregate(clipped)

    def get_config(self) -> dict[str, Any]:
        config = keras.optimizers.SGD.get_config(self)
        config.pop("nesterov", None)
        config.update(
            {
                "l2_norm_clip": self._l2_norm_clip,
                "noise_multiplier": self._noise_multiplier,
                "restart_every": self._restart_every,
                "max_epoch_steps": self._max_epoch_steps,
                "num_microbatches": self._num_microbatches,
                "gradient_mode": self._gradient_mode,
                "max_physical_batch_size": self._max_physical_batch_size,
            }
        )
        return config
