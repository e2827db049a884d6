"""Conformance check of a model under DP training: is its private step exact, does it keep its
ledger across a save and reload, which variables have an exact fast (ghost) rule, and what does
privacy cost in step time.

:func:`check_model` works on a copy of the model (a ``.keras`` round trip), never on the model
itself, and returns a :class:`ConformanceRecord`. It is how a user checks a layer of their own
(with or without a ghost rule registered for it) and what ``python -m bench.conformance`` runs
over every built-in Keras layer, ``keras.applications`` model and keras-hub task.

Example::

    import keras, numpy as np
    from tf_dp.keras.conformance import check_model

    model = keras.Sequential([keras.Input((5,)), keras.layers.Dense(3)])
    x = np.random.default_rng(0).normal(size=(8, 5)).astype("float32")
    y = np.arange(8) % 3
    record = check_model(
        model, x, y, keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert record.trains and record.exact and record.ledger_ok
    print(record.description, record.fallback_variables, record.step_ratio)
"""

from __future__ import annotations

import dataclasses
import math
import os
import tempfile
import time
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _compat

#: float32 machine epsilon (the gap between 1 and the next float32)
_EPS32 = 2.0**-23


@dataclasses.dataclass
class ConformanceRecord:
    """What :func:`check_model` found. ``exact``: the DP step with noise 0 equals the per-example
    reference within ``tolerance`` (``max_error`` is the largest weight difference, ``step_size``
    the largest weight change, so ``step_size / tolerance`` says how strong the check was);
    ``ledger_ok``: after 2 steps, a ``.keras`` save and reload and 1 more step, the ledger holds
    exactly the 3 steps that ran (counted by a callback, not by the ledger); ``mode``: the clipper
    ``gradient_mode="auto"`` chose (``"ghost"``: every variable on an exact fast rule;
    ``"mixed"``: some fall back to per-example gradients; ``"vectorized"``: all do);
    ``fallback_reasons``: layer -> why it has no rule; ``step_ratio``: median of the DP /
    non-private step-time ratios (``step_ratios``), measured interleaved in this process."""

    trains: bool = False
    exact: bool = False
    ledger_ok: bool = False
    max_error: float = math.nan
    tolerance: float = math.nan
    step_size: float = math.nan
    clip: float = math.nan
    mode: str = ""
    description: str = ""
    fast_rule_variables: list = dataclasses.field(default_factory=list)
    fallback_variables: list = dataclasses.field(default_factory=list)
    fallback_reasons: dict = dataclasses.field(default_factory=dict)
    ledger_steps: int = 0
    steps: int = 0
    step_ratio: float = math.nan
    step_ratios: list = dataclasses.field(default_factory=list)
    error: str | None = None

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


class _CountBatches(keras.callbacks.Callback):
    """Counts the training batches that ran (independently of the ledger)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def on_train_batch_end(self, batch, logs=None):
        self.count += 1


def _copy(model: keras.Model, folder: str, name: str) -> keras.Model:
    """A ``.keras`` copy of ``model`` with its LoRA adapters and trainable flags: a keras-hub
    backbone rebuilds its layers from its own config, which holds neither, so a plain reload of a
    model after ``backbone.enable_lora(r)`` trains every weight and no adapter."""
    path = os.path.join(folder, name + ".keras")
    model.save(path)
    copy = keras.saving.load_model(path, compile=False)
    src = _compat.flatten_layers(model) or []
    dst = _compat.flatten_layers(copy) or []
    if len(src) == len(dst):
        for a, b in zip(src, dst):
            if getattr(a, "lora_enabled", False) and not getattr(b, "lora_enabled", False):
                b.enable_lora(a.lora_rank, lora_alpha=getattr(a, "lora_alpha", None))
        for a, b in zip(src, dst):  # outer layers first: an inner layer's own flag wins
            if b.trainable != a.trainable:
                b.trainable = a.trainable
        if [w.shape for w in model.weights] == [w.shape for w in copy.weights]:
            copy.set_weights(model.get_weights())
            for a, b in zip(model.weights, copy.weights):  # e.g. the kernel LoRA froze
                if b.trainable != a.trainable:
                    b.trainable = a.trainable

    def shapes(m):  # paths may differ (a model's name, unnamed weights' counters)
        return [tuple(v.shape) for v in m.trainable_variables]

    if shapes(copy) != shapes(model):
        names = [getattr(v, "path", None) or v.name for v in copy.trainable_variables]
        raise ValueError(
            f"the .keras copy of the model does not train the model's variables: shapes "
            f"{shapes(model)[:8]} vs {shapes(copy)[:8]} ({names[:8]})"
        )
    return copy


def _no_dropout(model: keras.Model) -> keras.Model:
    """Sets every dropout layer's rate to 0: a random mask cannot be compared with a reference."""
    for layer in _compat.flatten_layers(model, include_self=False) or []:
        if (
            isinstance(layer, (keras.layers.Dropout, keras.layers.SpatialDropout1D))
            or hasattr(layer, "noise_shape")
        ) and hasattr(layer, "rate"):
            layer.rate = 0.0
    return model


