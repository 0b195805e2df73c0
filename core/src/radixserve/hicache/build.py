"""Building the hierarchical cache from the engine's flags: the host pool's size, the storage
tier chosen by ``--hicache-storage-backend`` (its keys salted with the model's identity, its
pages authenticated with the storage secret)."""

from __future__ import annotations

import logging
import os

from radixserve.hicache import (
    HEADER_BYTES,
    CacheTierContext,
    files_fingerprint,
    mac_key,
    rank_tag,
)
from radixserve.hicache.hiradix_cache import (
    DEFAULT_PREFETCH_TIMEOUT_BASE,
    DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN,
    HiRadixCache,
)
from radixserve.hicache.host_pool import HostKVPool
from radixserve.hicache.mirror import RankMirror, layout_salt
from radixserve.hicache.secret import storage_secret
from radixserve.hicache.storage_io import StorageIO
from radixserve.options import options_for

logger = logging.getLogger(__name__)

def _checkpoint_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    names = [f for f in os.listdir(path) if f.endswith((".safetensors", ".bin", ".gguf")) or f == "config.json"]
    return [os.path.join(path, f) for f in names]


def build_prefix_cache(args, runner, registry, checkpoint_path: str) -> HiRadixCache | None:
    """The hierarchical cache ``args`` ask for (None without ``--enable-hierarchical-cache``)."""
    if not args.enable_hierarchical_cache:
        return None
    kv = runner.kv_pool
    extra = args.hicache_extra_config()
    per_page = kv.buffer.shape[0] * kv.num_layers * kv.page_size * kv.num_kv_heads * kv.head_dim \
        * kv.buffer.element_size()  # K and V, or K alone (MLA)
    device_pages = kv.allocator.num_usable_pages
    if args.hicache_size:
        num_host = int(args.hicache_size * (1 << 30)) // per_page
    else:
        num_host = int(device_pages * args.hicache_ratio)
    if num_host < 1:
        raise ValueError(f"--hicache-size/--hicache-ratio: the host KV pool would hold no page of {per_page} bytes")
    if num_host <= device_pages:
        logger.warning("HiCache: the host pool (%d pages) is not larger than the device pool (%d pages); "
                       "raise --hicache-ratio or --hicache-size for it to hold more than the device", num_host,
                       device_pages)
    host = HostKVPool(kv, num_host, args.hicache_io_backend)
    logger.info("HiCache: host KV pool of %d pages (%.1f MB), write policy %s, io backend %s", num_host,
                num_host * per_page / 2**20, args.hicache_write_policy, args.hicache_io_backend)
    storage = fingerprint = None
    tag = rank_tag(0, args.tp_size, args.pp_size)  # with tensor parallelism each rank stores its own heads' pages
    if args.hicache_storage_backend:
        entry = registry.resolve("cache_tier", args.hicache_storage_backend, flag="--hicache-storage-backend")
        # the weights' storage (--quantization) and the activation dtype change the K/V computed too
        fingerprint = files_fingerprint(_checkpoint_files(checkpoint_path))
        salt = layout_salt(fingerprint, kv, runner, tag)
        ctx = CacheTierContext(args=args, extra_config=extra, model_key=salt, page_size=kv.page_size,
                               page_bytes=HEADER_BYTES + host.page_bytes, options=options_for(args, entry))
        tier = entry.factory(ctx)
        storage = StorageIO(tier, ctx, args.hicache_storage_backend, host.page_bytes,
                            mac=mac_key(storage_secret(args, extra)),
                            close_timeout=args.hicache_storage_shutdown_timeout, key_tag=tag)
        if kv.page_size < 16:
            logger.warning("HiCache: storage pages of %d token(s) make one stored value per %d token(s); "
                           "--page-size 16 or more keeps the storage tier efficient", kv.page_size, kv.page_size)
    # the other ranks' host pools and storage, in step with this one's (docs/multi_rank.md)
    mirror = RankMirror(runner.step_driver, num_host, fingerprint) if runner.step_driver is not None else None
    return HiRadixCache(
        kv, runner.req_to_token_pool, host, write_policy=args.hicache_write_policy, storage=storage, mirror=mirror,
        prefetch_policy=args.hicache_storage_prefetch_policy,
        prefetch_timeout_base=float(extra.get("prefetch_timeout_base", DEFAULT_PREFETCH_TIMEOUT_BASE)),
        prefetch_timeout_per_ki_token=float(extra.get("prefetch_timeout_per_ki_token",
                                                      DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN)),
        prefetch_min_pages=max(1, int(extra.get("prefetch_threshold", kv.page_size)) // kv.page_size),
    )
