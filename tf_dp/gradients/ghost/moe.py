"""Norm rules for keras-hub's mixture-of-experts blocks (Mixtral, GPT-OSS).

keras-hub 0.32's ``MixtralSparseMoeBlock`` and ``GptOssSparseMoeBlock`` flatten the tokens to
``[B*T, d]`` and apply their router (a ``Dense``) and their expert bank (``[E, d, m]`` weights,
every expert on every token, weighted by the router) to that. A rule that read those ``[B*T, .]``
tensors would have to fold axis 0 back into examples, which is only sound if the flattening is
proven batch-major; the clipper instead moved the router and the bank to a per-example fallback.

These rules never fold: their ``forward`` runs the block's computation with the examples kept on
axis 0 (``[B, T, d]`` into the router ``Dense``, recorded by its own rule; the bank as
``einsum("bth,ehm->betm")``, whose outputs are watched, so their gradients are ``[B, E, T, .]``
with example ``b`` on row ``b``). The block's returned router logits/scores are then reshaped to
``[B*T, E]`` as the block returns them (a row-major reshape of ``[B, T, E]``: batch-major by
construction). The bank's per-example gradients are the einsum factors of
:func:`~tf_dp.gradients.ghost.common.einsum_kernel_factor` (``Outer`` for the input-side weights,
materialised per expert for the output-side ones). ``supports`` accepts only the exact keras-hub
classes whose ``call`` the forward reproduces (their router, bank and settings checked); anything
else keeps the per-example fallback.
"""

from __future__ import annotations

from typing import Any, Optional

import keras
from keras import ops

from tf_dp import _compat
from tf_dp.gradients.ghost.common import einsum_kernel_factor, f32, trainable
from tf_dp.gradients.ghost.factors import PerExample

#: Mixtral's expert-bank weights by variable name, with the einsum each is used in
MIXTRAL_BANK = {
    "expert_feedforward_gate_dense": "bth,ehm->betm",
    "expert_feedforward_intermediate_dense": "bth,ehm->betm",
    "expert_feedforward_output_dense": "beti,eih->beth",
}


def _child(layer, name: str):
    """``layer``'s directly tracked sublayer called ``name`` (or None)."""
    for sub in _compat.flatten_layers(layer, include_self=False, recursive=False) or []:
        if sub.name == name:
            return sub
    return None


def _arg(args, kwargs, name, index, default):
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else default


# -- Mixtral ---------------------------------------------------------------------------------------


def _mixtral_parts(layer):
    """``(router Dense, expert bank, {name: weight})`` of a ``MixtralSparseMoeBlock``."""
    router = _child(layer, "sparse_feedforward_gate_dense")
    bank = getattr(layer, "expert_bank", None)
    weights = {w.name: w for w in (bank.weights if bank is not None else [])}
    return router, bank, weights


def mixtral_moe_supports(layer) -> Optional[str]:
    from keras_hub.src.models.mixtral.mixtral_decoder import (
        MixtralMoeExperts,
        MixtralSparseMoeBlock,
    )

    if type(layer) is not MixtralSparseMoeBlock:
        return f"{layer.name}: not keras-hub's own MixtralSparseMoeBlock"
    router, bank, weights = _mixtral_parts(layer)
    if type(bank) is not MixtralMoeExperts or set(weights) != set(MIXTRAL_BANK):
        return f"{layer.name}: its expert bank is not keras-hub's MixtralMoeExperts"
    e, d, m = layer.num_experts, layer.hidden_dim, layer.intermediate_dim
    shapes = {"expert_feedforward_gate_dense": (e, d, m),
              "expert_feedforward_intermediate_dense": (e, d, m),
              "expert_feedforward_output_dense": (e, m, d)}
    if any(tuple(weights[n].shape) != s for n, s in shapes.items()):
        return f"{layer.name}: expert weights of unexpected shapes"
    if not isinstance(router, keras.layers.Dense) or router.use_bias or router.units != e:
        return f"{layer.name}: its router is not a bias-free Dense with one logit per expert"
    if router.activation not in (None, keras.activations.linear):
        return f"{layer.name}: its router Dense has an activation"
    if layer.router_jitter_noise:
        return f"{layer.name}: router jitter noise has no built-in norm rule"
    return None


