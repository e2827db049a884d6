"""Every private Keras and TensorFlow name tf_dp uses, in one place.

tf_dp reads a few Keras and TensorFlow internals that have no public equivalent (the layers of a
model in order, the compiled metrics, the loss tracker, per-op tables of TensorFlow's
vectorizer and forward-mode autodiff ...). They all go through this module, so that a Keras or
TensorFlow upgrade that renames one breaks here, in one place: ``tests/test_compat.py`` checks
that each name in :data:`PRIVATE_NAMES` still exists in the installed versions and that no other
module of tf_dp uses a private Keras or TensorFlow name.

Example::

    from tf_dp import _compat
    layers = _compat.flatten_layers(model, include_self=False)   # every nested layer, in order
"""

from __future__ import annotations

from typing import Any, Optional

#: ``(owner, name)`` of every private Keras / TensorFlow attribute or module used by tf_dp.
PRIVATE_NAMES: tuple[tuple[str, str], ...] = (
    ("keras.Layer", "_flatten_layers"),
    ("keras.Layer", "_trainable_variables"),
    ("keras.layers.Dense", "_kernel"),
    ("keras.layers.Embedding", "_embeddings"),
    ("keras.Model", "_loss_tracker"),
    ("keras.Model", "_compile_metrics"),
    ("keras.Model", "_compile_loss"),
    ("keras.Model", "_call_has_training_arg"),
    ("keras.Model", "_symbolic_build"),
    ("keras.Model", "_maybe_symbolic_build"),
    ("keras functional model", "_inputs_struct"),
    ("keras CompileMetrics", "_flatten_y"),
    ("keras CompileMetrics", "_flat_metrics"),
    ("keras CompileMetrics", "_flat_weighted_metrics"),
    ("keras CompileLoss", "_user_loss_weights"),
    ("keras tensor", "_keras_mask"),
    ("keras.src.models.functional", "Functional"),
    ("keras.src.applications.convnext", "LayerScale"),
    ("keras.Variable", "_value"),
    ("keras_hub MaskedLMHead", "_intermediate_dense"),
    ("keras_hub MaskedLMHead", "_intermediate_layer_norm"),
    ("keras_hub MaskedLMHead", "_kernel"),
    ("keras_hub MaskedLMHead", "_bias"),
    ("keras_hub T5MultiHeadAttention", "_relative_position_bucket"),
    ("keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net", "_causal_conv1d"),
    ("keras_hub.src.models.qwen3_5.qwen3_5_gated_delta_net", "_chunk_gated_delta_rule"),
    ("keras.src.backend", "rnn"),
    ("keras.src.backend.tensorflow.trainer", "reduce_per_replica"),
    ("keras.src.backend.tensorflow.trainer", "_collective_all_reduce_multi_worker"),
    ("tensorflow.python.eager.forwardprop", "_SPECIAL_CASES"),
    ("tensorflow.python.ops.parallel_for.pfor", "_pfor_converter_registry"),
    ("tensorflow.python.ops.control_flow_util", "GraphOrParentsInXlaContext"),
    ("tensorflow.python.ops", "gen_nn_ops"),
    ("tensorflow.python.ops.parallel_for", "pfor"),
    ("tensorflow.python.autograph.core.config", "CONVERSION_RULES"),
    ("tensorflow.python.autograph.core.config_lib", "DoNotConvert"),
)


def tf_variable(v: Any) -> Any:
    """The ``tf.Variable`` behind a Keras 3 variable, also inside a mixed-precision autocast scope
    (where ``v.value`` is a cast tensor)."""
    import tensorflow as tf

    if isinstance(v, tf.Variable):
        return v
    inner = getattr(v, "_value", None)
    return inner if isinstance(inner, tf.Variable) else v


def masked_lm_head_parts(layer: Any) -> tuple[Any, Any, Any, Any]:
    """keras-hub ``MaskedLMHead``'s ``(intermediate Dense, its LayerNormalization, the untied
    projection kernel or None, the output bias)``; AttributeError when a part is missing."""
    kernel = getattr(layer, "_kernel", None) if not layer.token_embedding else None
    return layer._intermediate_dense, layer._intermediate_layer_norm, kernel, layer._bias


def t5_relative_position_bucket(layer: Any, relative_position: Any) -> Any:
    """keras-hub ``T5MultiHeadAttention``'s bucket of each relative position (its own static
    ``_relative_position_bucket`` with the layer's settings)."""
    return layer._relative_position_bucket(
        relative_position,
        bidirectional=not layer.is_decoder,
        num_buckets=layer.relative_attention_buckets,
        max_distance=layer.relative_attention_max_distance,
    )


