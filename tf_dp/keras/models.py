"""Private Keras models: a ``train_step`` that clips per example and noises through the optimizer.

Three ways to get one, all with the same DP step:

- ``tf_dp.keras.make_private(model)``: any existing Sequential, functional or subclassed model,
  made private in place (and returned);
- ``tf_dp.keras.DPSequential([...])``: a ``keras.Sequential``;
- ``tf_dp.keras.DPModel(inputs, outputs)`` or a subclass of ``DPModel``.

One DP step: the batch's per-example losses (from the compiled loss) -> the optimizer's gradient
strategy computes the clipped sum with the query's clipping rule -> the optimizer noises it
through its query (recording the step in its ledger) and normalises it -> gradients of weight
regularisers (which do not depend on the data) are added -> the base optimizer's update.

``model.fit`` also tells the optimizer how batches are drawn: in-memory arrays with ``batch_size``
are recorded as ``shuffle`` batches (``q = batch_size / n``, no amplification assumed);
``tf_dp.data.poisson_batches(...)`` as ``poisson`` with its real ``n`` and ``q``. For other inputs
call ``model.optimizer.set_sampling(...)`` before ``fit``.

Example::

    model = tf_dp.keras.make_private(keras.Sequential([...]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=256, epochs=2)
"""

from __future__ import annotations

import contextlib
import logging
import re
from typing import Any

import keras
from keras.src.models.functional import Functional
import numpy as np
import tensorflow as tf

from tf_dp.data.poisson import pad_to_multiple
from tf_dp.data.sampling import Sampling
from tf_dp.gradients import per_user
from tf_dp.gradients.base import as_tf_variables
from tf_dp.keras import batch_mixing, ledger_store, multi_worker
from tf_dp.keras.losses import PerExampleLoss

_logger = logging.getLogger("tf_dp")

#: Layers that mix examples of a batch: per-example gradients are not defined for them.
_MIXING_LAYERS = (keras.layers.BatchNormalization,)

#: How many offending layers a refusal names (then: "and N more").
_NAMED_LAYERS = 5


def _names(layers: list[keras.layers.Layer]) -> str:
    shown = ", ".join(repr(layer.name) for layer in layers[:_NAMED_LAYERS])
    more = len(layers) - _NAMED_LAYERS
    return shown + (f" and {more} more" if more > 0 else "")


def _all_layers(model: keras.Model) -> list[keras.layers.Layer]:
    flatten = getattr(model, "_flatten_layers", None)
    if flatten is not None:
        return list(flatten(include_self=False))
    out, stack = [], list(getattr(model, "layers", []))
    while stack:
        layer = stack.pop()
        out.append(layer)
        stack.extend(getattr(layer, "layers", []))
    return out


def incompatible_layers(model: keras.Model) -> dict[str, list[keras.layers.Layer]]:
    """Every layer that ``check_model_is_dp_compatible`` refuses, by kind (``"mixes_examples"``,
    ``"activity_regularizer"``, ``"stateful"``); ``tf_dp.keras.validate_for_dp`` reports them."""
    layers = _all_layers(model)
    return {
        "mixes_examples": [layer for layer in layers if isinstance(layer, _MIXING_LAYERS)],
        "activity_regularizer": [
            layer for layer in layers if getattr(layer, "activity_regularizer", None)
        ],
        "stateful": [layer for layer in layers if getattr(layer, "stateful", False) is True],
    }


