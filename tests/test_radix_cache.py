"""The radix prefix cache (``radixserve.mem.radix_cache``) against its contract.

Unit tests pin down each rule with hand-built trees at page sizes 1 and 4. A stateful
hypothesis test then runs random inserts, matches, locks, unlocks, evictions and resets
against a reference model: a dict from every cached page-aligned prefix (a token tuple)
to the page holding its last page of K/V. After every step the tree must hold exactly
the reference's prefixes on exactly the reference's pages, and no page may be lost or
owned twice between the tree and a real :class:`PageAllocator`.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radixserve.mem.kv_pool import PageAllocator
from radixserve.mem.radix_cache import NullPrefixCache, RadixCache, TreeNode

PAGE_SIZES = [1, 4]


# ---------------------------------------------------------------- helpers
def toks(ps: int, *labels: int) -> list[int]:
    """One page of ``ps`` distinct tokens per label: label 3 at ps=4 -> [30, 31, 32, 33]."""
    return [label * 10 + j for label in labels for j in range(ps)]


def make(ps: int, num_pages: int = 64) -> tuple[PageAllocator, RadixCache]:
    alloc = PageAllocator(num_pages, ps)
    return alloc, RadixCache(alloc, ps)


def put(cache: RadixCache, alloc: PageAllocator, ids: list[int]) -> tuple[list[int], int]:
    """Insert ``ids`` on fresh pages as a request would; free the already-cached ones."""
    pages = alloc.allocate(len(ids) // cache.page_size)
    num_cached = cache.insert(ids, pages)
    alloc.free(pages[:num_cached])
    return pages, num_cached


def path_key(cache: RadixCache, node: TreeNode) -> list[int]:
    """Token ids from the root down to ``node``; fails if ``node`` is detached."""
    parts = []
    while node is not cache.root:
        parent = node.parent
        assert parent is not None, "node has no parent but is not the root"
        assert parent.children.get(tuple(node.key[:cache.page_size])) is node, "node is detached"
        parts.append(node.key)
        node = parent
    return [t for key in reversed(parts) for t in key]


def nodes(cache: RadixCache) -> list[tuple[TreeNode, tuple[int, ...]]]:
    """Every non-root node with the token path down to (and including) it."""
    out, stack = [], [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for child in node.children.values():
            out.append((child, path + tuple(child.key)))
            stack.append((child, path + tuple(child.key)))
    return out


def tree_map(cache: RadixCache) -> dict[tuple[int, ...], int]:
    """Cached prefix -> page of its last page, checking the tree's structure on the way."""
    ps, out, stack = cache.page_size, {}, [(cache.root, ())]
    while stack:
        node, path = stack.pop()
        for first, child in node.children.items():
            assert child.parent is node, "child.parent does not point at its parent"
            assert child.key and len(child.key) % ps == 0, f"key of {len(child.key)} tokens, page size {ps}"
            assert len(child.pages) == len(child.key) // ps, "pages do not match the key length"
            assert first == tuple(child.key[:ps]), "child is not keyed by its first page of tokens"
            assert 0 <= child.lock_ref <= node.lock_ref or node is cache.root
            for i, page in enumerate(child.pages):
                out[path + tuple(child.key[:(i + 1) * ps])] = page
            stack.append((child, path + tuple(child.key)))
    return out


def check_counts(cache: RadixCache, alloc: PageAllocator) -> None:
    owned = cache.all_pages()
    assert len(owned) == len(set(owned)) == cache.total_pages
    assert cache.evictable_pages == sum(len(n.pages) for n, _ in nodes(cache) if n.lock_ref == 0)
    assert alloc.num_free_pages + cache.total_pages == alloc.num_usable_pages
    assert not set(owned) & set(alloc._free)  # no public view of the free list