def keras_layer_scale() -> Optional[type]:
    """``keras.applications``' ConvNeXt ``LayerScale`` layer class (None if Keras moved it)."""
    try:
        from keras.src.applications.convnext import LayerScale
    except ImportError:
        return None
    return LayerScale


def functional_class() -> type:
    """Keras's ``Functional`` model class (what ``keras.Model(inputs, outputs)`` builds)."""
    from keras.src.models.functional import Functional

    return Functional


def variable_watcher() -> Any:
    """A new (not entered) TensorFlow ``VariableWatcher``: a context in which every access of a
    trainable variable is noted (``watched_variables()``), as a tape with
    ``watch_accessed_variables=True`` notes it, without recording operations
    (``tensorflow.python.eager.record``, TF 2.13 and later)."""
    from tensorflow.python.eager import record

    return record.VariableWatcher()


def keras_backend() -> Any:
    """Keras's backend module (``keras.src.backend``: its ``rnn`` loop, for identical semantics)."""
    from keras.src import backend

    return backend


def keras_tf_trainer() -> Any:
    """Keras's TensorFlow trainer module (``reduce_per_replica``, multi-worker detection)."""
    from keras.src.backend.tensorflow import trainer

    return trainer


def is_multi_worker(strategy: Any) -> bool:
    """Keras's own test for a multi-worker ``tf.distribute`` strategy."""
    return bool(keras_tf_trainer()._collective_all_reduce_multi_worker(strategy))


def flatten_layers(obj: Any, include_self: bool = True, recursive: bool = True) -> Optional[list]:
    """Every layer under ``obj`` in Keras's order, or None if ``obj`` is not a Keras layer."""
    flatten = getattr(obj, "_flatten_layers", None)
    if flatten is None:
        return None
    return list(flatten(include_self=include_self, recursive=recursive))


def own_trainable_variables(layer: Any) -> Optional[list]:
    """The trainable variables a layer owns itself (not its sublayers'), or None."""
    return getattr(layer, "_trainable_variables", None)


def build_input_shape(layer: Any) -> Any:
    """The input shape a built layer was built with (Keras keeps it in a private dict), or None."""
    shapes = getattr(layer, "_build_shapes_dict", None) or {}
    return next(iter(shapes.values())) if shapes else None


def kernel_variable(layer: Any) -> Any:
    """The kernel *variable* of a Dense/EinsumDense (``layer.kernel`` is a tensor under LoRA)."""
    return getattr(layer, "_kernel", None) if hasattr(layer, "_kernel") else layer.kernel


def embeddings_variable(layer: Any) -> Any:
    """The embedding table *variable* of an Embedding layer."""
    table = getattr(layer, "_embeddings", None)
    return layer.embeddings if table is None else table


def keras_mask(t: Any) -> Any:
    """The Keras output mask carried by a tensor, or None."""
    return getattr(t, "_keras_mask", None)


def inputs_struct(model: Any) -> Any:
    """The structure (tensor, list or dict) a functional model is called with, or None."""
    return getattr(model, "_inputs_struct", None)


def loss_tracker(model: Any) -> Any:
    """The compiled model's loss ``Mean`` metric (what ``fit`` logs as ``loss``), or None."""
    return getattr(model, "_loss_tracker", None)


def call_has_training_arg(model: Any) -> bool:
    """Whether ``model.call`` takes a ``training`` argument."""
    return bool(getattr(model, "_call_has_training_arg", True))


def user_loss_weights(model: Any) -> Any:
    """The ``loss_weights`` given to ``compile``, or None."""
    return getattr(getattr(model, "_compile_loss", None), "_user_loss_weights", None)


def compiled_metrics(model: Any) -> Any:
    """The model's compiled-metrics container, if it has the parts tf_dp reads, else None."""
    compiled = getattr(model, "_compile_metrics", None)
    if compiled is None or not hasattr(compiled, "_flat_metrics"):
        return None
    return compiled


def metrics_parts(compiled: Any) -> tuple[Any, list, list]:
    """``(flatten_y, metrics, weighted_metrics)`` of a compiled-metrics container: the function
    that arranges targets like the outputs, and the metrics of each output (None where none)."""
    return compiled._flatten_y, compiled._flat_metrics, compiled._flat_weighted_metrics


def symbolic_build(model: Any, data_batch: Any) -> None:
    """Builds a model's metrics and optimizer from one batch, as Keras's ``fit`` does."""
    model._symbolic_build(data_batch=data_batch)


#: The name of the model method Keras's ``fit`` calls to build from the first batch.
MAYBE_SYMBOLIC_BUILD = "_maybe_symbolic_build"


def forward_rules() -> Optional[dict]:
    """TensorFlow's table of per-op forward-mode rules, or None if it is not there."""
    try:
        from tensorflow.python.eager import forwardprop

        return forwardprop._SPECIAL_CASES
    except (ImportError, AttributeError):  # pragma: no cover - TF internals changed
        return None


