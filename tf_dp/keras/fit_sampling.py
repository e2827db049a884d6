"""The bookkeeping of ``fit``, ``train_on_batch`` and ``compile`` of a private model.

``fit`` declares the sampling of its input to the DP optimizer (a :class:`tf_dp.engine.Sampling`:
in-memory arrays with ``batch_size`` as ``shuffle`` batches, ``q = batch_size / n``;
``tf_dp.data.poisson_batches(...)`` as ``poisson``, sampled by tf_dp) for that ``fit`` only, marks
every epoch as a new pass, probes for layers that mix records, and flushes the ledger after every
compiled call. ``compile`` hands the model's ledger on to a new DP optimizer; loading and saving
carry the ledger with the weights. The train step itself is in ``models.py``.
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_dp._progress import working
from tf_dp.data.poisson import pad_to_multiple
from tf_dp.dp_query.noise import PrefetchedNoise
from tf_dp.engine import Sampling
from tf_dp.keras import batch_mixing, multi_worker
from tf_dp.keras.compatibility import check_model_is_dp_compatible
from tf_dp.keras.optimizers import DPOptimizerMixin
from tf_dp.ledger.privacy_ledger import table_steps

_logger = logging.getLogger("tf_dp")


def _num_examples(x: Any) -> int | None:
    leaves = tf.nest.flatten(x)
    if leaves and all(isinstance(t, (np.ndarray, tf.Tensor)) or hasattr(t, "shape") for t in leaves):
        first = leaves[0]
        if isinstance(first, tf.data.Dataset):
            return None
        shape = getattr(first, "shape", None)
        if shape is not None and len(shape) > 0 and shape[0] is not None:
            return int(shape[0])
    return None


def _dp_optimizer_of(model: keras.Model):
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizerMixin):
        raise TypeError(
            "a private model needs a tf_dp DP optimizer (e.g. tf_dp.keras.DPKerasSGDOptimizer); "
            f"compile it with one (got {type(optimizer).__name__})"
        )
    return optimizer


def _with_class_weight(dataset: tf.data.Dataset, class_weight: dict) -> tf.data.Dataset:
    """Multiplies each row's sample weight by its class weight (as Keras does for arrays)."""
    if not isinstance(class_weight, dict) or not class_weight:
        raise ValueError(f"class_weight must be a non-empty dict {{class: weight}}, got {class_weight!r}")
    size = max(int(k) for k in class_weight) + 1
    table = np.ones(size, np.float32)
    for k, w in class_weight.items():
        if isinstance(k, bool) or int(k) != k or int(k) < 0:
            raise ValueError(f"class_weight keys must be integers >= 0, got {k!r}")
        if not np.isfinite(w) or w < 0:
            raise ValueError(f"class_weight values must be finite numbers >= 0, got {w!r}")
        table[int(k)] = w
    table = tf.constant(table)

    def weigh(x, y, sample_weight):
        if len(y.shape) == 2 and y.shape[-1] is not None and y.shape[-1] > 1:
            labels = tf.argmax(y, axis=-1)
        else:
            labels = tf.reshape(tf.cast(y, tf.int64), [-1])
        return x, y, sample_weight * tf.gather(table, labels)

    return dataset.map(weigh)




