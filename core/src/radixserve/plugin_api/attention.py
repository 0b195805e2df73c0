"""For attention backends (``register_attention_backends``): the contract, the batch it is
handed, and the helpers its kernels need.

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "AttentionBackend": "radixserve.layers.attention",
    "AttentionContext": "radixserve.layers.attention",
    "AttentionLayer": "radixserve.layers.attention",
    "ForwardBatch": "radixserve.layers.attention",
    "ForwardMode": "radixserve.layers.attention",
    "to_storage": "radixserve.mem.kv_pool",
    "ModelConfig": "radixserve.models.config",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
