"""Canaries: records whose membership an audit tests.

Each canary is included in the training data independently with probability 1/2
(:func:`draw_inclusion`); the inclusion is kept, since it is what the attack must guess.

* **Gradient-space (Dirac) canaries**, for white-box audits that read the weights: the model gets
  one extra trainable vector ``w`` of length ``m`` (:class:`CanaryHead`) that real records do not
  touch. Canary ``j`` is a record whose loss is ``-g * w[j]``, so its per-example gradient is
  ``-g`` times the ``j``-th unit vector (norm ``g``, the ``canary_gradient_norm``) and zero on every
  other weight. It goes through the DP optimizer's real path: clipped by the query (to ``C`` when
  ``g >= C``), summed, noised, recorded in the ledger. Reading ``w[j]`` after every step gives the
  per-step updates on that coordinate; :func:`dirac_score` combines them into the canary's score
  (the likelihood-ratio test of the sampled Gaussian mechanism). Canaries on distinct coordinates,
  under Poisson sampling, give independent scores.
* **Input-space canaries** (:func:`mislabeled_canaries`), for black-box audits of the final model:
  real inputs with a wrong label; the score is minus the final model's loss on them.

Example::

    rng = np.random.default_rng(0)
    included = draw_inclusion(1000, rng)
    x_c, y_c = mislabeled_canaries(x_pool, y_pool, num_classes=10, rng=rng)
"""

from __future__ import annotations

from typing import Any, Callable

import keras
import numpy as np
from keras import ops

__all__ = [
    "CanaryHead", "dirac_score", "draw_inclusion", "mislabeled_canaries",
    "per_example_output_loss",
]


def draw_inclusion(num_canaries: int, rng: np.random.Generator) -> np.ndarray:
    """``num_canaries`` independent fair coins: True where the canary is trained on."""
    return rng.random(num_canaries) < 0.5


def mislabeled_canaries(
    x: np.ndarray, y: np.ndarray, num_classes: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """The inputs ``x`` with labels moved to another class, drawn uniformly (integer labels).

    Example::

        x_c, y_c = mislabeled_canaries(x[:500], y[:500], num_classes=10, rng=rng)
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, int) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    labels = np.asarray(y).astype(np.int64).reshape(-1)
    if labels.size != len(x) or labels.min() < 0 or labels.max() >= num_classes:
        raise ValueError(
            f"y must hold one integer label in [0, {num_classes}) per input row (mislabeled "
            "canaries need sparse class labels)"
        )
    shift = rng.integers(1, num_classes, size=labels.size)
    return np.asarray(x), ((labels + shift) % num_classes).astype(np.asarray(y).dtype)


def _per_example(loss: Any) -> Callable:
    """A ``(y_true, y_pred) -> [B]`` loss without reduction from a Keras loss name/function/Loss."""
    fn = keras.losses.get(loss) if isinstance(loss, str) else loss
    if isinstance(fn, keras.losses.Loss):
        fn = fn.call  # the unreduced values
    if not callable(fn):
        raise TypeError(f"loss must be a Keras loss name, function or Loss, got {loss!r}")

    def per_example(y_true, y_pred):
        values = ops.convert_to_tensor(fn(y_true, y_pred))
        if len(values.shape) == 0:
            raise ValueError("loss returned a scalar for a batch; pass an unreduced loss")
        return ops.mean(ops.reshape(values, (ops.shape(values)[0], -1)), axis=1)

    return per_example


def dirac_score(updates: Any, sampling_probability: float, noise_multiplier: float) -> np.ndarray:
    """White-box score of Dirac canaries from their per-step updates, in units of the clip.

    ``updates[j, t]`` is canary ``j``'s coordinate update at step ``t`` divided by
    ``learning_rate * C / (q n)`` (the contribution of one clipped canary): ``Bernoulli(q) +
    N(0, sigma^2)`` when the canary is trained on, ``N(0, sigma^2)`` when not, independently over
    steps. The most powerful test between the two (Neyman-Pearson) thresholds the sum over steps of
    the log-likelihood ratio ``log(1 - q + q exp((u - 1/2) / sigma^2))``; at ``q = 1`` it is a
    multiple of ``sum_t u``, and that sum is returned. Any score gives a valid audit; this one is
    the best when the mechanism is the one configured.

    Example::

        scores = dirac_score(updates, sampling_probability=0.5, noise_multiplier=2.0)
    """
    u = np.asarray(updates, dtype=np.float64)
    if u.ndim != 2:
        raise ValueError(f"updates must be a [canaries, steps] array, got shape {u.shape}")
    q = float(sampling_probability)
    if not 0.0 < q <= 1.0:
        raise ValueError(f"sampling_probability must be in (0, 1], got {sampling_probability!r}")
    sigma = float(noise_multiplier)
    if not (sigma > 0 and np.isfinite(sigma)):
        raise ValueError(f"noise_multiplier must be a finite number > 0, got {noise_multiplier!r}")
    if q == 1.0:
        return u.sum(axis=1)
    return np.logaddexp(np.log1p(-q), np.log(q) + (u - 0.5) / sigma**2).sum(axis=1)


def per_example_output_loss(y_true: Any, y_pred: Any) -> Any:
    """Compiled loss of a :class:`CanaryHead` model: its output already is the per-example loss."""
    del y_true
    return y_pred


@keras.saving.register_keras_serializable(package="tf_dp.auditing")
class CanaryHead(keras.layers.Layer):
    """Per-example loss of a white-box audit model: the real loss, or a Dirac canary's.

    Inputs ``(y_pred, y_true, canary_id)``: for a row with ``canary_id == -1`` (a real record) the
    output is the real loss ``loss(y_true, y_pred)``; for ``canary_id == j`` it is
    ``-canary_gradient_norm * w[j]``, whose gradient is ``-canary_gradient_norm`` on ``w[j]`` alone
    (``tf.where`` passes no gradient to the branch it did not pick). Compile the model with
    :func:`per_example_output_loss`.

    Example::

        pred = base_model(x_in)
        out = CanaryHead(1000, "sparse_categorical_crossentropy", 10.0)([pred, y_in, id_in])
    """

    def __init__(self, num_canaries: int, loss: Any, canary_gradient_norm: float, **kwargs):
        super().__init__(**kwargs)
        self.num_canaries = int(num_canaries)
        self.loss = loss
        self.canary_gradient_norm = float(canary_gradient_norm)
        self._loss_fn = _per_example(loss)

    def build(self, input_shape):
        self.canary_weights = self.add_weight(
            shape=(self.num_canaries,), initializer="zeros", name="canary_weights")

    def call(self, inputs):
        y_pred, y_true, canary_id = inputs
        canary_id = ops.reshape(ops.cast(canary_id, "int32"), (-1,))
        code = ops.one_hot(ops.maximum(canary_id, 0), self.num_canaries)
        canary_loss = -self.canary_gradient_norm * ops.sum(
            code * ops.cast(self.canary_weights, code.dtype), axis=1)
        real_loss = ops.cast(self._loss_fn(y_true, y_pred), canary_loss.dtype)
        return ops.where(canary_id >= 0, canary_loss, real_loss)

    def get_config(self):
        return {**super().get_config(), "num_canaries": self.num_canaries,
                "loss": self.loss if isinstance(self.loss, str) else None,
                "canary_gradient_norm": self.canary_gradient_norm}
