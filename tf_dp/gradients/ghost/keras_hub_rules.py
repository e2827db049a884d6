"""Norm rules for keras-hub layers. This module imports keras-hub, so the default registry loads
it only when it first meets a layer class from a ``keras_hub`` module (importing tf_dp never
imports keras-hub). The rules themselves live with their layer family (``embeddings.py``,
``normalization.py``, ``moe.py``, ``window_attention.py``, ``delta_net.py``)."""

from __future__ import annotations

import importlib

from keras_hub.layers import MaskedLMHead, PositionEmbedding, TokenAndPositionEmbedding
from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

from tf_dp.gradients.ghost.dense import (
    gemma4_decoder_forward,
    gemma4_decoder_rule,
    gemma4_decoder_supports,
    masked_lm_head_forward,
    masked_lm_head_rule,
    masked_lm_head_supports,
    no_own_variables,
)
from tf_dp.gradients.ghost.embeddings import (
    deit_forward,
    deit_rule,
    deit_supports,
    pali_gemma_vit_embeddings_rule,
    pali_gemma_vit_embeddings_supports,
    pali_gemma_vit_embeddings_variables,
    t5_attention_forward,
    t5_attention_rule,
    t5_attention_supports,
    position_embedding_rule,
    position_forward,
    relative_embedding_rule,
    relative_embedding_variables,
    vit_patching_rule,
    vit_patching_variables,
)
from tf_dp.gradients.ghost.normalization import (
    channelwise_forward,
    channelwise_rule,
    channelwise_supports,
    gemma_rms_normalization_rule,
    last_axis_rms_norm_rule,
)
from tf_dp.gradients.ghost import delta_net, moe, window_attention
from tf_dp.gradients.ghost.registry import LayerRuleRegistry

# keras-hub's RMS layer norms over the last axis (module, class, rule); a class missing from the
# installed keras-hub is skipped
_RMS_NORMS = (
    ("keras_hub.src.models.llama.llama_layernorm", "LlamaLayerNorm", last_axis_rms_norm_rule),
    (
        "keras_hub.src.models.mistral.mistral_layer_norm",
        "MistralLayerNormalization",
        last_axis_rms_norm_rule,
    ),
    ("keras_hub.src.models.phi3.phi3_layernorm", "Phi3LayerNorm", last_axis_rms_norm_rule),
    ("keras_hub.src.models.qwen.qwen_layernorm", "QwenLayerNorm", last_axis_rms_norm_rule),
    ("keras_hub.src.models.qwen3.qwen3_layernorm", "Qwen3LayerNorm", last_axis_rms_norm_rule),
    ("keras_hub.src.models.t5.t5_layer_norm", "T5LayerNorm", last_axis_rms_norm_rule),
    (
        "keras_hub.src.models.mixtral.mixtral_layer_norm",
        "MixtralLayerNormalization",
        last_axis_rms_norm_rule,
    ),
    (
        "keras_hub.src.models.gpt_oss.gpt_oss_layer_norm",
        "GptOssLayerNormalization",
        last_axis_rms_norm_rule,
    ),
    (
        "keras_hub.src.models.qwen3_5.qwen3_5_layers",
        "Qwen3_5LayerNorm",
        gemma_rms_normalization_rule,
    ),
)

# keras-hub's other norms and layer scales over the last axis, whatever their formula: the
# channelwise rule (forward-mode products, exact when channel h depends on v[h] alone; each class
# is checked against per-example gradients in tests/test_ghost_channelwise.py)
CHANNELWISE = (
    ("keras_hub.src.models.gemma3.gemma3_layers", "RMSNormalization"),
    ("keras_hub.src.models.gemma4.gemma4_layers", "RMSNormalization"),
    ("keras_hub.src.models.gemma3n.rms_normalization", "Gemma3nRMSNorm"),
    ("keras_hub.src.models.roformer_v2.roformer_v2_attention", "RoformerNorm"),
    ("keras_hub.src.models.qwen_moe.qwen_moe_layernorm", "QwenMoeLayerNorm"),
    ("keras_hub.src.models.qwen3_moe.qwen3_moe_layernorm", "Qwen3MoeLayerNorm"),
    ("keras_hub.src.models.edrec.edrec_layers", "EdRecRMSNormalization"),
    ("keras_hub.src.layers.modeling.rms_normalization", "RMSNormalization"),
    ("keras_hub.src.models.dinov2.dinov2_layers", "DINOV2LayerScale"),
    ("keras_hub.src.models.dinov3.dinov3_layers", "DINOV3LayerScale"),
)