def _take(x: Any, i: int) -> Any:
    return tf.nest.map_structure(lambda a: a[i : i + 1], x)


def _batch_size(x: Any) -> int:
    return int(np.shape(tf.nest.flatten(x)[0])[0])


def _positions(x: Any) -> int:
    """The largest number of positions (all non-batch, non-channel entries) of one example's input
    leaves: what a ghost rule or a weight gradient sums over."""
    best = 1
    for a in tf.nest.flatten(x):
        shape = np.shape(a)[1:]
        if len(shape) >= 2:
            best = max(best, math.prod(shape[:-1]))
        elif len(shape) == 1:
            best = max(best, shape[0])
    return best


def _gradient_terms(model: keras.Model, x: Any) -> int:
    """An upper count of the roundings on the way from an input to one entry of a per-example
    gradient, and to its ghost norm: for every layer with weights, its largest fan-in (the product
    of a variable's leading dimensions) or the positions, whichever is larger, plus 2 (bias,
    activation), forward and backward; the squared positions (a ghost norm sums over pairs of
    positions); 2 casts."""
    positions = _positions(x)
    total = 0
    for layer in _compat.flatten_layers(model, include_self=False) or []:
        own = _compat.own_trainable_variables(layer) or []
        if not own:
            continue
        fan_in = max(
            (math.prod(v.shape[:-1]) for v in own if len(v.shape) > 1), default=1
        )
        total += max(fan_in, positions) + 2
    return 2 * total + positions * positions + 2


def _per_example_gradients(model, x, y, loss) -> tuple[list, list]:
    """Each example's gradient of its loss (a batch of one), by a GradientTape loop, as numpy
    arrays in the variables' own float type (a float64 copy of every example's gradient would
    double what the largest models need: ConvNeXtXLarge's 350M parameters), and the trainable
    weights the gradients were taken at.

    Every example starts from the same variable values, restored after each (a layer may write
    variables in its forward pass: ``SpectralNormalization`` updates its power-iteration vector
    and writes the normalised kernel into the kernel it wraps), and the model is left as it was.
    The weights returned are those after one forward pass from that state: the weights a DP step
    from it updates."""
    state = [v.numpy() for v in model.variables]
    out, at = [], None
    for i in range(_batch_size(x)):
        if i:
            for v, value in zip(model.variables, state):
                v.assign(value)
        with tf.GradientTape() as tape:
            value = loss(_take(y, i), model(_take(x, i), training=True))
        grads = tape.gradient(value, model.trainable_variables)
        if at is None:
            at = [np.array(v.numpy(), np.float64) for v in model.trainable_variables]
        out.append(
            [
                np.zeros(v.shape, v.dtype)
                if g is None
                else np.asarray(tf.convert_to_tensor(g))
                for g, v in zip(grads, model.trainable_variables)
            ]
        )
    for v, value in zip(model.variables, state):
        v.assign(value)
    return out, at


