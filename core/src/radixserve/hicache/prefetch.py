"""HiCache's prefetch from the storage tier (a part of :class:`~radixserve.hicache.hiradix_cache.HiRadixCache`):
a queued request's pages beyond the tree are fetched by content key on the storage thread,
what arrives becomes host-only nodes, and ``--hicache-storage-prefetch-policy`` says how long
admission waits for them (see the HiRadixCache module docstring)."""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field

from radixserve.hicache import page_keys
from radixserve.mem.radix_cache import TreeNode

logger = logging.getLogger(__name__)

# prefill steps shorter than this do not count toward the prefill rate: a step's fixed cost
# (a decode step's worth) would pass for the cost of its few tokens
MIN_PREFILL_SAMPLE_TOKENS = 128


@dataclass
class _Prefetch:
    rid: str
    ids: list[int]  # whole pages of the request's prompt
    start: int  # tokens already in the tree when it was queued
    keys: list[str]  # content keys of the pages after ``start``
    deadline: float
    future: Future
    t0: float = field(default_factory=time.monotonic)
    waited: bool = False  # admission held the request back for it at least once


class StoragePrefetch:
    """The prefetch methods of HiRadixCache; they use its tree, host pool and storage."""

    def on_request_queued(self, req) -> None:
        if self.storage is None:
            return
        page = self.page_size
        ids = req.cache_ids[:-1]  # the last token is always computed
        whole = len(ids) - len(ids) % page
        match = self.match_prefix(ids)
        start = match.num_tokens + match.lower_tokens
        if (whole - start) // page < self.prefetch_min_pages:
            return
        last = match.lower_node or match.node
        prev = last.hashes[-1] if last is not self.root and last.hashes else None
        keys = page_keys(self.storage.salt, ids[start:whole], page, prev)
        old = self._prefetch.pop(req.rid, None)
        if old is not None:
            self._detached.append(old)
        wait = self._prefetch_wait(whole - start)
        self._prefetch[req.rid] = _Prefetch(req.rid, list(ids[:whole]), start, keys, time.monotonic() + wait,
                                            self.storage.submit_fetch(keys))

    def _prefetch_wait(self, num_tokens: int) -> float:
        """Seconds admission may wait for a fetch of ``num_tokens`` tokens (``timeout`` and
        ``auto``; see the module docstring)."""
        timeout = self.prefetch_timeout_base + self.prefetch_timeout_per_ki_token * num_tokens / 1024
        if self.prefetch_policy != "auto":
            return timeout
        recompute = self.prefill.estimate(num_tokens)
        if recompute is None:
            return timeout
        load = self.storage.estimate_read_seconds(num_tokens // self.page_size)
        if load is not None and load >= recompute:
            self.prefetch_skips += 1
            return 0.0
        return recompute

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        if num_tokens >= MIN_PREFILL_SAMPLE_TOKENS:
            self.prefill.observe(num_tokens, seconds)

    def prefetch_ready(self, req) -> bool:
        op = self._prefetch.get(req.rid)
        if op is None:
            return True
        if op.future.done():
            del self._prefetch[req.rid]
            self._finish_prefetch(op)
            return True
        if self.prefetch_policy == "wait_complete" or (self.prefetch_policy in ("timeout", "auto")
                                                        and time.monotonic() < op.deadline):
            if not op.waited:
                op.waited = True
                self.prefetch_waits += 1
            return False
        del self._prefetch[req.rid]  # best_effort, or its wait is over: go without it
        self._detached.append(op)
        return True

    def wait_prefetch(self, timeout: float) -> None:
        pending = [op.future for op in self._prefetch.values()]
        if pending:
            deadline = min(op.deadline for op in self._prefetch.values())
            if self.prefetch_policy in ("timeout", "auto"):
                timeout = max(0.0, min(timeout, deadline - time.monotonic()))
            wait_futures(pending, timeout=timeout, return_when="FIRST_COMPLETED")

    def on_request_done(self, req) -> None:
        op = self._prefetch.pop(req.rid, None)
        if op is not None:
            self._detached.append(op)

    def _poll_detached(self) -> None:
        if not self._detached:
            return
        still = []
        for op in self._detached:
            if op.future.done():
                self._finish_prefetch(op)
            else:
                still.append(op)
        self._detached = still

    def _finish_prefetch(self, op: _Prefetch) -> None:
        """Put what a fetch brought into the host tier as host-only nodes under the tree's
        current match of the request's prompt."""
        try:
            payloads, seconds = op.future.result()
        except Exception:  # noqa: BLE001 - StorageIO already catches tier errors
            logger.exception("HiCache: prefetch of %s failed", op.rid)
            return
        if not payloads:
            return
        page = self.page_size
        match = self.match_prefix(op.ids)
        have = match.num_tokens + match.lower_tokens
        end = op.start + len(payloads) * page
        if have < op.start or have >= end:
            return  # the tree lost the prefix it attaches to, or already has all of it
        first = (have - op.start) // page
        host_pages = self._alloc_host(len(payloads) - first)
        if host_pages is None:
            return
        for hp, data in zip(host_pages, payloads[first:]):
            self.host.set_payload(hp, data)
        if self.mirror is not None:  # every rank reads its own heads' pages: the shortest run counts
            n = self.mirror.take(op.keys[first:first + len(host_pages)], host_pages, len(host_pages))
            if n < len(host_pages):
                self.host.allocator.free(host_pages[n:])
                host_pages, payloads = host_pages[:n], payloads[:first + n]
                if not host_pages:
                    return
                end = op.start + len(payloads) * page
        parent = match.lower_node or match.node
        key = list(op.ids[have:end])
        node = TreeNode(key=key, pages=[], parent=parent, host_pages=host_pages,
                        hashes=list(op.keys[first:first + len(host_pages)]))
        parent.children[self._page_key(key)] = node
        c = self.storage.counters
        c.hit_pages += len(host_pages)
        c.hit_tokens += len(host_pages) * page
        c.load_bytes += len(host_pages) * self.storage.payload_bytes
        c.load_seconds += seconds
        c.num_loads += 1
