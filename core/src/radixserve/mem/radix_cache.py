"""RadixAttention's prefix cache: a radix tree over token ids whose nodes own KV pages.

Keys are page aligned: a node's key is a whole number of pages of token ids and its value
is the list of pages holding their K/V, one page per ``page_size`` tokens. A request that
starts with a cached prefix reuses those pages instead of recomputing them.

Safety rules:

* Pages returned by :meth:`match_prefix` are valid only while the returned node is locked
  (:meth:`inc_lock_ref`); a locked node and its ancestors are never evicted.
* After :meth:`insert` the tree owns the inserted pages. Pages the caller passed for a part
  that was already cached are *not* taken; the caller frees them (insert says how many).
* :meth:`evict` frees only pages of unlocked leaves, least recently used first, back to
  the page allocator.

:class:`NullPrefixCache` has the same interface and caches nothing
(``--disable-radix-cache``), so callers never branch on whether caching is on.
"""

from __future__ import annotations

import heapq
import itertools
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from radixserve.mem.kv_pool import PageAllocator, ReqToTokenPool

if TYPE_CHECKING:
    from radixserve.engine.request import Req

_tick = itertools.count()


def _now() -> tuple[float, int]:
    return (time.monotonic(), next(_tick))


@dataclass(eq=False)
class TreeNode:
    key: list[int] = field(default_factory=list)  # token ids, a multiple of page_size long
    pages: list[int] = field(default_factory=list)  # len(key) // page_size pages
    parent: TreeNode | None = None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)  # first page of key -> child
    lock_ref: int = 0
    last_access: tuple[float, int] = field(default_factory=_now)
    # HiCache (radixserve.hicache.hiradix_cache): a copy in the host tier (None: none), the
    # content key of each page (None: no storage tier), admissions that reused the node.
    # ``pages == []`` with host pages set: the node lives on the host only.
    host_pages: list[int] | None = None
    hashes: list[str] | None = None
    hit_count: int = 0
    loaded_from_host: bool = False  # its device pages were loaded back and no admission has counted them yet

    @property
    def is_leaf(self) -> bool:
        return not self.children


@dataclass
class MatchResult:
    pages: list[int]  # KV pages (on the device) of the matched prefix, in order
    node: TreeNode  # deepest node of the match on the device (lock it while the pages are in use)
    num_tokens: int  # len(pages) * page_size
    # HiCache: the prefix continues below the device (host memory) for this many more
    # tokens, down to ``lower_node``; :meth:`BasePrefixCache.load_back` brings them up.
    lower_tokens: int = 0
    lower_node: TreeNode | None = None
    loaded_tokens: int = 0  # of ``num_tokens``: brought up from the host by this match's load_back