def check_model_is_dp_compatible(model: keras.Model) -> None:
    """Raises ValueError naming the layers that DP training cannot support.

    Refused: layers that mix the examples of a batch (``BatchNormalization``), activity
    regularizers (a loss on activations bypasses clipping) and stateful recurrent layers (a
    record's output depends on the records of the previous batch). Each kind names its layers
    (the first five, then how many more). Other layers that mix examples are found at ``fit`` by
    the probe of ``tf_dp/keras/batch_mixing.py``.

    Example::

        check_model_is_dp_compatible(model)  # ValueError: 3 layers mix the examples ...
    """
    found = incompatible_layers(model)
    mixing = found["mixes_examples"]
    if mixing:
        kinds = sorted({type(layer).__name__ for layer in mixing})
        raise ValueError(
            f"{len(mixing)} layer(s) mix the examples of a batch ({', '.join(kinds)}): "
            f"{_names(mixing)}; per-example gradients (and DP-SGD's guarantee) are undefined "
            "with them: use keras.layers.GroupNormalization or keras.layers.LayerNormalization "
            "instead (tf_dp.keras.fix_for_dp(model) swaps in GroupNormalization)"
        )
    regularized = found["activity_regularizer"]
    if regularized:
        raise ValueError(
            f"{len(regularized)} layer(s) have an activity_regularizer, a loss term that depends "
            f"on the batch and would bypass clipping: {_names(regularized)}; remove it for DP "
            "training"
        )
    stateful = found["stateful"]
    if stateful:
        raise ValueError(
            f"{len(stateful)} stateful recurrent layer(s): {_names(stateful)}; a stateful layer "
            "carries its state from one batch to the next, so a record's output and gradient "
            "depend on other records and per-example clipping does not bound its influence: "
            "use stateful=False for DP training"
        )


def _regularization_gradients(model: keras.Model, variables: list[Any]) -> list[Any] | None:
    regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return None
    tf_vars = as_tf_variables(variables)
    with tf.GradientTape() as tape:
        penalty = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
    return tape.gradient(penalty, tf_vars, unconnected_gradients="zero"), penalty


def _refuse_add_loss_terms(model: keras.Model) -> None:
    """Raises if the forward pass added loss terms with ``add_loss``.

    ``model.losses`` holds the ``add_loss`` terms of the last call plus one term per regularised
    weight. ``add_loss`` terms may depend on the batch, so they can be neither clipped per example
    nor added after the noise without breaking the guarantee; the DP step refuses them instead of
    silently dropping them. Weight regularisers (``kernel_regularizer`` ...) are supported.
    """
    regularized = sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None))
    extra = len(model.losses) - regularized
    if extra > 0:
        raise NotImplementedError(
            f"the model adds {extra} loss term(s) with add_loss() during its forward pass; DP "
            "training cannot clip them per example, so they are not supported. Use weight "
            "regularizers (kernel_regularizer=...), which are added after the noise."
        )


