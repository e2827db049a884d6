"""JL clipping (``gradient_mode="jl"``): per-example norms estimated from random projections.

This is DP-SGD-JL / DP-Adam-JL of Bu, Gopi, Kulkarni, Lee, Shen and Tantipongpipat, "Fast
Differentially Private-SGD via JL Projections" (2020; section and lemma numbers here are those of
that version, published in 2021 as "Fast and Memory Efficient Differentially Private-SGD via JL
Projections", NeurIPS 2021), Algorithm 1:

1. draw ``r`` directions ``v_1..v_r ~ N(0, I_d)`` over all trainable variables, fresh at every
   step and independent of the data: from a Philox generator keyed from OS entropy, like the
   noise (:func:`tf_dp.dp_query.make_generator`); or, with a ``seed`` and the step's number
   (what the DP optimizers pass with ``noise_seed``), from a stateless draw keyed by ``(seed,
   step, replica)`` with a constant of their own folded in, never the noise's key
   (:func:`tf_dp.gradients.base.step_seed`), so that a seeded run repeats in another process;
2. compute the projections ``p_ij = <grad L_i, v_j>`` of every per-example gradient, i.e. the
   Jacobian-vector products ``J v_j`` of the per-example loss vector ``F = (L_1, ..., L_B)``;
3. estimate each norm as ``M_i = sqrt(mean_j p_ij^2)`` (Proposition 2.1: ``r M_i^2 / ||g_i||^2`` is
   ``chi2_r``, so ``E[M_i^2] = ||g_i||^2``);
4. weight each example's loss by the query's clipping weight ``min(1, C / M_i)`` (treated as a
   constant) and take one backward pass of the weighted sum: the "clipped" sum
   ``sum_i min(1, C/M_i) g_i``.

The optimizer's query then adds noise ``sigma * C`` and the ledger records the step as a JL
mechanism with ``r`` projections (``ClippedGradients.jl_projections``). Because ``M_i`` is only an
estimate, a clipped gradient can have norm larger than ``C``: the privacy of a step is not that of
the Gaussian mechanism but Lemma 4.3's ``T(Z_r, N(Z_r/sigma, 1) || Z_r, N(0, 1))`` with
``Z_r = sqrt(r / chi2_r)``, composed over steps as in Theorem 4.1. That accounting lives in
``tf_dp.accounting``; this module only computes gradients.

Two routes compute the projections (section 2.1 of the paper), with the same result:

- ``"forward"``: ``tf.autodiff.ForwardAccumulator`` (forward-mode jvp). The first projection is
  computed during the same forward pass the backward tape records; each further projection is one
  more forward-mode pass, run with the model's non-trainable state (Keras seed generators, so
  dropout masks are replayed) restored to its value before the step, so that every projection is
  of the very per-example gradients that are summed.
- ``"double_vjp"``: the double-vjp trick. ``G(a) = a^T J`` is a vjp (a backward pass with output
  cotangent ``a``); ``grad_a <G(a), v> = J v``. An outer tape watching ``a`` gives every
  projection from one forward pass and one backward pass, plus one second-order backward pass per
  projection. It works through ``tf.while_loop`` (Keras 3's recurrent layers), where forward mode
  fails.

``method="auto"`` (what ``gradient_mode="jl"`` uses) picks ``"forward"`` on models it can trace in
forward mode and ``"double_vjp"`` otherwise: recurrent layers without ``unroll=True`` go straight
to double-vjp, and any other model whose forward-mode trace fails falls back to it. With ``r > 1``
the forward route checks that every replayed pass reproduces the per-example losses of the first
one, and fails the step (before noise and ledger) if not: randomness outside Keras seed
generators cannot be replayed, and such models need ``method="double_vjp"``.

Memory: on the double-vjp route the DP optimizer draws the noise after the clipped sum
(``noise_after_sum``), so that it is not held through the projection passes; see ``docs/jl.md``.

Supported queries: those whose clipping rule depends only on the total norm of a record
(``GaussianSumQuery``, ``NoPrivacySumQuery``, and them wrapped in ``QueryWithLedger``,
``NormalizedQuery`` or a single-leaf ``NestedQuery``). Per-group clipping (a ``NestedQuery`` with
several groups, ``JointClipGaussianSumQuery``) would need per-group projections and a per-group JL
analysis; it is refused with an error that names the query.

Example::

    opt = tf_dp.keras.DPKerasAdamOptimizer(
        l2_norm_clip=1.0, noise_multiplier=1.1, learning_rate=1e-3,
        gradient_mode="jl", jl_projections=1)
    model = tf_dp.keras.make_private(model)
    model.compile(optimizer=opt, loss="sparse_categorical_crossentropy")
    model.fit(x, y, batch_size=64, epochs=1)
    # opt.ledger records every step with mechanism "jl" and r = 1

    # or directly:
    clipper = JLClipper(jl_projections=4)
    out = clipper.clipped_sum(loss_fn, (x, y, None), model.trainable_variables, query, params)
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import keras
import numpy as np
import tensorflow as tf

from tf_dp import _compat
from tf_dp.dp_query.dp_query import DPQuery
from tf_dp.dp_query.gaussian_query import GaussianSumQuery
from tf_dp.dp_query.nested_query import NestedQuery
from tf_dp.dp_query.no_privacy_query import NoPrivacySumQuery
from tf_dp.dp_query.noise import gaussian_noise, make_generator, stateless_gaussian_noise
from tf_dp.dp_query.normalized_query import NormalizedQuery
from tf_dp.gradients import base

_logger = logging.getLogger("tf_dp")

METHODS = ("auto", "forward", "double_vjp")
_ZERO = tf.UnconnectedGradients.ZERO


# -- queries ---------------------------------------------------------------------------------------


def _unwrap_query(query: Any) -> Any:
    """The query whose clipping rule applies, through ledger / normalising / single-leaf wrappers."""
    seen = 0
    while seen < 16:
        seen += 1
        inner = getattr(query, "query", None)  # QueryWithLedger
        if inner is not None and isinstance(inner, DPQuery) and inner is not query:
            query = inner
            continue
        if isinstance(query, NormalizedQuery):
            query = query.numerator_query
            continue
        if isinstance(query, NestedQuery):
            leaves = tf.nest.flatten(query.queries)
            if len(leaves) == 1:
                query = leaves[0]
                continue
        break
    return query


def check_query(query: Any) -> None:
    """Raises TypeError unless JL clipping (one total norm per example) is valid for ``query``."""
    inner = _unwrap_query(query)
    # Late import: these modules import this layer's dependencies, not the other way round.
    from tf_dp.dp_query.automatic_clip_query import AutomaticClipSumQuery
    from tf_dp.dp_query.quantile_adaptive_clip_query import QuantileAdaptiveClipSumQuery

    # Automatic clipping's weight C / (M + gamma) of an estimated norm M gives a clipped record
    # of norm ||g|| C / (M + gamma) <= C ||g|| / M, within the JL analysis's bound (Lemma 4.3:
    # the worst case is the ratio ||g|| / M); adaptive clipping's sum clips like GaussianSumQuery
    # (its count is an exact Gaussian query, recorded as such).
    if isinstance(
        inner,
        (GaussianSumQuery, NoPrivacySumQuery, AutomaticClipSumQuery, QuantileAdaptiveClipSumQuery),
    ):
        return
    if isinstance(inner, NestedQuery):
        n = len(tf.nest.flatten(inner.queries))
        raise TypeError(
            f"gradient_mode='jl' estimates one total gradient norm per example, but the query is "
            f"a NestedQuery with {n} groups (separate clipping per group needs per-group JL "
            "projections and a per-group JL privacy analysis, which tf_dp does not provide); use a "
            "single GaussianSumQuery (l2_norm_clip / noise_multiplier) or another gradient_mode"
        )
    raise TypeError(
        f"gradient_mode='jl' supports queries that clip the total norm of each example "
        f"(GaussianSumQuery, NoPrivacySumQuery); got {type(inner).__name__}. Use another "
        "gradient_mode for this query"
    )


# -- models ----------------------------------------------------------------------------------------


def _walk_layers(model: Any) -> list[Any]:
    out: list[Any] = []
    stack = [model]
    seen: set[int] = set()
    while stack:
        layer = stack.pop()
        if layer is None or id(layer) in seen:
            continue
        seen.add(id(layer))
        out.append(layer)
        stack.extend(getattr(layer, "layers", None) or [])
        for attr in ("layer", "forward_layer", "backward_layer"):
            child = getattr(layer, attr, None)
            if isinstance(child, keras.layers.Layer):
                stack.append(child)
    return out


def forward_mode_blocker(model: Any) -> Optional[str]:
    """Why ``tf.autodiff.ForwardAccumulator`` cannot run through ``model`` (None if no known reason).

    Keras 3's recurrent layers run a ``tf.while_loop`` unless ``unroll=True``, and forward mode
    fails inside it (a ``variant`` dtype error while tracing).
    """
    if model is None:
        return None
    for layer in _walk_layers(model):
        if isinstance(layer, keras.layers.RNN) and not getattr(layer, "unroll", False):
            return f"layer {layer.name!r} ({type(layer).__name__}) runs a while loop (unroll=False)"
    return None


def _state_variables(model: Any) -> list[tf.Variable]:
    """Non-trainable model state (seed generators, statistics) to restore between replays."""
    if model is None:
        return []
    return [
        v
        for v in base.as_tf_variables(getattr(model, "non_trainable_variables", []))
        if isinstance(v, tf.Variable)
    ]


# -- projections -----------------------------------------------------------------------------------


def _dot(g: Any, v: tf.Tensor) -> tf.Tensor:
    """``<g, v>`` for a dense or ``IndexedSlices`` gradient ``g``."""
    if isinstance(g, tf.IndexedSlices):
        return tf.reduce_sum(g.values * tf.cast(tf.gather(v, g.indices), g.values.dtype))
    return tf.reduce_sum(g * tf.cast(v, g.dtype))


def _attr(attr_tuple: Sequence[Any], name: str) -> Any:
    attrs = dict(zip(attr_tuple[::2], attr_tuple[1::2]))
    value = attrs.get(name)
    return value.decode() if isinstance(value, bytes) else value


def _first_max_along(x, t, axis: int, k: int, stride: int, out_size):
    """1-D max-pool of ``x`` along ``axis`` (window ``k``, VALID) and the tangent ``t`` at the
    first maximum of each window. Returns ``(max, tangent)``."""
    m = tm = None
    for d in range(k):
        window = [slice(None)] * 4
        window[axis] = slice(d, d + (out_size - 1) * stride + 1, stride)
        cx, ct = x[tuple(window)], t[tuple(window)]
        if m is None:
            m, tm = cx, ct
        else:
            tm = tf.where(cx > m, ct, tm)  # strictly greater: the earlier element wins a tie
            m = tf.maximum(m, cx)
    return m, tm


@tf.function(jit_compile=True, autograph=False)
def _max_pool_tangent(x, t, kh: int, kw: int, sh: int, sw: int, out_h, out_w):
    # A 2-D max is a max over columns then rows, and the first maximum of a window in row-major
    # order is the first row's first maximum unless a later row is strictly larger: the two
    # 1-D passes give the same element as the row-major scan. XLA fuses the few element-wise ops.
    x, t = _first_max_along(x, t, 2, kw, sw, out_w)
    _, t = _first_max_along(x, t, 1, kh, sh, out_h)
    return t


def _max_pool_jvp(attr_tuple, inputs, outputs, tangents):
    """Forward-mode rule for ``MaxPool``: each output takes the tangent of its window's argmax.

    TF's default forward mode transposes the backward function, which for max-pooling runs
    ``MaxPoolGradGrad``: on this CPU slower than the whole forward pass of the reference CNN (as
    is ``MaxPoolWithArgmax``). Here the tangent of the *first* maximum of each window in
    row-major order is selected -- the element CPU ``MaxPoolGrad`` routes the gradient to -- so
    the projections are those of the gradient the backward pass computes (checked against the
    double-vjp route, ties included, in the tests). Other layouts use ``MaxPoolGradGrad``.
    """
    gen_nn_ops = _compat.gen_nn_ops()

    x, y, t = inputs[0], outputs[0], tangents[0]
    ksize, strides = list(_attr(attr_tuple, "ksize")), list(_attr(attr_tuple, "strides"))
    padding, data_format = _attr(attr_tuple, "padding"), _attr(attr_tuple, "data_format")
    if (
        data_format != "NHWC"
        or padding not in ("VALID", "SAME")
        or ksize[0] != 1
        or ksize[3] != 1
        or strides[0] != 1
        or strides[3] != 1
        or not x.dtype.is_floating
    ):
        return [gen_nn_ops.max_pool_grad_grad(x, y, t, ksize, strides, padding, data_format)]
    (kh, kw), (sh, sw) = ksize[1:3], strides[1:3]
    out_h, out_w = tf.shape(y)[1], tf.shape(y)[2]
    if padding == "SAME":
        in_h, in_w = tf.shape(x)[1], tf.shape(x)[2]
        pad_h = tf.maximum((out_h - 1) * sh + kh - in_h, 0)
        pad_w = tf.maximum((out_w - 1) * sw + kw - in_w, 0)
        pads = [[0, 0], [pad_h // 2, pad_h - pad_h // 2], [pad_w // 2, pad_w - pad_w // 2], [0, 0]]
        x = tf.pad(x, pads, constant_values=float("-inf"))
        t = tf.pad(t, pads)
    out = _max_pool_tangent(x, tf.cast(t, x.dtype), kh, kw, sh, sw, out_h, out_w)
    return [tf.reshape(out, tf.shape(y))]


def _bias_add_jvp(attr_tuple, inputs, outputs, tangents):
    """Forward-mode rule for ``BiasAdd`` (linear): ``t_value + t_bias`` broadcast on channels.

    TF's default transposition tiles and sums a ones tensor of the output's size.
    """
    t_value, t_bias = tangents[0], tangents[1]
    if _attr(attr_tuple, "data_format") == "NCHW" and t_value.shape.rank not in (None, 1, 2):
        shape = [1, -1] + [1] * (t_value.shape.rank - 2)
        return [t_value + tf.reshape(tf.cast(t_bias, t_value.dtype), shape)]
    return [t_value + tf.cast(t_bias, t_value.dtype)]


def _register_forward_rules() -> None:
    # ``tf.autodiff.ForwardAccumulator`` looks up per-op forward rules in this (TF-private) table
    # before falling back to transposing the backward function. Guarded: without it, forward
    # mode is only slower.
    rules = _compat.forward_rules()
    if rules is None:  # pragma: no cover
        _logger.info("tf_dp: no forward-mode rule table; MaxPool jvp uses TF's default")
        return
    rules.setdefault("MaxPool", _max_pool_jvp)
    rules.setdefault("BiasAdd", _bias_add_jvp)


_register_forward_rules()


def _same_losses(reference: tf.Tensor, replay: tf.Tensor):
    """Fails the step (before any noise or ledger record) if a replayed forward pass differs.

    Each projection must be of the per-example gradients that are summed (Lemma 4.3 needs the
    norm estimate of *that* gradient). A forward pass with randomness that the model's state does
    not determine (e.g. ``tf.random`` ops outside Keras seed generators) cannot be replayed.
    """
    ref = tf.cast(reference, tf.float32)
    rep = tf.cast(replay, tf.float32)
    # a non-finite loss (a non-finite record, given weight 0 later) must replay as non-finite
    finite = tf.math.is_finite(ref)
    ref = tf.where(finite, ref, tf.zeros_like(ref))
    rep = tf.where(finite, rep, tf.zeros_like(rep))
    tol = 1e-4 * (1.0 + tf.abs(ref))
    message = (
        "gradient_mode='jl' (forward route, r > 1): a replayed forward pass gave different "
        "per-example losses, so the model's randomness is not replayable; use "
        "JLClipper(method='double_vjp'), which needs a single forward pass"
    )
    if tf.executing_eagerly():
        if not bool(tf.reduce_all(tf.abs(rep - ref) <= tol)):
            raise ValueError(message)
        return tf.no_op()
    return tf.debugging.assert_less_equal(tf.abs(rep - ref), tol, message)


def _dense(g: Any) -> tf.Tensor:
    return tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g


class JLClipper(base.GradientClipper):
    """JL clipping (DP-SGD-JL, Bu et al. 2020, Algorithm 1). See the module docstring.

    Args:
      jl_projections: the JL dimension ``r`` (integer >= 1). Larger ``r`` estimates norms better
        (privacy closer to exact clipping) and costs more.
      method: ``"auto"`` (default), ``"forward"`` (``ForwardAccumulator``) or ``"double_vjp"``.
      seed: tests and debugging only. ``None`` keys the directions' Philox generator from OS
        entropy; a known seed makes the directions, hence the clipping, predictable. With the
        step's number (``clipped_sum(..., step=)``) the directions are a function of ``(seed,
        step)`` (and the replica under ``tf.distribute``); without one they come from a Philox
        generator seeded with ``seed``.
      noise_after_sum: draw the DP noise only after the clipped sum exists
        (``ClippedGradients.noise_after_sum``). ``None`` (default): on the double-vjp route only.
        Its peak (two backward passes, the directions held) is where an early draw of the noise
        would also be held: on the reference BiLSTM the step's peak was 1.1-2.2x non-private
        with the noise drawn early, 0.8-1.3x with it drawn late. On the forward route the
        executor may draw it early on a free core, faster when the noise is a large part of the
        step (MLP JL(1): 2.8x early, 3.3x late).

    Example::

        clipper = JLClipper(jl_projections=1)
        out = clipper.clipped_sum(loss_fn, (x, y, None), variables, query, params)
        out.jl_projections  # 1: the optimizer records a JL step in its ledger
    """

    name = "jl"
    exact = False
    needs_step = True

    def __init__(
        self,
        jl_projections: int = 1,
        method: str = "auto",
        seed: Optional[int] = None,
        noise_after_sum: Optional[bool] = None,
    ):
        if isinstance(jl_projections, bool) or not isinstance(jl_projections, int) or (
            jl_projections < 1
        ):
            raise ValueError(f"jl_projections must be an integer >= 1, got {jl_projections!r}")
        if method not in METHODS:
            raise ValueError(f"method must be one of {METHODS}, got {method!r}")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(seed).__name__}")
        if noise_after_sum is not None and not isinstance(noise_after_sum, bool):
            raise TypeError(
                f"noise_after_sum must be True, False or None, got {type(noise_after_sum).__name__}"
            )
        self.jl_projections = jl_projections
        self.method = method
        self._seed = seed
        self._generator: Optional[tf.random.Generator] = None
        #: the route actually used ("forward" / "double_vjp"), set on the first call
        self.resolved_method: Optional[str] = None
        self.noise_after_sum = noise_after_sum

    def __repr__(self) -> str:
        return f"JLClipper(jl_projections={self.jl_projections}, method={self.method!r})"

    @property
    def generator(self) -> tf.random.Generator:
        if self._generator is None:
            self._generator = make_generator(self._seed)
        return self._generator

    # -- directions ------------------------------------------------------------------------------

    def draw_directions(
        self, tf_vars: Sequence[tf.Variable], step: Any = None
    ) -> list[list[tf.Tensor]]:
        """``r`` standard Gaussian directions over all variables: ``[j][k]`` has var k's shape.

        One draw of ``r * d`` normals from the project's sampler
        (:func:`tf_dp.dp_query.noise.gaussian_noise`: Box-Muller on the Philox words, tails to
        9.49 standard deviations), split per variable; keyed by ``(seed, step)`` when both are
        given (:func:`tf_dp.dp_query.noise.stateless_gaussian_noise`).
        """
        r = self.jl_projections
        shapes = [v.shape.as_list() for v in tf_vars]
        sizes = [int(np.prod(shape)) for shape in shapes]
        if self._seed is not None and step is not None:
            key = base.step_seed(self._seed, base.JL_STREAM, step)
            flat = stateless_gaussian_noise(key, r * sum(sizes))
        else:
            flat = gaussian_noise(self.generator, r * sum(sizes))
        flat = tf.reshape(flat, [r, sum(sizes)])
        parts = tf.split(flat, sizes, axis=1)
        stacked = [
            tf.cast(tf.reshape(part, [r] + shape), v.dtype)
            for part, shape, v in zip(parts, shapes, tf_vars)
        ]
        return [[s[j] for s in stacked] for j in range(r)]

    # -- route selection -------------------------------------------------------------------------

    def _resolve(self, loss_fn, data, tf_vars) -> str:
        if self.resolved_method is not None:
            return self.resolved_method
        model = getattr(loss_fn, "model", None)
        if self.method != "auto":
            method = self.method
        else:
            reason = forward_mode_blocker(model)
            if reason is None and not tf.executing_eagerly():
                reason = self._probe_forward(loss_fn, data, tf_vars)
            method = "forward" if reason is None else "double_vjp"
            if reason is not None:
                _logger.info("tf_dp: jl uses the double-vjp route: %s", reason)
        self.resolved_method = method
        return method

    @staticmethod
    def _probe_forward(loss_fn, data, tf_vars) -> Optional[str]:
        """Traces (without running) one forward-mode pass; the error message if it fails."""
        x, y, sw = data
        args = (x, y) if sw is None else (x, y, sw)
        specs = tf.nest.map_structure(
            lambda t: tf.TensorSpec.from_tensor(tf.convert_to_tensor(t)), args
        )

        def probe(*a):
            tangents = [tf.zeros_like(v) for v in tf_vars]
            with tf.autodiff.ForwardAccumulator(tf_vars, tangents) as acc:
                losses, _ = loss_fn(a[0], a[1], a[2] if len(a) > 2 else None)
            return acc.jvp(losses, unconnected_gradients=_ZERO)

        try:
            tf.function(probe, autograph=False).get_concrete_function(*specs)
        except Exception as e:  # noqa: BLE001 -- any failure means: use the other route
            return f"forward mode fails on this model ({type(e).__name__}: {str(e)[:200]})"
        return None

    # -- the two routes --------------------------------------------------------------------------

    def _forward(self, loss_fn, data, tf_vars, directions):
        """Projections by forward mode. Returns (losses, y_pred, projections [r, B], tape)."""
        x, y, sw = data
        state = _state_variables(getattr(loss_fn, "model", None))
        before = [tf.identity(v.read_value()) for v in state] if len(directions) > 1 else []
        with tf.GradientTape() as tape:
            tape.watch(tf_vars)
            with tf.autodiff.ForwardAccumulator(tf_vars, directions[0]) as acc:
                losses, y_pred = loss_fn(x, y, sw)
        projections = [acc.jvp(losses, unconnected_gradients=_ZERO)]
        if len(directions) > 1:
            after = [tf.identity(v.read_value()) for v in state]
            checks = []
            for tangents in directions[1:]:
                # Replay the step's forward pass from the same state (same dropout masks).
                for v, b in zip(state, before):
                    v.assign(b)
                with tf.autodiff.ForwardAccumulator(tf_vars, tangents) as acc_j:
                    losses_j, _ = loss_fn(x, y, sw)
                projections.append(acc_j.jvp(losses_j, unconnected_gradients=_ZERO))
                checks.append(_same_losses(losses, losses_j))
            for v, a in zip(state, after):
                v.assign(a)
            with tf.control_dependencies(checks):
                projections = [tf.identity(p) for p in projections]
        return losses, y_pred, tf.stack(projections), tape

    def _double_vjp(self, loss_fn, data, tf_vars, directions):
        """Projections by the double-vjp trick (section 2.1). Same return as :meth:`_forward`."""
        x, y, sw = data
        with tf.GradientTape(persistent=True) as tape:
            tape.watch(tf_vars)
            losses, y_pred = loss_fn(x, y, sw)
        cotangent = tf.ones_like(losses)
        with tf.GradientTape(persistent=len(directions) > 1) as outer:
            outer.watch(cotangent)
            g = tape.gradient(losses, tf_vars, output_gradients=cotangent, unconnected_gradients=_ZERO)
            dots = [tf.add_n([_dot(gk, vk) for gk, vk in zip(g, v)]) for v in directions]
        projections = [outer.gradient(d, cotangent, unconnected_gradients=_ZERO) for d in dots]
        del outer
        return losses, y_pred, tf.stack(projections), tape

    def projections(self, loss_fn, data, variables, directions=None):
        """Per-example projections ``p [r, B]`` (``p_ij = <grad L_i, v_j>``), for tests/research.

        Returns ``(p, losses, directions)``.
        """
        tf_vars = base.as_tf_variables(variables)
        if directions is None:
            directions = self.draw_directions(tf_vars)
        method = self._resolve(loss_fn, data, tf_vars)
        route = self._forward if method == "forward" else self._double_vjp
        losses, _, p, tape = route(loss_fn, data, tf_vars, directions)
        del tape
        return p, losses, directions

    # -- the clipper ----------------------------------------------------------------------------

    def clipped_sum(
        self, loss_fn, data, variables, query, params, step: Any = None
    ) -> base.ClippedGradients:
        check_query(query)
        tf_vars = base.as_tf_variables(variables)
        data = base.fill_padding_rows(data)
        method = self._resolve(loss_fn, data, tf_vars)
        directions = self.draw_directions(tf_vars, step)
        route = self._forward if method == "forward" else self._double_vjp
        losses, y_pred, p, tape = route(loss_fn, data, tf_vars, directions)
        p = tf.cast(p, tf.float32)
        squared = tf.reduce_mean(tf.square(p), axis=0)  # M_i^2, [B]
        # The query's rule on the estimated total norm: all of it in the first leaf (the rule of
        # the supported queries depends only on the sum over leaves). A record whose loss or
        # projections are not finite gets weight 0.
        squared_norms = [squared] + [tf.zeros_like(squared) for _ in tf_vars[1:]]
        weights, keep = base.record_weights(query, params, squared_norms, losses)
        weights = tf.stop_gradient(tf.cast(tf.nest.flatten(weights)[0], losses.dtype))
        grads = tape.gradient(losses, tf_vars, output_gradients=weights, unconnected_gradients=_ZERO)
        del tape
        grads = [_dense(g) for g in grads]

        def without_bad_records():
            # The weighted backward pass is shared by the batch: 0 * NaN of a bad record would
            # reach every parameter. Re-run it with the bad records replaced by copies of a kept
            # one (weight 0, finite values); with no kept record the sum is 0.
            (x, y, sw), has_kept = base.fill_rows(data, tf.logical_not(keep), keep)
            with tf.GradientTape() as again:
                again.watch(tf_vars)
                losses_again, _ = loss_fn(x, y, sw)
            redone = again.gradient(
                losses_again, tf_vars, output_gradients=weights, unconnected_gradients=_ZERO
            )
            return [
                tf.where(has_kept, _dense(g), tf.zeros_like(g0)) for g, g0 in zip(redone, grads)
            ]

        grads = tf.cond(
            tf.reduce_all(keep), lambda: [tf.identity(g) for g in grads], without_bad_records
        )
        return base.ClippedGradients(
            clipped_sum=grads,
            norms=tf.sqrt(squared),
            num_records=base.batch_size_of(data[0]),
            sensitivity_multiplier=1.0,
            record_mask=base.real_records(data[2], base.batch_size_of(data[0])),
            y_pred=y_pred,
            losses=losses,
            jl_projections=self.jl_projections,
            noise_after_sum=(
                method == "double_vjp" if self.noise_after_sum is None else self.noise_after_sum
            ),
        )
