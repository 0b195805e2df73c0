"""For HiCache storage tiers (``register_cache_tiers``).

Names load on first use (a plugin's entry module may import them without importing torch).
"""

from radixserve.plugin_api import lazy_attr

_SOURCES = {
    "CacheTier": "radixserve.hicache",
    "CacheTierContext": "radixserve.hicache",
    "ConfigError": "radixserve.config",
}
__all__ = sorted(_SOURCES)


def __getattr__(name: str):
    return lazy_attr(__name__, _SOURCES, name)