def dp_train_step(model: keras.Model, data: Any) -> dict[str, Any]:
    """The DP ``train_step`` used by every private model (see the module docstring)."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
    optimizer = model.optimizer
    if not getattr(optimizer, "_tf_dp_optimizer", False):
        raise TypeError(
            "a private model needs a tf_dp DP optimizer (e.g. tf_dp.keras.DPKerasSGDOptimizer), "
            f"got {type(optimizer).__name__}"
        )
    if not model.built or not model.trainable_variables:
        # A subclassed model builds its variables on its first call: create them here, outside
        # the per-example computation, so that the strategy sees them.
        model(x, training=False)
    strategy = optimizer.strategy_for(model)
    model._tf_dp_step_records_per_user = optimizer.records_per_user  # what this trace clips
    if optimizer.records_per_user is not None:  # user-level: each user's summed gradient
        strategy = per_user.for_users(strategy, optimizer.records_per_user)
    variables = list(model.trainable_variables)
    query = optimizer.dp_query
    optimizer.update_dp_schedules()  # this step's clip and noise, before clipping and recording
    params = query.derive_sample_params(optimizer._dp_global_state)
    loss_fn = PerExampleLoss(model)
    clipped = strategy.clipped_sum(loss_fn, (x, y, sample_weight), variables, query, params)
    _refuse_add_loss_terms(model)
    grads = optimizer.dp_aggregate(clipped)
    reg = _regularization_gradients(model, variables)
    losses = tf.cast(clipped.losses, tf.float32)
    if sample_weight is None:
        mean_loss = tf.reduce_mean(losses)
    else:  # zero-weight rows (e.g. Poisson padding) are not examples: leave them out of the mean
        rows = tf.reduce_sum(tf.cast(tf.not_equal(tf.reshape(sample_weight, [-1]), 0), tf.float32))
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses), rows)
    if reg is not None:
        reg_grads, penalty = reg
        grads = [g + tf.cast(r, g.dtype) for g, r in zip(grads, reg_grads)]
        mean_loss += penalty
    optimizer.apply_dp_gradients(grads, variables)
    tracker = getattr(model, "_loss_tracker", None)
    if tracker is not None:
        real = tf.shape(clipped.losses)[0] if sample_weight is None else rows
        tracker.update_state(mean_loss, sample_weight=real)
    return _compute_metrics(model, x, y, clipped.y_pred, sample_weight)


def _compute_metrics(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any):
    """``model.compute_metrics`` over the real records only.

    Rows with sample weight 0 (the padding of ``tf_dp.data.poisson_batches``) are not examples:
    Keras's compiled ``metrics`` ignore sample weights, so they get the 0/1 mask of real rows as
    their weight, and ``weighted_metrics`` get the sample weights as usual. Shapes stay fixed
    (XLA-safe): rows are masked, not removed.
    """
    compiled = getattr(model, "_compile_metrics", None)
    overridden = type(model).compute_metrics is not keras.Model.compute_metrics
    if (
        sample_weight is None
        or overridden
        or compiled is None
        or not hasattr(compiled, "_flat_metrics")
    ):
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if not compiled.built:
        compiled.build(y, y_pred)
    flat_y = compiled._flatten_y(y)
    flat_pred = compiled._flatten_y(y_pred)
    weights = compiled._flatten_y(sample_weight)
    if len(weights) < len(flat_y):
        weights = [weights[0]] * len(flat_y)
    masks = [tf.cast(tf.not_equal(w, 0), tf.float32) for w in weights]
    for m, y_t, y_p, mask in zip(compiled._flat_metrics, flat_y, flat_pred, masks):
        if m:
            m.update_state(y_t, y_p, mask)
    for m, y_t, y_p, w in zip(compiled._flat_weighted_metrics, flat_y, flat_pred, weights):
        if m:
            m.update_state(y_t, y_p, w)
    return model.get_metrics_result()


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
    if not getattr(optimizer, "_tf_dp_optimizer", False):
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
            dataset = multi_worker.distribute_poisson_batches(
                model.distribute_strategy, dataset, x.max_batch_size
            )
        else:  # equal pieces for the local replicas (whole user slots), whatever the batch's size
            replicas = model.distribute_strategy.num_replicas_in_sync
            k = claim.records_per_unit if isinstance(claim, Sampling) else None
            dataset = pad_to_multiple(dataset, replicas * (k or 1))
        if isinstance(claim, Sampling) and claim.origin == "sampled":
            optimizer._declare_fit_sampling(claim)  # tf_dp's sampler: example- or user-level
        else:
            optimizer._declare_fit_sampling(n, q, "poisson")
        kwargs.setdefault("shuffle", False)  # the Poisson sampler draws its own batches
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
        optimizer._declare_fit_sampling(n_train, batch_size / n_train, "shuffle")
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
        optimizer._end_fit()


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


def _retrace_for_unit(model: keras.Model, optimizer) -> None:
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
    if isinstance(optimizer, keras.optimizers.LossScaleOptimizer) and getattr(
        optimizer.inner_optimizer, "_tf_dp_optimizer", False
    ):
        _logger.warning(
            "tf_dp: LossScaleOptimizer removed: DP steps do not use dynamic loss scaling "
            "(per-example losses and the clipped, noised sum are computed in float32)"
        )
        optimizer = optimizer.inner_optimizer
        if args:
            args[0] = optimizer
        else:
            kwargs["optimizer"] = optimizer
    if getattr(optimizer, "_tf_dp_optimizer", False):
        kwargs["auto_scale_loss"] = False
    compile_fn(*args, **kwargs)
    current = getattr(model, "optimizer", None)
    if (
        current is not previous
        and getattr(previous, "_tf_dp_optimizer", False)
        and getattr(current, "_tf_dp_optimizer", False)
    ):
        current.inherit_ledger(previous)
    if getattr(current, "_tf_dp_optimizer", False):
        weights = _weights_ledger(model)
        if weights is not None and weights.steps > current.ledger.num_samples:
            current.restore_ledger_tables(weights.samples, weights.queries)


class _WeightsLedger:
    """The ledger that came with a private model's loaded weights (the longest one loaded)."""

    def __init__(self, samples: np.ndarray, queries: np.ndarray):
        self.samples, self.queries = samples, queries

    @property
    def steps(self) -> int:
        return int(self.samples.shape[0])


