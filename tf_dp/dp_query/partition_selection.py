"""Private partition selection of embedding rows and sparsity-preserving noise (DP-AdaFEST and
DP-FEST, Ghazi et al. 2023, "Sparsity-Preserving Differentially Private Training of Large
Embedding Models").

One DP-AdaFEST step on an embedding table of ``V`` rows:

1. Contribution map: example ``i`` touches the set ``R_i`` of rows (its ids, duplicates counted
   once); its map is the indicator of ``R_i`` scaled to L2 norm at most ``contribution_bound``
   (``c_i = min(1, C1 / sqrt(|R_i|))`` on each of its rows). The batch's map is the sum: a
   Gaussian sum query of L2 sensitivity ``C1`` (add/remove one example).
2. Selection: ``N(0, (sigma1 C1)^2)`` is added to every row's count and the rows whose noisy count
   exceeds ``threshold`` are selected (:func:`select_rows`).
3. Gradient: the clipped per-example gradient rows are summed and ``N(0, (sigma2 C2)^2)`` noise
   is added on the selected rows only; rows not selected get nothing, not noise
   (:func:`sparse_noised_sum`). The result is a ``tf.IndexedSlices`` over the selected rows.

Both noisy sums are Gaussian sum queries on the same sample, so the step's mechanism is their
composition (record both with the ledger: ``tf_dp.accounting.partition_selection``); the
threshold is post-processing. DP-FEST replaces step 2 by a fixed set of rows chosen once, from
public frequencies or from one privately counted histogram (:func:`top_rows`).

Example::

    ids = tf.constant([[3, 3, 7], [7, 1, -1]])           # -1 pads
    counts = contribution_map(ids, vocab_size=10, contribution_bound=1.0)
    gen = make_generator()
    rows = select_rows(gen, counts, threshold=0.5, noise_stddev=1.0)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Optional

import tensorflow as tf

from tf_dp.dp_query.dp_query import DPQuery, SumQuerySpec
from tf_dp.dp_query.noise import gaussian_noise, make_generator

__all__ = [
    "contribution_weights",
    "contribution_map",
    "select_rows",
    "sparse_noised_sum",
    "top_rows",
    "private_row_counts",
    "make_generator",
    "SparseEmbeddingConfig",
    "PartitionSelectionQuery",
]


def _check_nonneg(name: str, value: Any) -> None:
    v = tf.get_static_value(value)
    if v is not None and not float(v) >= 0.0:
        raise ValueError(f"{name} must be >= 0, got {v!r}")


def _first_occurrences(ids: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    """Sorted ids ``[B, L]`` and a mask of each example's distinct valid ids (first occurrence
    in sorted order; ids < 0 are padding)."""
    ids = tf.sort(tf.cast(ids, tf.int64), axis=1)
    prev = tf.concat([tf.fill([tf.shape(ids)[0], 1], tf.constant(-1, tf.int64)), ids[:, :-1]], 1)
    first = tf.logical_and(ids >= 0, tf.not_equal(ids, prev))
    return ids, first


def contribution_weights(ids: Any, contribution_bound: Any) -> tf.Tensor:
    """Per-example weight ``min(1, C1 / sqrt(|R_i|))`` of its distinct rows (``[B]``, float32):
    the contribution map of example ``i`` then has L2 norm ``<= contribution_bound``.

    ``ids``: ``[B, L]`` integer row ids, ``-1`` for padding."""
    _check_nonneg("contribution_bound", contribution_bound)
    _, first = _first_occurrences(tf.convert_to_tensor(ids))
    k = tf.reduce_sum(tf.cast(first, tf.float32), axis=1)
    c = tf.cast(contribution_bound, tf.float32)
    return tf.where(k > 0, tf.minimum(1.0, c * tf.math.rsqrt(tf.maximum(k, 1.0))), 0.0)


def contribution_map(ids: Any, vocab_size: int, contribution_bound: Any) -> tf.Tensor:
    """The batch's clipped contribution map: ``[vocab_size]`` float32, row ``r`` the sum over
    examples touching ``r`` of their weight (:func:`contribution_weights`). Its L2 sensitivity
    under add/remove-one is ``contribution_bound``.

    Args:
      ids: ``[B, L]`` integer row ids of each example (``-1`` pads; duplicates count once).
      vocab_size: number of rows ``V`` (> 0); ids must be in ``[-1, V)``.
      contribution_bound: ``C1 > 0``, the L2 bound of one example's map.
    """
    if not (isinstance(vocab_size, int) and vocab_size > 0):
        raise ValueError(f"vocab_size must be an integer > 0, got {vocab_size!r}")
    c = tf.get_static_value(tf.convert_to_tensor(contribution_bound))
    if c is not None and not float(c) > 0:
        raise ValueError(f"contribution_bound must be > 0, got {c!r}")
    ids = tf.convert_to_tensor(ids)
    if ids.shape.rank != 2:
        raise ValueError(f"ids must be a [batch, length] tensor, got shape {ids.shape}")
    sorted_ids, first = _first_occurrences(ids)
    k = tf.reduce_sum(tf.cast(first, tf.float32), axis=1)
    w = tf.where(
        k > 0, tf.minimum(1.0, tf.cast(contribution_bound, tf.float32) * tf.math.rsqrt(tf.maximum(k, 1.0))), 0.0
    )
    tf.debugging.assert_less(
        sorted_ids[:, -1:] if ids.shape[1] != 0 else tf.zeros([0, 1], tf.int64),
        tf.constant(vocab_size, tf.int64), message="ids must be < vocab_size",
    )
    per = tf.where(first, w[:, None] * tf.ones_like(sorted_ids, tf.float32), 0.0)
    rows = tf.where(first, sorted_ids, 0)
    return tf.tensor_scatter_nd_add(
        tf.zeros([vocab_size], tf.float32), tf.reshape(rows, [-1, 1]), tf.reshape(per, [-1])
    )


def select_rows(
    generator: tf.random.Generator, counts: Any, threshold: Any, noise_stddev: Any
) -> tf.Tensor:
    """DP-AdaFEST's selection: the rows (int64 ``[n]``, ascending) whose count plus
    ``N(0, noise_stddev^2)`` exceeds ``threshold``.

    ``noise_stddev`` is ``sigma1 * contribution_bound``; ``noise_stddev = 0`` selects exactly
    the rows with ``count > threshold`` (no privacy; for tests). The noise is drawn for every row
    (``V`` scalars, one per row, not ``V x d``)."""
    _check_nonneg("noise_stddev", noise_stddev)
    counts = tf.convert_to_tensor(counts, tf.float32)
    noise = gaussian_noise(generator, tf.size(counts), tf.float32, tf.cast(noise_stddev, tf.float32))
    noisy = counts + tf.reshape(noise, tf.shape(counts))
    return tf.reshape(tf.where(noisy > tf.cast(threshold, tf.float32)), [-1])


def sparse_noised_sum(
    generator: tf.random.Generator,
    rows: Any,
    row_ids: Any,
    row_values: Any,
    noise_stddev: Any,
    dense_shape: Any,
) -> tf.IndexedSlices:
    """The noised sum of clipped per-example gradient rows, restricted to the selected ``rows``.

    Args:
      generator: noise generator (:func:`make_generator`).
      rows: selected row indices, int64 ``[n]``, distinct (from :func:`select_rows` or
        :func:`top_rows`).
      row_ids: ``[m]`` row index of each (already clipped and weighted) gradient row.
      row_values: ``[m, d]`` the gradient rows (several may share a row id: they are summed).
      noise_stddev: ``sigma2 * C2``, added i.i.d. to each of the ``n x d`` selected coordinates.
      dense_shape: the table's shape ``[V, d]``.

    Returns ``tf.IndexedSlices(values [n, d], indices rows, dense_shape)``: gradient rows whose id
    is not selected are dropped; selected rows nobody touched carry noise only.
    """
    _check_nonneg("noise_stddev", noise_stddev)
    rows = tf.cast(tf.reshape(rows, [-1]), tf.int64)
    row_ids = tf.cast(tf.reshape(row_ids, [-1]), tf.int64)
    row_values = tf.convert_to_tensor(row_values)
    d = tf.shape(row_values)[1]
    # position of each gradient row's id among the selected rows (or -1)
    pos = tf.searchsorted(rows, row_ids, side="left", out_type=tf.int64)
    padded = tf.concat([rows, tf.constant([-1], tf.int64)], 0)  # pos in [0, n] always gathers
    hit = tf.equal(tf.gather(padded, pos), row_ids)
    seg = tf.where(hit, pos, tf.size(rows, out_type=tf.int64))  # misses -> a dropped segment
    summed = tf.math.unsorted_segment_sum(row_values, seg, tf.size(rows) + 1)[:-1]
    n = tf.size(rows)
    noise = gaussian_noise(generator, n * d, row_values.dtype, tf.cast(noise_stddev, row_values.dtype))
    values = summed + tf.reshape(noise, [n, d])
    return tf.IndexedSlices(values, rows, tf.cast(dense_shape, tf.int64))


def top_rows(frequencies: Any, k: int) -> tf.Tensor:
    """DP-FEST's fixed selection: the ``k`` rows (int64, ascending) of largest frequency, from
    public frequencies or from a privately counted histogram (e.g. :func:`contribution_map`
    summed over the dataset plus Gaussian noise, recorded once as its own mechanism)."""
    freqs = tf.convert_to_tensor(frequencies, tf.float32)
    n = int(freqs.shape[0])
    if not (isinstance(k, int) and 0 < k <= n):
        raise ValueError(f"k must be an integer in [1, {n}], got {k!r}")
    return tf.sort(tf.cast(tf.math.top_k(freqs, k).indices, tf.int64))


def private_row_counts(ids: Any, vocab_size: int, contribution_bound: float,
                       noise_multiplier: float, ledger: Any = None,
                       seed: Optional[int] = None) -> tf.Tensor:
    """DP-FEST's privately counted histogram: the contribution map of the whole data set
    (:func:`contribution_map`, one example's map of L2 norm at most ``C1``) plus
    ``N(0, (noise_multiplier * C1)^2)`` on every row; pass it to :func:`top_rows`. One Gaussian
    sum query over all ``n`` examples: with ``ledger`` (a :class:`~tf_dp.ledger.PrivacyLedger`)
    it is recorded there as a sample of every example (rate 1) with that query; compose it with
    the training's: ``compute_epsilon(ledger.runs() + optimizer.ledger.runs(), delta)``.

    Args:
      ids: ``[n, L]`` integer row ids of every example (``-1`` pads).
      vocab_size: ``V``, the table's rows.
      contribution_bound: ``C1 > 0``.
      noise_multiplier: ``sigma > 0`` (finite).
      ledger: where to record the query, or None (the caller accounts for it).
      seed: tests only (a predictable draw has no privacy).

    Example:

    >>> import numpy as np
    >>> from tf_dp.ledger import PrivacyLedger
    >>> ledger = PrivacyLedger()
    >>> ids = np.random.default_rng(0).integers(0, 50, (1000, 4))
    >>> counts = private_row_counts(ids, 50, 1.0, 4.0, ledger=ledger)
    >>> rows = top_rows(counts, 10)
    >>> entry = ledger.samples()[0]
    >>> entry.queries[0].noise_stddev, entry.sampling.selection_probability
    (4.0, 1.0)
    """
    c1 = _finite("contribution_bound", contribution_bound, 0.0, True)
    sigma = _finite("noise_multiplier", noise_multiplier, 0.0, True)
    ids = tf.convert_to_tensor(ids)
    n = int(ids.shape[0]) if ids.shape.rank else 0
    if n < 1:
        raise ValueError(f"ids must be [n, L] with n >= 1 examples, got shape {ids.shape}")
    counts = contribution_map(ids, vocab_size, c1)
    generator = make_generator(seed)
    noisy = counts + gaussian_noise(generator, vocab_size, tf.float32, sigma * c1)
    if ledger is not None:
        ledger.record_sampling(n, 1.0, "poisson", origin="sampled")
        ledger.record_sum_query(c1, sigma * c1, noise_seed=seed)
        ledger.flush()
    return noisy


def _finite(name: str, value: Any, low: float, strict: bool) -> float:
    ok = (not isinstance(value, bool)) and isinstance(value, (int, float)) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        rel = ">" if strict else ">="
        raise ValueError(f"{name} must be a finite number {rel} {low:g}, got {value!r}")
    return float(value)


def _check_rows(rows: Any) -> tuple:
    """``rows`` as ``((layer name or None, (sorted distinct ids...)), ...)``."""
    import numpy as np

    if isinstance(rows, dict):
        items = list(rows.items())
    else:
        items = [(None, rows)]
    if not items:
        raise ValueError("rows must name at least one table (a dict of layer name -> row ids)")
    out = []
    for name, ids in items:
        if name is not None and not isinstance(name, str):
            raise ValueError(f"rows: keys must be layer names (str), got {name!r}")
        arr = np.asarray(ids)
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(
                f"rows{'' if name is None else '[' + repr(name) + ']'} must be a non-empty 1-d "
                f"sequence of integer row ids >= 0, got {ids!r:.80}")
        if arr.min() < 0:
            raise ValueError(f"rows: row ids must be >= 0, got {int(arr.min())}")
        out.append((name, tuple(int(v) for v in np.unique(arr))))
    return tuple(out)


@dataclasses.dataclass(frozen=True)
class SparseEmbeddingConfig:
    """Sparse DP training of the embedding tables of a Keras model (the ``sparse_embeddings``
    argument of the DP optimizers): each table gets the noised gradient on a set of rows only, as a
    ``tf.IndexedSlices``; the other rows get nothing, not noise.

    Two ways to choose the rows (Ghazi et al. 2023):

    - DP-AdaFEST (``threshold`` and ``selection_noise_multiplier``): at every step, the rows whose
      clipped contribution count plus Gaussian noise exceeds ``threshold`` (a second Gaussian sum
      query of the step, recorded in the ledger);
    - DP-FEST (``rows``): a fixed set of rows per table, chosen once from public frequencies or
      from one privately counted histogram (:func:`top_rows`; its privacy cost is the user's to
      record, e.g. as one more Gaussian sum query in the ledger). No per-step selection: the step
      is the gradient's Gaussian query alone, and its shapes are fixed, so it also runs under XLA.

    Attributes:
      threshold: ``tau`` (finite, >= 0): a row is selected when its clipped count plus noise
        exceeds it. Required without ``rows``; must be None with it.
      selection_noise_multiplier: ``sigma1`` (finite, >= 0): the count noise stddev is
        ``sigma1 * contribution_bound`` (0: no privacy, for tests only). Required without
        ``rows``; must be None with it.
      contribution_bound: ``C1`` (finite, > 0): the L2 bound of one example's contribution map
        (its distinct rows over all sparse tables, each of weight ``min(1, C1 / sqrt(k))``).
      layers: names of the ``keras.layers.Embedding`` layers to train sparsely (None: every
        ``Embedding`` of the model, ``ReversibleEmbedding`` included).
      rows: DP-FEST's fixed rows: a dict of layer name -> row ids (every sparse table must have
        an entry), or one sequence of row ids when the model has one sparse table. Stored as
        ``((name or None, sorted distinct ids), ...)``.

    Example:

    >>> cfg = SparseEmbeddingConfig(threshold=5.0, selection_noise_multiplier=3.0)
    >>> cfg.contribution_bound
    1.0
    >>> SparseEmbeddingConfig.from_config(cfg.get_config()) == cfg
    True
    >>> fest = SparseEmbeddingConfig(rows={"items": [7, 3, 3, 11]})
    >>> fest.rows, fest.selection_stddev
    ((('items', (3, 7, 11)),), None)
    """

    threshold: Optional[float] = None
    selection_noise_multiplier: Optional[float] = None
    contribution_bound: float = 1.0
    layers: Optional[tuple] = None
    rows: Optional[tuple] = None

    def __post_init__(self):
        if self.rows is not None:
            given = [n for n in ("threshold", "selection_noise_multiplier")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(
                    f"{' and '.join(given)} must be None with rows= (DP-FEST: the rows are fixed, "
                    "no per-step selection)")
            if not (isinstance(self.rows, tuple) and all(
                    isinstance(r, tuple) and len(r) == 2 and isinstance(r[1], tuple)
                    for r in self.rows)):
                object.__setattr__(self, "rows", _check_rows(self.rows))
        else:
            for name in ("threshold", "selection_noise_multiplier"):
                if getattr(self, name) is None:
                    raise ValueError(
                        f"{name} is required (a finite number >= 0) unless rows= is given "
                        "(DP-FEST's fixed rows)")
            object.__setattr__(self, "threshold", _finite("threshold", self.threshold, 0.0, False))
            object.__setattr__(self, "selection_noise_multiplier", _finite(
                "selection_noise_multiplier", self.selection_noise_multiplier, 0.0, False))
        object.__setattr__(self, "contribution_bound", _finite(
            "contribution_bound", self.contribution_bound, 0.0, True))
        if self.layers is not None:
            names = (self.layers,) if isinstance(self.layers, str) else tuple(self.layers)
            if not names or not all(isinstance(n, str) for n in names):
                raise ValueError(
                    f"layers must be None or a non-empty sequence of layer names, got {self.layers!r}")
            object.__setattr__(self, "layers", names)

    @property
    def selection_stddev(self) -> Optional[float]:
        """``sigma1 * C1``, the noise stddev of each row's count (None with fixed ``rows``)."""
        if self.rows is not None:
            return None
        return self.selection_noise_multiplier * self.contribution_bound

    def rows_for(self, name: str, num_tables: int) -> Optional[tuple]:
        """The fixed rows of the table of layer ``name`` (None without ``rows``); ValueError
        when ``rows`` has no entry for it."""
        if self.rows is None:
            return None
        table = dict(self.rows)
        if name in table:
            return table[name]
        if None in table and num_tables == 1:
            return table[None]
        raise ValueError(
            f"sparse_embeddings rows= has no entry for the sparse table of layer {name!r} (its "
            f"entries: {sorted(str(k) for k in table)}); give a dict of layer name -> row ids with "
            "one entry per sparse table")

    def get_config(self) -> dict:
        config = {"threshold": self.threshold,
                  "selection_noise_multiplier": self.selection_noise_multiplier,
                  "contribution_bound": self.contribution_bound,
                  "layers": None if self.layers is None else list(self.layers)}
        if self.rows is not None:
            config["rows"] = [[name, list(ids)] for name, ids in self.rows]
        return config

    @classmethod
    def from_config(cls, config: dict) -> "SparseEmbeddingConfig":
        config = dict(config)
        if config.get("rows") is not None:
            config["rows"] = tuple((name, tuple(ids)) for name, ids in config["rows"])
        return cls(**config)