def mixtral_moe_variables(layer) -> list:
    """The expert bank's weights (the router ``Dense`` keeps its own rule)."""
    _, _, weights = _mixtral_parts(layer)
    return [weights[n] for n in MIXTRAL_BANK if n in weights]


def mixtral_moe_forward(layer, call, args, kwargs, watch):
    """``MixtralSparseMoeBlock.call`` with the examples on axis 0 (see the module docstring):
    router ``Dense`` on ``[B, T, d]``; top-k routing renormalised; the three bank einsums on
    ``[B, T, d]`` watched; the output summed over the experts; the logits returned as
    ``[B*T, E]`` and the load-balancing loss added in training, as the block does."""
    del call
    from keras_hub.src.models.mixtral.mixtral_decoder import compute_load_balancing_loss

    x = _arg(args, kwargs, "hidden_states", 0, None)
    attention_mask = _arg(args, kwargs, "attention_mask", 1, None)
    training = _arg(args, kwargs, "training", 2, False)
    router, bank, w = _mixtral_parts(layer)
    logits = router(x)  # [B, T, E]
    probs = ops.softmax(logits, axis=-1)
    top_p, top_i = ops.top_k(probs, k=layer.top_k)
    top_p = top_p / ops.sum(top_p, axis=-1, keepdims=True)
    one_hot = ops.cast(ops.one_hot(top_i, layer.num_experts), top_p.dtype)
    routing = ops.cast(ops.sum(one_hot * top_p[..., None], axis=-2), x.dtype)  # [B, T, E]
    names = list(MIXTRAL_BANK)
    gate = watch(ops.einsum(MIXTRAL_BANK[names[0]], x, w[names[0]]))  # [B, E, T, m]
    gate = ops.cast(bank.activation(ops.cast(gate, "float32")), bank.compute_dtype)
    inter = watch(ops.einsum(MIXTRAL_BANK[names[1]], x, w[names[1]]))
    hidden = inter * gate
    out = watch(ops.einsum(MIXTRAL_BANK[names[2]], hidden, w[names[2]]))  # [B, E, T, d]
    out = ops.sum(out * ops.transpose(routing, (0, 2, 1))[..., None], axis=1)
    flat_logits = ops.reshape(logits, (-1, layer.num_experts))
    if training:
        aux = compute_load_balancing_loss(
            router_logits=flat_logits,
            num_experts=layer.num_experts,
            top_k=layer.top_k,
            attention_mask=attention_mask,
        )
        layer.add_loss(layer.router_aux_loss_coef * aux)
    return (out, flat_logits), (x, hidden)


def mixtral_moe_rule(layer, context, grads):
    """The expert bank's per-example gradients: for ``einsum("bth,ehm->betm", x, W)`` the
    ``Outer(x [B, T, d], g [B, T, E m])`` factor (every expert sees every token), for the output
    weights ``einsum("beti,beth->beih")`` materialised per example (``[B, E, m, d]``)."""
    x, hidden = context
    _, _, w = _mixtral_parts(layer)
    inputs = (x, x, hidden)
    out = []
    for (name, equation), a, g in zip(MIXTRAL_BANK.items(), inputs, grads):
        v = w[name]
        if trainable(v):
            out.append((v, einsum_kernel_factor(equation, f32(a), f32(g), v.shape)))
    return out


# -- GPT-OSS ---------------------------------------------------------------------------------------


def _gpt_oss_parts(layer):
    router = getattr(layer, "router", None)
    return router, getattr(router, "router_dense", None), getattr(layer, "experts", None)


