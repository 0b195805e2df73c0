"""For HiCache storage tiers (``register_cache_tiers``)."""

from radixserve.config import ConfigError
from radixserve.hicache import CacheTier, CacheTierContext

__all__ = ["CacheTier", "CacheTierContext", "ConfigError"]