def _reference_step(model, x, y, loss, learning_rate: float) -> tuple:
    """The reference DP-SGD step of :func:`check_model` (noise 0): ``(clip, expected, scale,
    weight_max, step_size)``, with ``expected`` the weights after the step (float64),
    ``scale`` the largest sum of one entry's clipped absolute values and ``step_size`` the
    largest change of one weight. Sums are float64, one variable at a time, so the memory is
    the per-example gradients plus one float64 copy of the weights."""
    batch = _batch_size(x)
    records, start = _per_example_gradients(model, x, y, loss)
    norms = [
        math.sqrt(sum(float(np.sum(np.square(g, dtype=np.float64))) for g in r))
        for r in records
    ]
    clip = float(np.median(norms)) or 1.0
    factors = [min(1.0, clip / n) if n > 0 else 1.0 for n in norms]
    expected, scale, weight_max, step_size = [], 0.0, 0.0, 0.0
    for j, w in enumerate(start):
        total = np.zeros_like(w)
        magnitude = np.zeros_like(w)
        for r, f in zip(records, factors):
            g = r[j].astype(np.float64)
            total += f * g
            magnitude += f * np.abs(g)
            r[j] = None  # each example's gradient is read once
        e = w - learning_rate * total / batch
        if w.size:
            scale = max(scale, learning_rate * float(magnitude.max()))
            weight_max = max(weight_max, float(np.abs(w).max()))
            step_size = max(step_size, float(np.abs(e - w).max()))
        expected.append(e)
        start[j] = None
    return clip, expected, scale, weight_max, step_size


def _plan(model, clipper) -> tuple[str, list, list, dict]:
    names = [getattr(v, "path", None) or v.name for v in model.trainable_variables]
    name = getattr(clipper, "name", type(clipper).__name__)
    if name != "ghost":
        reason = f"clipper {name!r}: per-example gradients of every variable (no ghost rule used)"
        return name, [], names, {"(model)": reason}
    from tf_dp.gradients.ghost.clipper import make_plan

    if hasattr(clipper, "plan"):  # as refined by the traced steps (layers off the example axis)
        plan = clipper.plan(model)
    else:
        plan = make_plan(model, list(model.trainable_variables))
    fallback, reasons = [], {}
    for unit, reason, variables in plan.local:
        fallback.extend(getattr(v, "path", None) or v.name for v in variables)
        reasons[f"{unit.name} ({type(unit).__name__})"] = str(reason)
    for name, where in getattr(plan, "demoted", {}).items():
        reasons[name] = where
    if plan.model_level_names:
        fallback.extend(plan.model_level_names)
        reasons["(model-level variables)"] = "tied or unowned variables: " + ", ".join(
            plan.model_level_names
        )
    fast = [n for n in names if n not in set(fallback)]
    return plan.mode, fast, fallback, reasons