def gpt_oss_moe_supports(layer) -> Optional[str]:
    from keras_hub.src.models.gpt_oss.gpt_oss_decoder import (
        GptOssExperts,
        GptOssSparseMoeBlock,
        GptOssTopKRouter,
    )

    if type(layer) is not GptOssSparseMoeBlock:
        return f"{layer.name}: not keras-hub's own GptOssSparseMoeBlock"
    router, dense, experts = _gpt_oss_parts(layer)
    if type(router) is not GptOssTopKRouter or type(experts) is not GptOssExperts:
        return f"{layer.name}: its router or experts are not keras-hub's GPT-OSS layers"
    if not isinstance(dense, keras.layers.Dense) or dense.units != layer.num_experts:
        return f"{layer.name}: its router has no Dense with one logit per expert"
    if dense.activation not in (None, keras.activations.linear):
        return f"{layer.name}: its router Dense has an activation"
    return None


def gpt_oss_moe_variables(layer) -> list:
    """The experts' ``gate_up_proj``, its bias, ``down_proj`` and its bias (the router's
    ``Dense`` keeps its own rule)."""
    _, _, ex = _gpt_oss_parts(layer)
    return [ex.gate_up_proj, ex.gate_up_proj_bias, ex.down_proj, ex.down_proj_bias]


def gpt_oss_moe_forward(layer, call, args, kwargs, watch):
    """``GptOssSparseMoeBlock.call`` (with its router's and experts' calls) with the examples on
    axis 0: router ``Dense`` on ``[B, T, d]``, top-k logits softmaxed into ``[B, T, E]`` scores;
    the experts' ``gate_up`` (after its bias) and output (after its bias) watched as
    ``[B, E, T, .]``; the scores returned as ``[B*T, E]``, as the block does."""
    del call
    x = _arg(args, kwargs, "hidden_states", 0, None)
    router, dense, ex = _gpt_oss_parts(layer)
    logits = dense(x)  # [B, T, E]
    top, selected = ops.top_k(logits, k=router.top_k)
    top = ops.softmax(top, axis=-1)
    mask = ops.cast(ops.one_hot(selected, router.num_experts), top.dtype)
    scores = ops.sum(mask * ops.expand_dims(top, -1), axis=-2)  # [B, T, E]
    gate_up = watch(
        ops.einsum("bth,ehm->betm", x, ex.gate_up_proj) + ex.gate_up_proj_bias[None, :, None, :]
    )
    gate = ops.clip(gate_up[..., ::2], -1e9, ex.limit)
    up = ops.clip(gate_up[..., 1::2], -ex.limit, ex.limit)
    glu = gate * ops.sigmoid(gate * ex.alpha)
    gated = (up + 1) * glu  # [B, E, T, m]
    out = watch(
        ops.einsum("betm,emh->beth", gated, ex.down_proj) + ex.down_proj_bias[None, :, None, :]
    )
    final = ops.sum(out * ops.expand_dims(ops.transpose(scores, (0, 2, 1)), -1), axis=1)
    return (final, ops.reshape(scores, (-1, router.num_experts))), (x, gated)


def gpt_oss_moe_rule(layer, context, grads):
    """``gate_up_proj``: ``Outer(x [B, T, d], g [B, T, E 2m])``; its bias: ``g`` summed over the
    tokens (``[B, E, 2m]``); ``down_proj``: ``einsum("betm,beth->bemh")`` materialised; its bias:
    the output gradient summed over the tokens."""
    x, gated = context
    g_up, g_out = f32(grads[0]), f32(grads[1])
    _, _, ex = _gpt_oss_parts(layer)
    pairs = [
        (ex.gate_up_proj, lambda: einsum_kernel_factor(
            "bth,ehm->betm", f32(x), g_up, ex.gate_up_proj.shape)),
        (ex.gate_up_proj_bias, lambda: PerExample(ops.sum(g_up, axis=2))),
        (ex.down_proj, lambda: einsum_kernel_factor(
            "betm,emh->beth", f32(gated), g_out, ex.down_proj.shape)),
        (ex.down_proj_bias, lambda: PerExample(ops.sum(g_out, axis=2))),
    ]
    return [(v, make()) for v, make in pairs if trainable(v)]


