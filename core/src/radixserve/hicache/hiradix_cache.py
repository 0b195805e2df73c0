"""HiRadixCache: the radix cache over three tiers, device -> host memory -> storage.

Every tree node knows where its pages live: ``node.pages`` on the device (``[]`` when it
was evicted from there), ``node.host_pages`` in the host pool (``None`` when it has no host
copy), and, with a storage tier, ``node.hashes``, the content key of each page. Nodes on
the device form a subtree that contains the root (a node is on the device only if its
parent is), so a match is a device part followed by a host part.

* **Demotion instead of dropping.** Evicting a device leaf that has a host copy frees only
  its device pages; the node stays in the tree, on the host. Without a host copy it is
  dropped (``write_back`` copies it to the host first). Host pages are reclaimed from
  host-only leaves, least recently used first; those pages may still be in storage.
* **Write policy** (``--hicache-write-policy``): ``write_through`` copies every node to the
  host when it enters the tree, ``write_back`` when it is evicted from the device,
  ``write_through_selective`` once it has been reused ``WRITE_THROUGH_THRESHOLD`` times.
  Pages reaching the host are also written to the storage tier.
* **Load back.** At admission (:meth:`load_back`) the host part of a request's match is
  copied into fresh device pages before the request runs.
* **Prefetch** (:meth:`on_request_queued`): a queued request's pages beyond the tree are
  looked up in storage by content key on the storage thread; what arrives becomes
  host-only nodes. ``--hicache-storage-prefetch-policy`` says how long admission waits:
  ``auto`` (the default) weighs the two ways of getting that prefix, loading it (the
  storage tier's measured read rate) against recomputing it (the engine's measured
  prefill rate, :meth:`observe_prefill`), and waits as long as recomputing would take
  when loading is estimated cheaper, not at all when it is not; before either rate is
  measured it waits as the ``timeout`` policy does. ``best_effort`` never waits,
  ``wait_complete`` always does, ``timeout`` up to ``prefetch_timeout_base +
  prefetch_timeout_per_ki_token * tokens / 1024`` seconds.

Device <-> host copies run on one I/O worker thread (in order), storage on another; the
scheduler waits for loads before the next forward (:meth:`ready_for_forward`) and for
pending copies before it frees any page a copy may still read or write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from radixserve.hicache import (
    TierCounters,
    page_keys,
)
from radixserve.hicache.host_pool import HostKVPool
from radixserve.hicache.prefetch import StoragePrefetch, _Prefetch
from radixserve.hicache.storage_io import RateMeter, StorageIO, _per_second
from radixserve.kernels import cpu as cpu_kernels
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.mem.radix_cache import MatchResult, RadixCache, TreeNode, _now

logger = logging.getLogger(__name__)

WRITE_THROUGH_THRESHOLD = 2  # write_through_selective: admissions that reuse a node before it is copied
DEFAULT_PREFETCH_TIMEOUT_BASE = 1.0  # seconds (timeout policy), as SGLang's extra-config keys
DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN = 0.25


class HiRadixCache(StoragePrefetch, RadixCache):
    def __init__(self, kv_pool: KVPool, req_to_token_pool: ReqToTokenPool, host_pool: HostKVPool, *,
                 write_policy: str = "write_through", storage: StorageIO | None = None,
                 prefetch_policy: str = "auto", prefetch_timeout_base: float = DEFAULT_PREFETCH_TIMEOUT_BASE,
                 prefetch_timeout_per_ki_token: float = DEFAULT_PREFETCH_TIMEOUT_PER_KI_TOKEN,
                 prefetch_min_pages: int = 1, mirror=None) -> None:
        self.kv_pool = kv_pool
        self.mirror = mirror  # tp > 1: the other ranks repeat every copy (radixserve.hicache.mirror)
        self.host = host_pool
        self.write_policy = write_policy
        self.storage = storage
        self.prefetch_policy = prefetch_policy
        self.prefetch_timeout_base = prefetch_timeout_base
        self.prefetch_timeout_per_ki_token = prefetch_timeout_per_ki_token
        self.prefetch_min_pages = prefetch_min_pages
        self.prefill = RateMeter()  # seconds per prompt token the engine computes (auto policy)
        self.prefetch_waits = 0  # auto policy: fetches a request was held back for
        self.prefetch_skips = 0  # auto policy: fetches estimated slower than recomputing
        self.io = ThreadPoolExecutor(1, thread_name_prefix="radixserve-hicache-io")
        self._io_pending: list[Future] = []
        self._loads: list[Future] = []
        self._pinned: set[int] = set()  # ids of host-only nodes being loaded (never host-evicted)
        self._prefetch: dict[str, _Prefetch] = {}  # queued requests' fetches, by rid
        self._detached: list[_Prefetch] = []  # fetches whose request stopped waiting
        self.host_counters = TierCounters()
        self._closed = False
        self.device_hit_tokens = 0
        self.demoted_pages = 0
        self.dropped_pages = 0
        self.backup_skipped_pages = 0
        super().__init__(kv_pool.allocator, kv_pool.page_size, req_to_token_pool)

    # ------------------------------------------------------------ the walk
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix over device and host: the device part's
        pages and deepest node, and how far the host part goes beyond it."""
        pages, pos = [], 0
        dev_node, dev_pos = self.root, 0
        node = self.root
        for node, pos in self._walk(token_ids):
            if node.pages:
                pages.extend(node.pages)
                dev_node, dev_pos = node, pos
        return MatchResult(pages, dev_node, dev_pos, lower_tokens=pos - dev_pos,
                           lower_node=node if pos > dev_pos else None)

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """As :meth:`RadixCache.insert`; a host-only node on the path takes the caller's
        pages (it is on the device again) instead of counting as cached."""
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(token_ids)} tokens for {len(pages)} pages of {self.page_size}")
        page = self.page_size
        node, pos = self.root, 0
        existing = None
        stamp = _now()
        while pos < len(token_ids):
            child = node.children.get(self._page_key(token_ids, pos))
            if child is None:
                new = TreeNode(key=list(token_ids[pos:]), pages=list(pages[pos // page:]), parent=node,
                               last_access=stamp, hashes=self._hashes_after(node, token_ids[pos:]))
                node.children[self._page_key(token_ids, pos)] = new
                self._total += len(new.pages)
                self._evictable += len(new.pages)
                if self.write_policy == "write_through":
                    self._backup(new)
                return pos // page if existing is None else existing
            n = self._common_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            if not child.pages:  # on the host only: the caller's pages bring it back
                if existing is None:
                    existing = pos // page
                child.pages = list(pages[pos // page:(pos + n) // page])
                self._total += len(child.pages)
                self._evictable += len(child.pages)  # host-only nodes are never locked
            pos += n
            node = child
        return len(pages) if existing is None else existing

    def _hashes_after(self, parent: TreeNode, token_ids: Sequence[int]) -> list[str] | None:
        if self.storage is None:
            return None
        prev = parent.hashes[-1] if parent is not self.root and parent.hashes else None
        return page_keys(self.storage.salt, token_ids, self.page_size, prev)

    # --------------------------------------------------------- transfers
    def _submit_io(self, fn: Callable[[], None]) -> Future:
        self._io_pending = [f for f in self._io_pending if not f.done()]
        cpu = self.kv_pool.device.type == "cpu"  # the io thread's OpenMP workers go back after each copy
        fut = self.io.submit(cpu_kernels.run_and_release, fn) if cpu else self.io.submit(fn)
        self._io_pending.append(fut)
        return fut

    def _wait_io(self) -> None:
        """Every queued copy has run (before a page that a copy reads or writes is freed)."""
        pending, self._io_pending = self._io_pending, []
        for f in pending:
            f.result()

    def _backup(self, node: TreeNode, sync: bool = False) -> bool:
        """Copy ``node``'s device pages to new host pages (and on to storage)."""
        if node.host_pages is not None or not node.pages:
            return node.host_pages is not None
        host_pages = self._alloc_host(len(node.pages))
        if host_pages is None:
            self.backup_skipped_pages += len(node.pages)
            return False
        node.host_pages = host_pages
        dev = list(node.pages)
        keys = list(node.hashes) if (self.storage is not None and node.hashes) else None
        storage, host, counters = self.storage, self.host, self.host_counters
        if self.mirror is not None:
            self.mirror.backup(dev, host_pages, keys)

        def job() -> None:
            host.backup(dev, host_pages)
            counters.store_pages += len(dev)
            counters.store_bytes += len(dev) * host.page_bytes
            if keys is not None:
                storage.store(keys, [host.payload(p) for p in host_pages])

        fut = self._submit_io(job)
        if sync:
            fut.result()
        return True

    def _alloc_host(self, n: int) -> list[int] | None:
        alloc = self.host.allocator
        if alloc.num_free_pages < n:
            self._evict_host(n - alloc.num_free_pages)
        return alloc.allocate(n) if alloc.can_allocate(n) else None

    def _evict_host(self, num_pages: int) -> int:
        """Free host pages of host-only leaves, least recently used first."""
        import heapq

        self._wait_io()
        heap = [(n.last_access, id(n), n) for n in self._all_nodes()
                if not n.pages and not n.children and id(n) not in self._pinned]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            freed += self._delete(node)
            parent = node.parent
            if (parent is not self.root and not parent.pages and not parent.children
                    and id(parent) not in self._pinned):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _delete(self, node: TreeNode) -> int:
        """Remove ``node`` and its subtree (host-only below a device node); returns the
        host pages freed. Device pages of ``node`` itself are the caller's business."""
        freed = 0
        stack = [node]
        while stack:
            n = stack.pop()
            if n.host_pages:
                self.host.allocator.free(n.host_pages)
                freed += len(n.host_pages)
                n.host_pages = None
            stack.extend(n.children.values())
        del node.parent.children[self._page_key(node.key)]
        return freed

    # ------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> int:
        """Free device pages of unlocked device leaves, least recently used first: nodes
        with a host copy stay in the tree on the host, the others are dropped."""
        import heapq

        self._wait_io()
        heap = [(n.last_access, id(n), n) for n in self._device_leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            if node.host_pages is None and self.write_policy == "write_back":
                self._backup(node, sync=True)
            num = len(node.pages)
            self.allocator.free(node.pages)
            freed += num
            self._total -= num
            self._evictable -= num
            node.pages = []
            node.loaded_from_host = False
            if node.host_pages is not None:
                self.demoted_pages += num
            else:
                self.dropped_pages += num
                self._delete(node)
            parent = node.parent
            if (parent is not self.root and parent.lock_ref == 0 and parent.pages
                    and not any(c.pages for c in parent.children.values())):
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _device_leaves(self):
        for n in self._all_nodes():
            if n.pages and not any(c.pages for c in n.children.values()):
                yield n

    def _all_nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    # ----------------------------------------------------------- load back
    def load_back(self, match: MatchResult) -> MatchResult:
        """Copy the host part of ``match`` into device pages (as much as fits, from the
        top)."""
        if not match.lower_tokens:
            return match
        path = []
        node = match.lower_node
        while node is not match.node:
            path.append(node)
            node = node.parent
        path.reverse()
        need = sum(len(n.host_pages) for n in path)
        self.inc_lock_ref(match.node)
        self._pinned = {id(n) for n in path}
        try:
            if self.allocator.num_free_pages < need:
                self.evict(need - self.allocator.num_free_pages)
            room = self.allocator.num_free_pages
            take = []
            for n in path:
                if len(n.host_pages) > room:
                    break
                take.append(n)
                room -= len(n.host_pages)
            if not take:
                return match
            src = [p for n in take for p in n.host_pages]
            dev = self.allocator.allocate(len(src))
            off = 0
            for n in take:
                n.pages = dev[off:off + len(n.host_pages)]
                n.loaded_from_host = True
                off += len(n.pages)
            self._total += len(dev)
            self._evictable += len(dev)
            host, counters = self.host, self.host_counters
            if self.mirror is not None:
                self.mirror.load(src, dev)
            t0 = time.monotonic()

            def job() -> None:
                host.load(src, dev)
                counters.load_seconds += time.monotonic() - t0
                counters.num_loads += 1

            self._loads.append(self._submit_io(job))
            counters.hit_pages += len(dev)
            counters.load_bytes += len(dev) * host.page_bytes
        finally:
            self._pinned = set()
            self.dec_lock_ref(match.node)
        rest = match.lower_tokens - off * self.page_size
        return MatchResult(match.pages + dev, take[-1], match.num_tokens + off * self.page_size,
                           lower_tokens=rest, lower_node=match.lower_node if rest else None,
                           loaded_tokens=off * self.page_size)

    @property
    def host_capacity_tokens(self) -> int:
        """Tokens of KV the host tier holds when full."""
        return self.host.num_pages * self.page_size

    def on_admit(self, req, match: MatchResult) -> None:
        """Count the hit per tier (first admissions only, as ``cached_tokens`` does);
        ``write_through_selective`` copies a node to the host
        once admissions have reused it ``WRITE_THROUGH_THRESHOLD`` times."""
        from_host = 0
        node = match.node
        while node is not self.root:
            if node.loaded_from_host:  # brought up for this request (maybe a step before it fit)
                from_host += len(node.key)
                node.loaded_from_host = False
            if self.write_policy == "write_through_selective":
                node.hit_count += 1
                if node.hit_count >= WRITE_THROUGH_THRESHOLD:
                    self._backup(node)
            node = node.parent
        if req is None or req.num_retractions == 0:  # a retracted request's re-admission is not a new hit
            self.device_hit_tokens += match.num_tokens - from_host
            self.host_counters.hit_tokens += from_host

    def ready_for_forward(self) -> None:
        loads, self._loads = self._loads, []
        for f in loads:
            f.result()
        self._poll_detached()

    # ------------------------------------------------------------ lifecycle
    def reset(self) -> None:
        if getattr(self, "root", None) is not None:
            if any(child.lock_ref for child in self.root.children.values()):
                raise RuntimeError("reset with locked nodes: requests are still running")
            self._wait_io()
            for n in list(self._all_nodes()):
                if n.pages:
                    self.allocator.free(n.pages)
                if n.host_pages:
                    self.host.allocator.free(n.host_pages)
        self.root = TreeNode(lock_ref=1)
        self._total = 0
        self._evictable = 0

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._wait_io()
        finally:
            self.io.shutdown(wait=True)
            if self.mirror is not None:
                self.mirror.close()
            if self.storage is not None:
                self.storage.close()

    def invariant_problems(self) -> list[str]:
        problems = []
        if self._loads:
            problems.append("pages loaded back for a forward that never ran")
        self._wait_io()  # backups may still be copying while idle; let them land
        host_pages = [p for n in self._all_nodes() if n.host_pages for p in n.host_pages]
        free = self.host.allocator._free
        if len(host_pages) + len(free) != self.host.num_pages:
            problems.append(f"{self.host.num_pages - len(host_pages) - len(free)} host KV pages leaked "
                            f"({len(free)} free + {len(host_pages)} cached of {self.host.num_pages})")
        if len(set(host_pages)) != len(host_pages) or set(host_pages) & set(free) or len(set(free)) != len(free):
            problems.append("a host page is both free and cached, cached twice or freed twice")
        for n in self._all_nodes():
            if n.pages and n.parent is not self.root and not n.parent.pages:
                problems.append("a node on the device under a node that is not")
                break
            if not n.pages and n.host_pages is None:
                problems.append("a node with its pages in no tier")
                break
        if self._prefetch:
            problems.append(f"{len(self._prefetch)} prefetches of requests no longer queued")
        return problems

    def stats(self) -> dict:
        h = self.host_counters
        used = self.host.num_pages - self.host.allocator.num_free_pages
        out = {
            "hicache_device_hit_tokens": self.device_hit_tokens,
            "hicache_host_hit_tokens": h.hit_tokens,
            "hicache_host_load_bytes": h.load_bytes,
            "hicache_host_load_seconds": h.load_seconds,
            "hicache_host_num_loads": h.num_loads,
            "hicache_host_backup_pages": h.store_pages,
            "hicache_host_backup_bytes": h.store_bytes,
            "hicache_host_backup_skipped_pages": self.backup_skipped_pages,
            "hicache_host_pages": self.host.num_pages,
            "hicache_host_used_pages": used,
            "hicache_demoted_pages": self.demoted_pages,
            "hicache_dropped_pages": self.dropped_pages,
        }
        if self.storage is not None:
            s = self.storage.counters
            out.update({
                "hicache_storage_hit_tokens": s.hit_tokens,
                "hicache_storage_load_bytes": s.load_bytes,
                "hicache_storage_load_seconds": s.load_seconds,
                "hicache_storage_num_loads": s.num_loads,
                "hicache_storage_store_pages": s.store_pages,
                "hicache_storage_store_bytes": s.store_bytes,
                "hicache_storage_errors": s.errors,
                "hicache_storage_skipped_pages": self.storage.skipped_pages,
                "hicache_storage_prefetch_waits": self.prefetch_waits,
                "hicache_storage_prefetch_skips": self.prefetch_skips,
                "hicache_storage_read_bytes_per_second": _per_second(self.storage.reads),
                "hicache_prefill_tokens_per_second": _per_second(self.prefill),
            })
            try:
                out.update({f"hicache_storage_{k}": v for k, v in self.storage.tier.stats().items()})
            except Exception:  # noqa: BLE001
                logger.exception("HiCache storage tier: stats() raised")
        return out
