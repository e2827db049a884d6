"""Tree aggregation: noised prefix sums of clipped records by the binary tree mechanism.

Kairouz, McMahan, Song, Thakkar, Thakurta and Xu, "Practical and private (deep) learning without
sampling or shuffling" (ICML 2021), building on the binary counting mechanism of Dwork, Naor,
Pitassi and Rothblum ("Differential privacy under continual observation", 2010) and Chan, Shi and
Song ("Private and continual release of statistics", 2011).

Step ``t = 1, 2, ...`` of a tree adds the clipped sum ``x_t`` of that step's records as leaf ``t``.
Every node of the binary tree over the leaves (a dyadic interval ``(j 2^l, (j+1) 2^l]`` at level
``l``) carries its own Gaussian noise ``N(0, stddev^2)``, drawn once, when the interval is complete.
The prefix ``[1, m]`` is the disjoint union of the nodes given by the set bits of ``m`` (bit ``l``
set: one node of ``2^l`` leaves), so the released prefix sum is::

    S_m = x_1 + ... + x_m + sum over the set bits l of m of (noise of that level-l node)

and its noise has variance ``popcount(m) * stddev^2`` (at most ``ceil(log2(m + 1))`` nodes).

State. Only the newest complete node of each level can still be part of a future prefix, so the
global state holds a fixed-depth stack ``nodes[l]`` (one noise tensor per level, shape
``[depth, *record_shape]`` per leaf of the record structure) and the step count ``m``: graph-safe
and XLA-safe (fixed shapes, no Python control flow on tensors). Going from ``m - 1`` to ``m``
completes the node at level ``l0 = trailing_zeros(m)``: ``nodes[l0]`` gets a fresh draw, and the
levels below ``l0`` (now inside it) are never read again. The memory cost is ``depth`` copies of
the record (``depth = ceil(log2(restart_every + 1))``).

Restarts. After ``restart_every`` steps the tree starts afresh (``m = 0``): the released sums
then cover the leaves since the restart only, and each tree's nodes are independent. Restarting
every epoch is what the paper's multi-epoch accounting assumes (each record in at most one leaf
of each tree); :meth:`TreeCumulativeSumQuery.restart` restarts by hand (e.g. at an epoch
boundary that is not a fixed number of steps).

Two queries:

* :class:`TreeCumulativeSumQuery` releases ``S_m`` (the noised sum since the last restart): what
  DP-FTRL consumes (``theta_m = theta_0 - lr * S_m``).
* :class:`TreeResidualSumQuery` releases ``S_m - S_{m-1}`` (``S_0 = 0`` at every restart): the
  step's clipped sum plus a noise difference, so a standard optimizer (SGD, momentum) can consume
  it as a per-step noised gradient; the residuals of one tree sum back to ``S_m``. Plain SGD on
  the residuals is DP-FTRL exactly (``theta_m = theta_0 - lr * S_m``, ``theta_0`` the parameters
  at the restart). Its noise at step ``m`` is ``fresh - sum_{l < l0} nodes[l]`` (the new node
  minus the nodes it absorbs), with variance ``(1 + l0) stddev^2``.

Ledger: every step is recorded as a ``tree`` sum query with its clip, node stddev and its index
in the current tree (``tree_step = m - 1``); the accountants rebuild the trees from those indices
(see ``tf_dp.accounting.tree``).

Example:

>>> import tensorflow as tf, tf_dp
>>> query = tf_dp.TreeResidualSumQuery(
...     l2_norm_clip=1.0, stddev=1.1, record_specs=tf.TensorSpec([3]), restart_every=100)
>>> gs = query.initial_global_state()
>>> params = query.derive_sample_params(gs)
>>> state = query.initial_sample_state(tf.zeros([3]))
>>> state = query.accumulate_record(params, state, tf.constant([3.0, 4.0, 0.0]))
>>> noised_residual, gs = query.get_noised_result(state, gs)
>>> noised_residual.shape
TensorShape([3])
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_dp.dp_query import dp_query
from tf_dp.dp_query.gaussian_query import JointClipSumQuery, RecordStateMixin
from tf_dp.dp_query.noise import gaussian_noise
from tf_dp.dp_query.validation import check_scalar

__all__ = [
    "TreeState",
    "TreeCumulativeSumQuery",
    "TreeResidualSumQuery",
    "tree_depth",
    "MAX_DEPTH",
]

#: Deepest tree supported (restart_every <= 2**MAX_DEPTH - 1 steps).
MAX_DEPTH = 40


def tree_depth(steps: int) -> int:
    """Levels of a tree with ``steps`` leaves that hold released nodes: ``ceil(log2(steps + 1))``
    (``floor(log2(steps)) + 1``); each leaf lies in at most this many released nodes."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
    return int(steps).bit_length()