def _weights_ledger(model: keras.Model) -> _WeightsLedger | None:
    return model.__dict__.get("_tf_dp_weights_ledger")


def _take_weights_ledger(model: keras.Model, samples: np.ndarray, queries: np.ndarray) -> None:
    """A ledger loaded with the model's weights: kept on the model (never a shorter one) and
    restored into its DP optimizer, if it has one (a later DP compile adopts it otherwise)."""
    current = _weights_ledger(model)
    if current is None or samples.shape[0] >= current.steps:
        object.__setattr__(model, "_tf_dp_weights_ledger", _WeightsLedger(samples, queries))
    optimizer = getattr(model, "optimizer", None)
    if getattr(optimizer, "_tf_dp_optimizer", False):
        optimizer.restore_ledger_tables(samples, queries)


def _ledger_tables_to_save(model: keras.Model) -> tuple[np.ndarray, np.ndarray] | None:
    """The longest of the DP optimizer's ledger and the ledger the weights came with."""
    candidates = []
    optimizer = getattr(model, "optimizer", None)
    if getattr(optimizer, "_tf_dp_optimizer", False):
        candidates.append(optimizer.ledger.tables())
    weights = _weights_ledger(model)
    if weights is not None:
        candidates.append((weights.samples, weights.queries))
    if not candidates:
        return None
    return max(candidates, key=lambda t: t[0].shape[0])


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
    tables = optimizer.ledger.tables() if getattr(optimizer, "_tf_dp_optimizer", False) else None
    return values, optimizer, tables, _weights_ledger(model)


def _restore_snapshot(model: keras.Model, snapshot: tuple) -> None:
    values, optimizer, tables, weights = snapshot
    for variable, value in values:
        variable.assign(value)
    if tables is not None:
        optimizer.ledger.load_tables(*tables)
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
    if not getattr(optimizer, "_tf_dp_optimizer", False):
        return
    specs = optimizer.dp_query.sum_query_specs(optimizer._dp_global_state)
    steps = int(getattr(model, "steps_per_execution", 1) or 1)
    optimizer.ledger.reserve(steps, len(specs))

    def train_function(*a, **k):
        optimizer.check_dp_schedules(steps)  # bad schedule values fail before the call runs
        try:
            out = fn(*a, **k)
        except tf.errors.InvalidArgumentError as e:
            # a run-time clip or noise check of the query (nothing was recorded or applied)
            found = re.search(r"sum query \d+: [^\n]*?must be a finite number >= 0", e.message)
            if found is None:
                raise
            raise ValueError(
                f"{found.group(0)}, got a non-finite or negative value at run time (e.g. a "
                "tf.Variable clip set to inf or NaN); the step recorded and applied nothing"
            ) from None
        optimizer.after_compiled_call()
        return out

    train_function._tf_dp_flushing = True
    model.train_function = train_function