def prepare_fit(model: keras.Model, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Declares the sampling of ``fit``'s input to the DP optimizer; unwraps Poisson batches.

    The declaration holds for this ``fit`` only (the DP optimizer forgets it when ``fit``
    returns), so a later ``fit`` on another input never inherits it.
    """
    optimizer = _dp_optimizer_of(model)
    args = list(args)
    x = args[0] if args else kwargs.get("x")
    sampling = getattr(x, "tf_dp_sampling", None)
    claim = getattr(x, "sampling", None)
    if isinstance(claim, Sampling) and claim.origin == "sampled" and sampling is None:
        sampling = (claim.population_size, claim.selection_probability)
    if sampling is not None:
        n, q = sampling
        if kwargs.get("batch_size") is not None:
            raise ValueError("batch_size must be None when x is tf_dp.data.poisson_batches(...)")
        workers = multi_worker.num_workers(model.distribute_strategy)
        shards = getattr(x, "num_shards", 1)
        if shards != workers:
            raise ValueError(
                f"poisson_batches(num_shards={shards}) under a strategy with {workers} worker(s): "
                f"each worker must sample its own shard, with num_shards={workers} and "
                "shard_index=<its task index>, so that the union of the workers' batches is one "
                "Poisson sample of the whole data set"
            )
        dataset = x.dataset
        class_weight = kwargs.pop("class_weight", None)
        if class_weight is not None:
            dataset = _with_class_weight(dataset, class_weight)
        if workers > 1:  # one element per worker and global step (see multi_worker.py)
            k = getattr(x, "records_per_user", None) or 1  # rows per unit (user slot)
            dataset = multi_worker.distribute_poisson_batches(
                model.distribute_strategy, dataset, x.max_batch_size * k, k
            )
        if not isinstance(claim, Sampling):  # else a tf_dp sampler's own claim (policy, unit, k)
            claim = Sampling(int(n), float(q), "poisson", origin="sampled")
        if workers <= 1:  # equal pieces (whole user slots) for the local replicas
            replicas = model.distribute_strategy.num_replicas_in_sync
            dataset = pad_to_multiple(dataset, replicas * (claim.records_per_unit or 1))
        given = kwargs.get("steps_per_epoch")
        if claim.policy == "balls_in_bins" and given not in (None, x.steps_per_epoch):
            # each fit epoch must be one whole pass (one assignment): the accountants count
            # epochs of T steps from each fit epoch's start
            raise ValueError(
                f"steps_per_epoch must be None or {x.steps_per_epoch} (T, the batches of one "
                f"pass) with balls_in_bins_batches, got {given!r}"
            )
        optimizer.declare_fit_sampling(claim)
        kwargs.setdefault("shuffle", False)  # the sampler draws its own batches
        if args:
            args[0] = dataset
        else:
            kwargs["x"] = dataset
        if kwargs.get("steps_per_epoch") is None and getattr(x, "steps_per_epoch", None):
            kwargs["steps_per_epoch"] = x.steps_per_epoch
        return tuple(args), kwargs
    n = _num_examples(x)
    if n is not None:
        split = kwargs.get("validation_split") or 0.0
        n_train = int(n * (1.0 - split)) if split else n
        if n_train < 1:
            raise ValueError(
                f"x holds {n} examples ({n_train} for training after validation_split={split}); "
                "DP training needs at least 1"
            )
        batch_size = kwargs.get("batch_size") or (args[2] if len(args) > 2 and args[2] else 32)
        batch_size = min(int(batch_size), n_train)
        # Fixed-size batches, shuffled or not: the bound used for them assumes no amplification
        # (each example is in one batch per epoch), so it does not depend on the order.
        optimizer.declare_fit_sampling(
            Sampling(n_train, batch_size / n_train, "shuffle", origin="sampled")
        )
        return tuple(args), kwargs
    if not optimizer.sampling_configured:
        raise ValueError(
            "cannot tell how this input samples the data: pass in-memory arrays, "
            "tf_dp.data.poisson_batches(...), or call model.optimizer.set_sampling("
            "population_size=..., selection_probability=..., sampling_policy=...) before this "
            "fit (a sampling that an earlier fit derived from its own input is not reused)"
        )
    return tuple(args), kwargs


class _PassStarts(keras.callbacks.Callback):
    """Marks every ``fit`` epoch as a new pass over the data (a new shuffle / iterator)."""

    def __init__(self, optimizer):
        super().__init__()
        self._dp_optimizer = optimizer

    def on_epoch_begin(self, epoch, logs=None):
        self._dp_optimizer.start_pass()


def _with_pass_starts(optimizer, args: list, kwargs: dict) -> None:
    """Adds the :class:`_PassStarts` callback to ``fit``'s callbacks (keyword or positional)."""
    if len(args) > 5:  # fit(x, y, batch_size, epochs, verbose, callbacks, ...)
        callbacks = args[5]
    else:
        callbacks = kwargs.get("callbacks")
    if isinstance(callbacks, keras.callbacks.CallbackList):
        callbacks.append(_PassStarts(optimizer))
        return
    callbacks = [_PassStarts(optimizer)] + list(callbacks or [])
    if len(args) > 5:
        args[5] = callbacks
    else:
        kwargs["callbacks"] = callbacks


def _refuse_ragged_input(args: tuple, kwargs: dict) -> None:
    """Ragged or sparse ``x`` / ``y``: per-example gradients need records of one shape."""
    for i, name in enumerate(("x", "y")):
        value = args[i] if len(args) > i else kwargs.get(name)
        kinds = {type(t).__name__ for t in tf.nest.flatten(value)
                 if isinstance(t, (tf.RaggedTensor, tf.SparseTensor))}
        if kinds:
            raise ValueError(
                f"{name} holds a {' and a '.join(sorted(kinds))}: DP training needs rectangular "
                "inputs (the per-example gradients are computed over a dense batch); pad the "
                "records to one shape (.to_tensor(), keras.utils.pad_sequences) and mask the "
                "padding (e.g. Embedding(mask_zero=True))"
            )


def _probe_batch_mixing(model: keras.Model, x: Any) -> None:
    """Once per model (until conclusive): refuses a model whose layers mix the records of a batch
    (``tf_dp/keras/batch_mixing.py``), eagerly, before the first step runs or is recorded."""
    if getattr(model, "_tf_dp_batch_probe_done", False):
        return
    records = batch_mixing.probe_inputs(model, x)
    if records is None:
        _logger.warning(
            "tf_dp: cannot read records of this input without consuming it, and the model's "
            "inputs are not all floating point: layers that mix the records of a batch are not "
            "probed (see tf_dp/keras/batch_mixing.py)"
        )
    elif batch_mixing.check_batch_independence(model, records):
        model._tf_dp_batch_probe_done = True


def private_fit(model: keras.Model, fit: Any, args: tuple, kwargs: dict) -> Any:
    """``fit`` of a private model: checks, sampling declaration, and the ledger's bookkeeping.

    Every epoch of ``fit`` starts a new pass over the data: the ledger marks its first step
    (``pass_start``), so shuffle accounting and DP-FTRL's trees restart there, however the
    epochs of several ``fit`` calls are cut.
    """
    check_model_is_dp_compatible(model)
    optimizer = _dp_optimizer_of(model)
    optimizer.check_ledger_covers_steps()
    _refuse_ragged_input(args, kwargs)
    _probe_batch_mixing(model, args[0] if args else kwargs.get("x"))
    _check_weights_ledger(model, optimizer)
    args, kwargs = prepare_fit(model, args, kwargs)
    _retrace_for_unit(model, optimizer)
    args = list(args)
    _with_pass_starts(optimizer, args, kwargs)
    fixes = (
        multi_worker.keras_multi_worker_fixes(model)
        if multi_worker.num_workers(model.distribute_strategy) > 1
        else contextlib.nullcontext()
    )
    try:
        with fixes:
            return fit(*args, **kwargs)
    finally:
        optimizer.end_fit()


def private_train_on_batch(model: keras.Model, train_on_batch: Any, args: tuple, kwargs: dict):
    """``train_on_batch`` of a private model: one DP step on a batch the caller chose.

    Needs an explicit declaration, ``model.optimizer.set_sampling(...)``: a declaration that a
    ``fit`` derived from its own input ended with that ``fit``. Under ``sampling_policy=
    'shuffle'`` every call starts its own pass over the data (the caller may put any record in
    any batch, so each call is charged as a full epoch, without amplification) and the noised
    sum is divided by the number of records in the batch; under ``'poisson'`` the caller claims
    each batch is a Poisson sample at the declared rate (recorded as declared, not checked) and
    the denominator is ``q * n``.
    """
    check_model_is_dp_compatible(model)
    optimizer = _dp_optimizer_of(model)
    optimizer.check_ledger_covers_steps()
    if not optimizer.sampling_configured:
        raise ValueError(
            "train_on_batch of a private model needs a sampling declaration: call "
            "model.optimizer.set_sampling(population_size=N, selection_probability=b / N, "
            "sampling_policy='shuffle') first (N: records in the private data set, b: batch "
            "size). With 'shuffle' every call is charged as one full pass over the data (no "
            "amplification); declare 'poisson' only if you draw each batch by Poisson sampling "
            "at rate selection_probability yourself. A declaration that fit derived from its own "
            "input is not reused."
        )
    optimizer.start_pass()
    _retrace_for_unit(model, optimizer)
    return train_on_batch(*args, **kwargs)


def _retrace_for_unit(model: keras.Model, optimizer: Any) -> None:
    """Drops a traced train step that clips another unit (example vs user, or another ``k``)
    than the sampling now in force, so the next call traces the right one."""
    traced = getattr(model, "_tf_dp_step_records_per_user", "untraced")
    if traced != "untraced" and traced != optimizer.records_per_user:
        model.train_function = None


def private_compile(model: keras.Model, compile_fn: Any, args: tuple, kwargs: dict) -> None:
    """``compile`` of a private model: a new DP optimizer continues the model's ledger.

    Under the ``mixed_float16`` policy the DP optimizer is not wrapped in a Keras
    ``LossScaleOptimizer`` (and one passed in is unwrapped): the DP step computes per-example
    losses in float32 without loss scaling, and clips and noises in float32. A loss scale that
    adapts to overflows in the private data would make later steps depend on that data outside
    the noised sum.
    """
    previous = getattr(model, "optimizer", None)
    args = list(args)
    optimizer = args[0] if args else kwargs.get("optimizer")
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and isinstance(optimizer.inner_optimizer, DPOptimizerMixin):
        _logger.warning(
            "tf_dp: LossScaleOptimizer removed: DP steps do not use dynamic loss scaling "
            "(per-example losses and the clipped, noised sum are computed in float32)"
        )
        optimizer = optimizer.inner_optimizer
        if args:
            args[0] = optimizer
        else:
            kwargs["optimizer"] = optimizer
    if isinstance(optimizer, DPOptimizerMixin):
        kwargs["auto_scale_loss"] = False
    compile_fn(*args, **kwargs)
    current = getattr(model, "optimizer", None)
    if (
        current is not previous
        and isinstance(previous, DPOptimizerMixin)
        and isinstance(current, DPOptimizerMixin)
    ):
        current.inherit_ledger(previous)
    if isinstance(current, DPOptimizerMixin):
        weights = _weights_ledger(model)
        if weights is not None and weights.steps > current.ledger.num_samples:
            current.restore_ledger_tables(weights.samples, weights.queries, weights.verified)


class _WeightsLedger:
    """The ledger that came with a private model's loaded weights (the longest one loaded)."""

    def __init__(self, samples: np.ndarray, queries: np.ndarray, verified: bool = True):
        self.samples, self.queries, self.verified = samples, queries, verified

    @property
    def steps(self) -> int:
        return table_steps(self.samples)


def _weights_ledger(model: keras.Model) -> _WeightsLedger | None:
    return model.__dict__.get("_tf_dp_weights_ledger")


def _take_weights_ledger(
    model: keras.Model, samples: np.ndarray, queries: np.ndarray, verified: bool = True
) -> None:
    """A ledger loaded with the model's weights: kept on the model (never a shorter one) and
    restored into its DP optimizer, if it has one (a later DP compile adopts it otherwise)."""
    current = _weights_ledger(model)
    if current is None or table_steps(samples) >= current.steps:
        object.__setattr__(
            model, "_tf_dp_weights_ledger", _WeightsLedger(samples, queries, verified)
        )
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, DPOptimizerMixin):
        optimizer.restore_ledger_tables(samples, queries, verified)