# ------------------------------------------------------------ unit tests
@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_on_empty_tree(ps):
    alloc, cache = make(ps)
    for ids in ([], toks(ps, 1), toks(ps, 1, 2, 3)):
        res = cache.match_prefix(ids)
        assert (res.pages, res.num_tokens) == ([], 0) and res.node is cache.root
    assert cache.total_pages == cache.evictable_pages == 0 and cache.all_pages() == []


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_then_match_full_and_partial(ps):
    alloc, cache = make(ps)
    ids = toks(ps, 1, 2, 3)
    pages, num_cached = put(cache, alloc, ids)
    assert num_cached == 0 and cache.total_pages == cache.evictable_pages == 3

    res = cache.match_prefix(ids)
    assert (res.pages, res.num_tokens) == (pages, 3 * ps)
    assert path_key(cache, res.node) == ids
    # A longer query matches only what is cached.
    assert cache.match_prefix(ids + toks(ps, 4, 5)).pages == pages
    # A query ending part-way into a page rounds down to whole pages.
    res = cache.match_prefix(ids[:2 * ps + ps - 1])
    assert (res.pages, res.num_tokens) == (pages[:2], 2 * ps)
    # So does one diverging on the last token of the third page.
    diverged = ids[:3 * ps - 1] + [999]
    res = cache.match_prefix(diverged)
    assert (res.pages, res.num_tokens) == (pages[:2], 2 * ps)
    # Less than a page, or a different first page, matches nothing.
    assert cache.match_prefix(ids[:ps - 1]).num_tokens == 0
    assert cache.match_prefix(toks(ps, 2, 3)).num_tokens == 0
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_match_ending_inside_a_node_splits_it(ps):
    alloc, cache = make(ps)
    ids = toks(ps, 1, 2, 3, 4)
    pages, _ = put(cache, alloc, ids)
    (original,) = cache.root.children.values()
    assert original.key == ids and original.pages == pages

    res = cache.match_prefix(toks(ps, 1, 2, 9))
    assert res.num_tokens == 2 * ps and res.pages == pages[:2]
    top = res.node
    assert top.parent is cache.root and cache.root.children == {tuple(ids[:ps]): top}
    assert top.key == ids[:2 * ps] and top.pages == pages[:2]
    assert list(top.children) == [tuple(ids[2 * ps:3 * ps])]
    bottom = top.children[tuple(ids[2 * ps:3 * ps])]
    assert bottom is original and bottom.parent is top
    assert bottom.key == ids[2 * ps:] and bottom.pages == pages[2:]
    assert top.key + bottom.key == ids and top.pages + bottom.pages == pages
    # Splitting moves pages between nodes; it neither adds nor drops any.
    assert cache.total_pages == cache.evictable_pages == 4
    assert cache.match_prefix(ids).pages == pages
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_sharing_a_prefix_takes_only_the_new_pages(ps):
    alloc, cache = make(ps, num_pages=32)
    first, num_cached = put(cache, alloc, toks(ps, 1, 2, 3))
    assert num_cached == 0

    second = alloc.allocate(4)
    num_cached = cache.insert(toks(ps, 1, 2, 5, 6), second)
    assert num_cached == 2
    # The tree took second[2:] only; second[:2] are still ours and were not cached.
    assert sorted(cache.all_pages()) == sorted(first + second[2:])
    assert not set(second[:2]) & set(cache.all_pages())
    assert alloc.num_free_pages + cache.total_pages + 2 == alloc.num_usable_pages
    alloc.free(second[:2])
    check_counts(cache, alloc)
    assert cache.match_prefix(toks(ps, 1, 2, 5, 6)).pages == first[:2] + second[2:]
    assert cache.match_prefix(toks(ps, 1, 2, 3)).pages == first

    # A fully cached sequence (whole, or ending at a node boundary or inside a node).
    for labels in ((1, 2, 3), (1, 2), (1,), ()):
        dup = alloc.allocate(len(labels))
        assert cache.insert(toks(ps, *labels), dup) == len(labels)
        alloc.free(dup)
    assert cache.total_pages == 5
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_insert_rejects_misaligned_input(ps):
    alloc, cache = make(ps)
    with pytest.raises(ValueError, match="tokens for"):
        cache.insert(toks(ps, 1, 2) + [7], alloc.allocate(2))
    with pytest.raises(ValueError):
        cache.insert(toks(ps, 1, 2), [5])
    assert cache.total_pages == 0


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_protects_node_and_ancestors(ps):
    alloc, cache = make(ps)
    abc, _ = put(cache, alloc, toks(ps, 1, 2, 3))
    abd, _ = put(cache, alloc, toks(ps, 1, 2, 4))
    res = cache.match_prefix(toks(ps, 1, 2, 3))
    cache.inc_lock_ref(res.node)
    assert cache.evictable_pages == 1  # only the D leaf
    assert cache.evict(100) == 1
    assert cache.match_prefix(toks(ps, 1, 2, 3)).pages == abc
    assert cache.match_prefix(toks(ps, 1, 2, 4)).pages == abc[:2]
    assert cache.evict(100) == 0 and cache.total_pages == 3
    check_counts(cache, alloc)

    # Two locks need two unlocks.
    cache.inc_lock_ref(res.node)
    cache.dec_lock_ref(res.node)
    assert cache.evict(100) == 0
    cache.dec_lock_ref(res.node)
    assert cache.evictable_pages == 3
    with pytest.raises(RuntimeError, match="unlocked"):
        cache.dec_lock_ref(res.node)
    assert cache.evict(100) == 3 and cache.total_pages == 0
    assert alloc.num_free_pages == alloc.num_usable_pages
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_lock_on_an_inner_prefix_protects_it_but_not_below(ps):
    alloc, cache = make(ps)
    pages, _ = put(cache, alloc, toks(ps, 1, 2, 3, 4))
    res = cache.match_prefix(toks(ps, 1, 2))  # splits; locks the top half only
    cache.inc_lock_ref(res.node)
    assert cache.evictable_pages == 2
    assert cache.evict(1) == 2  # the whole unlocked leaf goes
    assert cache.match_prefix(toks(ps, 1, 2, 3, 4)).pages == pages[:2]
    assert cache.evict(1) == 0
    cache.dec_lock_ref(res.node)
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_is_lru(ps):
    alloc, cache = make(ps)
    put(cache, alloc, toks(ps, 1, 2))
    put(cache, alloc, toks(ps, 1, 3))
    b2, b3 = (cache.match_prefix(toks(ps, 1, x)).pages for x in (2, 3))
    # Untouched since: [1 2] was used before [1 3], so its leaf goes first.
    assert cache.evict(1) == 1
    assert cache.match_prefix(toks(ps, 1, 2)).pages == b2[:1]
    assert cache.match_prefix(toks(ps, 1, 3)).pages == b3

    put(cache, alloc, toks(ps, 1, 2))  # now [1 2] is the newest ...
    b2 = cache.match_prefix(toks(ps, 1, 2)).pages
    assert cache.match_prefix(toks(ps, 1, 3)).pages == b3  # ... until [1 3] is touched
    assert cache.evict(1) == 1
    assert cache.match_prefix(toks(ps, 1, 2)).pages == b2[:1]
    assert cache.match_prefix(toks(ps, 1, 3)).pages == b3
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_evict_cascades_to_parents_that_become_leaves(ps):
    alloc, cache = make(ps)
    pages, _ = put(cache, alloc, toks(ps, 1, 2, 3, 4))
    cache.match_prefix(toks(ps, 1, 2))  # split: [1 2] -> [3 4]
    assert cache.evict(2) == 2  # the leaf only; its parent is now a leaf
    assert cache.match_prefix(toks(ps, 1, 2, 3, 4)).pages == pages[:2]
    assert cache.evictable_pages == 2
    assert cache.evict(1) == 2  # whole nodes: asking for 1 frees the 2-page leaf

    put(cache, alloc, toks(ps, 1, 2, 3, 4))
    cache.match_prefix(toks(ps, 1, 2))
    # One call walks up: leaf first, then its parent once it became a leaf.
    assert cache.evict(3) == 4 and cache.total_pages == 0 and cache.root.children == {}
    put(cache, alloc, toks(ps, 1, 2, 3))
    put(cache, alloc, toks(ps, 1, 2, 4))
    assert cache.evict(3) == 4 and cache.total_pages == 0
    assert alloc.num_free_pages == alloc.num_usable_pages
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_counts_stay_consistent_through_locks_splits_and_evictions(ps):
    alloc, cache = make(ps)
    put(cache, alloc, toks(ps, 1, 2, 3, 4))
    put(cache, alloc, toks(ps, 1, 2, 5))
    put(cache, alloc, toks(ps, 6, 7))
    check_counts(cache, alloc)
    assert cache.total_pages == cache.evictable_pages == 7

    deep = cache.match_prefix(toks(ps, 1, 2, 3, 4)).node
    cache.inc_lock_ref(deep)
    assert cache.evictable_pages == 3
    split = cache.match_prefix(toks(ps, 1, 2, 3)).node  # splits a locked node
    assert split.lock_ref == deep.lock_ref == 1
    assert cache.evictable_pages == 3
    check_counts(cache, alloc)
    cache.inc_lock_ref(split)
    assert cache.evictable_pages == 3
    cache.dec_lock_ref(deep)
    assert cache.evictable_pages == 4  # page 4 unlocked, 1 2 3 still held by `split`
    check_counts(cache, alloc)

    assert cache.evict(100) == 4
    assert cache.total_pages == 3 and cache.evictable_pages == 0
    check_counts(cache, alloc)
    cache.dec_lock_ref(split)
    assert cache.evictable_pages == 3
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_reset_returns_every_page(ps):
    alloc, cache = make(ps)
    put(cache, alloc, toks(ps, 1, 2, 3))
    put(cache, alloc, toks(ps, 1, 4))
    put(cache, alloc, toks(ps, 5))
    cache.match_prefix(toks(ps, 1, 2))
    cache.reset()
    assert cache.total_pages == cache.evictable_pages == 0 and cache.all_pages() == []
    assert alloc.num_free_pages == alloc.num_usable_pages
    assert cache.match_prefix(toks(ps, 1, 2, 3)).num_tokens == 0
    check_counts(cache, alloc)