def pfor_converters() -> Optional[dict]:
    """TensorFlow's table of ``vectorized_map`` op converters, or None if it is not there."""
    try:
        from tensorflow.python.ops.parallel_for import pfor

        return pfor._pfor_converter_registry
    except (ImportError, AttributeError):  # pragma: no cover - TF internals changed
        return None


def graph_in_xla_context() -> bool:
    """Whether the graph being traced is compiled by XLA (``jit_compile=True``); True if
    TensorFlow's check is unavailable (the fixed-shape routes are correct everywhere)."""
    try:
        import tensorflow as tf
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:  # pragma: no cover - depends on TensorFlow internals
        return True


def gen_nn_ops() -> Any:
    """TensorFlow's generated nn ops (``MaxPoolGradGrad`` ... without public wrappers)."""
    from tensorflow.python.ops import gen_nn_ops as ops

    return ops


def pfor_module() -> Any:
    """TensorFlow's ``vectorized_map`` implementation module (converter inputs, ``wrap``)."""
    from tensorflow.python.ops.parallel_for import pfor

    return pfor


class Qwen3_5DeltaNetHooks:
    """Context manager: keras-hub Qwen3.5's module-level ``_causal_conv1d(x, weight, bias)`` and
    ``_chunk_gated_delta_rule(query, key, value, g, beta, ...)`` (what
    ``Qwen3_5GatedDeltaNet.call`` computes its convolution and recurrence with) replaced by
    ``conv1d(original, *args, **kwargs)`` and ``chunk_rule(original, *args, **kwargs)`` while
    active."""

    def __init__(self, conv1d: Any, chunk_rule: Any):
        from keras_hub.src.models.qwen3_5 import qwen3_5_gated_delta_net as module

        self._module = module
        self._originals = (module._causal_conv1d, module._chunk_gated_delta_rule)
        self._hooks = (conv1d, chunk_rule)

    def __enter__(self):
        conv1d, chunk_rule = self._hooks
        conv_orig, chunk_orig = self._originals
        self._module._causal_conv1d = lambda *a, **k: conv1d(conv_orig, *a, **k)
        self._module._chunk_gated_delta_rule = lambda *a, **k: chunk_rule(chunk_orig, *a, **k)
        return self

    def __exit__(self, *exc):
        self._module._causal_conv1d, self._module._chunk_gated_delta_rule = self._originals
        return False


#: the package :func:`exclude_from_autograph` keeps out of AutoGraph
AUTOGRAPH_EXCLUDED = "tf_dp"


def exclude_from_autograph() -> bool:
    """Adds a do-not-convert rule for the ``tf_dp`` package to AutoGraph's conversion rules (once;
    idempotent), when TensorFlow is loaded: ``tf_dp.dp_query`` and ``tf_dp.data`` call it at the
    end of their import, and every tf_dp module that uses TensorFlow imports one of them
    (``tests/test_import_isolation.py`` checks each module alone). Returns False when TensorFlow
    is not loaded yet, or has no such rules (then tf_dp still works, converted, with slower first
    traces).

    Why: a ``tf.function`` with ``autograph=True`` (the default, and the one tf_dp's own training
    loops use) rewrites every Python function it reaches unless AutoGraph's rules exclude its
    module. TensorFlow excludes ``tensorflow`` and ``keras``, and Keras 3 traces its train step
    with ``do_not_convert``, so a Keras model's layers run unconverted in ``fit``. tf_dp's DP step
    is TensorFlow ops with Python control flow on static values only, so converting it bought
    nothing and cost most of the first step's trace: 133 functions at about 0.2 s each for a small
    Dense model (``tests/test_budget_planner.py``'s three-steps-per-call test: 57 s converted,
    5.4 s not, 2-core AMD EPYC). The user's code the step calls (the model's layers, a loss) runs
    as in Keras's ``fit``: unconverted; the user's own ``tf.function`` code is still converted.

    Example::

        from tf_dp import _compat
        _compat.exclude_from_autograph()  # True once TensorFlow is imported
    """
    import sys

    if "tensorflow" not in sys.modules:  # nothing traces tf_dp code without TensorFlow loaded
        return False
    try:
        from tensorflow.python.autograph.core import config, config_lib
    except ImportError:  # pragma: no cover - a TensorFlow without AutoGraph's rule table
        return False
    rules = tuple(getattr(config, "CONVERSION_RULES", ()))
    for rule in rules:
        if (isinstance(rule, config_lib.DoNotConvert)
                and getattr(rule, "_prefix", None) == AUTOGRAPH_EXCLUDED):
            return True
    config.CONVERSION_RULES = (config_lib.DoNotConvert(AUTOGRAPH_EXCLUDED),) + rules
    return True