def _ledger_tables_to_save(model: keras.Model) -> tuple[np.ndarray, np.ndarray] | None:
    """The longest of the DP optimizer's ledger and the ledger the weights came with."""
    candidates = []
    optimizer = getattr(model, "optimizer", None)
    if isinstance(optimizer, DPOptimizerMixin):
        candidates.append(optimizer.ledger.run_tables())
    weights = _weights_ledger(model)
    if weights is not None:
        candidates.append((weights.samples, weights.queries))
    if not candidates:
        return None
    return max(candidates, key=lambda t: table_steps(t[0]))


def _check_weights_ledger(model: keras.Model, optimizer: Any) -> None:
    weights = _weights_ledger(model)
    if weights is not None and optimizer.ledger.num_samples < weights.steps:
        raise ValueError(
            f"this model's weights were trained with {weights.steps} DP steps (the ledger saved "
            f"with them) but its optimizer's ledger records only {optimizer.ledger.num_samples}: "
            "the privacy already spent would be ignored, so training cannot continue. Restore "
            "the run's ledger (model.optimizer.ledger.restore_entries(...)), or recompile with a "
            "DP optimizer (model.compile adopts the ledger the weights came with)"
        )


def _state_snapshot(model: keras.Model) -> tuple:
    """Values of the model's and optimizer's variables and the ledgers, to undo a failed load."""
    optimizer = getattr(model, "optimizer", None)
    variables = list(model.variables) + list(getattr(optimizer, "variables", None) or [])
    values = [(v, np.array(v.numpy())) for v in variables]
    tables = None
    if isinstance(optimizer, DPOptimizerMixin):
        ledger = optimizer.ledger
        tables = (ledger.run_tables(), ledger.verified, ledger.trained_steps)
    return values, optimizer, tables, _weights_ledger(model)


