"""radixserve HiCache storage tier ``redis``: KV pages in a Redis or Valkey server.

``--hicache-storage-backend redis --hicache-storage-url redis://HOST:PORT/DB``. Every
radixserve server pointed at the same database shares the prefixes any of them computed
(for the same model: keys are salted with the model's identity). Options and failure
behaviour: :mod:`radixserve_cache_redis.tier`. The size bound is Redis's own
``maxmemory`` with ``maxmemory-policy allkeys-lru``.
"""

from __future__ import annotations

import importlib.util

from radixserve.plugin_api import hookimpl


def probe() -> str | None:
    if importlib.util.find_spec("redis") is None:
        return "the redis client library is not installed (pip install redis)"
    return None


def make_tier(ctx):
    from radixserve_cache_redis.tier import RedisTier

    return RedisTier.from_context(ctx)


@hookimpl
def register_cache_tiers(register):
    register("redis", make_tier, probe=probe,
             description="KV pages in a Redis/Valkey server (--hicache-storage-url), shared between servers; "
                         "bounded by Redis's maxmemory with allkeys-lru")
