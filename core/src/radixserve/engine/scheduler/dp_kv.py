"""The KV manager of a DP-attention replica (``--enable-dp-attention --dp-size D``): one
:class:`~radixserve.engine.scheduler.kv.KVManager` per attention group, each with its own page
allocator and prefix cache over that group's pool (the pools of different groups hold
different requests, so a page number means a page of one group's pool only). The request-to-token
table is shared: its rows hold each request's slots in its own group's pool.

A request is given a group when it is queued (:meth:`GroupedPrefixCache.on_request_queued`):
the one its client asked for (SGLang's ``routed_dp_rank`` / ``data_parallel_rank``), else
cache-aware as SGLang's router balances replicas: the group whose prefix cache holds the
longest prefix of it, when that covers at least :data:`CACHE_HIT_SHARE` of the prompt; else the
group with the fewest tokens (prompt plus budget) of unfinished requests. Everything the
scheduler does to a request's pages then goes to its group's manager; reservations for future
decode tokens are kept per group (:class:`GroupPages`).
"""

from __future__ import annotations

from radixserve.engine.request import Req
from radixserve.engine.scheduler.kv import KVManager
from radixserve.mem.kv_pool import PageAllocator
from radixserve.mem.radix_cache import BasePrefixCache, MatchResult, NullPrefixCache, RadixCache

CACHE_HIT_SHARE = 0.5  # a group caching at least this share of a prompt gets it whatever its load


class GroupPages(tuple):
    """Pages per attention group (reservations); ``+`` adds group by group."""

    def __add__(self, other):  # noqa: D105
        return GroupPages(a + b for a, b in zip(self, other, strict=True))


class GroupedPrefixCache(BasePrefixCache):
    """The scheduler's view of the groups' prefix caches: hooks go to the request's group,
    totals add up. Matching and inserting go through each group's own cache (its manager)."""

    def __init__(self, caches: list[BasePrefixCache]) -> None:
        self.caches = caches
        self.page_size = caches[0].page_size
        self.root = caches[0].root
        self.enabled = caches[0].enabled
        self.load = [0] * len(caches)  # tokens (prompt + budget) of each group's unfinished requests
        self._load_of: dict[int, tuple[int, int]] = {}  # id(req) -> (group, tokens)

    # ------------------------------------------------------------ groups
    def choose_group(self, req: Req) -> int:
        """The attention group ``req`` runs in (see the module docstring)."""
        prompt = req.cache_ids[:max(len(req.all_ids) - 1, 0)]
        if self.enabled and prompt:
            hits = [c.match_prefix(prompt).num_tokens for c in self.caches]
            best = max(range(len(hits)), key=lambda g: (hits[g], -self.load[g]))
            if hits[best] and hits[best] >= CACHE_HIT_SHARE * len(prompt):
                return best
        return min(range(len(self.load)), key=lambda g: (self.load[g], g))

    def on_request_queued(self, req: Req) -> None:
        if id(req) in self._load_of:  # queued again (it keeps its group and its cached pages)
            return
        g = req.dp_rank if req.dp_rank is not None and 0 <= req.dp_rank < len(self.caches) else self.choose_group(req)
        req.dp_group = g
        tokens = len(req.input_ids) + req.max_new_tokens
        self.load[g] += tokens
        self._load_of[id(req)] = (g, tokens)
        self.caches[g].on_request_queued(req)

    def on_request_done(self, req: Req) -> None:
        g, tokens = self._load_of.pop(id(req), (req.dp_group, 0))
        self.load[g] -= tokens
        self.caches[g].on_request_done(req)

    # ------------------------------------------------------------ per request
    def prefetch_ready(self, req: Req) -> bool:
        return self.caches[req.dp_group].prefetch_ready(req)

    def on_admit(self, req: Req, match: MatchResult) -> None:
        self.caches[req.dp_group].on_admit(req, match)

    def cache_finished_req(self, req: Req) -> None:
        self.caches[req.dp_group].cache_finished_req(req)

    def cache_unfinished_req(self, req: Req) -> None:
        self.caches[req.dp_group].cache_unfinished_req(req)

    # ------------------------------------------------------------ every group
    def match_prefix(self, token_ids: list[int]) -> MatchResult:
        raise TypeError("with DP attention a prefix is matched in one attention group's cache (KVManager.match)")

    def insert(self, token_ids: list[int], pages: list[int]) -> int:
        raise TypeError("with DP attention pages are inserted into one attention group's cache")

    def inc_lock_ref(self, node) -> None:
        raise TypeError("with DP attention a node is locked in its attention group's cache")

    dec_lock_ref = inc_lock_ref

    def evict(self, num_pages: int) -> int:
        raise TypeError("with DP attention pages are evicted from one attention group's cache")

    @property
    def evictable_pages(self) -> int:
        return sum(c.evictable_pages for c in self.caches)

    @property
    def total_pages(self) -> int:
        return sum(c.total_pages for c in self.caches)

    def reset(self) -> None:
        for c in self.caches:
            c.reset()

    def all_pages(self) -> list[int]:
        raise TypeError("with DP attention each attention group's cache numbers its own pages")

    def ready_for_forward(self) -> None:
        for c in self.caches:
            c.ready_for_forward()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        for c in self.caches:
            c.observe_prefill(num_tokens, seconds)

    def stats(self) -> dict:
        return {"dp_attention_group_load_tokens": list(self.load)}

    def invariant_problems(self) -> list[str]:
        """The groups' loads (each group's cache is checked by its own manager)."""
        if any(self.load) or self._load_of:
            return [f"{len(self._load_of)} requests still counted in the attention groups' loads"]
        return []

    def close(self) -> None:
        for c in self.caches:
            c.close()


