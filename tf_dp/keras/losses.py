"""Per-example losses from the loss a user passed to ``model.compile``.

Users compile with ordinary Keras losses (a name, a function or a ``keras.losses.Loss`` with any
reduction, or a list/dict of them for multi-output models, with ``loss_weights``). DP training
needs one loss per example, so :class:`PerExampleLoss` rebuilds each loss without reduction and
averages any remaining non-batch axes (e.g. time steps), which matches Keras's default
``sum_over_batch_size`` (a mean over all elements) example by example.
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import tensorflow as tf

from tf_dp import _compat


def _unreduced(loss: Any) -> Callable:
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if isinstance(fn, keras.losses.Loss):
        config = fn.get_config()
        config["reduction"] = None
        return type(fn).from_config(config)
    if callable(fn):
        return fn
    raise TypeError(f"cannot derive a per-example loss from {loss!r}")


def _to_per_example(values: tf.Tensor, batch: tf.Tensor) -> tf.Tensor:
    values = tf.convert_to_tensor(values)
    if values.shape.rank == 0:
        raise ValueError(
            "the compiled loss returned a scalar for a batch; DP training needs one loss per "
            "example (use a keras.losses.Loss or a function returning per-example values)"
        )
    values = tf.cast(values, tf.float32)
    return tf.reduce_mean(tf.reshape(values, [batch, -1]), axis=1)


def _weights_like(sample_weight: Any, values: tf.Tensor) -> tf.Tensor:
    """``sample_weight`` broadcastable against the unreduced loss ``values``: per-example weights
    ``[B]`` (or ``[B, 1]``) get trailing axes of size 1, per-time-step weights ``[B, T]`` stay."""
    w = tf.cast(tf.convert_to_tensor(sample_weight), values.dtype)
    rank, w_rank = values.shape.rank, w.shape.rank
    if rank is None or w_rank is None:
        return w
    if w_rank == rank + 1 and w.shape[-1] == 1:
        return tf.squeeze(w, -1)
    if w_rank < rank:
        return tf.reshape(w, tf.concat([tf.shape(w), tf.ones([rank - w_rank], tf.int32)], 0))
    return w


def add_loss_terms(model: keras.Model) -> int:
    """How many ``add_loss`` terms the model's last call added: ``model.losses`` holds them plus
    one term per regularised weight."""
    regularized = sum(1 for v in model.trainable_weights if getattr(v, "regularizer", None))
    return max(len(model.losses) - regularized, 0)


class PerExampleLoss:
    """``loss_fn(x, y, sample_weight) -> (per_example_losses [B], y_pred)`` for a compiled model.

    ``loss`` (optional): a loss to use instead of the compiled one (a name, a
    ``keras.losses.Loss`` or a function ``(y_true, y_pred) -> per-example values``), structured
    like ``compile``'s ``loss``, without ``loss_weights``.

    The compiled ``loss`` and ``loss_weights`` are matched to the model's outputs as Keras does:

    - one loss for a single output (a float ``loss_weights`` scales it);
    - one loss for several outputs: applied to each output and summed (a float ``loss_weights``
      scales each term);
    - a list of losses: one per output, in output order (or, for a single output, each applied to
      it and summed);
    - a dict of losses keyed by output name, on a model whose outputs are a list (e.g. a
      functional model with named output layers) or a dict; outputs without a key get no loss;
    - targets (and per-output sample weights) as a list in output order or a dict keyed by output
      name; ``loss_weights`` with the structure of ``loss`` (or a flat list as long as it).

    Example::

        loss_fn = PerExampleLoss(model)
        losses, y_pred = loss_fn(x_batch, y_batch, None)   # losses.shape == [batch]
        # tf.reduce_mean(losses) == model.compute_loss(x_batch, y_batch, y_pred) without
        # regularisation terms
    """

    def __init__(self, model: keras.Model, loss: Any = None):
        if loss is None and getattr(model, "loss", None) is None:
            raise ValueError(
                "the model must be compiled with a loss before DP training (or pass loss=...)"
            )
        self.model = model
        weights = None
        if loss is None:
            loss = model.loss
            weights = _compat.user_loss_weights(model)
        if isinstance(loss, dict):
            self._losses = {k: None if v is None else _unreduced(v) for k, v in loss.items()}
        elif isinstance(loss, (list, tuple)):
            self._losses = [None if v is None else _unreduced(v) for v in loss]
        else:
            self._losses = _unreduced(loss)
        self._loss_weights = weights
        names = getattr(model, "output_names", None)
        self._output_names = list(names) if isinstance(names, (list, tuple)) else None
        self._call_has_training = _compat.call_has_training_arg(model)

    def __call__(self, x: Any, y: Any, sample_weight: Any = None):
        model = self.model
        y_pred = model(x, training=True) if self._call_has_training else model(x)
        # read now: a gradient clipper may call layers again afterwards (a per-layer fallback),
        # which resets their add_loss terms in model.losses
        self.add_loss_terms = max(getattr(self, "add_loss_terms", 0), add_loss_terms(model))
        batch = tf.shape(tf.nest.flatten(y_pred)[0])[0]
        total = None
        for loss_fn, weight, y_t, y_p, sw in self._terms(y, y_pred, sample_weight):
            value = self._one(loss_fn, y_t, y_p, sw, batch)
            if weight is not None:
                value = value * tf.cast(weight, value.dtype)
            total = value if total is None else total + value
        if total is None:
            raise ValueError("the compiled loss applies to none of the model's outputs")
        return total, y_pred

    # -- matching losses, weights, targets and outputs (as keras.Model.compile does) ---------------

    def _by_name(self, value: Any, what: str) -> list:
        """A dict keyed by output name -> list in output order."""
        names = self._output_names
        if names is None or set(value) != set(names):
            raise ValueError(
                f"{what} is a dict with keys {sorted(value)}, but the model's outputs are a "
                f"list named {names}; the keys must be exactly the output names"
            )
        return [value[name] for name in names]

    def _like_outputs(self, value: Any, y_pred: Any, what: str) -> Any:
        """``value`` (targets or per-output sample weights) arranged like ``y_pred``."""
        if isinstance(y_pred, (list, tuple)):
            if isinstance(value, dict):
                return self._by_name(value, what)
            if not isinstance(value, (list, tuple)):
                if len(y_pred) == 1:
                    return [value]
                raise ValueError(
                    f"{what} is a single tensor but the model has {len(y_pred)} outputs; give "
                    f"a list in output order or a dict keyed by output name {self._output_names}"
                )
            return list(value)
        if isinstance(y_pred, dict):
            if isinstance(value, dict):
                return value
            flat = tf.nest.flatten(value)
            if len(flat) != len(y_pred):
                raise ValueError(
                    f"{what} has {len(flat)} entries for the {len(y_pred)} outputs "
                    f"{sorted(y_pred)}; give a dict keyed by output name"
                )
            return dict(zip(sorted(y_pred), flat))
        if isinstance(value, dict) and len(value) == 1:
            return next(iter(value.values()))
        if isinstance(value, (list, tuple)) and len(value) == 1:
            return value[0]
        return value

    def _terms(self, y: Any, y_pred: Any, sample_weight: Any) -> list[tuple]:
        """``[(loss_fn, weight or None, y_true, y_pred, sample_weight)]``, one per loss term."""
        losses, weights = self._losses, self._loss_weights
        nested = isinstance(y_pred, (list, tuple, dict))
        # A dict keyed by output name on a model whose outputs are not a dict.
        if isinstance(losses, dict) and not isinstance(y_pred, dict):
            if isinstance(y_pred, (list, tuple)):
                losses = self._by_name(losses, "loss")
            elif self._output_names is not None and set(losses) == set(self._output_names[:1]):
                losses = [losses[self._output_names[0]]]
            else:
                raise ValueError(
                    f"loss is a dict with keys {sorted(losses)} but the model has one output "
                    f"named {self._output_names}"
                )
            if isinstance(weights, dict):
                weights = self._by_name(weights, "loss_weights")
        if isinstance(weights, dict) and not isinstance(losses, dict):
            raise ValueError(
                f"loss_weights is a dict with keys {sorted(weights)}; it needs a loss dict keyed "
                f"the same way (or a model with outputs named {self._output_names})"
            )
        if (
            not isinstance(losses, (list, tuple, dict))
            and isinstance(weights, (list, tuple))
            and len(weights) == 1
        ):
            weights = weights[0]
        single_weight = weights is None or (
            isinstance(weights, (int, float)) and not isinstance(weights, bool)
        )
        # One loss: applied to every output (and scaled by a float loss_weights), as in Keras.
        if not isinstance(losses, (list, tuple, dict)):
            if not single_weight:
                raise ValueError(
                    "loss_weights must be a single number when one loss is given for all "
                    f"outputs (Keras applies it to each output), got {weights!r}"
                )
            if not nested:
                return [(losses, weights, y, y_pred, sample_weight)]
            losses = (
                {k: losses for k in y_pred} if isinstance(y_pred, dict) else [losses] * len(y_pred)
            )
            weights = None if weights is None else tf.nest.map_structure(lambda _: weights, losses)
        elif isinstance(losses, (list, tuple)) and not isinstance(y_pred, (list, tuple)):
            flat_pred = tf.nest.flatten(y_pred)
            if isinstance(y_pred, dict) and len(losses) == len(flat_pred):
                losses = dict(zip(sorted(y_pred), losses))
            elif not nested:
                # Several losses for one output: each applied to it, and summed.
                ws = self._flat_weights(weights, len(losses))
                return [(fn, w, y, y_pred, sample_weight) for fn, w in zip(losses, ws) if fn]
        if isinstance(losses, (list, tuple)):
            if len(losses) != len(y_pred):
                raise ValueError(
                    f"loss is a list of {len(losses)} losses but the model has {len(y_pred)} "
                    "outputs; give one loss per output (None for an output without a loss)"
                )
            keys = list(range(len(losses)))
            weights = self._flat_weights(weights, len(losses))
        else:
            missing = sorted(set(losses) - set(y_pred))
            if missing:
                raise ValueError(
                    f"loss has keys {missing} that are not model outputs {sorted(y_pred)}"
                )
            keys = sorted(losses)
            if isinstance(weights, dict):
                weights = [weights.get(k) for k in keys]
            else:
                weights = self._flat_weights(weights, len(keys))
        used = [i for i, k in enumerate(keys) if losses[k] is not None]
        y = self._targets(y, y_pred, losses, keys, used)
        sample_weight = (
            self._like_outputs(sample_weight, y_pred, "sample_weight")
            if isinstance(sample_weight, (list, tuple, dict))
            else None if sample_weight is None else {k: sample_weight for k in keys}
        )
        return [
            (losses[keys[i]], weights[i], y[keys[i]], y_pred[keys[i]],
             None if sample_weight is None else sample_weight[keys[i]])
            for i in used
        ]

    def _targets(self, y: Any, y_pred: Any, losses: Any, keys: list, used: list) -> Any:
        """Targets arranged like ``y_pred``; also a list holding only the targets of the outputs
        that have a loss (Keras accepts that when some outputs have none)."""
        if isinstance(y, (list, tuple)) and len(y) == len(used) < len(keys):
            arranged = dict(zip([keys[i] for i in used], y))
            return arranged if isinstance(y_pred, dict) else [arranged.get(k) for k in keys]
        return self._like_outputs(y, y_pred, "y (the targets)")

    @staticmethod
    def _flat_weights(weights: Any, count: int) -> list:
        if weights is None:
            return [None] * count
        if isinstance(weights, (int, float)) and not isinstance(weights, bool):
            return [weights] * count
        flat = tf.nest.flatten(weights)
        if len(flat) != count:
            raise ValueError(
                f"loss_weights must give one weight per loss ({count}), got {len(flat)}: "
                f"{weights!r}"
            )
        return flat

    @staticmethod
    def _one(loss_fn, y, y_pred, sample_weight, batch):
        # the unreduced values ([B] or [B, T, ...], a mask of y_pred already applied), then the
        # sample weight: one per example ([B], e.g. Poisson padding) or per time step
        values = tf.convert_to_tensor(loss_fn(y, y_pred))
        if sample_weight is not None:
            values = values * _weights_like(sample_weight, values)
        return _to_per_example(values, batch)