# -- GPT-OSS attention sinks -----------------------------------------------------------------------


class _WatchBroadcastOf:
    """``keras.ops`` whose ``broadcast_to`` of ``ops.reshape(variable, ...)`` passes the
    broadcast result through ``watch`` (and keeps it in ``seen``)."""

    def __init__(self, ops_module, variable, watch):
        self._ops, self._variable, self._watch = ops_module, variable, watch
        self._reshaped: list = []
        self.seen: list = []

    def __getattr__(self, name):
        return getattr(self._ops, name)

    def reshape(self, x, newshape):
        out = self._ops.reshape(x, newshape)
        if x is self._variable:
            self._reshaped.append(out)
        return out

    def broadcast_to(self, x, shape):
        out = self._ops.broadcast_to(x, shape)
        if any(x is r for r in self._reshaped):
            out = self._watch(out)
            self.seen.append(out)
        return out


def gpt_oss_attention_supports(layer) -> Optional[str]:
    import sys

    sinks = getattr(layer, "sinks", None)
    if sinks is None or tuple(sinks.shape) != (layer.num_query_heads,):
        return f"{layer.name}: this GptOssAttention has no [heads] sinks"
    if not hasattr(sys.modules.get(type(layer).__module__), "ops"):
        return f"{layer.name}: its module has no `ops` to watch the sinks through"
    return None


def gpt_oss_attention_forward(layer, call, args, kwargs, watch):
    """keras-hub ``GptOssAttention.call`` as written, with its module's ``ops`` replaced for the
    call so that the sinks' broadcast to ``[B, heads, Q, 1]`` (``ops.broadcast_to(ops.reshape(
    self.sinks, ...))``, the attention's only use of them) is watched: its gradient has example
    ``b`` on row ``b``. The call must make exactly one such broadcast, else it raises (a changed
    keras-hub: never a silently missing gradient)."""
    import sys

    module = sys.modules[type(layer).__module__]
    original = module.ops
    proxy = _WatchBroadcastOf(original, layer.sinks, watch)
    module.ops = proxy
    try:
        out = call(*args, **kwargs)
    finally:
        module.ops = original
    if len(proxy.seen) != 1:
        raise ValueError(
            f"tf_dp ghost rule for {layer.name}: expected one broadcast of the sinks in the "
            f"attention, saw {len(proxy.seen)}; register no rule for this keras-hub version"
        )
    return out, None


def gpt_oss_attention_rule(layer, context, grads):
    """The ``[heads]`` sinks: example ``b``'s gradient is its broadcast's gradient
    ``[B, heads, Q, 1]`` summed over the queries (:class:`PerExample`)."""
    del context
    if not trainable(layer.sinks):
        return []
    return [(layer.sinks, PerExample(ops.sum(f32(grads[0]), axis=(2, 3))))]


def registrations() -> list[tuple[str, str, dict[str, Any]]]:
    """``(module, class, register options)`` of this module's rules, for
    :func:`tf_dp.gradients.ghost.keras_hub_rules.register`."""
    return [
        ("keras_hub.src.models.mixtral.mixtral_decoder", "MixtralSparseMoeBlock",
         dict(rule=mixtral_moe_rule, forward=mixtral_moe_forward,
              supports=mixtral_moe_supports, variables=mixtral_moe_variables)),
        ("keras_hub.src.models.gpt_oss.gpt_oss_decoder", "GptOssSparseMoeBlock",
         dict(rule=gpt_oss_moe_rule, forward=gpt_oss_moe_forward,
              supports=gpt_oss_moe_supports, variables=gpt_oss_moe_variables)),
        ("keras_hub.src.models.gpt_oss.gpt_oss_attention", "GptOssAttention",
         dict(rule=gpt_oss_attention_rule, forward=gpt_oss_attention_forward,
              supports=gpt_oss_attention_supports)),
    ]
