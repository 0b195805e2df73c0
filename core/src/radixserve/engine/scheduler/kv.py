"""KV manager: the scheduler's one door to the KV pool, the request-to-token table and
the prefix cache.

The rest of the scheduler speaks in requests and tokens; pages stay in here. It matches a
request's prompt against the prefix cache, admits it (locks the match, allocates the pages
of its first chunk), grows requests (the next chunk, the next decode token, draft tokens),
keeps back pages for the future decode tokens of admitted requests, and releases them
(computed pages enter the prefix cache, the rest return to the pool).

Reservation: admission keeps ``new_token_ratio`` of every admitted request's remaining
budget (at most ``CLIP_MAX_NEW_TOKENS`` each) free for its future tokens. The ratio starts at
``INIT_NEW_TOKEN_RATIO``, decays by ``NEW_TOKEN_RATIO_DECAY`` per decode step down to
``MIN_NEW_TOKEN_RATIO``, and goes back up when a request had to be retracted.

Memory rule: every KV page is free, owned by the prefix cache, or owned by exactly one
admitted request; :meth:`KVManager.idle_problems` lists what breaks it when nothing runs.
"""

from __future__ import annotations

from radixserve.engine.request import Req
from radixserve.mem.kv_pool import PageAllocator
from radixserve.mem.radix_cache import BasePrefixCache

INIT_NEW_TOKEN_RATIO = 0.7  # share of each running request's remaining budget kept free
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per decode step without retraction
CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's reserved future tokens


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def cacheable_prefix(req: Req) -> int:
    """How many leading tokens of ``req`` may come from the prefix cache: not the last (its
    logits pick the next token), nor any position whose logits give a prompt logprob still
    to compute (``logprob_start_len``), as SGLang caps it."""
    return min(len(req.all_ids) - 1, req.prompt_logprob_next - 1)


