"""Privacy accounting of tree aggregation (DP-FTRL): Renyi DP and the ledger's tree events.

Kairouz, McMahan, Song, Thakkar, Thakurta and Xu, "Practical and private (deep) learning without
sampling or shuffling" (ICML 2021), Appendix D.

One tree. Leaves ``1..T`` are the clipped sums of ``T`` steps; every released node (a dyadic
interval of leaves) gets independent ``N(0, sigma^2)`` noise. Only nodes at levels ``l`` with
``2^l <= T`` are ever released, so a leaf lies in at most ``d(T) = ceil(log2(T + 1))`` released
nodes (``floor(log2 T) + 1``). If a record takes part in one leaf, changing it moves at most
``d(T)`` node sums, each by at most ``Delta`` (the per-record sensitivity of a leaf), so the
vector of released nodes has L2 sensitivity ``sqrt(d(T)) * Delta``: the whole tree is one
Gaussian mechanism with noise multiplier ``z / sqrt(d(T))``, ``z = sigma / Delta``, whose Renyi
divergence of order ``a`` is::

    RDP(a) = a * d(T) / (2 z^2).

Several trees, each record in at most one leaf of all of them (one epoch, the tree restarted
within it): the record touches one tree only, so ``RDP(a) = a * max_i d(T_i) / (2 z^2)``. ``E``
epochs with the tree restarted every epoch compose: ``E`` times that. This is the statement of
the paper's Appendix D and what ``dp_accounting``'s ``SingleEpochTreeAggregationDpEvent`` computes
under its ``REPLACE_SPECIAL`` adjacency (replacing a record by a special record whose clipped
contribution is zero: ``Delta = C``); :func:`rdp_tree_aggregation` equals it (tested).

The ledger (:func:`tree_gaussian_mechanisms`). Steps recorded as ``tree`` sum queries carry their
leaf index in their tree (``tree_step``; 0 starts a tree) and the sampling declaration. Tree
aggregation gets no amplification, so only the ``shuffle`` policy is accepted: each epoch of
``ceil(n / b)`` steps uses every record at most once (shuffled or in a fixed order; the
shuffling is not used). Adjacency is replace-one, as for every ``shuffle`` run in tf_dp: a
replaced record moves a leaf by up to ``2C`` (``Delta = 2C``, i.e. ``dp_accounting`` with noise
multiplier ``z / 2``). Steps are cut into trees (at each ``tree_step == 0``, or where the index
does not continue) and into epoch windows (consecutive ``ceil(n / b)`` steps from the start of each
pass over the data, i.e. each draw marked ``pass_start`` or change of sampling, as the ``shuffle``
accounting counts them). Then:

* every tree inside one epoch window (restarts at least once per epoch): per window, the record is
  in one leaf of one tree; the window counts as one Gaussian mechanism with
  ``z_eff = min_i z_i / (2 sqrt(d(T_i)))`` over its trees (``z_i``: the tree's smallest per-step
  ``sigma / C``). This is exactly the paper's bound.
* some tree spans several windows (no restart at the epoch boundary): a record may be in ``k``
  leaves of that tree (``k`` = windows it touches). Node sums then add up to ``k`` contributions;
  per level ``l`` the squared change is at most ``k * min(k, c_l)`` (``c_l`` = the most windows
  one node of level ``l`` touches, counted from the recorded steps: a pass cut short makes
  windows shorter than an epoch), and by the triangle inequality at most ``k^2`` per level, so the tree's
  sensitivity is ``Delta * sqrt(min(k^2 d, k * sum_l min(k, c_l)))``. Every tree then counts as
  its own Gaussian mechanism (a conservative composition: a window shared by two trees is
  counted in both). This is an upper bound, looser than restarting every epoch.

Each resulting mechanism is a Gaussian mechanism without subsampling, which every tf_dp
accountant (``rdp``, ``moments``, ``pld``, ``gdp``) analyses exactly.

Example::

    from tf_dp.accounting import tree, rdp
    orders = rdp.DEFAULT_ORDERS
    curve = 3 * tree.rdp_tree_aggregation(noise_multiplier=2.0, step_counts=100, orders=orders)
    eps, order = rdp.epsilon_from_rdp(orders, curve, delta=1e-5)   # 3 epochs, restart each epoch
"""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np