class _PrivateTrainingMixin:
    """``train_step``, ``fit`` and ``compile`` of a private model (DPSequential and DPModel)."""

    def train_step(self, data):
        return dp_train_step(self, data)

    def fit(self, *args, **kwargs):
        return private_fit(self, super().fit, args, kwargs)

    def train_on_batch(self, *args, **kwargs):
        return private_train_on_batch(self, super().train_on_batch, args, kwargs)

    def compile(self, *args, **kwargs):
        return private_compile(self, super().compile, args, kwargs)

    # Same arguments as Keras's compile: let Keras save and restore the compile config as usual.
    compile._is_default = True

    def compile_from_config(self, config):
        config = keras.saving.deserialize_keras_object(config)
        self.compile(**config)
        if getattr(self, "optimizer", None) is not None and self.built:
            self.optimizer.build(self.trainable_variables)  # create its variables to load into

    def make_train_function(self, force=False):
        out = super().make_train_function(force)
        private_train_function(self)
        return self.train_function if out is None else out

    def save_own_variables(self, store):
        """Saves the model's own variables and the ledger (with its checksum): the privacy
        spent travels with the weights, whatever optimizer the model is compiled with."""
        super().save_own_variables(store)
        tables = _ledger_tables_to_save(self)
        if tables is not None:
            ledger_store.write_ledger(store, *tables)

    def load_own_variables(self, store):
        """Restores the model's own variables and the ledger saved with them, after checking
        its checksum (a corrupted or edited ledger raises ``LedgerFileError``)."""
        tables = ledger_store.read_ledger(store)
        super().load_own_variables(ledger_store.without_ledger(store))
        if tables is not None:
            _take_weights_ledger(self, *tables)

    def load_weights(self, filepath, *args, **kwargs):
        """Keras's ``load_weights``; if loading fails (e.g. a ledger checksum mismatch), the
        weights, optimizer variables and ledger are left as they were."""
        snapshot = _state_snapshot(self)
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except BaseException:
            _restore_snapshot(self, snapshot)
            raise


@keras.saving.register_keras_serializable(package="tf_dp")
class DPSequential(_PrivateTrainingMixin, keras.Sequential):
    """A ``keras.Sequential`` trained with DP-SGD by its DP optimizer.

    Example::

        model = tf_dp.keras.DPSequential([
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(16, 8, strides=2, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(10),
        ])
        model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    """


@keras.saving.register_keras_serializable(package="tf_dp")
class DPModel(_PrivateTrainingMixin, keras.Model):
    """A ``keras.Model`` (functional or subclassed) trained with DP-SGD by its DP optimizer.

    Example::

        inputs = keras.Input((20,))
        outputs = keras.layers.Dense(2)(keras.layers.Dense(16, activation="relu")(inputs))
        model = tf_dp.keras.DPModel(inputs, outputs)      # a DPFunctional, isinstance DPModel

        class MyModel(tf_dp.keras.DPModel):               # subclassed
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(2)

            def call(self, x):
                return self.dense(x)
    """

    def __new__(cls, *args, **kwargs):
        # DPModel(inputs, outputs) builds a DPFunctional. (Keras's own route would inject
        # Functional into DPModel's bases for good, breaking later subclasses of DPModel.)
        if cls is DPModel and _functional_init_arguments(args, kwargs):
            return DPFunctional.__new__(DPFunctional, *args, **kwargs)
        return super().__new__(cls, *args, **kwargs)


def _functional_init_arguments(args: tuple, kwargs: dict) -> bool:
    return (len(args) == 2) or (len(args) == 1 and "outputs" in kwargs) or (
        "inputs" in kwargs and "outputs" in kwargs
    )


@keras.saving.register_keras_serializable(package="tf_dp")
class DPFunctional(DPModel, Functional):
    """A functional private model: what ``tf_dp.keras.DPModel(inputs, outputs)`` returns."""


#: Key of the original class in the config of a model made private by ``make_private``.
_ORIGINAL_CLASS_KEY = "tf_dp_original_class"
_PRIVATE_CLASSES: dict[type, type] = {}


