"""Vectorized per-example gradients: ``tf.vectorized_map`` of a per-example gradient.

Each example's gradient is computed by running the model on a batch of one inside
``tf.vectorized_map`` (which auto-vectorises the per-example computation); every example's gradient
is weighted by the query's clipping rule and the weighted gradients are summed. Exact for any model
whose examples do not interact (BatchNormalization is refused upstream).

Two things keep it fast:

- **Chunks.** Per-example gradients take ``batch_size * num_parameters`` floats. When that exceeds
  ``chunk_bytes`` (default 16 MiB), the batch is processed in chunks of examples that fit, inside a
  ``tf.while_loop`` that accumulates the clipped sum: the per-example gradients of a chunk are
  clipped and summed while they are still in cache, and memory stays bounded (a few chunks), not
  ``O(batch * parameters)``. Clip weights depend only on each example's own norms, so chunking does
  not change the result. The clipped record summed is exactly the per-example gradient whose norm
  was measured (no second forward pass, so dropout masks and other randomness stay consistent).
- **Convolutions.** TensorFlow's vectorizer turns the per-example filter gradient of a convolution
  (``Conv2DBackpropFilter`` with per-example inputs) into a ``while_loop`` over the examples. While
  this clipper traces, that op is vectorized instead as image patches times output gradients (one
  batched matmul, Rochette et al. 2019 style); other ops and formats keep TensorFlow's converter.
  This uses TensorFlow's internal ``pfor`` converter registry; if that changes, the clipper falls
  back to TensorFlow's default (same results, slower) -- tests compare both with a slow reference.

Recurrent layers: Keras 3's ``LSTM``/``GRU``/``SimpleRNN`` run a ``tf.while_loop``, and
``tf.vectorized_map`` cannot vectorise the gradient of that loop with respect to its inputs (a
``TypeError`` about ``dtype variant`` on TF 2.21, e.g. for ``Embedding`` + ``LSTM``). While the
per-example gradients are traced, such layers run unrolled (``unroll=True``, the same
computation as a Python loop over the time steps), which vectorises. Where that fails too (a
sequence length unknown when tracing, or any other op that ``vectorized_map`` cannot convert), the
per-example gradients are computed one example after another in a ``tf.while_loop`` (same values,
slower; logged once at INFO level).

Non-finite records: an example whose loss or gradient norm is NaN or inf gets clip weight 0 and
adds exactly 0 to the clipped sum (selected out, not multiplied by 0; see
:mod:`tf_dp.gradients.base`). Rows of sample weight 0 (Poisson padding) are computed as copies of
a real row, so that padding which is not a valid input (e.g. padding tokens only) does not give
NaN losses.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Optional, Sequence

import tensorflow as tf

from tf_dp import _compat
from tf_dp.gradients import base

_logger = logging.getLogger("tf_dp")

_DEFAULT_CHUNK_BYTES = 16 * 2**20


def _expand(t: Any) -> Any:
    return None if t is None else tf.expand_dims(t, 0)


# -- fast per-example convolution filter gradients inside vectorized_map ---------------------------

_PATCH_LOCK = threading.RLock()


def _fast_conv2d_backprop_filter(original):
    pfor_lib = _compat.pfor_module()

    def converter(pfor_input):
        inputs, inputs_stacked, _ = pfor_input.input(0)
        grads_stacked = pfor_input.input(2)[1]
        data_format = pfor_input.get_attr("data_format")
        padding = pfor_input.get_attr("padding")
        if isinstance(data_format, bytes):
            data_format = data_format.decode()
        if isinstance(padding, bytes):
            padding = padding.decode()
        if not inputs_stacked or data_format != "NHWC" or padding not in ("SAME", "VALID", "EXPLICIT"):
            return original(pfor_input)
        pfor_input.stack_inputs(stack_indices=[2])
        grads = pfor_input.stacked_input(2)
        del grads_stacked
        filter_sizes = pfor_input.unstacked_input(1)
        strides = list(pfor_input.get_attr("strides"))
        dilations = list(pfor_input.get_attr("dilations"))
        x = inputs  # [n, N1, H, W, Cin]
        n = tf.shape(x)[0]
        x_shape = tf.shape(x)
        x = tf.reshape(x, tf.concat([[-1], x_shape[2:]], 0))
        if padding == "EXPLICIT":
            pads = list(pfor_input.get_attr("explicit_paddings"))
            x = tf.pad(x, tf.reshape(tf.constant(pads, tf.int32), [4, 2]))
            padding = "VALID"
        kh, kw = filter_sizes[0], filter_sizes[1]
        static = tf.get_static_value(filter_sizes)
        if static is None:
            return original(pfor_input)
        kh, kw, cin, cout = (int(s) for s in static)
        patches = tf.image.extract_patches(
            x,
            sizes=[1, kh, kw, 1],
            strides=strides,
            rates=dilations,
            padding=padding,
        )  # [n*N1, H', W', kh*kw*Cin]
        patches = tf.reshape(patches, [n, -1, kh * kw * cin])
        g = tf.reshape(grads, [n, -1, cout])
        out = tf.matmul(patches, g, transpose_a=True)  # [n, kh*kw*Cin, Cout]
        out = tf.reshape(out, [n, kh, kw, cin, cout])
        return pfor_lib.wrap(out, True)

    return converter


@contextlib.contextmanager
def fast_pfor_converters():
    """While active, ``tf.vectorized_map`` vectorizes per-example conv filter gradients as patches
    times output gradients instead of a while loop. A no-op if TensorFlow's internals differ."""
    registry = _compat.pfor_converters()
    original = None if registry is None else registry.get("Conv2DBackpropFilter")
    if original is None:  # pragma: no cover - TF internals changed
        yield
        return
    with _PATCH_LOCK:
        registry["Conv2DBackpropFilter"] = _fast_conv2d_backprop_filter(original)
        try:
            yield
        finally:
            registry["Conv2DBackpropFilter"] = original