from tf_dp.ledger.events import SampleEntry

__all__ = [
    "tree_depth",
    "rdp_tree_aggregation",
    "tree_gaussian_mechanisms",
    "TreeAccountingError",
]


class TreeAccountingError(ValueError):
    """A ledger's tree-aggregation steps cannot be analysed (e.g. recorded under Poisson
    sampling)."""


def tree_depth(steps: int) -> int:
    """``ceil(log2(steps + 1))``: the levels of a ``steps``-leaf tree holding released nodes (0 for
    an empty tree)."""
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    return int(steps).bit_length()


def rdp_tree_aggregation(
    noise_multiplier: float,
    step_counts: Union[int, Sequence[int]],
    orders: Sequence[float],
) -> np.ndarray:
    """RDP of one epoch of tree aggregation: ``a * max_i d(T_i) / (2 z^2)`` at each order ``a``.

    Args:
      noise_multiplier: ``z``, node noise stddev over the per-record leaf sensitivity (>= 0;
        0 gives ``inf``).
      step_counts: the steps ``T_i`` of each tree of the epoch (an integer >= 0 or a non-empty
        list of them); every record is in at most one leaf of all these trees.
      orders: RDP orders (> 1).

    Kairouz et al. 2021, Appendix D; equal to ``dp_accounting``'s
    ``SingleEpochTreeAggregationDpEvent`` (``REPLACE_SPECIAL`` adjacency). Wrap ``E`` epochs with
    a restart each as ``E * rdp_tree_aggregation(...)``.
    """
    if isinstance(noise_multiplier, bool) or not isinstance(
        noise_multiplier, (int, float, np.floating)
    ) or not (noise_multiplier >= 0 and math.isfinite(noise_multiplier)):
        raise ValueError(f"noise_multiplier must be a finite number >= 0, got {noise_multiplier!r}")
    counts = [step_counts] if np.isscalar(step_counts) else list(step_counts)
    if not counts:
        raise ValueError("step_counts must be an integer >= 0 or a non-empty list of them")
    depth = max(tree_depth(c) for c in counts)
    arr = np.asarray(orders, dtype=np.float64)
    if arr.ndim != 1 or arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 1.0):
        raise ValueError("orders must be a non-empty list of finite numbers > 1")
    if noise_multiplier == 0:
        return np.full(arr.shape, math.inf if depth else 0.0)
    return arr * depth / (2.0 * float(noise_multiplier) ** 2)


def _node_windows(leaf_windows: dict, level: int) -> int:
    """Most distinct epoch windows that the leaves of one node of ``2^level`` leaves touch
    (``leaf_windows``: leaf index -> window of the step that recorded it)."""
    nodes: dict = {}
    for leaf, window in leaf_windows.items():
        nodes.setdefault(leaf >> level, set()).add(window)
    return max(len(w) for w in nodes.values())


def _squared_sensitivity(k: int, depth: int, leaf_windows: dict) -> int:
    """Squared L2 sensitivity (in units of ``Delta^2``) of a tree of ``depth`` released levels in
    which a record has up to ``k`` leaves, at most one per epoch window. The windows a node
    touches are counted from the steps recorded (a pass cut short gives windows shorter than an
    epoch, so a node can touch more windows than its length in epochs suggests)."""
    if k <= 1:
        return depth
    per_level = sum(min(k, _node_windows(leaf_windows, level)) for level in range(depth))
    return min(k * k * depth, k * per_level)