class BasePrefixCache(ABC):
    """Interface shared by the radix cache, the null cache and the hierarchical cache
    (:class:`radixserve.hicache.hiradix_cache.HiRadixCache`).

    The cache owns the caching *policy*: what of a request enters the tree when it
    finishes, is retracted or completes a prefill chunk, and the hand-over of its lock
    (:meth:`cache_finished_req`, :meth:`cache_unfinished_req`). The scheduler only asks
    for matches, locks what it uses and calls those two at the right moments; a cache with
    more tiers is a subclass, not a scheduler change. The hooks below the core methods
    (:meth:`load_back`, :meth:`on_request_queued`, ...) are no-ops for a one-tier cache."""

    page_size: int
    root: TreeNode
    enabled: bool = True  # False for the null cache: callers keep ownership of their pages
    allocator: PageAllocator
    req_to_token_pool: ReqToTokenPool | None = None

    @abstractmethod
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of ``token_ids``."""

    @abstractmethod
    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """Take ownership of ``pages`` as the KV of ``token_ids``; returns how many leading
        pages were already cached (those stay the caller's)."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect ``node`` and its ancestors from eviction."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one :meth:`inc_lock_ref`."""

    @abstractmethod
    def evict(self, num_pages: int) -> int:
        """Free up to ``num_pages`` unlocked pages; returns how many were freed."""

    @property
    @abstractmethod
    def evictable_pages(self) -> int:
        """Pages held by unlocked nodes."""

    @property
    @abstractmethod
    def total_pages(self) -> int:
        """Pages held by the cache."""

    @abstractmethod
    def reset(self) -> None:
        """Drop everything cached (nothing may be locked)."""

    @abstractmethod
    def all_pages(self) -> list[int]:
        """Every page the cache owns (for the idle invariant)."""

    # ---------------------------------------------------------------- policy
    def cache_finished_req(self, req: Req) -> None:
        """``req`` finished or is retracted: the full pages of its computed tokens enter the
        tree, it lets go of every page and of its lock."""
        pages = req.pages
        num_pages, existing = self._insert_req(req)
        self.allocator.free(pages[num_pages:])
        self.dec_lock_ref(req.prefix_node)
        req.pages, req.num_tree_pages, req.prefix_node = [], 0, None

    def cache_unfinished_req(self, req: Req) -> None:
        """``req`` computed more tokens and goes on (between prefill chunks, after its
        prompt): their full pages enter the tree so that others reuse them now; ``req``
        keeps using them, locked through the deeper node, and keeps its partial last page."""
        num_pages, existing = self._insert_req(req)
        tokens = req.cache_ids[:num_pages * self.page_size]
        match = self.match_prefix(tokens)
        duplicates = existing > req.num_tree_pages
        req.pages[:num_pages] = match.pages
        if duplicates and self.req_to_token_pool is not None:
            self.req_to_token_pool.write(req.req_pool_idx, req.pages, self.page_size,
                                         req.num_tree_pages * self.page_size, existing * self.page_size)
        self.inc_lock_ref(match.node)
        self.dec_lock_ref(req.prefix_node)
        req.prefix_node, req.num_tree_pages = match.node, num_pages

    def _insert_req(self, req: Req) -> tuple[int, int]:
        """Insert the full pages of ``req``'s computed tokens; free the pages it computed
        for a prefix that someone else cached meanwhile. Returns (its full pages, pages the
        tree already had)."""
        page = self.page_size
        num_pages = req.kv_len // page
        existing = self.insert(req.cache_ids[:num_pages * page], req.pages[:num_pages]) if num_pages else 0
        duplicates = req.pages[req.num_tree_pages:existing]
        if duplicates:
            self.allocator.free(duplicates)
        return num_pages, existing

    # ------------------------------------------------- lower tiers (HiCache)
    def load_back(self, match: MatchResult) -> MatchResult:
        """Bring the part of ``match`` below the device up into device pages (called at
        admission, before the request runs); returns the match extended by what fit."""
        return match

    def on_admit(self, req: Req, match: MatchResult) -> None:  # noqa: B027 - no-op hook for one tier
        """``req`` was admitted with ``match`` as its cached prefix (count the hit per tier)."""

    def on_request_queued(self, req: Req) -> None:  # noqa: B027 - no-op hook for one tier
        """A request entered the waiting queue (start fetching its prefix from storage)."""

    def prefetch_ready(self, req: Req) -> bool:
        """Whether ``req`` may be admitted now as far as fetching its prefix goes."""
        return True

    def wait_prefetch(self, timeout: float) -> None:  # noqa: B027
        """Block until some pending fetch finishes or ``timeout`` passes (an idle scheduler
        with only requests waiting for storage)."""

    def ready_for_forward(self) -> None:  # noqa: B027
        """Wait for copies into device pages that the next forward reads."""

    def on_request_done(self, req: Req) -> None:  # noqa: B027
        """``req`` left the engine (finished, failed or aborted)."""

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:  # noqa: B027
        """A prefill step computed ``num_tokens`` prompt tokens in ``seconds`` (what
        recomputing a prefix costs, against which loading it from storage is weighed)."""

    def stats(self) -> dict:
        """Numbers for ``get_stats()``."""
        return {}

    def invariant_problems(self) -> list[str]:
        """What is wrong with the lower tiers' bookkeeping (the idle invariant); [] if nothing."""
        return []

    def close(self) -> None:  # noqa: B027
        """Finish pending writes, release threads, files and connections (engine shutdown)."""


class RadixCache(BasePrefixCache):
    def __init__(self, allocator: PageAllocator, page_size: int,
                 req_to_token_pool: ReqToTokenPool | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.req_to_token_pool = req_to_token_pool
        self.reset()

    # ------------------------------------------------------------ helpers
    def _page_key(self, token_ids: list[int], start: int = 0) -> tuple[int, ...]:
        return tuple(token_ids[start:start + self.page_size])

    def _common_len(self, key: list[int], token_ids: list[int], start: int) -> int:
        """Matching tokens of ``key`` and ``token_ids[start:]``, rounded down to whole pages."""
        n = min(len(key), len(token_ids) - start)
        i = 0
        while i < n and key[i] == token_ids[start + i]:
            i += 1
        return i - i % self.page_size

    def _split(self, node: TreeNode, at: int) -> TreeNode:
        """Split ``node`` so that its first ``at`` tokens become a new parent; return it."""
        pages_at = at // self.page_size
        parent = TreeNode(key=node.key[:at], pages=node.pages[:pages_at], parent=node.parent,
                          lock_ref=node.lock_ref, last_access=node.last_access, hit_count=node.hit_count,
                          loaded_from_host=node.loaded_from_host)
        parent.children[self._page_key(node.key, at)] = node
        node.parent.children[self._page_key(node.key)] = parent
        node.key, node.pages, node.parent = node.key[at:], node.pages[pages_at:], parent
        if node.host_pages is not None:
            parent.host_pages, node.host_pages = node.host_pages[:pages_at], node.host_pages[pages_at:]
        if node.hashes is not None:
            parent.hashes, node.hashes = node.hashes[:pages_at], node.hashes[pages_at:]
        return parent

    # ---------------------------------------------------------- interface
    def _walk(self, token_ids: list[int]):
        """Descend the tree along ``token_ids`` (whole pages), splitting a node where the
        match ends inside it and stamping each visited node; yields ``(node, tokens
        matched up to the end of node)``."""
        node, pos = self.root, 0
        stamp = _now()
        node.last_access = stamp
        while len(token_ids) - pos >= self.page_size:
            child = node.children.get(self._page_key(token_ids, pos))
            if child is None:
                return
            n = self._common_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            pos += n
            yield child, pos
            node = child

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        """The longest cached page-aligned prefix of ``token_ids``."""
        node, pos, pages = self.root, 0, []
        for node, pos in self._walk(token_ids):  # noqa: B007 - the last node and position are the match
            pages.extend(node.pages)
        return MatchResult(pages, node, pos)

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        """Cache ``pages`` as the KV of ``token_ids`` (page aligned, ``len(pages)`` pages).

        Returns how many leading pages were already cached; the caller still owns (and
        must free or keep using the tree's copy of) exactly those pages of its list.
        """
        if len(token_ids) != len(pages) * self.page_size:
            raise ValueError(f"insert: {len(token_ids)} tokens for {len(pages)} pages of {self.page_size}")
        node, pos = self.root, 0
        stamp = _now()
        while pos < len(token_ids):
            child = node.children.get(self._page_key(token_ids, pos))
            if child is None:
                new = TreeNode(key=list(token_ids[pos:]), pages=list(pages[pos // self.page_size:]),
                               parent=node, last_access=stamp)
                node.children[self._page_key(token_ids, pos)] = new
                self._total += len(new.pages)
                self._evictable += len(new.pages)
                return pos // self.page_size
            n = self._common_len(child.key, token_ids, pos)
            if n < len(child.key):
                child = self._split(child, n)
            child.last_access = stamp
            pos += n
            node = child
        return len(pages)

    def inc_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.pages)
            node.lock_ref += 1
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError("dec_lock_ref on an unlocked node")
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._evictable += len(node.pages)
            node = node.parent

    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages from unlocked leaves, LRU first (fewer if
        not that many are evictable). Returns the number freed."""
        heap = [(n.last_access, id(n), n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_pages and heap:
            _, _, node = heapq.heappop(heap)
            self.allocator.free(node.pages)
            freed += len(node.pages)
            self._total -= len(node.pages)
            self._evictable -= len(node.pages)
            parent = node.parent
            del parent.children[self._page_key(node.key)]
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def _leaves(self):
        stack = [self.root]
        while stack:
            node = stack.pop()
            if node.is_leaf and node is not self.root:
                yield node
            stack.extend(node.children.values())

    @property
    def evictable_pages(self) -> int:
        return self._evictable

    @property
    def total_pages(self) -> int:
        return self._total

    def reset(self) -> None:
        """Drop every cached page (only valid with nothing locked); returns them to the allocator."""
        if getattr(self, "root", None) is not None:
            # A lock also holds every ancestor, so a locked tree has a locked child of the root.
            # Check before freeing anything: a refused reset must leave the tree intact.
            if any(child.lock_ref for child in self.root.children.values()):
                raise RuntimeError("reset with locked nodes: requests are still running")
            stack = list(self.root.children.values())
            while stack:
                node = stack.pop()
                self.allocator.free(node.pages)
                stack.extend(node.children.values())
        self.root = TreeNode(lock_ref=1)
        self._total = 0
        self._evictable = 0

    def all_pages(self) -> list[int]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.extend(node.pages)
            stack.extend(node.children.values())
        return out


class NullPrefixCache(BasePrefixCache):
    """``--disable-radix-cache``: matches nothing, keeps nothing."""

    enabled = False

    def __init__(self, allocator: PageAllocator, page_size: int,
                 req_to_token_pool: ReqToTokenPool | None = None) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.req_to_token_pool = req_to_token_pool
        self.root = TreeNode(lock_ref=1)

    def cache_finished_req(self, req: Req) -> None:
        self.allocator.free(req.pages)
        req.pages = []

    def cache_unfinished_req(self, req: Req) -> None:
        pass  # nothing is shared: the request keeps its pages

    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        return MatchResult([], self.root, 0)

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        return len(pages)  # "already cached": the caller keeps ownership and frees them

    def inc_lock_ref(self, node: TreeNode) -> None:
        pass

    def dec_lock_ref(self, node: TreeNode) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def total_pages(self) -> int:
        return 0

    def reset(self) -> None:
        pass

    def all_pages(self) -> list[int]:
        return []
