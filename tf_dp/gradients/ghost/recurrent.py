"""Exact ghost rules for Keras's recurrent layers: ``LSTM``, ``GRU``, ``SimpleRNN`` (also inside
``Bidirectional``, stacked, masked, with ``return_sequences``/``return_state``/``go_backwards``).

The per-example gradient of a recurrent layer's variables is a sum over time steps:

- ``kernel`` ``[D, G]``: ``sum_t x_t (x) dz_t``, with ``x_t`` the step input (after input dropout)
  and ``dz_t`` the gradient of the step's input pre-activations ``x_t W + b`` (``G`` = 4 units
  for LSTM, 3 for GRU, 1 for SimpleRNN);
- ``recurrent_kernel`` ``[H, G]``: ``sum_t h_{t-1} (x) dr_t``, with ``dr_t`` the gradient of the
  recurrent pre-activations ``h_{t-1} U`` (for LSTM and SimpleRNN ``dr_t = dz_t``, both are added
  to the same sum);
- ``bias``: ``sum_t dz_t`` (GRU with ``reset_after``: ``[sum_t dz_t, sum_t dr_t]``).

So both are :class:`~tf_dp.gradients.ghost.factors.Outer` factors over time, like a Dense layer
applied to a sequence, once ``x_t``, ``h_{t-1}``, ``dz_t`` and ``dr_t`` are known for every step.
The rule gets them from the single backward pass of the ghost step: during the recorded forward
pass the layer's loop (``RNN.inner_loop``) is replaced, for that call only, by one that

1. computes the input projection ``x W + b`` for all steps at once, outside the loop (the tensor
   is *watched*: its gradient is ``dz`` for every step);
2. runs the recurrence on it with Keras's own loop (``backend.rnn``: the same masking,
   ``go_backwards``, ``unroll`` and ``zero_output_for_mask`` semantics), with a zero *probe*
   ``[B, T, G]`` added to the recurrent pre-activations for GRU (watched: its gradient is
   ``dr``), and emits ``h_{t-1}`` (and for GRU without ``reset_after``, ``r_t * h_{t-1}``) as a
   second output stacked over time. An LSTM or SimpleRNN (without recurrent dropout) run without
   a mask emits ``h_t`` only: there ``h_{t-1}`` is the previous step's output (the initial state
   for the first step), so the outputs shifted by one step are the stacked ``h_{t-1}``.

The layer's variables, configuration and saved weights are untouched: Keras's ``RNN.call``
still does everything around the loop (initial states, dropout masks, output selection), and
outside the private step the layer runs Keras's own loop. Masked steps get ``dz_t = dr_t = 0``
exactly (the loop carries the state over them), so they add nothing.

Configurations with no rule here (they fall back to per-layer per-example gradients, still exact):
``stateful`` layers, cells other than Keras's own, and ``implementation=1`` with dropout or
recurrent dropout (one dropout mask per gate; the default ``implementation=2`` is covered, with
input dropout; Keras's ``implementation=2`` LSTM and GRU cells apply no recurrent dropout, and
SimpleRNN's recurrent dropout is covered).
"""

from __future__ import annotations

from typing import Any, Optional

import keras
import tensorflow as tf
from keras import ops

from tf_dp import _compat
from tf_dp.gradients.ghost.factors import Outer, PerExample
from tf_dp.gradients.ghost.registry import norm_rule

_CELLS = {
    "LSTM": keras.layers.LSTMCell,
    "GRU": keras.layers.GRUCell,
    "SimpleRNN": keras.layers.SimpleRNNCell,
}


def _kind(layer) -> str:
    for cls in type(layer).__mro__:
        if cls.__name__ in _CELLS and cls.__module__.startswith("keras"):
            return cls.__name__
    raise TypeError(f"{type(layer).__name__} is not a Keras LSTM, GRU or SimpleRNN")


def supports(layer) -> Optional[str]:
    kind = _kind(layer)
    cell = getattr(layer, "cell", None)
    if type(cell) is not _CELLS[kind]:
        return f"{layer.name}: the recurrent rule needs Keras's own {_CELLS[kind].__name__}"
    if getattr(layer, "stateful", False):
        return f"{layer.name}: stateful recurrent layers have no built-in norm rule"
    if getattr(cell, "implementation", 2) == 1 and (cell.dropout or cell.recurrent_dropout):
        return (
            f"{layer.name}: implementation=1 with (recurrent) dropout has no built-in norm rule "
            "(one dropout mask per gate)"
        )
    return None