def _restore_snapshot(model: keras.Model, snapshot: tuple) -> None:
    values, optimizer, tables, weights = snapshot
    for variable, value in values:
        variable.assign(value)
    if tables is not None:
        (samples, queries), verified, trained = tables
        optimizer.ledger.load_tables(samples, queries, verified=verified)
        optimizer.ledger.reset_trained_steps(trained)
    object.__setattr__(model, "_tf_dp_weights_ledger", weights)


def private_train_function(model: keras.Model) -> None:
    """Makes the train function of a private model XLA-safe for the ledger.

    Before the function is traced, the ledger's staging table gets room for one compiled call
    (``steps_per_execution`` steps); after every call, the staging table is flushed.
    """
    fn = model.train_function
    if fn is None or getattr(fn, "_tf_dp_flushing", False):
        return
    optimizer = getattr(model, "optimizer", None)
    if not isinstance(optimizer, DPOptimizerMixin):
        return
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    optimizer.engine.reserve(steps)
    first = [True]  # the first call traces (and compiles) the DP step: a big model takes minutes
    fused = _fused_train_function(model, optimizer.engine) if steps == 1 else None

    def call(*a, **k):
        if fused is None or PrefetchedNoise.background:  # a background draw: between calls
            optimizer.engine.prefetch_noise()  # XLA steps: noise drawn outside XLA (no-op else)
            return fn(*a, **k), None
        return fused(*a, **k)

    def train_function(*a, **k):
        optimizer.check_dp_schedules(steps)  # bad schedule values fail before the call runs
        try:
            if first[0]:
                first[0] = False
                with working(f"tracing and compiling the first DP step of {model.name!r} "
                             f"({len(model.trainable_variables)} trainable variables)"):
                    out, counters = call(*a, **k)
            else:
                out, counters = call(*a, **k)
        except tf.errors.InvalidArgumentError as e:
            # a run-time clip or noise check of the query (nothing was recorded or applied)
            found = re.search(r"sum query \d+: [^\n]*?must be a finite number >= 0", e.message)
            if found is None:
                raise
            raise ValueError(
                f"{found.group(0)}, got a non-finite or negative value at run time (e.g. a "
                "tf.Variable clip set to inf or NaN); the step recorded and applied nothing"
            ) from None
        optimizer.after_compiled_call(counters)
        return out

    train_function._tf_dp_flushing = True
    model.train_function = train_function