def _optional_class(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


def register(registry: LayerRuleRegistry) -> None:
    """Registers the keras-hub layers' rules in ``registry``."""
    registry.register(PositionEmbedding, position_embedding_rule, forward=position_forward)
    # its call is token_embedding(ids) + position_embedding(...): each sublayer is recorded with
    # its own rule (ReversibleEmbedding's, PositionEmbedding's), including when the backbone also
    # tracks the token embedding (``backbone.token_embedding``, used again for tied LM logits)
    registry.register_container(TokenAndPositionEmbedding)
    # RoFormer-v2's masked-LM head only calls its tied token embedding (reverse=True)
    roformer_head = _optional_class(
        "keras_hub.src.models.roformer_v2.roformer_v2_masked_lm", "RoformerV2MaskedLMHead"
    )
    if roformer_head is not None:
        registry.register_container(roformer_head)
    registry.register(RMSNormalization, gemma_rms_normalization_rule)
    registry.register(
        MaskedLMHead,
        masked_lm_head_rule,
        forward=masked_lm_head_forward,
        supports=masked_lm_head_supports,
    )
    relative = _optional_class(
        "keras_hub.src.models.deberta_v3.relative_embedding", "RelativeEmbedding"
    )
    if relative is not None:
        registry.register(
            relative, relative_embedding_rule, variables=relative_embedding_variables
        )
    vit = _optional_class("keras_hub.src.models.vit.vit_layers", "ViTPatchingAndEmbedding")
    if vit is not None:
        registry.register(vit, vit_patching_rule, variables=vit_patching_variables)
    gemma4 = _optional_class(
        "keras_hub.src.models.gemma4.gemma4_decoder_block", "Gemma4TextDecoderBlock"
    )
    if gemma4 is not None:
        registry.register(
            gemma4,
            gemma4_decoder_rule,
            forward=gemma4_decoder_forward,
            supports=gemma4_decoder_supports,
            variables=no_own_variables,
        )
    pali_vit = _optional_class(
        "keras_hub.src.models.pali_gemma.pali_gemma_vit", "PaliGemmaVitEmbeddings"
    )
    if pali_vit is not None:
        registry.register(
            pali_vit,
            pali_gemma_vit_embeddings_rule,
            variables=pali_gemma_vit_embeddings_variables,
            supports=pali_gemma_vit_embeddings_supports,
        )
    deit = _optional_class("keras_hub.src.models.deit.deit_layers", "DeiTEmbeddings")
    if deit is not None:
        registry.register(deit, deit_rule, forward=deit_forward, supports=deit_supports)
    t5 = _optional_class("keras_hub.src.models.t5.t5_multi_head_attention", "T5MultiHeadAttention")
    if t5 is not None:
        registry.register(
            t5, t5_attention_rule, forward=t5_attention_forward, supports=t5_attention_supports
        )
    # rules that keep the examples on axis 0 where keras-hub flattens them into it (mixture-of-
    # experts blocks, Swin's window attention, Qwen3.5's gated delta net; see moe.py,
    # window_attention.py and delta_net.py)
    hub = moe.registrations() + window_attention.registrations() + delta_net.registrations()
    for module, name, options in hub:
        layer_class = _optional_class(module, name)
        if layer_class is not None:
            options = dict(options)
            registry.register(layer_class, options.pop("rule"), **options)
    for module, name in CHANNELWISE:
        layer_class = _optional_class(module, name)
        if layer_class is not None:
            registry.register(
                layer_class,
                channelwise_rule,
                forward=channelwise_forward,
                supports=channelwise_supports,
            )
    for module, name, rule in _RMS_NORMS:
        layer_class = _optional_class(module, name)
        if layer_class is not None:
            registry.register(layer_class, rule)