@pytest.mark.parametrize("ps", PAGE_SIZES)
@pytest.mark.parametrize("locked", [0, 1])
def test_reset_refuses_with_locked_nodes_and_changes_nothing(ps, locked):
    alloc, cache = make(ps)
    put(cache, alloc, toks(ps, 1, 2, 3))
    put(cache, alloc, toks(ps, 1, 4))
    put(cache, alloc, toks(ps, 5, 6))
    node = cache.match_prefix(toks(ps, 1, 2) if locked == 0 else toks(ps, 5, 6)).node
    cache.inc_lock_ref(node)
    before = tree_map(cache)
    with pytest.raises(RuntimeError, match="locked"):
        cache.reset()
    assert tree_map(cache) == before and cache.total_pages == 6
    check_counts(cache, alloc)
    cache.dec_lock_ref(node)
    cache.reset()
    assert alloc.num_free_pages == alloc.num_usable_pages


@pytest.mark.parametrize("ps", PAGE_SIZES)
def test_null_cache_keeps_nothing(ps):
    alloc = PageAllocator(16, ps)
    cache = NullPrefixCache(alloc, ps)
    assert cache.enabled is False and RadixCache(alloc, ps).enabled is True
    pages = alloc.allocate(3)
    assert cache.insert(toks(ps, 1, 2, 3), pages) == 3  # the caller keeps all three
    res = cache.match_prefix(toks(ps, 1, 2, 3))
    assert (res.pages, res.num_tokens) == ([], 0) and res.node is cache.root
    cache.inc_lock_ref(res.node)
    cache.dec_lock_ref(res.node)
    assert cache.evict(10) == 0
    assert cache.total_pages == cache.evictable_pages == 0 and cache.all_pages() == []
    cache.reset()
    assert alloc.num_free_pages == alloc.num_usable_pages - 3
    alloc.free(pages)


