"""For MoE runners (``register_moe_runners``) and all-to-all transports
(``register_moe_a2a_backends``).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "DispatchOutput": "radixserve.layers.moe_a2a",
    "ExpertWeights": "radixserve.layers.moe",
    "MoEA2ABackend": "radixserve.layers.moe_a2a",
    "MoEContext": "radixserve.layers.moe",
    "MoERunner": "radixserve.layers.moe",
    "Pending": "radixserve.layers.moe_a2a",
    "PendingDispatch": "radixserve.layers.moe_a2a",
    "split_range": "radixserve.distributed",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
