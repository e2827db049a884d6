"""A probe for layers that mix the records of a batch (which voids per-example clipping).

DP-SGD clips each record's gradient, which bounds a record's influence only if the model's output
for a record depends on that record alone. A layer that computes a statistic over the batch
(``BatchNormalization`` in training, a custom layer subtracting the batch mean, ...) lets every
record change every other record's output and gradient. ``BatchNormalization`` is refused by type
(``check_model_is_dp_compatible``); any other such layer is caught by this probe, which
``fit`` of a private model runs once per model, eagerly, before its first step:

1. ``B`` records (up to 8) are taken from ``fit``'s input; the first ``h = B // 2`` are kept, the
   other rows are replaced by copies of the kept ones.
2. The model runs on both batches in training mode, with its non-trainable variables (random
   generator states included) restored before each pass, so dropout draws the same masks.
3. If the kept rows' outputs differ beyond float round-off, the model mixes records. The first
   layer whose output changes is named (layer by layer for Sequential and functional models,
   nested models included; a subclassed model is named as a whole) and ``fit`` raises
   ``ValueError`` before anything runs or is recorded.

Nothing is trained or recorded; the non-trainable variables are restored afterwards.

Limits (what the probe cannot see):

- A layer that mixes records only in some batches (e.g. only for batch sizes above 8, or only
  on some input values) or only through a path that these records do not reach.
- A model whose training-mode output is random beyond Keras's seed generators (e.g. a custom
  layer calling ``tf.random.uniform``): two identical passes then differ, so the probe falls back
  to inference mode, where a layer that mixes records only in training is not seen.
- Inputs it cannot read without consuming them: Python generators and ``keras.utils.PyDataset``
  are probed with random normal inputs of the model's declared input shape when all inputs are
  floating point, and not at all otherwise (a warning is logged).
- A batch whose records are all equal (no record differs from the kept ones) is inconclusive;
  the probe runs again at the next ``fit``.

Example::

    check_batch_independence(model, x[:8])   # ValueError naming a layer that mixes records
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _compat

_logger = logging.getLogger("tf_dp")

#: Records taken from the input for the probe.
PROBE_RECORDS = 8


class _Inconclusive(Exception):
    """The probe could not decide (no usable input, or a nondeterministic model)."""


def _leaves_with_rows(x: Any) -> list:
    return [t for t in tf.nest.flatten(x) if getattr(t, "shape", None) is not None]


def _num_rows(x: Any) -> int:
    leaves = _leaves_with_rows(x)
    if not leaves or any(len(t.shape) == 0 for t in leaves):
        raise _Inconclusive("an input without a batch dimension")
    return int(leaves[0].shape[0])


def _take(x: Any, rows: Any) -> Any:
    return tf.nest.map_structure(lambda t: tf.gather(tf.convert_to_tensor(t), rows), x)


def _variant(x: Any) -> tuple[Any, Any, int]:
    """``(x, x')``: ``x'`` keeps the first ``h`` rows of ``x`` and copies them over the others."""
    b = _num_rows(x)
    h = b // 2
    if h < 1:
        raise _Inconclusive("fewer than 2 records")
    other = np.concatenate([np.arange(h), np.arange(b - h) % h])
    return x, _take(x, other), h


def _tolerance(dtype: tf.DType) -> float:
    return 1e-2 if dtype.size <= 2 else 1e-4


def _changed(out_a: Any, out_b: Any, h: int) -> bool:
    """Whether the first ``h`` rows of any output differ between the two passes."""
    for a, b in zip(tf.nest.flatten(out_a), tf.nest.flatten(out_b)):
        if not isinstance(a, tf.Tensor) or a.shape.rank == 0 or a.shape != b.shape:
            continue
        if not (a.dtype.is_floating or a.dtype.is_integer):
            continue
        tol = _tolerance(a.dtype)
        a64 = tf.cast(a[:h], tf.float64).numpy()
        b64 = tf.cast(b[:h], tf.float64).numpy()
        finite = np.abs(a64[np.isfinite(a64)])
        scale = max(1.0, float(finite.max())) if finite.size else 1.0
        if not np.allclose(a64, b64, rtol=tol, atol=tol * scale, equal_nan=True):
            return True
    return False


class _Passes:
    """Forward passes that restore the model's non-trainable variables before each one."""

    def __init__(self, model: keras.Model):
        self.variables = list(model.non_trainable_variables)
        self.saved = [tf.identity(v.value) for v in self.variables]

    def restore(self) -> None:
        for v, s in zip(self.variables, self.saved):
            v.assign(s)

    def run(self, fn: Any, x: Any, training: bool) -> Any:
        self.restore()
        try:
            return fn(x, training=training)
        except Exception as e:  # noqa: BLE001 -- the probe must not fail what would run
            raise _Inconclusive(f"the model failed on the probe's batch: {type(e).__name__}") from e


def _layer_outputs(model: keras.Model) -> Optional[tuple[keras.Model, list]]:
    """A model giving the output (and input) of each layer, or None if not a layer graph."""
    if not getattr(model, "inputs", None) or not isinstance(model, keras.Model):
        return None
    # The structure (tensor, list or dict) the model is called with: a functional model keeps
    # it; a Sequential model has one input.
    inputs = _compat.inputs_struct(model)
    if inputs is None:
        inputs = model.inputs[0] if len(model.inputs) == 1 else model.inputs
    probed, tensors = [], []
    for layer in model.layers:
        if isinstance(layer, keras.layers.InputLayer):
            continue
        try:
            tensors.append((layer.input, layer.output))
        except (AttributeError, ValueError):  # a shared layer (several call sites): skip it
            continue
        probed.append(layer)
    if not probed:
        return None
    try:
        return keras.Model(inputs, tensors), probed
    except Exception:  # noqa: BLE001 -- not a plain layer graph: name the model instead
        return None


def _culprit(model: keras.Model, x: Any, training: bool, depth: int = 0) -> str:
    """The first layer of ``model`` whose output changes when other records change."""
    graph = _layer_outputs(model) if depth < 5 else None
    if graph is None:
        return f"model {model.name!r} ({type(model).__name__}; its layers are not probed one by one)"
    extractor, layers = graph
    passes = _Passes(model)
    try:
        a, b, h = _variant(x)
        out_a = passes.run(extractor, a, training)
        out_b = passes.run(extractor, b, training)
    finally:
        passes.restore()
    for layer, (inp_a, o_a), (_, o_b) in zip(layers, out_a, out_b):
        if _changed(o_a, o_b, h):
            if isinstance(layer, keras.Model):
                return f"{_culprit(layer, inp_a, training, depth + 1)} in layer {layer.name!r}"
            return f"layer {layer.name!r} ({type(layer).__name__})"
    return f"model {model.name!r} ({type(model).__name__})"


def find_batch_mixing(model: keras.Model, x: Any) -> Optional[str]:
    """Names the layer through which a record's output depends on other records, or None.

    ``x``: a batch of at least 2 records for ``model``. Raises ``_Inconclusive`` when it cannot
    decide. See the module docstring for the method and its limits.
    """
    a, b, h = _variant(x)
    passes = _Passes(model)
    try:
        for training in (True, False):
            out_a = passes.run(model, a, training)
            out_b = passes.run(model, b, training)
            if not _changed(out_a, out_b, h):
                return None
            if not _changed(out_a, passes.run(model, a, training), h):
                return _culprit(model, a, training)
            # The same batch gave different outputs: random beyond Keras's seed generators.
            _logger.info("tf_dp: the model is random in training mode; probing in inference mode")
        raise _Inconclusive("the model's outputs are random even in inference mode")
    finally:
        passes.restore()


def check_batch_independence(model: keras.Model, x: Any) -> bool:
    """Raises ``ValueError`` if ``model``'s output for a record depends on the other records.

    Returns True if the probe was conclusive (the model does not mix these records), False if it
    could not decide. Runs eagerly, inside the model's distribution strategy scope.

    Example::

        check_batch_independence(model, x_train[:8])
    """
    try:
        with model.distribute_strategy.scope():
            culprit = find_batch_mixing(model, x)
    except _Inconclusive as e:
        _logger.warning("tf_dp: batch-mixing probe inconclusive (%s)", e)
        return False
    if culprit is not None:
        raise ValueError(
            f"{culprit} mixes the records of a batch: a record's output changes when the other "
            "records of its batch change, so per-example clipping does not bound its influence "
            "and DP-SGD's guarantee does not hold; compute statistics per record (e.g. "
            "keras.layers.LayerNormalization instead of a batch mean)"
        )
    return True


def _probe_size(model: keras.Model) -> tuple[int, int]:
    """``(records to take, fewest usable)``: up to ``PROBE_RECORDS`` (at least 2), or exactly
    the model's static batch size (``keras.Input(batch_size=k)``)."""
    sizes = {t.shape[0] for t in getattr(model, "inputs", None) or []} - {None}
    if len(sizes) == 1:
        k = int(sizes.pop())
        return k, k
    return PROBE_RECORDS, 2


def probe_inputs(model: keras.Model, x: Any) -> Optional[Any]:
    """Up to ``PROBE_RECORDS`` real records of ``fit``'s input ``x``, without consuming it.

    In-memory arrays: their first rows. ``tf_dp.data.poisson_batches`` or a ``tf.data.Dataset``:
    the records of a batch from a fresh iterator (rows of sample weight 0 left out). Anything
    else: random normal inputs of the model's declared input shape if all its inputs are floating
    point, else None.
    """
    size, fewest = _probe_size(model)
    dataset = getattr(x, "dataset", None) if hasattr(x, "tf_dp_sampling") else x
    if isinstance(dataset, tf.data.Dataset):
        for batch in dataset.take(3):
            bx, _, weight = keras.utils.unpack_x_y_sample_weight(batch)
            rows = tf.range(_num_rows(bx))
            if weight is not None:
                rows = tf.reshape(tf.where(tf.reshape(weight, [-1]) != 0), [-1])
            if int(tf.size(rows)) >= fewest:
                return _take(bx, rows[:size])
        return None
    leaves = tf.nest.flatten(x) if x is not None else []
    if leaves and all(isinstance(t, (np.ndarray, tf.Tensor)) for t in leaves):
        if all(len(t.shape) > 0 for t in leaves):
            return tf.nest.map_structure(lambda t: t[:size], x)
        return None
    inputs = getattr(model, "inputs", None)
    if inputs and all(keras.backend.standardize_dtype(t.dtype).startswith("float") for t in inputs):
        if all(None not in t.shape[1:] for t in inputs):
            rng = np.random.default_rng(0)
            fake = [rng.standard_normal((size, *t.shape[1:])).astype(t.dtype) for t in inputs]
            return fake[0] if len(fake) == 1 else fake
    return None