# -------------------------------------------------- property-based tests
MAX_TOKENS = 24
POOL_TOKENS = 48  # two long sequences fill the pool, so inserts often have to evict first


class RadixCacheMachine(RuleBasedStateMachine):
    """Random operations on a RadixCache, mirrored on a dict of cached prefixes."""

    page_size = 1

    @initialize()
    def setup(self):
        self.alloc = PageAllocator(POOL_TOKENS // self.page_size + 1, self.page_size)
        self.cache = RadixCache(self.alloc, self.page_size)
        self.ref: dict[tuple[int, ...], int] = {}  # cached prefix -> page of its last page
        self.stamp: dict[tuple[int, ...], int] = {}  # cached prefix -> last op that touched it
        self.clock = 0
        self.locks: list[tuple[tuple[int, ...], list[int], TreeNode]] = []
        self.history: list[list[int]] = []

    # ------------------------------------------------------------ model
    def prefixes(self, ids) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(ids[:i * ps]) for i in range(1, len(ids) // ps + 1)]

    def longest(self, ids) -> list[tuple[int, ...]]:
        out = []
        for p in self.prefixes(ids):
            if p not in self.ref:
                break
            out.append(p)
        return out

    def touch(self, prefixes) -> None:
        self.clock += 1
        for p in prefixes:
            self.stamp[p] = self.clock

    def is_locked(self, prefix) -> bool:
        return any(held[:len(prefix)] == prefix for held, _, _ in self.locks)

    def sequence(self, data, aligned: bool) -> list[int]:
        """Mostly an earlier sequence cut somewhere plus a short tail, so prefixes collide."""
        if self.history and data.draw(st.integers(0, 3)):
            base = data.draw(st.sampled_from(self.history))
            head = base[:data.draw(st.integers(0, len(base)))]
            tail = data.draw(st.lists(st.integers(0, 3), max_size=2 * self.page_size + 1))
        else:
            size = data.draw(st.integers(0, MAX_TOKENS))
            head, tail = [], data.draw(st.lists(st.integers(0, 3), min_size=size, max_size=size))
        ids = (head + tail)[:MAX_TOKENS]
        if aligned:
            ids = ids[:len(ids) - len(ids) % self.page_size]
        return ids

    def checked_evict(self, num_pages: int) -> int:
        """Evict and check what went: whole unlocked prefixes, enough of them, LRU first.

        A prefix is touched whenever a longer one is, so popping leaves oldest first never
        frees a prefix newer than an unlocked one that stays.
        """
        evictable, free = self.cache.evictable_pages, self.alloc.num_free_pages
        freed = self.cache.evict(num_pages)
        after = tree_map(self.cache)
        removed = set(self.ref) - set(after)
        assert after == {p: page for p, page in self.ref.items() if p not in removed}
        assert freed == len(removed) and self.alloc.num_free_pages == free + freed
        assert min(num_pages, evictable) <= freed <= evictable
        assert not any(self.is_locked(p) for p in removed), "evicted a locked prefix"
        kept = [self.stamp[p] for p in after if not self.is_locked(p)]
        if removed and kept:
            assert max(self.stamp[p] for p in removed) <= min(kept), "evicted out of LRU order"
        for p in removed:
            del self.ref[p], self.stamp[p]
        return freed

    # ------------------------------------------------------------ rules
    @rule(data=st.data())
    def insert(self, data):
        ids = self.sequence(data, aligned=True)
        num_pages = len(ids) // self.page_size
        if not self.alloc.can_allocate(num_pages):
            self.checked_evict(num_pages - self.alloc.num_free_pages)
            if not self.alloc.can_allocate(num_pages):
                return  # too much is locked
        pages = self.alloc.allocate(num_pages)
        expected = len(self.longest(ids))
        assert self.cache.insert(ids, pages) == expected
        self.alloc.free(pages[:expected])
        prefixes = self.prefixes(ids)
        for i in range(expected, num_pages):
            self.ref[prefixes[i]] = pages[i]
        self.touch(prefixes)
        self.history.append(ids)

    @rule(data=st.data(), lock=st.booleans())
    def match(self, data, lock):
        ids = self.sequence(data, aligned=False)
        want = self.longest(ids)
        res = self.cache.match_prefix(ids)
        assert res.num_tokens == len(want) * self.page_size
        assert res.pages == [self.ref[p] for p in want]
        assert path_key(self.cache, res.node) == ids[:res.num_tokens]
        self.touch(want)
        if lock:
            self.cache.inc_lock_ref(res.node)
            self.locks.append((tuple(ids[:res.num_tokens]), res.pages, res.node))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(min_value=0))
    def unlock(self, i):
        _, _, node = self.locks.pop(i % len(self.locks))
        self.cache.dec_lock_ref(node)

    @rule(num_pages=st.integers(0, 2 * MAX_TOKENS))
    def evict(self, num_pages):
        self.checked_evict(num_pages)

    @rule(now=st.integers(0, 4))
    def reset(self, now):
        if now:
            return  # keep resets rare so trees grow
        if any(held for held, _, _ in self.locks):
            before = tree_map(self.cache)
            try:
                self.cache.reset()
            except RuntimeError:
                pass
            else:
                raise AssertionError("reset succeeded with locked nodes")
            assert tree_map(self.cache) == before
        else:
            self.cache.reset()
            self.ref.clear()
            self.stamp.clear()
            self.locks.clear()  # only root locks (empty matches) are left; they are no-ops

    # ------------------------------------------------------- invariants
    @invariant()
    def cache_matches_the_model(self):
        cached = tree_map(self.cache)  # also checks keys, pages and child keying
        assert cached == self.ref, "the tree does not hold exactly the model's prefixes"

        owned, free = self.cache.all_pages(), self.alloc._free  # no public view of it
        assert len(owned) == len(set(owned)) == self.cache.total_pages, "a page is owned twice"
        assert len(free) == len(set(free)), "a page is on the free list twice"
        assert not set(owned) & set(free), "a cached page is also free"
        assert 0 not in owned and 0 not in free, "the scratch page was handed out"
        assert len(free) + self.cache.total_pages == self.alloc.num_usable_pages, "pages were lost"

        all_nodes = nodes(self.cache)
        by_nodes = sum(len(n.pages) for n, _ in all_nodes if n.lock_ref == 0)
        by_model = sum(1 for p in self.ref if not self.is_locked(p))
        assert self.cache.evictable_pages == by_nodes == by_model, "evictable_pages is off"
        for node, path in all_nodes:
            holders = sum(1 for held, _, _ in self.locks if held[:len(path)] == path)
            assert node.lock_ref == holders, f"lock_ref {node.lock_ref}, {holders} locks held below"

        for held, pages, node in self.locks:  # locked matches still match, on the same pages
            assert tuple(path_key(self.cache, node)) == held
            assert [cached[p] for p in self.prefixes(held)] == pages


PROPERTY_SETTINGS = settings(max_examples=150, stateful_step_count=40, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow])