def tree_gaussian_mechanisms(
    runs: Sequence[tuple[SampleEntry, int]],
    steps_per_epoch_fn,
) -> list[tuple[float, int]]:
    """Reduces consecutive tree-aggregation steps of a ledger to Gaussian mechanisms.

    Args:
      runs: ``(entry, count)`` runs (as from ``tf_dp.ledger.events.compress``) of consecutive
        ledger steps, every entry with a tree query (``entry.tree_step`` not None).
      steps_per_epoch_fn: ``(population_size, selection_probability) -> steps per epoch``.

    Returns:
      ``[(noise_multiplier, count), ...]``: ``count`` full-batch Gaussian mechanisms of unit
      sensitivity with that noise multiplier, replace-one adjacency (``Delta = 2C`` folded in).
      Raises :class:`TreeAccountingError` for tree steps recorded under a policy other than
      ``shuffle``.
    """
    trees: list[dict] = []  # each: z (min), last index, windows (set), leaf -> window
    segment = -1
    key = None
    position = 0  # step position within the current run of identical sampling
    prev_step = None
    for entry, count in runs:
        s = entry.sampling
        if s.policy != "shuffle":
            raise TreeAccountingError(
                f"the ledger has tree-aggregation steps recorded with sampling policy "
                f"{s.policy!r}; no tf_dp accountant (rdp, moments, pld, gdp) analyses tree "
                "aggregation under Poisson sampling (Kairouz et al. 2021 assume each record is "
                "used at most once per epoch, with no amplification): feed fixed-size batches "
                "(shuffled or in a fixed order) and declare sampling_policy='shuffle'"
            )
        if (s.population_size, s.selection_probability) != key:
            key = (s.population_size, s.selection_probability)
            segment += 1
            position = 0
            spe = steps_per_epoch_fn(s.population_size, s.selection_probability)
        z = entry.effective_noise_multiplier()
        t0 = entry.tree_step
        if count > 1 and t0 != 0:
            raise TreeAccountingError(
                f"the ledger repeats tree_step={t0} for {count} consecutive steps; only a tree "
                "restarted at every step (tree_step 0) repeats an index"
            )
        for _ in range(count):
            if s.pass_start:  # a new pass over the data: new epoch windows
                segment += 1
                position = 0
            window = (segment, position // spe)
            if t0 == 0 or prev_step is None or t0 != prev_step + 1 or not trees:
                trees.append({"z": z, "last": t0, "windows": {window}, "leaves": {t0: window}})
            else:
                tr = trees[-1]
                tr["z"] = min(tr["z"], z)
                tr["last"] = t0
                tr["windows"].add(window)
                tr["leaves"][t0] = window
            prev_step = t0
            position += 1
    out: list[tuple[float, int]] = []
    if all(len(tr["windows"]) == 1 for tr in trees):
        # each record in one leaf of one tree per window: the worst tree of each window
        worst: dict = {}
        for tr in trees:
            # a tree whose first recorded leaf is not leaf 0 still has the depth of its indices
            ratio = tree_depth(tr["last"] + 1) / (tr["z"] ** 2) if tr["z"] > 0 else math.inf
            (w,) = tr["windows"]
            worst[w] = max(worst.get(w, 0.0), ratio)
        for ratio in worst.values():
            out.append((0.5 / math.sqrt(ratio) if ratio > 0 else math.inf, 1))
    else:
        for tr in trees:
            k = len(tr["windows"])
            s2 = _squared_sensitivity(k, tree_depth(tr["last"] + 1), tr["leaves"])
            out.append((tr["z"] / (2.0 * math.sqrt(s2)) if tr["z"] > 0 else 0.0, 1))
    merged: list[tuple[float, int]] = []
    for z, c in out:
        if merged and merged[-1][0] == z:
            merged[-1] = (z, merged[-1][1] + c)
        else:
            merged.append((z, c))
    return merged


def split_runs(
    runs: Sequence[tuple[SampleEntry, int]], steps_per_epoch_fn
) -> tuple[list[tuple[SampleEntry, int]], list[tuple[float, int]]]:
    """Separates a ledger's tree-aggregation runs from the others.

    Returns ``(other_runs, mechanisms)``: the runs without tree queries, in order, and the
    Gaussian mechanisms (:func:`tree_gaussian_mechanisms`) of each block of consecutive tree
    runs.
    """
    others: list[tuple[SampleEntry, int]] = []
    mechanisms: list[tuple[float, int]] = []
    block: list[tuple[SampleEntry, int]] = []
    for entry, count in runs:
        if entry.tree_step is not None:
            block.append((entry, count))
            continue
        if block:
            mechanisms.extend(tree_gaussian_mechanisms(block, steps_per_epoch_fn))
            block = []
        others.append((entry, count))
    if block:
        mechanisms.extend(tree_gaussian_mechanisms(block, steps_per_epoch_fn))
    return others, mechanisms