class TreeState(NamedTuple):
    """Global state of a tree query (fixed-shape tensors).

    Attributes:
      step: int64 scalar, leaves added to the current tree so far (``m``; a restart sets it to 0
        before the next leaf).
      nodes: structure matching the records, each leaf ``[depth, *shape]``: the noise of the newest
        complete node of each level (only the levels set in ``step``'s binary form are live).
      prefix: structure matching the records: the exact (clipped, noiseless) sum since the last
        restart (:class:`TreeCumulativeSumQuery` only; ``()`` for the residual query).
      l2_norm_clip, stddev: the clip and the node noise stddev.
    """

    step: Any
    nodes: Any
    prefix: Any
    l2_norm_clip: Any
    stddev: Any


class TreeCumulativeSumQuery(RecordStateMixin, JointClipSumQuery):
    """Noised prefix sums of records clipped to ``l2_norm_clip`` (the binary tree mechanism).

    Each call of :meth:`get_noised_result` adds the sample's clipped sum as the next leaf and
    releases the sum of all leaves since the last restart plus the noise of the
    ``popcount(m)`` tree nodes covering them (each node ``N(0, stddev^2)``). See the module
    docstring for the state and the restarts.

    Args:
      l2_norm_clip: clip bound ``C`` of each record (finite, >= 0); the whole record is clipped
        jointly, as in ``GaussianSumQuery``.
      stddev: noise standard deviation of every tree node (finite, >= 0); DP-FTRL uses
        ``noise_multiplier * l2_norm_clip``.
      record_specs: the structure of one record (``tf.TensorSpec``\\ s, tensors or variables,
        e.g. ``model.trainable_variables``), needed for the fixed-shape state. May be given later
        with :meth:`set_record_specs` (before :meth:`initial_global_state`).
      restart_every: steps per tree (an integer >= 1): the tree restarts after that many leaves,
        e.g. the number of steps of an epoch. ``None``: one tree of up to
        ``2**max_depth - 1`` steps (restarted when full).
      max_depth: the stack depth when ``restart_every`` is None (1..:data:`MAX_DEPTH`).
      seed: tests and debugging only (a known seed makes the noise predictable and voids the
        guarantee); ``None`` keys the generator from OS entropy.
    """

    _keeps_prefix = True

    def __init__(
        self,
        l2_norm_clip: Any,
        stddev: Any,
        record_specs: Any = None,
        restart_every: Optional[int] = None,
        max_depth: Optional[int] = None,
        seed: Optional[int] = None,
    ):
        self._l2_norm_clip = check_scalar("l2_norm_clip", l2_norm_clip)
        self._stddev = check_scalar("stddev", stddev)
        if restart_every is not None:
            if isinstance(restart_every, bool) or not isinstance(
                restart_every, (int, np.integer)
            ) or not 1 <= restart_every <= 2**MAX_DEPTH - 1:
                raise ValueError(
                    f"restart_every must be an integer in [1, 2**{MAX_DEPTH} - 1] (steps per "
                    f"tree), got {restart_every!r}"
                )
            if max_depth is not None:
                raise ValueError("pass restart_every or max_depth, not both")
            restart_every = int(restart_every)
            depth = tree_depth(restart_every)
        else:
            if max_depth is None:
                raise ValueError(
                    "pass restart_every (steps per tree, e.g. the steps of one epoch) or "
                    f"max_depth (an integer in [1, {MAX_DEPTH}]: one tree of up to "
                    "2**max_depth - 1 steps)"
                )
            if isinstance(max_depth, bool) or not isinstance(max_depth, (int, np.integer)) or (
                not 1 <= max_depth <= MAX_DEPTH
            ):
                raise ValueError(
                    f"max_depth must be an integer in [1, {MAX_DEPTH}], got {max_depth!r}"
                )
            depth = int(max_depth)
            restart_every = 2**depth - 1
        self._restart_every = restart_every
        self._depth = depth
        self._init_record_state(seed, record_specs)

    # -- configuration ---------------------------------------------------------------------------

    def resize(self, restart_every: int, max_restart_every: Optional[int] = None) -> None:
        """Sets the steps per tree, with a node stack of ``depth`` levels for trees of up to
        ``max_restart_every`` steps (default ``restart_every``). Call it before the global state
        exists, or keep the depth of the state built (``max_restart_every = 2**depth - 1``)."""
        longest = int(max_restart_every or restart_every)
        if not 1 <= int(restart_every) <= longest <= 2**MAX_DEPTH - 1:
            raise ValueError(
                f"restart_every must be an integer in [1, {2**MAX_DEPTH - 1}], got {restart_every!r}"
            )
        self._restart_every = int(restart_every)
        self._depth = tree_depth(longest)

    @property
    def l2_norm_clip(self) -> Any:
        return self._l2_norm_clip

    @property
    def stddev(self) -> Any:
        return self._stddev

    @property
    def restart_every(self) -> int:
        return self._restart_every

    @property
    def depth(self) -> int:
        """Levels of the node stack: ``ceil(log2(restart_every + 1))``."""
        return self._depth

    # -- DPQuery protocol ------------------------------------------------------------------------

    def initial_global_state(self) -> TreeState:
        nodes = self._zeros_per_record(self._depth)
        prefix = (
            tf.nest.map_structure(lambda s: tf.zeros(s.shape, s.dtype), self._specs)
            if self._keeps_prefix else ()
        )
        return TreeState(
            tf.constant(0, tf.int64), nodes, prefix, self._l2_norm_clip, self._stddev
        )

    def restart(self, global_state: TreeState) -> TreeState:
        """The state with a fresh tree: the next step is leaf 1 of a new tree."""
        return global_state._replace(
            step=tf.zeros_like(global_state.step),
            prefix=tf.nest.map_structure(tf.zeros_like, global_state.prefix),
        )

    def _tree_step(self, global_state: TreeState) -> tf.Tensor:
        """Index (0-based) in its tree of the leaf the next call adds (0 after a restart)."""
        step = tf.cast(global_state.step, tf.int64)
        return tf.where(step >= self._restart_every, tf.zeros_like(step), step)

    def _advance(self, sample_state: Any, global_state: TreeState):
        """Adds a leaf: returns (dense sample state, fresh node noise, old nodes, new nodes,
        m, restarted)."""
        step = tf.cast(global_state.step, tf.int64)
        restarted = step >= self._restart_every
        m = tf.where(restarted, tf.zeros_like(step), step) + 1
        levels = tf.range(self._depth, dtype=tf.int64)
        lowbit = tf.bitwise.bitwise_and(m, -m)  # 2^l0, l0 = trailing zeros of m
        powers = tf.bitwise.left_shift(tf.ones_like(levels), levels)
        is_new = tf.equal(powers, lowbit)  # [depth]: the level completed by leaf m
        below = powers < lowbit  # the levels the new node absorbs
        live = tf.not_equal(tf.bitwise.bitwise_and(m, powers), 0)  # set bits of m
        stddev = tf.convert_to_tensor(global_state.stddev, tf.float32)
        dense = tf.nest.map_structure(
            lambda t: tf.convert_to_tensor(t) if isinstance(t, tf.IndexedSlices) else t,
            sample_state,
        )
        flat_nodes = tf.nest.flatten(global_state.nodes)
        fresh, new_nodes = [], []
        for node in flat_nodes:
            shape = tf.shape(node)[1:]
            size = node.shape[1:].num_elements()
            z = gaussian_noise(
                self._generator, size if size is not None else tf.reduce_prod(shape),
                node.dtype, tf.cast(stddev, node.dtype),
            )
            z = tf.reshape(z, shape)
            mask = tf.reshape(is_new, [-1] + [1] * (node.shape.rank - 1))
            fresh.append(z)
            new_nodes.append(tf.where(mask, z[tf.newaxis], node))
        return dense, fresh, flat_nodes, new_nodes, m, restarted, below, live

    @staticmethod
    def _masked_sum(nodes: tf.Tensor, mask: tf.Tensor) -> tf.Tensor:
        w = tf.reshape(tf.cast(mask, nodes.dtype), [-1] + [1] * (nodes.shape.rank - 1))
        return tf.reduce_sum(nodes * w, axis=0)

    def get_noised_result(self, sample_state: Any, global_state: TreeState):
        if not tf.nest.flatten(global_state.nodes):
            raise ValueError(f"{type(self).__name__}: the global state has no node stack")
        dense, _, _, new_nodes, m, restarted, _, live = self._advance(sample_state, global_state)
        flat_dense = tf.nest.flatten(dense)
        flat_prefix = tf.nest.flatten(global_state.prefix)
        new_prefix, out = [], []
        for x, p, nodes in zip(flat_dense, flat_prefix, new_nodes):
            p = tf.where(restarted, tf.zeros_like(p), p) + tf.cast(x, p.dtype)
            new_prefix.append(p)
            out.append(p + tf.cast(self._masked_sum(nodes, live), p.dtype))
        new_state = global_state._replace(
            step=m,
            nodes=tf.nest.pack_sequence_as(global_state.nodes, new_nodes),
            prefix=tf.nest.pack_sequence_as(global_state.prefix, new_prefix),
        )
        return tf.nest.pack_sequence_as(global_state.prefix, out), new_state

    def sum_query_specs(self, global_state: TreeState) -> list[dp_query.SumQuerySpec]:
        return [
            dp_query.SumQuerySpec(
                tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
                tf.convert_to_tensor(global_state.stddev, tf.float32),
                noise_seed=self._seed,
                tree_step=self._tree_step(global_state),
            )
        ]

    def derive_metrics(self, global_state: TreeState) -> dict[str, Any]:
        return {
            "l2_norm_clip": tf.convert_to_tensor(global_state.l2_norm_clip, tf.float32),
            "tree_step": self._tree_step(global_state),
        }

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(l2_norm_clip={self._l2_norm_clip!r}, stddev={self._stddev!r}, "
            f"restart_every={self._restart_every})"
        )


