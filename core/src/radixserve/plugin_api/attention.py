"""For attention backends (``register_attention_backends``): the contract, the batch it is
handed, and the helpers its kernels need."""

from radixserve.layers.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
    ForwardMode,
)
from radixserve.mem.kv_pool import to_storage
from radixserve.models.config import ModelConfig

__all__ = ["AttentionBackend", "AttentionContext", "AttentionLayer", "ForwardBatch", "ForwardMode",
           "ModelConfig", "to_storage"]