class GroupedKV:
    """The scheduler's KV manager with DP attention (see the module docstring); the same
    interface as :class:`KVManager`."""

    def __init__(self, runner, num_groups: int, disable_radix_cache: bool) -> None:
        pool = runner.kv_pool
        cache_cls = NullPrefixCache if disable_radix_cache else RadixCache
        self.groups: list[KVManager] = []
        for g in range(num_groups):  # group 0's pages are rank 0's own pool's; the others count alike
            allocator = pool.allocator if g == 0 else PageAllocator(pool.allocator.num_pages, pool.page_size)
            self.groups.append(KVManager(runner, cache_cls(allocator, pool.page_size, runner.req_to_token_pool),
                                         allocator=allocator))
        self.cache = GroupedPrefixCache([m.cache for m in self.groups])
        self.page_size = pool.page_size
        self.req_pool = runner.req_to_token_pool
        self.table = self.req_pool.req_to_token
        self.allocator = pool.allocator  # group 0's (its num_free_pages in messages)
        self.release_hooks: list = []
        for m in self.groups:
            m.release_hooks = self.release_hooks

    def _of(self, req: Req) -> KVManager:
        return self.groups[req.dp_group]

    def _split(self, reqs) -> list[list[Req]]:
        out: list[list[Req]] = [[] for _ in self.groups]
        for r in reqs:
            out[r.dp_group].append(r)
        return out

    # ------------------------------------------------------------ capacity
    @property
    def available_pages(self) -> int:
        return sum(m.available_pages for m in self.groups)

    @property
    def new_token_ratio(self) -> float:
        return self.groups[0].new_token_ratio

    def can_ever_hold(self, num_tokens: int) -> bool:
        return self.groups[0].can_ever_hold(num_tokens)

    @property
    def free_request_slots(self) -> int:
        return self.req_pool.num_free

    def reserved_pages(self, reqs) -> GroupPages:
        return GroupPages(m.reserved_pages(rs) for m, rs in zip(self.groups, self._split(reqs), strict=True))

    def decay_reservation(self) -> None:
        for m in self.groups:
            m.decay_reservation()

    def reset_reservation(self) -> None:
        for m in self.groups:
            m.reset_reservation()

    # ------------------------------------------------------------ admission
    def match(self, req: Req):
        return self._of(req).match(req)

    def prefix_match(self, req: Req):
        return self._of(req).prefix_match(req)

    @property
    def roots(self) -> list:
        return [m.cache.root for m in self.groups]

    def pages_for(self, req: Req, match, budget: int):
        return self._of(req).pages_for(req, match, budget)

    def fits(self, req: Req, match, budget: int, reserve: GroupPages, alone: bool) -> bool:
        return self._of(req).fits(req, match, budget, reserve[req.dp_group], alone)

    def fits_once_released(self, req: Req, budget: int, staying: list[Req], leaving: list[Req]) -> bool:
        g = req.dp_group
        return self._of(req).fits_once_released(req, budget, self._split(staying)[g], self._split(leaving)[g])

    def admit(self, req: Req, match, num_tokens: int, reserve: GroupPages) -> GroupPages | None:
        future = self._of(req).admit(req, match, num_tokens, reserve[req.dp_group])
        if future is None:
            return None
        return GroupPages(future if g == req.dp_group else 0 for g in range(len(self.groups)))

    def grow_chunk(self, req: Req, num_tokens: int) -> bool:
        return self._of(req).grow_chunk(req, num_tokens)

    def grow_by_one(self, reqs: list[Req], ahead: int = 0) -> bool:
        """As :meth:`KVManager.grow_by_one`, every group's requests or none."""
        before = {id(r): len(r.pages) for r in reqs}
        done: list[tuple[KVManager, list[Req]]] = []
        for m, rs in zip(self.groups, self._split(reqs), strict=True):
            if not rs:
                continue
            if not m.grow_by_one(rs, ahead):
                for dm, drs in done:  # give back what the groups before got
                    for r in drs:
                        extra = r.pages[before[id(r)]:]
                        if extra:
                            dm.allocator.free(extra)
                            del r.pages[before[id(r)]:]
                return False
            done.append((m, rs))
        return True

    def grow_for_drafts(self, req: Req, k: int) -> int:
        return self._of(req).grow_for_drafts(req, k)

    def trim(self, req: Req) -> None:
        self._of(req).trim(req)

    def write_table(self, req: Req, start: int, end: int) -> None:
        self._of(req).write_table(req, start, end)

    def slot_of(self, req: Req, pos: int) -> int:
        return self._of(req).slot_of(req, pos)

    # ------------------------------------------------------------ release
    def cache_computed(self, req: Req) -> None:
        self._of(req).cache_computed(req)

    def release(self, req: Req) -> None:
        self._of(req).release(req)

    # ------------------------------------------------------------ checks
    def usage(self) -> dict:
        per = [m.usage() for m in self.groups]
        usable = sum(m.allocator.num_usable_pages for m in self.groups)
        used = sum(u["num_used_tokens"] for u in per)
        return {
            "num_used_tokens": used,
            "num_cached_tokens": sum(u["num_cached_tokens"] for u in per),
            "token_usage": used / (usable * self.page_size) if usable else 0.0,
            "new_token_ratio": self.new_token_ratio,
            "dp_attention_token_usage": [u["token_usage"] for u in per],
        }

    def idle_problems(self) -> list[str]:
        problems = []
        for g, m in enumerate(self.groups):
            own = [p for p in m.idle_problems() if "request slots leaked" not in p]
            problems.extend(f"attention group {g}: {p}" for p in own)
        in_use = self.req_pool.size - self.req_pool.num_reserved - self.req_pool.num_free
        if in_use:
            problems.append(f"{in_use} request slots leaked")
        return problems + self.cache.invariant_problems()