class PartitionSelectionQuery(DPQuery):
    """A sum query (the gradient's, e.g. :class:`~tf_dp.dp_query.GaussianSumQuery`) together with
    the partition selection of the sparse tables' rows in the same step.

    The wrapped query noises the dense leaves as usual; :meth:`noised_rows` selects rows from the
    clipped contribution map and adds the wrapped query's noise stddev to the selected rows of the
    sparse tables only. :meth:`sum_query_specs` reports both sum queries, so a ledger records the
    selection (sensitivity ``C1``, noise ``sigma1 C1``) beside the gradient query at every step.

    Example::

        query = PartitionSelectionQuery(GaussianSumQuery(1.0, 1.1), SparseEmbeddingConfig(5.0, 3.0))
        len(query.sum_query_specs(query.initial_global_state()))     # 2
    """

    def __init__(self, query: DPQuery, config: SparseEmbeddingConfig,
                 seed: Optional[int] = None) -> None:
        if not isinstance(config, SparseEmbeddingConfig):
            raise TypeError(
                f"sparse_embeddings must be a SparseEmbeddingConfig, got {type(config).__name__}")
        self.query = query
        self.queries = [query]  # for walkers of nested queries (noise mode, prefetching)
        self.config = config
        self._seed = seed
        with tf.init_scope():  # a seed (tests only) keys a stream apart from the gradient's
            self._generator = make_generator(None if seed is None else (int(seed) + 0x5E1EC7) % 2**31)

    # the wrapped query's protocol
    def initial_global_state(self):
        return self.query.initial_global_state()

    def derive_sample_params(self, global_state):
        return self.query.derive_sample_params(global_state)

    def initial_sample_state(self, template):
        return self.query.initial_sample_state(template)

    def preprocess_record(self, params, record):
        return self.query.preprocess_record(params, record)

    def accumulate_preprocessed_record(self, sample_state, preprocessed_record):
        return self.query.accumulate_preprocessed_record(sample_state, preprocessed_record)

    def merge_sample_states(self, sample_state_1, sample_state_2):
        return self.query.merge_sample_states(sample_state_1, sample_state_2)

    def get_noised_result(self, sample_state, global_state):
        return self.query.get_noised_result(sample_state, global_state)

    def derive_metrics(self, global_state):
        return self.query.derive_metrics(global_state)

    @property
    def supports_norm_clipping(self) -> bool:
        return self.query.supports_norm_clipping

    def clip_weights(self, params, squared_norms):
        return self.query.clip_weights(params, squared_norms)

    def accumulate_norms(self, params, sample_state, norms, record_mask=None):
        return self.query.accumulate_norms(params, sample_state, norms, record_mask)

    def sum_query_specs(self, global_state) -> list:
        c = self.config
        specs = list(self.query.sum_query_specs(global_state))
        if c.rows is not None:  # DP-FEST: fixed rows, no selection in the step
            return specs
        return specs + [SumQuerySpec(
            c.contribution_bound, c.selection_stddev, noise_seed=self._seed, exact_gaussian=True)]

    def noised_rows(self, global_state: Any, ids: list, slices: list,
                    names: Optional[list] = None) -> list:
        """The released updates of the sparse tables (a list of ``tf.IndexedSlices``).

        Args:
          global_state: the wrapped query's global state (its noise stddev is used).
          ids: per table, ``[B, T]`` int64 row ids of each example (``-1``: not counted, e.g.
            padding records).
          slices: per table, the clipped rows: ``tf.IndexedSlices(values [B*T, d], indices =
            ids flattened, dense_shape [V, d])``.

        One selection for all tables: the tables' rows are numbered one after another, so each
        example's contribution map over all of them has L2 norm ``<= C1``. With DP-FEST's fixed
        ``rows`` (``names``: the tables' layer names) there is no selection: each table's
        fixed rows get the sum and the noise.
        """
        c = self.config
        std = self.query.sum_query_specs(global_state)[0].noise_stddev
        if c.rows is not None:
            if names is None or len(names) != len(slices):
                raise ValueError("noised_rows with fixed rows needs the tables' layer names")
            out = []
            for t, s, name in zip(ids, slices, names):
                fixed = tf.constant(c.rows_for(name, len(slices)), tf.int64)
                row_ids = tf.where(tf.reshape(t, [-1]) >= 0, tf.cast(s.indices, tf.int64), -1)
                out.append(sparse_noised_sum(self._generator, fixed, row_ids, s.values,
                                             tf.cast(std, s.values.dtype), s.dense_shape))
            return out
        sizes = [int(s.dense_shape[0]) if tf.get_static_value(s.dense_shape) is None
                 else int(tf.get_static_value(s.dense_shape)[0]) for s in slices]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        all_ids = tf.concat([tf.where(t >= 0, t + o, -1) for t, o in zip(ids, offsets)], axis=1)
        counts = contribution_map(all_ids, sum(sizes), c.contribution_bound)
        selected = select_rows(self._generator, counts, c.threshold, c.selection_stddev)
        out = []
        for t, s, o, v in zip(ids, slices, offsets, sizes):
            mine = tf.boolean_mask(selected, (selected >= o) & (selected < o + v)) - o
            row_ids = tf.where(tf.reshape(t, [-1]) >= 0, tf.cast(s.indices, tf.int64), -1)
            out.append(sparse_noised_sum(self._generator, mine, row_ids, s.values,
                                         tf.cast(std, s.values.dtype), s.dense_shape))
        return out
