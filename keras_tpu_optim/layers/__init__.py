"""Layers whose variables are trained by their own optimizer, inside the model's training step."""

from keras_tpu_optim.layers.distributed_embedding import (
    DistributedEmbedding,
    FeatureConfig,
    TableConfig,
)
from keras_tpu_optim.layers.embedding import Embedding

__all__ = ["DistributedEmbedding", "Embedding", "FeatureConfig", "TableConfig"]
