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


class PerExampleLoss:
    """``loss_fn(x, y, sample_weight) -> (per_example_losses [B], y_pred)`` for a compiled model.

    Example::

        loss_fn = PerExampleLoss(model)
        losses, y_pred = loss_fn(x_batch, y_batch, None)   # losses.shape == [batch]
    """

    def __init__(self, model: keras.Model):
        if getattr(model, "loss", None) is None:
            raise ValueError("the model must be compiled with a loss before DP training")
        self.model = model
        loss = model.loss
        weights = getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)
        if isinstance(loss, dict):
            self._losses = {k: _unreduced(v) for k, v in loss.items()}
        elif isinstance(loss, (list, tuple)):
            self._losses = [_unreduced(v) for v in loss]
        else:
            self._losses = _unreduced(loss)
        self._loss_weights = weights
        self._call_has_training = getattr(model, "_call_has_training_arg", True)

    def __call__(self, x: Any, y: Any, sample_weight: Any = None):
        model = self.model
        y_pred = model(x, training=True) if self._call_has_training else model(x)
        batch = tf.shape(tf.nest.flatten(y_pred)[0])[0]
        if isinstance(self._losses, (dict, list)):
            keys = (
                sorted(self._losses) if isinstance(self._losses, dict) else range(len(self._losses))
            )
            total = tf.zeros([batch], tf.float32)
            for k in keys:
                w = 1.0
                if isinstance(self._loss_weights, (dict, list, tuple)):
                    w = self._loss_weights[k]
                total += w * self._one(self._losses[k], y[k], y_pred[k], sample_weight, batch)
            return total, y_pred
        return self._one(self._losses, y, y_pred, sample_weight, batch), y_pred

    @staticmethod
    def _one(loss_fn, y, y_pred, sample_weight, batch):
        if isinstance(loss_fn, keras.losses.Loss):
            values = loss_fn(y, y_pred, sample_weight=sample_weight)
            return _to_per_example(values, batch)
        values = _to_per_example(loss_fn(y, y_pred), batch)
        if sample_weight is not None:
            values *= tf.reshape(tf.cast(sample_weight, values.dtype), [batch])
        return values