def variables(layer) -> list:
    return list(layer.cell.trainable_variables)


def _restore(layer, had, prev):
    if had:
        object.__setattr__(layer, "inner_loop", prev)
    else:
        object.__delattr__(layer, "inner_loop")


def forward(layer, call, args, kwargs, watch):
    """Runs ``call`` with the layer's loop replaced for this call (see the module docstring)."""
    ctx: dict[str, Any] = {}

    def inner_loop(sequences, initial_state, mask, training=False):
        return _inner_loop(layer, sequences, initial_state, mask, training, watch, ctx)

    had, prev = "inner_loop" in layer.__dict__, layer.__dict__.get("inner_loop")
    object.__setattr__(layer, "inner_loop", inner_loop)
    try:
        outputs = call(*args, **kwargs)
    finally:
        _restore(layer, had, prev)
    if "x" not in ctx:
        raise RuntimeError(f"{layer.name}: the recurrent loop was not run by call()")
    return outputs, ctx


def _inner_loop(layer, sequences, initial_state, mask, training, watch, ctx):
    kbackend = _compat.keras_backend()  # Keras's loop, for identical semantics

    kind = _kind(layer)
    cell = layer.cell
    if isinstance(mask, (list, tuple)):
        mask = mask[0]
    if isinstance(initial_state, (list, tuple)):
        initial_state = list(initial_state)
    else:
        initial_state = [initial_state]
    if kind == "GRU":
        initial_state = initial_state[:1]
    x = sequences
    if training and 0.0 < cell.dropout < 1.0:
        # the cell's cached mask for this call (RNN.call prepared it), the same for every step
        x = x * ops.expand_dims(cell.get_dropout_mask(sequences[:, 0, :]), 1)
    rec_mask = None
    if kind == "SimpleRNN" and training and 0.0 < cell.recurrent_dropout < 1.0:
        rec_mask = cell.get_recurrent_dropout_mask(initial_state[0])
    units = cell.units
    input_bias = recurrent_bias = None
    if cell.use_bias:
        if kind == "GRU" and cell.reset_after:
            input_bias, recurrent_bias = cell.bias[0], cell.bias[1]
        else:
            input_bias = cell.bias
    xw = ops.matmul(x, cell.kernel)
    if input_bias is not None:
        xw = xw + input_bias
    xw = watch(xw)
    act, rec_act = cell.activation, getattr(cell, "recurrent_activation", None)
    u = cell.recurrent_kernel

    # Without a mask (and, for SimpleRNN, without recurrent dropout) h_{t-1} is the previous
    # step's output (the initial state for the first step): the loop emits h_t only and the
    # rule shifts the outputs, instead of the loop emitting [h_t, h_{t-1}] (twice the outputs,
    # and their zero gradients, carried through the loop and its gradient)
    shift = mask is None and kind in ("LSTM", "SimpleRNN") and rec_mask is None

    if kind == "LSTM":
        inputs = xw

        def step(xw_t, states):
            h, c = states[0], states[1]
            z = xw_t + ops.matmul(h, u)
            # one split, as Keras's cell does (its gradient is one concatenation; four slices'
            # gradients are four zero-filled [B, 4 units] tensors added up, at every step)
            z0, z1, z2, z3 = ops.split(z, 4, axis=-1)
            c_new = rec_act(z1) * c + rec_act(z0) * act(z2)
            h_new = rec_act(z3) * act(c_new)
            return (h_new if shift else ops.concatenate([h_new, h], axis=-1)), [h_new, c_new]

    elif kind == "SimpleRNN":
        inputs = xw

        def step(xw_t, states):
            h = states[0]
            hr = h * rec_mask if rec_mask is not None else h
            z = xw_t + ops.matmul(hr, u)
            h_new = act(z) if act is not None else z
            return (h_new if shift else ops.concatenate([h_new, hr], axis=-1)), [h_new]

    else:  # GRU
        probe = watch(tf.zeros_like(xw))
        inputs = (xw, probe)
        reset_after = cell.reset_after

        def step(step_inputs, states):
            xw_t, p_t = step_inputs
            h = states[0]
            x_z, x_r, x_h = ops.split(xw_t, 3, axis=-1)
            if reset_after:
                inner = ops.matmul(h, u)
                if recurrent_bias is not None:
                    inner = inner + recurrent_bias
                inner = inner + p_t
                i_z, i_r, i_h = ops.split(inner, 3, axis=-1)
                z = rec_act(x_z + i_z)
                r = rec_act(x_r + i_r)
                hh = act(x_h + r * i_h)
                extra = (h,)
            else:
                p_zr, p_h = ops.split(p_t, [2 * units], axis=-1)
                inner = ops.matmul(h, u[:, : 2 * units]) + p_zr
                i_z, i_r = ops.split(inner, 2, axis=-1)
                z = rec_act(x_z + i_z)
                r = rec_act(x_r + i_r)
                rh = r * h
                hh = act(x_h + ops.matmul(rh, u[:, 2 * units :]) + p_h)
                extra = (h, rh)
            h_new = z * h + (1 - z) * hh
            return ops.concatenate((h_new,) + extra, axis=-1), [h_new]

    last, outs, states = kbackend.rnn(
        step,
        inputs,
        initial_state,
        go_backwards=layer.go_backwards,
        mask=mask,
        unroll=layer.unroll,
        input_length=sequences.shape[1],
        zero_output_for_mask=layer.zero_output_for_mask,
        return_all_outputs=True,
    )
    if shift:  # outputs h_t in processing order: h_{t-1} is the output one step before
        h0 = tf.cast(initial_state[0], outs.dtype)[:, None, :]
        stacked = [tf.concat([h0, outs[:, :-1]], axis=1)]
    else:
        # one output per step, [h_t, h_{t-1}(, r_t h_{t-1})] concatenated (Keras's unrolled
        # loop takes no nested outputs with a mask)
        n = outs.shape[-1] // units
        last = last[:, :units]
        stacked = [outs[:, :, i * units : (i + 1) * units] for i in range(1, n)]
        outs = outs[:, :, :units]
    if layer.go_backwards:  # the loop's outputs are in processing order; dz, dr in input order
        stacked = [tf.reverse(t, [1]) for t in stacked]
    ctx.update(kind=kind, x=x, prev=stacked, units=units, shifted=shift)
    return last, outs, states


