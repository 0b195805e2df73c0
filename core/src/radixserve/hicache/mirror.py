"""HiCache with tensor parallelism: every rank keeps its own KV heads' pages in its own host
pool and storage, in step with rank 0's decisions.

Rank 0's :class:`~radixserve.hicache.hiradix_cache.HiRadixCache` decides everything (which
pages are copied, evicted, loaded back, fetched); the followers repeat its copies on their own
pools, page for page, so a host page number means the same prefix on every rank:

* a device -> host backup and a host -> device load are deferred operations
  (:meth:`StepDriver.defer <radixserve.distributed.step_sync.StepDriver.defer>`): a follower
  does them at the start of the next step or service call, before any forward could write
  the device pages a backup reads or read those a load writes (rank 0 frees a page only after
  its own copy, and reuses it only in a later step);
* a follower stores its backed-up pages in its own storage tier under its own keys (rank 0's
  content key, then hashed with ``tp=N|rank=R``) and frames them with a salt that names the
  layout, so a page written by another TP size or rank is never read;
* a prefetch from storage: when rank 0's own fetch is done it asks every rank, in one service
  call (``hicache.take``), to read the same pages from its storage into the host pages rank 0
  chose; the prefix is as long as the shortest run any rank found (the followers read inside
  the call, so a slow tier delays rank 0's next step by that read).

With one rank none of this exists (``mirror`` is None).
"""

from __future__ import annotations

import logging

from radixserve.hicache import HEADER_BYTES, CacheTierContext, mac_key, model_key, rank_tag

logger = logging.getLogger(__name__)

CALLS = ("hicache.init", "hicache.backup", "hicache.load", "hicache.take", "hicache.close")


def layout_salt(fingerprint: str, kv, runner, tag: str) -> str:
    """The model key that frames a rank's stored pages: the checkpoint, the pool's layout, the
    weights' storage, and (tp > 1) the TP size and rank."""
    extra = f"quantization={runner.quantization.name}|activations={runner.dtype}" + (f"|{tag}" if tag else "")
    if kv.v_head_dim is not None:  # MLA: the pages hold latent rows only
        extra += f"|latent_v={kv.v_head_dim}"
    return model_key(fingerprint, dtype=kv.dtype, page_size=kv.page_size, num_layers=kv.num_layers,
                     num_kv_heads=kv.num_kv_heads, head_dim=kv.head_dim, extra=extra)


class FollowerHiCache:
    """A follower's host pool and storage tier, built when rank 0 says how many host pages."""

    def __init__(self, args, registry, runner) -> None:
        self.args, self.registry, self.runner = args, registry, runner
        self.host = None
        self.storage = None
        self.tag = ""

    def handlers(self) -> dict:
        return {name: getattr(self, name.split(".", 1)[1]) for name in CALLS}

    def init(self, p: dict) -> None:
        from radixserve.distributed import get_parallel_state
        from radixserve.hicache.host_pool import HostKVPool
        from radixserve.hicache.secret import storage_secret
        from radixserve.hicache.storage_io import StorageIO
        from radixserve.options import options_for

        args, kv = self.args, self.runner.kv_pool
        self.host = HostKVPool(kv, int(p["num_pages"]), args.hicache_io_backend)
        if p.get("fingerprint") is None:
            return
        ps = get_parallel_state()
        self.tag = rank_tag(ps.rank, ps.tp_size, ps.pp_size)
        extra = args.hicache_extra_config()
        entry = self.registry.resolve("cache_tier", args.hicache_storage_backend, flag="--hicache-storage-backend")
        ctx = CacheTierContext(args=args, extra_config=extra, model_key=layout_salt(p["fingerprint"], kv, self.runner,
                                                                                    self.tag),
                               page_size=kv.page_size, page_bytes=HEADER_BYTES + self.host.page_bytes,
                               options=options_for(args, entry))
        self.storage = StorageIO(entry.factory(ctx), ctx, args.hicache_storage_backend, self.host.page_bytes,
                                 mac=mac_key(storage_secret(args, extra)),
                                 close_timeout=args.hicache_storage_shutdown_timeout, key_tag=self.tag)

    def backup(self, values: list) -> None:
        dev, host, keys = values
        self.host.backup(list(dev), list(host))
        if self.storage is not None and keys:
            self.storage.store(list(keys), [self.host.payload(h) for h in host])

    def load(self, values: list) -> None:
        host, dev = values
        self.host.load(list(host), list(dev))

    def take(self, p: dict) -> int:
        """Read ``keys`` from this rank's storage into ``host_pages``; how many, from the first."""
        if self.storage is None:
            return 0
        payloads, _ = self.storage.fetch_now(list(p["keys"]))
        n = min(len(payloads), len(p["host_pages"]))
        for hp, data in zip(p["host_pages"][:n], payloads[:n]):
            self.host.set_payload(int(hp), data)
        return n

    def close(self, _payload=None) -> None:
        if self.storage is not None:
            self.storage.close()
            self.storage = None


class RankMirror:
    """Rank 0's handle on the followers' HiCache (through the replica's StepDriver)."""

    def __init__(self, driver, num_pages: int, fingerprint: str | None) -> None:
        self.driver = driver
        self._none = {name: (lambda _p: None) for name in CALLS}  # rank 0's own copies are the cache's
        driver.call("hicache.init", {"num_pages": num_pages, "fingerprint": fingerprint}, self._none)

    def backup(self, dev_pages: list[int], host_pages: list[int], keys: list[str] | None) -> None:
        self.driver.defer("hicache.backup", list(dev_pages), list(host_pages), list(keys or []))

    def load(self, host_pages: list[int], dev_pages: list[int]) -> None:
        self.driver.defer("hicache.load", list(host_pages), list(dev_pages))

    def take(self, keys: list[str], host_pages: list[int], have: int) -> int:
        """How many of ``host_pages`` (rank 0 holds ``have`` of them) every rank filled."""
        replies = self.driver.call("hicache.take", {"keys": keys, "host_pages": host_pages},
                                   {"hicache.take": lambda _p: have})
        return min(int(n) for n in replies)

    def close(self) -> None:
        try:
            self.driver.call("hicache.close", None, self._none)
        except Exception as e:  # noqa: BLE001 - a replica already failed has nothing to flush
            logger.warning("HiCache: the other ranks' storage writes could not be flushed: %s", e)