class TreeResidualSumQuery(TreeCumulativeSumQuery):
    """Releases ``S_m - S_{m-1}``: the step's clipped sum plus the change of the tree noise.

    The residuals of one tree sum to the noised prefix sums of :class:`TreeCumulativeSumQuery`
    (``S_0 = 0`` at each restart), so SGD on them is DP-FTRL (``theta_m = theta_0 - lr * S_m``)
    and momentum SGD on them is DP-FTRL with momentum (Kairouz et al. 2021, section 4). The noise
    of step ``m`` is the fresh node minus the ``l0 = trailing_zeros(m)`` nodes it absorbs
    (variance ``(1 + l0) stddev^2``). Same arguments as :class:`TreeCumulativeSumQuery`; the state
    keeps no prefix sum.

    Example::

        query = tf_dp.TreeResidualSumQuery(1.0, 1.1, record_specs=model.trainable_variables,
                                           restart_every=steps_per_epoch)
    """

    _keeps_prefix = False

    def get_noised_result(self, sample_state: Any, global_state: TreeState):
        if not tf.nest.flatten(global_state.nodes):
            raise ValueError(f"{type(self).__name__}: the global state has no node stack")
        dense, fresh, old_nodes, new_nodes, m, _, below, _ = self._advance(
            sample_state, global_state
        )
        out = [
            x + tf.cast(z - self._masked_sum(nodes, below), x.dtype)
            for x, z, nodes in zip(tf.nest.flatten(dense), fresh, old_nodes)
        ]
        new_state = global_state._replace(
            step=m, nodes=tf.nest.pack_sequence_as(global_state.nodes, new_nodes)
        )
        return tf.nest.pack_sequence_as(dense, out), new_state
