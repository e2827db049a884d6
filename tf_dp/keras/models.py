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

``model.fit`` also tells the optimizer how batches are drawn (``fit_sampling.py``): in-memory
arrays with ``batch_size`` are recorded as ``shuffle`` batches (``q = batch_size / n``, no
amplification assumed); ``tf_dp.data.poisson_batches(...)`` and ``tf_dp.data.poisson_sample(...)``
as ``poisson`` with their real ``n`` and ``q``, ``tf_dp.data.shuffled_passes(...)`` as
``shuffle``. For other inputs call ``model.optimizer.set_sampling(...)`` before ``fit``. A model class
with its own ``train_step`` is refused by ``make_private``: call a
:class:`tf_dp.keras.DPTrainStep` from it instead.

Example::

    model = tf_dp.keras.make_private(keras.Sequential([...]))
    model.compile(optimizer=tf_dp.keras.DPKerasSGDOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=0.1),
        loss="sparse_categorical_crossentropy", metrics=["accuracy"])
    model.fit(x_train, y_train, batch_size=256, epochs=2)
"""

from __future__ import annotations

import logging
from typing import Any

import keras
import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients.base import as_tf_variables
from tf_dp.keras import ledger_store
from tf_dp.keras.compatibility import (  # noqa: F401 -- incompatible_layers re-exported
    check_model_is_dp_compatible,
    incompatible_layers,
)
from tf_dp.keras.fit_sampling import (
    _ledger_tables_to_save,
    _restore_snapshot,
    _state_snapshot,
    _take_weights_ledger,
    private_compile,
    private_fit,
    private_train_function,
    private_train_on_batch,
)
from tf_dp.keras.losses import PerExampleLoss, add_loss_terms
from tf_dp.keras.optimizers import DPOptimizerMixin

Functional = _compat.functional_class()

_logger = logging.getLogger("tf_dp")

def _regularization_gradients(model: keras.Model, variables: list[Any]) -> list[Any] | None:
    regularized = [v for v in variables if getattr(v, "regularizer", None) is not None]
    if not regularized:
        return None
    tf_vars = as_tf_variables(variables)
    with tf.GradientTape() as tape:
        penalty = tf.add_n([tf.cast(v.regularizer(v), tf.float32) for v in regularized])
    return tape.gradient(penalty, tf_vars, unconnected_gradients="zero"), penalty


def _refuse_add_loss_terms(model: keras.Model, loss_fn: Any = None) -> None:
    """Raises if the forward pass added loss terms with ``add_loss``.

    ``model.losses`` holds the ``add_loss`` terms of the last call plus one term per regularised
    weight; ``loss_fn`` (a :class:`PerExampleLoss`) counted them right after its forward pass,
    before a clipper's per-layer fallback called layers again (which resets their terms).
    ``add_loss`` terms may depend on the batch, so they can be neither clipped per example
    nor added after the noise without breaking the guarantee; the DP step refuses them instead of
    silently dropping them. Weight regularisers (``kernel_regularizer`` ...) are supported.
    """
    extra = max(add_loss_terms(model), getattr(loss_fn, "add_loss_terms", 0))
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
    if not isinstance(optimizer, DPOptimizerMixin):
        raise TypeError(
            "a private model needs a tf_dp DP optimizer (e.g. tf_dp.keras.DPKerasSGDOptimizer), "
            f"got {type(optimizer).__name__}"
        )
    mean_loss, rows, y_pred = private_step(
        model, optimizer, PerExampleLoss(model), x, y, sample_weight
    )
    tracker = _compat.loss_tracker(model)
    if tracker is not None:
        real = tf.cast(rows, tf.int32) if sample_weight is None else rows
        tracker.update_state(mean_loss, sample_weight=real)
    return _compute_metrics(model, x, y, y_pred, sample_weight)


def private_step(
    model: keras.Model, optimizer: Any, loss_fn: Any, x: Any, y: Any, sample_weight: Any
) -> tuple[tf.Tensor, tf.Tensor, Any]:
    """One DP step of ``model`` through ``optimizer``'s engine (the body of ``train_step`` and of
    :class:`tf_dp.keras.DPTrainStep`), one call of the optimizer's ``dp_step``: the engine's
    noised mean gradient plus the gradients of weight regularisers, applied by the DP optimizer.
    Returns ``(mean loss over the real records, number of real records, predictions)``."""
    if not model.built or not model.trainable_variables:
        # A subclassed model builds its variables on its first call: create them here, outside
        # the per-example computation, so that the clipper sees them.
        model(x, training=False)
    variables = list(model.trainable_variables)
    model._tf_dp_step_records_per_user = optimizer.records_per_user  # the unit this trace clips
    reg = []  # (gradients, penalty) of the weight regularisers, once the engine asks

    def regularizer_gradients():  # called by the engine after the noise (data-independent)
        reg.append(_regularization_gradients(model, variables))
        return None if reg[0] is None else reg[0][0]

    clipped = optimizer.dp_step(
        loss_fn, (x, y, sample_weight), variables, model,
        check=lambda _: _refuse_add_loss_terms(model, loss_fn),
        extra_gradients=regularizer_gradients,
    )
    losses = tf.cast(clipped.losses, tf.float32)
    if sample_weight is None:
        rows = tf.cast(tf.shape(clipped.losses)[0], tf.float32)
        mean_loss = tf.reduce_mean(losses)
    else:  # zero-weight rows (e.g. Poisson padding) are not examples: leave them out of the mean
        rows = tf.reduce_sum(tf.cast(tf.not_equal(tf.reshape(sample_weight, [-1]), 0), tf.float32))
        mean_loss = tf.math.divide_no_nan(tf.reduce_sum(losses), rows)
    if reg[0] is not None:
        mean_loss += reg[0][1]
    return mean_loss, rows, clipped.y_pred


def _compute_metrics(model: keras.Model, x: Any, y: Any, y_pred: Any, sample_weight: Any):
    """``model.compute_metrics`` over the real records only.

    Rows with sample weight 0 (the padding of ``tf_dp.data.poisson_batches``) are not examples:
    Keras's compiled ``metrics`` ignore sample weights, so they get the 0/1 mask of real rows as
    their weight, and ``weighted_metrics`` get the sample weights as usual. Shapes stay fixed
    (XLA-safe): rows are masked, not removed.
    """
    compiled = _compat.compiled_metrics(model)
    overridden = type(model).compute_metrics is not keras.Model.compute_metrics
    if sample_weight is None or overridden or compiled is None:
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
    if not compiled.built:
        compiled.build(y, y_pred)
    flatten_y, flat_metrics, flat_weighted = _compat.metrics_parts(compiled)
    flat_y = flatten_y(y)
    flat_pred = flatten_y(y_pred)
    weights = flatten_y(sample_weight)
    if len(weights) < len(flat_y):
        weights = [weights[0]] * len(flat_y)
    masks = [tf.cast(tf.not_equal(w, 0), tf.float32) for w in weights]
    for m, y_t, y_p, mask in zip(flat_metrics, flat_y, flat_pred, masks):
        if m:
            m.update_state(y_t, y_p, mask)
    for m, y_t, y_p, w in zip(flat_weighted, flat_y, flat_pred, weights):
        if m:
            m.update_state(y_t, y_p, w)
    return model.get_metrics_result()


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
        its checksum (a corrupted or edited ledger raises ``LedgerFileError``; tables saved
        without a checksum by earlier versions load marked unverified)."""
        stored = ledger_store.read_ledger(store)
        super().load_own_variables(ledger_store.without_ledger(store))
        if stored is not None:
            _take_weights_ledger(self, *stored)

    def load_weights(self, filepath, *args, **kwargs):
        """Keras's ``load_weights``; if loading fails (e.g. a ledger checksum mismatch), the
        weights, optimizer variables and ledger are left as they were, and a ledger error
        surfaces as tf_dp's ``LedgerFileError`` (not Keras's generic "could not be loaded")."""
        snapshot = _state_snapshot(self)
        ledger_store.take_last_error()  # forget any earlier load's
        try:
            return super().load_weights(filepath, *args, **kwargs)
        except BaseException as e:
            _restore_snapshot(self, snapshot)
            ledger_error = ledger_store.take_last_error()
            if ledger_error is not None and ledger_error is not e:
                raise ledger_error from e
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


def _refuse_own_train_step(model: keras.Model) -> None:
    """A model class that defines its own ``train_step`` would lose it: refused, with the way to
    get DP inside a custom step."""
    owner = next(c for c in type(model).__mro__ if "train_step" in c.__dict__)
    if not owner.__module__.startswith("keras."):
        raise TypeError(
            f"{type(model).__name__} defines its own train_step ({owner.__module__}."
            f"{owner.__name__}); make_private would replace it with the DP step. To train it "
            "privately, call a tf_dp.keras.DPTrainStep(model, optimizer, loss) from your "
            "train_step or custom loop (it clips, noises, records and applies the update), or "
            "remove the override to use make_private's DP train_step"
        )


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
    _refuse_own_train_step(model)
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