class _PageSize1(RadixCacheMachine):
    page_size = 1


class _PageSize2(RadixCacheMachine):
    page_size = 2


class _PageSize4(RadixCacheMachine):
    page_size = 4


TestRadixCachePageSize1 = _PageSize1.TestCase
TestRadixCachePageSize1.settings = PROPERTY_SETTINGS
TestRadixCachePageSize2 = _PageSize2.TestCase
TestRadixCachePageSize2.settings = PROPERTY_SETTINGS
TestRadixCachePageSize4 = _PageSize4.TestCase
TestRadixCachePageSize4.settings = PROPERTY_SETTINGS


def test_kv_pool_reads_back_what_was_written():
    """The pool's read side (documented for backend authors): get_kv at a request's slots
    returns the K/V set there, in slot order, and nothing else changes."""
    import torch
    from radixserve.mem.kv_pool import KVPool

    pool = KVPool(num_layers=2, num_pages=8, page_size=4, num_kv_heads=2, head_dim=3,
                  dtype=torch.float32, device="cpu")
    assert torch.equal(pool.k_buffers[1][:4], torch.zeros(4, 2, 3))  # the scratch page
    loc = torch.tensor([13, 5, 30, 6])  # pages 3, 1, 7, 1: out of order
    k, v = torch.randn(4, 2, 3), torch.randn(4, 2, 3)
    pool.set_kv(1, loc, k, v)
    got_k, got_v = pool.get_kv(1, loc[[2, 0]])
    assert torch.equal(got_k, k[[2, 0]]) and torch.equal(got_v, v[[2, 0]])
