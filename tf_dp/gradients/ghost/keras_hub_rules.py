"""Norm rules for keras-hub layers. This module imports keras-hub, so the default registry loads
it only when it first meets a layer class from a ``keras_hub`` module (importing tf_dp never
imports keras-hub). The rules themselves live with their layer family (``embeddings.py``,
``normalization.py``)."""

from __future__ import annotations

from keras_hub.layers import PositionEmbedding
from keras_hub.src.models.gemma.rms_normalization import RMSNormalization

from tf_dp.gradients.ghost.embeddings import position_embedding_rule, position_forward
from tf_dp.gradients.ghost.normalization import gemma_rms_normalization_rule
from tf_dp.gradients.ghost.registry import LayerRuleRegistry


def register(registry: LayerRuleRegistry) -> None:
    """Registers the keras-hub layers' rules in ``registry``."""
    registry.register(PositionEmbedding, position_embedding_rule, forward=position_forward)
    registry.register(RMSNormalization, gemma_rms_normalization_rule)
