"""Norm rules for keras-hub layers. This module imports keras-hub, so the default registry loads
it only when it first meets a layer class from a ``keras_hub`` module (importing tf_dp never
imports keras-hub). The rules themselves live with their layer family (``embeddings.py``,
``normalization.py``)."""

from __future__ import annotations

from keras_hub.layers import PositionEmbedding, TokenAndPositionEmbedding
from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

from tf_dp.gradients.ghost.embeddings import position_embedding_rule, position_forward
from tf_dp.gradients.ghost.normalization import gemma_rms_normalization_rule
from tf_dp.gradients.ghost.registry import LayerRuleRegistry


def register(registry: LayerRuleRegistry) -> None:
    """Registers the keras-hub layers' rules in ``registry``."""
    registry.register(PositionEmbedding, position_embedding_rule, forward=position_forward)
    # its call is token_embedding(ids) + position_embedding(...): each sublayer is recorded with
    # its own rule (ReversibleEmbedding's, PositionEmbedding's), including when the backbone also
    # tracks the token embedding (``backbone.token_embedding``, used again for tied LM logits)
    registry.register_container(TokenAndPositionEmbedding)
    registry.register(RMSNormalization, gemma_rms_normalization_rule)