class KVManager:
    def __init__(self, runner, cache: BasePrefixCache, allocator: PageAllocator | None = None) -> None:
        self.page_size = runner.kv_pool.page_size
        self.allocator = allocator or runner.kv_pool.allocator
        self.req_pool = runner.req_to_token_pool
        self.table = self.req_pool.req_to_token
        self.cache = cache
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        self.release_hooks: list = []  # called with every released request (speculative proposers)

    # ------------------------------------------------------------ capacity
    @property
    def available_pages(self) -> int:
        return self.allocator.num_free_pages + self.cache.evictable_pages

    def can_ever_hold(self, num_tokens: int) -> bool:
        """Whether an empty pool could hold a request of ``num_tokens`` tokens."""
        return ceil_div(num_tokens, self.page_size) <= self.allocator.num_usable_pages

    @property
    def free_request_slots(self) -> int:
        return self.req_pool.num_free

    def reserved_pages(self, reqs) -> int:
        """Pages kept back for the future decode tokens of admitted requests."""
        tokens = sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) for r in reqs)
        return int(tokens * self.new_token_ratio) // self.page_size

    def decay_reservation(self) -> None:
        """A decode step ran without retraction: keep back a little less."""
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)

    def reset_reservation(self) -> None:
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    def _alloc(self, n: int) -> list[int] | None:
        """``n`` pages, evicting unlocked cache leaves if needed; None if impossible."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.cache.evict(short)
        if not self.allocator.can_allocate(n):
            return None
        return self.allocator.allocate(n)

    # ------------------------------------------------------------ admission
    def match(self, req: Req):
        """The prefix cache's longest match for what ``req`` may take from it."""
        return self.cache.match_prefix(req.cache_ids[:cacheable_prefix(req)])

    def prefix_match(self, req: Req):
        """The prefix cache's longest match for all of ``req``'s tokens (queue ordering)."""
        return self.cache.match_prefix(req.cache_ids)

    @property
    def roots(self) -> list:
        """The prefix cache's tree roots (one)."""
        return [self.cache.root]

    def pages_for(self, req: Req, match, budget: int) -> tuple[int, int, bool]:
        """(new pages for ``req``'s next prefill chunk once every tier of ``match`` is on
        the device, pages reserved for its future decode tokens, whether it is chunked)."""
        cached = match.num_tokens + match.lower_tokens
        n_new = len(req.all_ids) - cached
        n = min(n_new, budget)
        need = ceil_div(cached + n, self.page_size) - len(match.pages)
        future = self.reserved_pages([req]) if n == n_new else 0
        return need, future, n < n_new

    def fits(self, req: Req, match, budget: int, reserve: int, alone: bool) -> bool:
        """Whether ``req`` would be admitted with ``match`` once its lower-tier part is on
        the device, beside ``reserve`` kept-back pages (the test :meth:`admit` makes);
        a chunked prefill fits only ``alone`` in its batch."""
        need, future, chunked = self.pages_for(req, match, budget)
        if chunked and not alone:
            return False
        return self.available_pages >= need + reserve + future

    def fits_once_released(self, req: Req, budget: int, staying: list[Req], leaving: list[Req]) -> bool:
        """Whether the pages for ``req``'s next prefill chunk, beside the reservations of
        ``staying``, would be there once ``leaving`` were released (an upper bound)."""
        need, future, _ = self.pages_for(req, self.match(req), budget)
        freed = sum(len(r.pages) for r in leaving)
        return self.available_pages + freed >= need + self.reserved_pages(staying) + future

    def admit(self, req: Req, match, num_tokens: int, reserve: int) -> int | None:
        """Admit ``req`` with ``match`` from the cache and room for its next ``num_tokens``
        tokens, if the pool holds them beside ``reserve`` kept-back pages (and ``req``'s own
        future tokens when this chunk ends its prompt). Returns the pages it now keeps back,
        or None (nothing changed) when it does not fit."""
        need = ceil_div(match.num_tokens + num_tokens, self.page_size) - len(match.pages)
        self.cache.inc_lock_ref(match.node)  # protect the match while we may evict
        done = match.num_tokens + num_tokens == len(req.all_ids)
        future = self.reserved_pages([req]) if done else 0
        pages = self._alloc(need) if self.available_pages >= need + reserve + future else None
        if pages is None:
            self.cache.dec_lock_ref(match.node)
            return None
        req.req_pool_idx = self.req_pool.alloc()
        req.prefix_node, req.num_tree_pages = match.node, len(match.pages)
        req.pages = match.pages + pages
        req.kv_len = match.num_tokens
        self.write_table(req, 0, match.num_tokens)
        self.cache.on_admit(req, match)
        return future

    def grow_chunk(self, req: Req, num_tokens: int) -> bool:
        """Pages for the next ``num_tokens`` of a request in the middle of a chunked prefill."""
        need = ceil_div(req.kv_len + num_tokens, self.page_size) - len(req.pages)
        pages = self._alloc(need)
        if pages is None:
            return False
        req.pages.extend(pages)
        return True

    def grow_by_one(self, reqs: list[Req], ahead: int = 0) -> bool:
        """A slot for every request's next token (``ahead`` tokens past what it holds now),
        evicting cache leaves if needed; False, with nothing allocated, when they do not
        all fit."""
        page = self.page_size
        grow = [r for r in reqs if r.seq_len + ahead > len(r.pages) * page]
        if len(grow) > self.allocator.num_free_pages:
            self.cache.evict(len(grow) - self.allocator.num_free_pages)
        if len(grow) > self.allocator.num_free_pages:
            return False
        for req in grow:
            req.pages.extend(self.allocator.allocate(1))
        return True

    def grow_for_drafts(self, req: Req, k: int) -> int:
        """Slots for up to ``k`` draft tokens after ``req``'s last one, written into its
        table row; returns how many it got."""
        need = ceil_div(req.seq_len + k, self.page_size) - len(req.pages)
        if need > 0:
            if need > self.allocator.num_free_pages:
                self.cache.evict(need - self.allocator.num_free_pages)
            fits = min(need, self.allocator.num_free_pages)
            if fits:
                req.pages.extend(self.allocator.allocate(fits))
            if fits < need:  # what the reserved pages hold
                k = max(0, len(req.pages) * self.page_size - req.seq_len)
        if k:
            self.write_table(req, req.seq_len - 1, req.seq_len + k)
        return k

    def trim(self, req: Req) -> None:
        """Return the pages past ``req``'s tokens (rejected drafts) to the pool."""
        keep = ceil_div(req.seq_len, self.page_size)
        if len(req.pages) > keep:
            self.allocator.free(req.pages[keep:])
            del req.pages[keep:]

    def write_table(self, req: Req, start: int, end: int) -> None:
        self.req_pool.write(req.req_pool_idx, req.pages, self.page_size, start, end)

    def slot_of(self, req: Req, pos: int) -> int:
        """The KV slot that holds ``req``'s token at ``pos``."""
        return int(self.table[req.req_pool_idx, pos])

    # ------------------------------------------------------------ release
    def cache_computed(self, req: Req) -> None:
        """Insert ``req``'s computed full pages into the prefix cache (it keeps running)."""
        self.cache.cache_unfinished_req(req)

    def release(self, req: Req) -> None:
        """Return everything an admitted request holds (pages go to the cache first)."""
        if req.req_pool_idx is None:
            return
        for hook in self.release_hooks:
            hook(req)
        self.cache.cache_finished_req(req)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    # ------------------------------------------------------------ checks
    def usage(self) -> dict:
        usable = self.allocator.num_usable_pages
        used = usable - self.allocator.num_free_pages
        return {
            "num_used_tokens": used * self.page_size,
            "num_cached_tokens": self.cache.total_pages * self.page_size,
            "token_usage": used / usable if usable else 0.0,
            "new_token_ratio": self.new_token_ratio,
        }

    def idle_problems(self) -> list[str]:
        """What breaks the memory rule when no request is admitted."""
        problems = []
        usable = self.allocator.num_usable_pages
        free = self.allocator.num_free_pages
        cached = self.cache.total_pages
        if free + cached != usable:
            problems.append(f"{usable - free - cached} KV pages leaked ({free} free + {cached} cached of {usable})")
        if cached != self.cache.evictable_pages:
            problems.append(f"{cached - self.cache.evictable_pages} cached pages still locked")
        free_list = set(self.allocator._free)
        if len(free_list) != free or free_list & set(self.cache.all_pages()):
            problems.append("a page is both free and cached, or freed twice")
        in_use = self.req_pool.size - self.req_pool.num_reserved - self.req_pool.num_free
        if in_use:
            problems.append(f"{in_use} request slots leaked")
        problems.extend(self.cache.invariant_problems())
        return problems