# -- recurrent layers and a sequential fallback -----------------------------------------------------


def _walk_layers(model: Any) -> list:
    return _compat.flatten_layers(model) or []


def looping_rnns(model: Any) -> list:
    """The Keras recurrent layers of ``model`` that run a ``tf.while_loop`` (``unroll=False``)."""
    if model is None:
        return []
    import keras  # local: the gradients layer does not otherwise need Keras

    return [
        layer
        for layer in _walk_layers(model)
        if isinstance(layer, keras.layers.RNN) and not getattr(layer, "unroll", True)
    ]


@contextlib.contextmanager
def unrolled(rnns: Sequence[Any]):
    """While active (tracing only), the given Keras recurrent layers run unrolled."""
    if not rnns:
        yield
        return
    with _PATCH_LOCK:
        for layer in rnns:
            layer.unroll = True
        try:
            yield
        finally:
            for layer in rnns:
                layer.unroll = False


_LOGGED_FALLBACK: set = set()


def map_records(fn, elems: Any, model: Any = None, fast_conv: bool = True, what: str = "records"):
    """``fn`` over the leading axis of ``elems``, stacked: ``tf.vectorized_map`` where it can.

    Tries, in order: ``tf.vectorized_map`` (with the fast convolution converter); the same with the
    model's recurrent layers unrolled, if it has looping ones; and finally a ``tf.while_loop`` over
    the records, one at a time (same values, slower). Trace-time failures only: a model that fails
    every route raises the error of the sequential route. A model that
    :func:`~tf_dp.gradients.base.vectorized_map_blocker` names (``vectorized_map`` would crash the
    process) goes straight to the loop.
    """
    blocker = base.vectorized_map_blocker(model)
    if blocker is not None:
        # a known TensorFlow crash (segmentation fault), not an exception: never attempt it
        key = (id(model), what, "blocked")
        if key not in _LOGGED_FALLBACK:
            _LOGGED_FALLBACK.add(key)
            _logger.info(
                "tf_dp: per-%s gradients of model %r computed one after another, not with "
                "tf.vectorized_map: %s",
                what,
                getattr(model, "name", None),
                blocker,
            )
        return sequential_map(fn, elems)
    converters = fast_pfor_converters if fast_conv else contextlib.nullcontext
    rnns = looping_rnns(model)
    errors = []
    # a looping RNN under vectorized_map fails whenever its input needs a gradient: go straight to
    # the unrolled route
    attempts = [rnns] if rnns else [[]]
    for unroll in attempts:
        try:
            with converters(), unrolled(unroll):
                return tf.vectorized_map(fn, elems, fallback_to_while_loop=True)
        except (TypeError, ValueError, NotImplementedError) as e:
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}")
    key = (id(model), what)
    if key not in _LOGGED_FALLBACK:
        _LOGGED_FALLBACK.add(key)
        _logger.info(
            "tf_dp: tf.vectorized_map cannot compute per-%s gradients of model %r (%s); computing "
            "them one after another instead",
            what,
            getattr(model, "name", None),
            "; ".join(errors),
        )
    return sequential_map(fn, elems)