def _fused_train_function(model: keras.Model, engine: Any) -> Any:
    """For a model trained in graph mode one step per call on one device (not ``run_eagerly``,
    ``steps_per_execution`` 1, no ``tf.distribute`` strategy), Keras's train function with the
    work between DP steps in the same call: after the step (XLA-compiled or not), the function
    draws the next step's noise for an XLA step and reads the counters of the ledger's flush
    (:meth:`tf_dp.engine.DPEngine.after_step_in_graph`). Otherwise these are eager calls of
    their own after every step (about 0.7 ms under XLA on a 2-core CPU, 15% of the MLP's
    step). Returns ``fn(iterator) -> (logs, counters)``, or ``None`` where it does not apply
    (the caller keeps Keras's function).

    The step itself is Keras's: ``strategy.run(model.train_step)`` under
    ``tf.function(jit_compile=model.jit_compile)``, on the next element of a ``tf.data``
    iterator (the end of the data raises ``OutOfRangeError``, as in Keras) or on the one batch
    of ``train_on_batch``."""
    if (model.run_eagerly or tf.distribute.has_strategy()
            or model.distribute_strategy is not tf.distribute.get_strategy()):
        return None
    strategy = model.distribute_strategy

    @tf.autograph.experimental.do_not_convert
    def one_step_on_data(data):
        data = tf.nest.map_structure(  # as Keras: optional inputs (e.g. no weights) are None
            lambda x: None if isinstance(x, tf.experimental.Optional) else x, data)
        return strategy.run(model.train_step, args=(data,))

    compiled = tf.function(one_step_on_data, reduce_retracing=True,
                           jit_compile=bool(model.jit_compile))

    def step_and_after(data, journaled):
        logs = compiled(data)
        with tf.control_dependencies(tf.nest.flatten(logs)):
            return logs, engine.after_step_in_graph(journaled)

    # ``journaled`` (a Python bool: one trace with a journal attached, one without; the
    # compiled step is traced and compiled once for both)
    on_data = tf.function(step_and_after, reduce_retracing=True, autograph=False)

    @tf.function(reduce_retracing=True, autograph=False)
    def on_iterator(iterator, journaled):
        return step_and_after(iterator.get_next(), journaled)

    def function(iterator):
        journaled = engine.ledger.journal is not None
        if isinstance(iterator, tf.data.Iterator):
            return on_iterator(iterator, journaled)
        for data in iterator:  # train_on_batch: a generator of one batch
            return on_data(data, journaled)
        raise StopIteration

    return function