@norm_rule(
    keras.layers.LSTM,
    keras.layers.GRU,
    keras.layers.SimpleRNN,
    supports=supports,
    forward=forward,
    variables=variables,
)
def rule(layer, ctx, grads):
    cell = layer.cell
    grads = grads if isinstance(grads, (list, tuple)) else [grads]
    dz = tf.cast(grads[0], tf.float32)
    f32 = lambda t: tf.cast(t, tf.float32)  # noqa: E731
    x, prev = f32(ctx["x"]), [f32(t) for t in ctx["prev"]]
    out = [(cell.kernel, Outer(x, dz))]
    if ctx["kind"] != "GRU":
        out.append((cell.recurrent_kernel, Outer(prev[0], dz)))
        if cell.use_bias:
            out.append((cell.bias, PerExample(tf.reduce_sum(dz, axis=1))))
        return out
    dr = tf.cast(grads[1], tf.float32)
    units = ctx["units"]
    if cell.reset_after:
        out.append((cell.recurrent_kernel, Outer(prev[0], dr)))
        if cell.use_bias:
            per_ex = tf.stack([tf.reduce_sum(dz, axis=1), tf.reduce_sum(dr, axis=1)], axis=1)
            out.append((cell.bias, PerExample(per_ex)))
        return out
    # U = [U_zr | U_h]: the z, r columns see h_{t-1}, the h columns see r_t * h_{t-1}; one Outer
    # over 2T "steps" with the other columns' gradients zeroed is exactly their sum
    zeros_zr = tf.zeros_like(dr[:, :, : 2 * units])
    zeros_h = tf.zeros_like(dr[:, :, 2 * units :])
    a = tf.concat([prev[0], prev[1]], axis=1)
    g = tf.concat(
        [
            tf.concat([dr[:, :, : 2 * units], zeros_h], axis=2),
            tf.concat([zeros_zr, dr[:, :, 2 * units :]], axis=2),
        ],
        axis=1,
    )
    out.append((cell.recurrent_kernel, Outer(a, g)))
    if cell.use_bias:
        out.append((cell.bias, PerExample(tf.reduce_sum(dz, axis=1))))
    return out