def sequential_map(fn, elems: Any):
    """``fn`` over the leading axis of ``elems`` in a ``tf.while_loop``, outputs stacked.

    The first record is computed outside the loop (to learn the outputs' structure); at least one
    record is needed.
    """
    n = tf.shape(tf.nest.flatten(elems)[0])[0]
    first = fn(tf.nest.map_structure(lambda t: t[0], elems))
    tas = tf.nest.map_structure(
        lambda t: tf.TensorArray(t.dtype, size=n, element_shape=t.shape).write(0, t), first
    )

    def body(i, tas):
        out = fn(tf.nest.map_structure(lambda t: t[i], elems))
        return i + 1, tf.nest.map_structure(lambda ta, t: ta.write(i, t), tas, out)

    _, tas = tf.while_loop(lambda i, _: i < n, body, (tf.constant(1), tas))
    return tf.nest.map_structure(lambda ta: ta.stack(), tas)


# -- the clipper -----------------------------------------------------------------------------------


class VectorizedClipper(base.GradientClipper):
    """Per-example gradients with ``tf.vectorized_map``; clipping by the query's rule.

    Args:
      fallback_to_while_loop: passed to ``tf.vectorized_map`` (ops it cannot vectorise run in a
        loop instead of failing).
      chunk_bytes: memory budget for the per-example gradients of one chunk of examples (see the
        module docstring); ``None`` processes the whole batch at once.
      fast_conv: vectorize convolution filter gradients as patches x output gradients.

    Example::

        clipper = tf_dp.gradients.VectorizedClipper()
        out = clipper.clipped_sum(loss_fn, (x, y, None), model.trainable_variables, query, params)
    """

    name = "vectorized"

    def supports(self, model):
        reason = base.vectorized_map_blocker(model)
        if reason is None:
            return None
        return reason + "; gradient_mode='ghost' covers it ('auto' picks ghost for this model)"

    def __init__(
        self,
        fallback_to_while_loop: bool = True,
        chunk_bytes: Optional[int] = _DEFAULT_CHUNK_BYTES,
        fast_conv: bool = True,
    ):
        if chunk_bytes is not None and (
            isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1
        ):
            raise ValueError(f"chunk_bytes must be None or an integer >= 1, got {chunk_bytes!r}")
        self._fallback = fallback_to_while_loop
        self._chunk_bytes = chunk_bytes
        self._fast_conv = fast_conv

    def __repr__(self) -> str:
        return f"VectorizedClipper(chunk_bytes={self._chunk_bytes}, fast_conv={self._fast_conv})"

    def _converters(self):
        return fast_pfor_converters() if self._fast_conv else contextlib.nullcontext()

    def per_example_gradients(self, loss_fn, data, variables: Sequence[Any], model: Any = None):
        """``(per_example_grads [B, *var.shape] per variable, y_pred, losses [B])``.

        ``model`` (default ``loss_fn.model``): the model the loss runs; when
        :func:`~tf_dp.gradients.base.vectorized_map_blocker` names it, the examples are computed
        in a loop (``fallback_to_while_loop=False``: ``ValueError``), never vectorised.
        """
        x, y, sw = data
        if model is None:
            model = getattr(loss_fn, "model", None)
        tf_vars = base.as_tf_variables(variables)

        def one(example):
            ex_x, ex_y, ex_sw = example if sw is not None else (*example, None)
            with tf.GradientTape() as tape:
                loss, y_pred = loss_fn(
                    tf.nest.map_structure(_expand, ex_x),
                    tf.nest.map_structure(_expand, ex_y),
                    _expand(ex_sw),
                )
                loss = tf.reduce_sum(loss)
            grads = tape.gradient(loss, tf_vars, unconnected_gradients="zero")
            grads = [tf.convert_to_tensor(g) for g in grads]
            y_pred = tf.nest.map_structure(lambda t: t[0], y_pred)
            return grads, y_pred, loss

        elems = (x, y) if sw is None else (x, y, sw)
        if not self._fallback:
            blocker = base.vectorized_map_blocker(model)
            if blocker is not None:
                raise ValueError(
                    f"{blocker}; fallback_to_while_loop=False forbids the per-example loop "
                    "that replaces it: pass fallback_to_while_loop=True or use "
                    "gradient_mode='ghost'"
                )
            with self._converters():
                return tf.vectorized_map(one, elems, fallback_to_while_loop=False)
        return map_records(one, elems, model, self._fast_conv, what="example")

    def chunk_size(self, variables: Sequence[Any]) -> Optional[int]:
        """Examples per chunk for these variables (``None``: the whole batch at once)."""
        if self._chunk_bytes is None:
            return None
        params = 0
        for v in variables:
            n = 1
            for d in v.shape:
                n *= int(d) if d is not None else 1
            params += n
        return max(1, self._chunk_bytes // max(1, 4 * params))

    def _clip_and_sum(self, per_example, losses, query, params, real=None):
        sq = base.squared_norms_of(per_example)
        # padding examples of a chunk contribute nothing; nor do non-finite records
        keep = None if real is None else tf.greater(real, 0)
        weights, _ = base.record_weights(query, params, sq, losses, keep)
        clipped = base.weighted_sums(weights, per_example)
        return clipped, sq

    def clipped_sum(self, loss_fn, data, variables, query, params) -> base.ClippedGradients:
        data = base.fill_padding_rows(data)
        x, y, sw = data
        b = base.batch_size_of(x)
        chunk = self.chunk_size(variables)
        static_b = tf.nest.flatten(x)[0].shape[0]
        if chunk is None or (static_b is not None and static_b <= chunk):
            per_example, y_pred, losses = self.per_example_gradients(loss_fn, data, variables)
            clipped, sq = self._clip_and_sum(per_example, losses, query, params)
            return base.ClippedGradients(
                clipped_sum=clipped,
                norms=base.global_norms(sq),
                num_records=b,
                sensitivity_multiplier=1.0,
                record_mask=base.real_records(sw, b),
                y_pred=y_pred,
                losses=losses,
            )
        if static_b is not None:  # balance the chunks: no padded examples computed in vain
            num_chunks = -(-static_b // chunk)
            chunk = -(-static_b // num_chunks)
        return self._chunked(loss_fn, data, variables, query, params, chunk)

    def _chunked(self, loss_fn, data, variables, query, params, chunk: int):
        x, y, sw = data
        b = base.batch_size_of(x)
        num_chunks = tf.maximum((b + chunk - 1) // chunk, 1)
        pad = num_chunks * chunk - b

        def split(t):
            t = tf.convert_to_tensor(t)
            padded = tf.concat([t, tf.zeros(tf.concat([[pad], tf.shape(t)[1:]], 0), t.dtype)], 0)
            return tf.reshape(padded, tf.concat([[num_chunks, chunk], tf.shape(t)[1:]], 0))

        xs = tf.nest.map_structure(split, x)
        ys = tf.nest.map_structure(split, y)
        sws = None if sw is None else split(sw)
        real = split(tf.ones([b], tf.float32))
        tf_vars = base.as_tf_variables(variables)
        acc0 = [tf.zeros(v.shape, v.dtype) for v in tf_vars]
        # Specs of one chunk's outputs, to size the TensorArrays.
        sq_ta = tf.TensorArray(tf.float32, size=num_chunks, element_shape=[chunk])
        loss_ta = tf.TensorArray(tf.float32, size=num_chunks, element_shape=[chunk])

        def body(i, acc, sq_ta, loss_ta, y_tas):
            cx = tf.nest.map_structure(lambda t: t[i], xs)
            cy = tf.nest.map_structure(lambda t: t[i], ys)
            csw = None if sws is None else sws[i]
            per_example, y_pred, losses = self.per_example_gradients(
                loss_fn, (cx, cy, csw), variables
            )
            clipped, sq = self._clip_and_sum(per_example, losses, query, params, real[i])
            acc = [a + tf.cast(c, a.dtype) for a, c in zip(acc, clipped)]
            sq_ta = sq_ta.write(i, tf.add_n([tf.cast(s, tf.float32) for s in sq]))
            loss_ta = loss_ta.write(i, tf.cast(losses, tf.float32))
            if y_tas is None:
                return i + 1, acc, sq_ta, loss_ta, y_pred
            y_tas = tf.nest.map_structure(lambda ta, t: ta.write(i, t), y_tas, y_pred)
            return i + 1, acc, sq_ta, loss_ta, y_tas

        # Trace the first chunk once to learn y_pred's structure and dtypes.
        i0 = tf.constant(0)
        _, acc, sq_ta, loss_ta, y_first = body(i0, acc0, sq_ta, loss_ta, None)
        y_tas = tf.nest.map_structure(
            lambda t: tf.TensorArray(t.dtype, size=num_chunks, element_shape=t.shape).write(0, t),
            y_first,
        )
        _, acc, sq_ta, loss_ta, y_tas = tf.while_loop(
            lambda i, *_: i < num_chunks,
            body,
            (tf.constant(1), acc, sq_ta, loss_ta, y_tas),
            parallel_iterations=1,
        )

        def unchunk(t):
            return tf.reshape(t, tf.concat([[num_chunks * chunk], tf.shape(t)[2:]], 0))[:b]

        y_pred = tf.nest.map_structure(lambda ta: unchunk(ta.stack()), y_tas)
        losses = unchunk(loss_ta.stack())
        norms = tf.sqrt(unchunk(sq_ta.stack()))
        return base.ClippedGradients(
            clipped_sum=acc,
            norms=norms,
            num_records=b,
            sensitivity_multiplier=1.0,
            record_mask=base.real_records(sw, b),
            y_pred=y_pred,
            losses=losses,
        )