def _private_model_from_config(config: dict, custom_objects: Any = None) -> keras.Model:
    """Rebuilds a model made private by ``make_private``: its original class, made private."""
    config = dict(config)
    original = config.pop(_ORIGINAL_CLASS_KEY, None)
    if not isinstance(original, dict) or not {"module", "class_name"} <= set(original):
        raise ValueError(
            f"not the config of a model made private by tf_dp.keras.make_private (no "
            f"{_ORIGINAL_CLASS_KEY!r} entry)"
        )
    model = keras.saving.deserialize_keras_object(
        {**original, "config": config}, custom_objects=custom_objects
    )
    return make_private(model)


class _MadePrivate(_PrivateTrainingMixin):
    """Base of the classes ``make_private`` gives to models of other classes.

    Saved under the registered name ``tf_dp>PrivateModel`` with the original class in the
    config, so ``keras.saving.load_model`` gives back the original class, made private.
    """

    _tf_dp_original_class: type

    def get_config(self):
        config = dict(super().get_config())
        original = self._tf_dp_original_class
        config[_ORIGINAL_CLASS_KEY] = {
            "module": original.__module__,
            "class_name": original.__name__,
            "registered_name": keras.saving.get_registered_name(original),
        }
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _private_model_from_config(config, custom_objects)


@keras.saving.register_keras_serializable(package="tf_dp", name="PrivateModel")
class _PrivateModelLoader:
    """What ``tf_dp>PrivateModel`` names in a saved config before a private class is made."""

    def get_config(self) -> dict:
        return {}

    @classmethod
    def from_config(cls, config, custom_objects=None):
        return _private_model_from_config(config, custom_objects)


def _private_class(cls: type) -> type:
    if cls is keras.Sequential:
        return DPSequential
    if cls is Functional:
        return DPFunctional
    if cls not in _PRIVATE_CLASSES:
        private = type(
            cls.__name__,
            (_MadePrivate, cls),
            {"__module__": __name__, "_tf_dp_original_class": cls, "__doc__": cls.__doc__},
        )
        # Every such class saves as tf_dp>PrivateModel; loading reads the original class from
        # the config (each registration maps the same name to a class with the same from_config).
        _PRIVATE_CLASSES[cls] = keras.saving.register_keras_serializable(
            package="tf_dp", name="PrivateModel"
        )(private)
    return _PRIVATE_CLASSES[cls]


def make_private(model: keras.Model) -> keras.Model:
    """Makes ``model`` (Sequential, functional or subclassed) private, in place, and returns it.

    Its ``train_step`` becomes the DP step and its ``fit`` declares the sampling of its input to
    the DP optimizer. Compile it with a tf_dp DP optimizer. Layers that mix examples
    (BatchNormalization), activity regularizers and stateful RNNs are refused here; other layers
    that mix the records of a batch are found by a probe at the first ``fit``
    (``tf_dp/keras/batch_mixing.py``). The model's class becomes a private subclass of its class
    (``keras.Sequential`` -> ``DPSequential``, a functional model -> ``DPFunctional``, any other
    class ``C`` -> a subclass of ``C`` with the same name), so ``isinstance`` checks still hold,
    a train function built before is rebuilt, and the model saves and reloads
    (``keras.saving.load_model``) as a private model with its ledger.

    Example::

        model = tf_dp.keras.make_private(model)
        model.compile(optimizer=tf_dp.keras.DPKerasAdamOptimizer(
            l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3), loss="mse")
    """
    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if isinstance(model, _PrivateTrainingMixin):
        return model
    check_model_is_dp_compatible(model)
    private = _private_class(type(model))
    try:
        object.__setattr__(model, "__class__", private)
    except TypeError as e:
        raise TypeError(
            f"make_private cannot make a {type(model).__name__} private ({e}); subclass "
            "tf_dp.keras.DPModel instead of keras.Model"
        ) from None
    # A train function traced before (for the non-private train_step) must not be reused.
    model.train_function = None
    return model


def is_private(model: keras.Model) -> bool:
    """Whether ``model`` trains with the DP step (``make_private``, ``DPSequential``, ``DPModel``).

    Example::

        assert tf_dp.keras.is_private(tf_dp.keras.make_private(model))
    """
    return isinstance(model, _PrivateTrainingMixin)