def check_model(
    model: keras.Model,
    x: Any,
    y: Any,
    loss: Any,
    *,
    learning_rate: float = 1.0,
    timing_repeats: int = 3,
    folder: str | None = None,
) -> ConformanceRecord:
    """Checks a private copy of ``model`` in ``gradient_mode="auto"`` on the batch ``(x, y)``
    (all examples in one step) and returns a :class:`ConformanceRecord`. Dropout layers of the
    copy get rate 0 (a random mask cannot be compared with the reference).

    (a) One DP-SGD step (noise 0, clip norm ``C`` = the median per-example gradient norm, so some
    examples are clipped and some not, ``learning_rate``) against the reference: each example's
    gradient from a ``GradientTape`` loop, clipped to ``C``, summed, divided by the batch size.
    The tolerance is float32's: ``terms * eps * scale`` with ``terms`` counted from the model's
    fan-ins, positions and parameters (Higham's bound for sums in any order) and ``scale`` the
    largest sum of one entry's clipped absolute values, plus one rounding of the weights.
    (b) A second step, a ``.keras`` save and reload, a third step: the ledger holds 3 steps.
    (c) The plan: which variables have an exact fast rule and which fall back, and why.
    (d) The DP / non-private step-time ratio: ``timing_repeats`` interleaved pairs of one-step
    ``fit`` calls after a warm-up.

    ``model`` must be built (or buildable by calling it on ``x``) and saveable as ``.keras``
    (custom layers registered with ``keras.saving.register_keras_serializable``); ``loss`` a
    Keras loss (name or object); ``x`` and ``y`` arrays or nests of arrays with the batch first.
    A failure in (b)-(d) is recorded in ``error``; the record is still returned.

    Example::

        record = check_model(model, x, y, "mse")
        assert record.exact, (record.max_error, record.tolerance)
    """
    from tf_dp.keras import DPKerasSGDOptimizer, make_private

    if not isinstance(model, keras.Model):
        raise TypeError(f"model must be a keras.Model, got {type(model).__name__}")
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate!r}")
    if int(timing_repeats) < 1:
        raise ValueError(
            f"timing_repeats must be an integer >= 1, got {timing_repeats!r}"
        )
    loss_fn = keras.losses.get(loss)
    batch = _batch_size(x)
    record = ConformanceRecord()
    own_folder = None
    if folder is None:
        own_folder = tempfile.TemporaryDirectory()
        folder = own_folder.name
    private = None
    try:
        model(x)  # builds it
        private = make_private(_no_dropout(_copy(model, folder, "original")))
        private(x)

        # (a) one step against the per-example reference
        params = sum(int(np.prod(v.shape)) for v in private.trainable_variables)
        clip, expected, scale, weight_max, step_size = _reference_step(
            private, x, y, loss_fn, learning_rate
        )
        record.clip = clip
        optimizer = DPKerasSGDOptimizer(
            l2_norm_clip=clip,
            noise_multiplier=0.0,
            learning_rate=learning_rate,
            gradient_mode="auto",
        )
        private.compile(optimizer=optimizer, loss=loss)
        counter = _CountBatches()
        history = private.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[counter],
        )
        record.trains = bool(np.isfinite(history.history["loss"][0]))
        terms = _gradient_terms(private, x) + params + 1 + batch
        record.tolerance = terms * _EPS32 * scale / batch + _EPS32 * weight_max
        record.max_error = max(
            float(np.abs(np.array(v.numpy(), np.float64) - e).max())
            for v, e in zip(private.trainable_variables, expected)
            if e.size
        )
        record.step_size = step_size
        del expected
        record.exact = record.max_error <= record.tolerance

        # (c) the plan
        clipper = optimizer.gradient_clipper
        record.description = getattr(clipper, "description", repr(clipper))
        (
            record.mode,
            record.fast_rule_variables,
            record.fallback_variables,
            record.fallback_reasons,
        ) = _plan(private, clipper)

        # (b) ledger = steps across a save and reload
        private.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[counter],
        )
        path = os.path.join(folder, "private.keras")
        private.save(path)
        loaded = keras.saving.load_model(path)
        loaded.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=[counter],
        )
        record.steps = counter.count
        record.ledger_steps = len(loaded.optimizer.ledger.samples())
        record.ledger_ok = record.steps == 3 and record.ledger_steps == record.steps

        # (d) DP / non-private step time, interleaved after a warm-up (traced already)
        plain = _no_dropout(_copy(model, folder, "plain"))
        plain.compile(optimizer=keras.optimizers.SGD(learning_rate=1e-3), loss=loss)
        plain.fit(x, y, batch_size=batch, epochs=1, verbose=0)
        ratios = []
        for _ in range(int(timing_repeats)):
            start = time.perf_counter()
            private.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            dp = time.perf_counter() - start
            start = time.perf_counter()
            plain.fit(x, y, batch_size=batch, epochs=1, shuffle=False, verbose=0)
            ratios.append(dp / (time.perf_counter() - start))
        record.step_ratios = ratios
        record.step_ratio = float(np.median(ratios))
    except Exception as e:  # noqa: BLE001 - a conformance check records what failed
        record.error = f"{type(e).__name__}: {str(e)[:500]}"
        if not record.mode and private is not None:
            try:  # the plan of the model whose step failed: what would have fallen back
                from tf_dp.gradients.ghost.clipper import make_plan

                plan = make_plan(private, list(private.trainable_variables))
                record.mode = "failed (plan: " + plan.mode + ")"
                record.fallback_reasons = {
                    f"{u.name} ({type(u).__name__})": str(r) for u, r, _ in plan.local
                }
            except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                pass
    finally:
        if own_folder is not None:
            own_folder.cleanup()
    return record
