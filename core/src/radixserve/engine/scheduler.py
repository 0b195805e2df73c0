"""Scheduler: continuous batching over the paged KV pool with RadixAttention prefix reuse.

Each :meth:`Scheduler.step` runs one forward pass:

* **prefill first** — admit waiting requests (in ``--schedule-policy`` order) while
  requests, tokens (``--max-prefill-tokens``, ``--chunked-prefill-size``) and KV pages
  allow; each reuses the longest cached prefix of its tokens and computes only the rest. A
  prompt longer than the chunk budget is prefilled in chunks over several steps, its
  finished pages inserted into the cache after each chunk.
* otherwise **decode** every running request by one token. When the pool cannot hold the
  step even after evicting unlocked cache leaves, requests with the least progress are
  *retracted*: their computed pages go to the prefix cache, the rest back to the pool, and
  they wait to be resumed (greedy outputs are unchanged by this).

Structured output: a request with a grammar (``json_schema``, ``regex``, ``ebnf``) waits in
``grammar_queue`` while a worker thread compiles it, out of every batch, and joins the
waiting queue once compiled; a grammar that fails (or runs past the compile time limit)
finishes only its own request with an ``abort`` carrying ``status_code`` 400. In each
sampling step the constrained rows' matchers fill a token bitmask that masks their logits,
and a matcher that terminates finishes its request with ``stop``. With ``--reasoning-parser``
each matcher is wrapped in a :class:`~radixserve.reasoning.ReasoningMatcher`: nothing is
masked while the request is still reasoning, the grammar starts after ``</think>``.

Failure is per request. An exception while serving one request (its grammar matcher, its
row of the sampler, its stop-string check, its output callback) ends that request only,
with finish reason ``{"type": "abort", "status_code": 500, ...}``; its pages and slot are
freed and its neighbours go on untouched. A forward pass that raises is retried with each
request alone to find the culprits: they fail, and the rest of the batch runs again
without them. When no single request is to blame, the whole batch fails with 500 and the
engine goes on; only ``--max-consecutive-failed-steps`` such steps in a row raise
:class:`EngineFailure` out of :meth:`Scheduler.step`.

Admission: beyond ``--max-queued-requests`` waiting requests a new one is refused with
finish reason ``{"type": "abort", "status_code": 429, ...}``.

Priority (``--enable-priority-scheduling``): the waiting queue is ordered by priority
first (lower values first), and when its most urgent request finds no running slot or too
few KV pages, less urgent decoding requests are retracted for it (preempted); the rules
are in :mod:`radixserve.engine.priority`.

First-token preemption (HiCache, unless ``--disable-hicache-first-token-preemption``; not
with priority scheduling): a waiting request that has no token yet is admitted before
requests that have, and when it finds no running slot or too few KV pages, decoding
requests are paused for it: retracted, their pages demoted to the host tier instead of
recomputed later. A request is paused this way at most once, and only with at least
``FIRST_TOKEN_PREEMPT_MIN_LEFT`` tokens of its budget left (pausing one about to finish is
not worth its copy back); once the paused requests waiting hold as many tokens as the host
tier, nothing more is paused and they go first. When a burst arrives at a pool that holds
one or two requests, every request gets its first token after the prefills ahead of it
instead of after their whole answers.

Prompt logprobs (``return_logprob`` with ``logprob_start_len`` k): such a request takes at
most its first k - 1 tokens from the prefix cache, so every position whose logits give one
is computed; the runner reduces those rows to logprobs in the step that computes them, and
one step computes at most ``prompt_logprob_rows`` of them (chunks are cut to fit). A
request with ``max_new_tokens: 0`` is prefilled (so its prompt enters the prefix cache: SGLang's
frontend caches a prefix this way), then finished without sampling.

Memory rule: every KV page is free, owned by the prefix cache, or owned by exactly one
admitted request. :meth:`check_idle_invariant` verifies it when nothing is running.

Overlapped scheduling (unless ``--disable-overlap-schedule``; off on CPU by default): a
decode step's CPU work overlaps the next step's forward, its results resolved one step late,
token-identical to the sequential loop; see :mod:`radixserve.engine.overlap`.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from radixserve.detokenizer import StopStringMatcher
from radixserve.engine.hidden_states import take_hidden_states
from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.overlap import OverlapScheduler, overlap_unsupported, overlap_wanted
from radixserve.engine.priority import order_by_priority, preemption_victims
from radixserve.engine.request import Req
from radixserve.grammar import grammar_key
from radixserve.grammar.manager import GrammarManager, no_backend_message
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.mem.radix_cache import BasePrefixCache, NullPrefixCache, RadixCache
from radixserve.reasoning import ReasoningMatcher, ReasoningSpec
from radixserve.sampling import Sampler, SamplingBatchInfo
from radixserve.sampling.bitmask import allocate_token_bitmask
from radixserve.speculative.runtime import SpecDecoder

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7  # share of each running request's remaining budget kept free
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002  # per decode step without retraction
FIRST_TOKEN_PREEMPT_MIN_LEFT = 8  # HiCache: decoding requests with fewer tokens left are not paused
CLIP_MAX_NEW_TOKENS = 4096  # cap on one request's reserved future tokens
IN_BATCH_PREFIX_TOKENS = 32  # lpm: defer a request sharing this much with one being prefilled
PROMPT_LOGPROB_LOGITS_BYTES = 256 << 20  # float32 logits one step may hold for prompt logprobs
GRAMMAR_WAIT_SECONDS = 0.05  # longest idle wait for a compile before the caller's loop runs again


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineFailure(RuntimeError):
    """Forward passes keep failing with no single request to blame: the engine must stop."""


@dataclass
class SchedulerStats:
    num_prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    num_cached_prompt_tokens: int = 0  # of those, served from the prefix cache
    num_prefill_tokens: int = 0  # tokens actually computed in extend steps
    num_decode_tokens: int = 0
    num_forward_steps: int = 0
    num_mixed_steps: int = 0  # forward steps that decoded running requests beside a prefill chunk
    num_finished: int = 0
    num_aborted: int = 0
    num_retractions: int = 0
    num_preemptions: int = 0  # running requests retracted for another (priority, HiCache first-token rule)
    num_failed: int = 0  # requests ended by an error while serving them (status 500)
    num_failed_steps: int = 0  # forward steps that failed as a whole
    num_overlap_steps: int = 0  # decode steps resolved while the next one's forward ran (overlap schedule)
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer, eos_token_ids: set[int],
                 grammar: GrammarManager | None = None, proposer=None, cache: BasePrefixCache | None = None,
                 reasoning: ReasoningSpec | None = None) -> None:
        self.runner = runner
        self.args = runner.args
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.page_size = runner.kv_pool.page_size
        self.allocator = runner.kv_pool.allocator
        self.req_pool = runner.req_to_token_pool
        self.table = runner.req_to_token_pool.req_to_token
        if cache is None:
            cache_cls = NullPrefixCache if self.args.disable_radix_cache else RadixCache
            cache = cache_cls(self.allocator, self.page_size, self.req_pool)
        self.cache: BasePrefixCache = cache
        self.policy = self.args.schedule_policy
        if self.args.disable_radix_cache and self.policy in ("lpm", "dfs-weight"):
            self.policy = "fcfs"  # prefix-aware orders mean nothing without the cache
        self.sampler = Sampler()
        self.waiting: deque[Req] = deque()
        self.grammar = grammar  # None: constrained requests are refused
        self.reasoning = reasoning  # --reasoning-parser: grammars apply after the think block
        self.grammar_queue: list[Req] = []  # waiting for their grammar to compile
        self._bitmask: torch.Tensor | None = None  # [max_running, ceil(V / 32)] int32, reused
        self.running: list[Req] = []  # admitted: decoding, or mid chunked prefill
        self.stats = SchedulerStats()
        self.vocab_size = runner.model_config.vocab_size
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        # prompt logprobs: most logits rows beyond the last tokens one step computes for them
        self.prompt_logprob_rows = max(1, PROMPT_LOGPROB_LOGITS_BYTES // (4 * self.vocab_size))
        self._arrivals = 0
        self._rng = random.Random(0)
        # overlapped scheduling (unless --disable-overlap-schedule): forwards run on a worker
        # thread and a decode step's CPU work overlaps the next one's forward (engine/overlap.py)
        self.overlap: OverlapScheduler | None = None
        if overlap_wanted(self.args, runner.device):
            why_not = overlap_unsupported(self.args, runner, self.cache, proposer)
            if why_not is None:
                self.overlap = OverlapScheduler(self)
            else:
                logger.info("overlapped scheduling is off with %s", why_not)
        self.consecutive_failed_steps = 0
        self._last_step_error = ""
        self._waiting_on_storage = False  # the last admission pass skipped a request fetching from storage
        # speculative decoding (--speculative-algorithm): decode steps verify drafts
        self.spec = SpecDecoder(self, proposer) if proposer is not None else None
        # --enable-mixed-chunk: decoding requests ride along in prefill steps (not while
        # speculating: a verify step is its own kind of extend)
        self.mixed_chunk = bool(self.args.enable_mixed_chunk) and self.spec is None
        # HiCache: a request waiting for its first token may pause decoding ones (their
        # pages wait on the host tier); priority scheduling has its own preemption rule
        self._pause_capacity = getattr(self.cache, "host_capacity_tokens", 0)  # tokens the host tier holds
        self.first_token_preemption = (self._pause_capacity > 0
                                       and not self.args.disable_hicache_first_token_preemption
                                       and not self.args.enable_priority_scheduling)

    # ------------------------------------------------------------- intake
    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        total = num_prompt + max_new_tokens
        if num_prompt == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if total > self.runner.context_len:
            raise RequestRejected(
                f"prompt ({num_prompt} tokens) plus max_new_tokens ({max_new_tokens}) is {total} tokens, "
                f"over the context length {self.runner.context_len}", "max_new_tokens")
        if _ceil_div(total, self.page_size) > self.allocator.num_usable_pages:
            raise RequestRejected(
                f"prompt plus max_new_tokens ({total} tokens) can never fit in the KV pool "
                f"({self.runner.max_total_tokens} tokens); raise --max-total-tokens", "max_new_tokens")

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission (queued, or waiting for their grammar)."""
        return len(self.waiting) + len(self.grammar_queue)

    def add_request(self, req: Req) -> None:
        self.check_fits(len(req.input_ids), req.max_new_tokens)
        self._arrivals += 1
        req.arrival = self._arrivals
        limit = self.args.max_queued_requests
        if limit is not None and self.num_queued >= limit:
            self._finish(req, {"type": "abort", "status_code": 429,
                               "message": f"the server is busy: {self.num_queued} requests are already "
                                          f"queued (--max-queued-requests {limit}); retry later"})
            return
        key = grammar_key(req.params)
        if key is None:
            self._enqueue(req)
            return
        if self.grammar is None:
            self._finish(req, _bad_grammar(no_backend_message(self.args)))
            return
        req.grammar_job = self.grammar.get(key)
        self.grammar_queue.append(req)
        self._poll_grammars()

    def _poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose
        compile failed or ran out of time."""
        if not self.grammar_queue:
            return
        still = []
        for req in self.grammar_queue:
            job = req.grammar_job
            self.grammar.check_timeout(job)
            if not job.is_done:
                still.append(req)
                continue
            req.grammar_job = None
            if job.error is not None:
                self._finish(req, _bad_grammar(job.error, job.status_code))
                continue
            try:
                req.grammar = self.grammar.backend.new_matcher(job.compiled)
                if self.reasoning is not None:
                    req.grammar = ReasoningMatcher(req.grammar, self.reasoning,
                                                   self.reasoning.initial_state(req.input_ids))
            except Exception as e:  # noqa: BLE001 - a backend failure fails only this request
                logger.exception("grammar backend could not start a matcher")
                self._finish(req, _bad_grammar(f"{type(e).__name__}: {e}"))
                continue
            self._enqueue(req)
        self.grammar_queue = still

    def _enqueue(self, req: Req) -> None:
        self.waiting.append(req)
        self.cache.on_request_queued(req)  # HiCache: start fetching its prefix from storage

    def abort(self, rid: str) -> bool:
        """Abort a queued, prefilling or decoding request; its caller gets finish reason
        ``abort`` with the tokens produced so far."""
        for req in self.waiting:
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.grammar_queue:
            if req.rid == rid:
                self.grammar_queue.remove(req)
                req.grammar_job = None
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                if self.overlap is not None:
                    self.overlap.drain_if_idle()
                return True
        return False

    def abort_all(self, reason: dict) -> int:
        """End every queued, compiling and running request with ``reason``; returns how many."""
        reqs = list(self.waiting) + list(self.grammar_queue) + list(self.running)
        self.waiting.clear()
        self.grammar_queue = []
        self.running = []
        for req in reqs:
            req.grammar_job = None
            self._finish(req, dict(reason))
        if self.overlap is not None:
            self.overlap.drain_if_idle()
        return len(reqs)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar_queue)

    # ------------------------------------------------------------ memory
    @property
    def available_pages(self) -> int:
        return self.allocator.num_free_pages + self.cache.evictable_pages

    def _alloc_pages(self, n: int) -> list[int] | None:
        """``n`` pages, evicting unlocked cache leaves if needed; None if impossible."""
        short = n - self.allocator.num_free_pages
        if short > 0:
            self.cache.evict(short)
        if not self.allocator.can_allocate(n):
            return None
        return self.allocator.allocate(n)

    def _slot(self, pages: list[int], pos: int) -> int:
        return pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def _write_table(self, req: Req, start: int, end: int) -> None:
        self.req_pool.write(req.req_pool_idx, req.pages, self.page_size, start, end)

    def _release(self, req: Req) -> None:
        """Return everything an admitted request holds (pages go to the cache first)."""
        if req.req_pool_idx is None:
            return
        if self.spec is not None:
            self.spec.release(req)
        self.cache.cache_finished_req(req)
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.kv_len = 0

    # --------------------------------------------------------- admission
    def _order_waiting(self) -> list[Req]:
        """The waiting queue in admission order: by priority first when priority scheduling
        is on (stable), then by ``--schedule-policy``."""
        order = self._policy_order()
        return order_by_priority(order) if self.args.enable_priority_scheduling else order

    def _policy_order(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.policy == "fcfs" or len(reqs) < 2:
            return reqs
        if self.policy == "random":
            self._rng.shuffle(reqs)
            return reqs
        if self.policy == "lof":
            return sorted(reqs, key=lambda r: -r.max_new_tokens)
        matches = {id(r): self.cache.match_prefix(r.all_ids) for r in reqs}
        if self.policy == "lpm":
            return sorted(reqs, key=lambda r: -(matches[id(r)].num_tokens + matches[id(r)].lower_tokens))
        # dfs-weight: walk the tree, heavier subtrees (more waiting requests) first
        weight: dict[int, int] = {}
        at_node: dict[int, list[Req]] = {}
        for r in reqs:
            node = matches[id(r)].node
            at_node.setdefault(id(node), []).append(r)
            while node is not None:
                weight[id(node)] = weight.get(id(node), 0) + 1
                node = node.parent
        out: list[Req] = []
        stack = [self.cache.root]
        while stack:
            node = stack.pop()
            out.extend(at_node.get(id(node), ()))
            kids = [c for c in node.children.values() if id(c) in weight]
            stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
        return out

    def _reserved_pages(self, reqs) -> int:
        """Pages kept back for the future decode tokens of admitted requests."""
        tokens = sum(min(r.max_new_tokens - len(r.output_ids), CLIP_MAX_NEW_TOKENS) for r in reqs)
        return int(tokens * self.new_token_ratio) // self.page_size

    def _schedule_prefill(self) -> list[tuple[Req, int]]:
        """(request, tokens to compute this step) for an extend batch; [] if none."""
        batch: list[tuple[Req, int]] = []
        chunk = self.args.chunked_prefill_size
        budget = self.args.max_prefill_tokens if chunk < 0 else min(chunk, self.args.max_prefill_tokens)
        lp_rows = self.prompt_logprob_rows  # logits rows for prompt logprobs this step
        # A request in the middle of a chunked prefill goes first.
        for req in self.running:
            if req.in_prefill:
                n, rows = self._fit_logprob_rows(req, req.kv_len, min(len(req.all_ids) - req.kv_len, budget), lp_rows)
                lp_rows -= rows
                need = _ceil_div(req.kv_len + n, self.page_size) - len(req.pages)
                pages = self._alloc_pages(need)
                while pages is None and self._retract_one(exclude=req):
                    pages = self._alloc_pages(need)
                if pages is None:
                    raise RuntimeError("the KV pool cannot hold a chunked prompt that passed admission")
                req.pages.extend(pages)
                batch.append((req, n))
                budget -= n
                break
        max_running = self.runner.max_running_requests
        order = self._order_waiting()
        if order and self.args.enable_priority_scheduling and not self.args.disable_priority_preemption:
            self._preempt_for(order[0], budget)
        elif order and self.first_token_preemption:
            order = self._pause_for_first_token(order, budget)
        reserve = self._reserved_pages(self._decoding())
        prefix_aware = self.policy in ("lpm", "dfs-weight")
        self._waiting_on_storage = False
        for req in order:
            if budget <= 0 or len(self.running) >= max_running or not self.req_pool.num_free:
                break
            if not self.cache.prefetch_ready(req):  # HiCache: its prefix is still coming from storage
                self._waiting_on_storage = True
                continue
            ids = req.all_ids
            match = self.cache.match_prefix(ids[:self._cacheable_prefix(req)])
            if prefix_aware and self._shares_with_batch(ids, match.num_tokens + match.lower_tokens, batch):
                continue  # wait one step: it will find that prefix in the cache
            if match.lower_tokens and not self._fits(req, match, batch, budget, reserve):
                break  # HiCache: load its host pages back only once it will be admitted
            match = self.cache.load_back(match)  # HiCache: the part on the host comes back to the device
            n_new = len(ids) - match.num_tokens
            n, rows = self._fit_logprob_rows(req, match.num_tokens, min(n_new, budget), lp_rows)
            if n == 0 or (n < n_new and batch):
                break  # only the first request of a batch may be chunked
            need = _ceil_div(match.num_tokens + n, self.page_size) - len(match.pages)
            self.cache.inc_lock_ref(match.node)  # protect the match while we may evict
            future = self._reserved_pages([req]) if n == n_new else 0
            if self.available_pages < need + reserve + future:
                self.cache.dec_lock_ref(match.node)
                break
            pages = self._alloc_pages(need)
            if pages is None:
                self.cache.dec_lock_ref(match.node)
                break
            self.waiting.remove(req)
            req.req_pool_idx = self.req_pool.alloc()
            req.prefix_node, req.num_tree_pages = match.node, len(match.pages)
            req.pages = match.pages + pages
            req.kv_len = match.num_tokens
            self._write_table(req, 0, match.num_tokens)
            self.cache.on_admit(req, match)
            if req.num_retractions == 0:
                req.cached_tokens = match.num_tokens
                self.stats.num_prompt_tokens += len(req.input_ids)
                self.stats.num_cached_prompt_tokens += match.num_tokens
            self.running.append(req)
            batch.append((req, n))
            budget -= n
            lp_rows -= rows
            reserve += future
        return batch

    @staticmethod
    def _cacheable_prefix(req: Req) -> int:
        """How many leading tokens of ``req`` may come from the prefix cache: not the last
        (its logits pick the next token), nor any position whose logits give a prompt
        logprob still to compute (``logprob_start_len``), as SGLang caps it."""
        return min(len(req.all_ids) - 1, req.prompt_logprob_next - 1)

    @staticmethod
    def _fit_logprob_rows(req: Req, start: int, n: int, rows_left: int) -> tuple[int, int]:
        """``n`` cut so that the prompt-logprob rows of ``req``'s chunk ``[start, start + n)``
        fit in ``rows_left`` (which bounds the logits one step materialises), and that
        chunk's row count."""
        a, b = req.prompt_logprob_span(start, start + n)
        if b - a <= rows_left:
            return n, b - a
        return a + rows_left - start, rows_left

    def _preempt_for(self, req: Req, budget: int) -> None:
        """Priority scheduling: while ``req`` (the most urgent waiting request) cannot be
        admitted for want of a running slot or KV pages, retract the least urgent decoding
        requests that it may preempt (:mod:`radixserve.engine.priority`). Nothing is retracted
        when even all of them leaving would not make room."""
        victims = preemption_victims(req, self._decoding(), self.args.priority_scheduling_preemption_threshold)
        if not victims or budget <= 0 or not self.cache.prefetch_ready(req):
            return
        if self._room_for(req, budget, []) or not self._room_for(req, budget, victims):
            return
        for victim in victims:
            self._retract(victim, preempted=True)
            if self._room_for(req, budget, []):
                return

    def _pause_for_first_token(self, order: list[Req], budget: int) -> list[Req]:
        """HiCache's first-token rule. Returns the admission order for this step: the first
        request of ``order`` that has no output yet goes first when it fits (a paused
        request, whose long match puts it ahead in prefix-aware orders, would otherwise take
        the room), and when it does not, decoding requests are paused for it (fewest output
        tokens first; never one paused before or with fewer than FIRST_TOKEN_PREEMPT_MIN_LEFT
        tokens left). When even that cannot make room, ``order`` is kept, so that what fits
        runs meanwhile. Once the paused requests waiting hold as many tokens as the host
        tier, nothing is paused or reordered until they have resumed: under sustained
        overload, newcomers cannot keep every request paused."""
        req = next((r for r in order if not r.output_ids), None)
        if req is None or budget <= 0 or not self.cache.prefetch_ready(req):
            return order
        if sum(r.seq_len for r in self.waiting if r.output_ids and r.num_preemptions) >= self._pause_capacity:
            return order
        victims = sorted((r for r in self._decoding() if r.num_preemptions == 0
                          and r.max_new_tokens - len(r.output_ids) >= FIRST_TOKEN_PREEMPT_MIN_LEFT),
                         key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        if not self._room_for(req, budget, []):
            if not victims or not self._room_for(req, budget, victims):
                return order  # it must wait anyway: let whatever fits run meanwhile
            for victim in victims:
                self._retract(victim, preempted=True)
                if self._room_for(req, budget, []):
                    break
        return [req] + [r for r in order if r is not req]

    def _room_for(self, req: Req, budget: int, leaving: list[Req]) -> bool:
        """Whether a running slot and the KV pages for ``req``'s next prefill chunk would be
        there once ``leaving`` were retracted (their pages counted as freed: an upper bound)."""
        if len(self.running) - len(leaving) >= self.runner.max_running_requests \
                or self.req_pool.num_free + len(leaving) == 0:
            return False
        match = self.cache.match_prefix(req.all_ids[:self._cacheable_prefix(req)])
        need, future, _ = self._pages_for(req, match, budget)
        reserve = self._reserved_pages([r for r in self._decoding() if r not in leaving])
        freed = sum(len(r.pages) for r in leaving)
        return self.available_pages + freed >= need + reserve + future

    def _pages_for(self, req: Req, match, budget: int) -> tuple[int, int, bool]:
        """(new pages for ``req``'s next prefill chunk once every tier of ``match`` is on
        the device, pages reserved for its future decode tokens, whether it is chunked)."""
        cached = match.num_tokens + match.lower_tokens
        n_new = len(req.all_ids) - cached
        n = min(n_new, budget)
        need = _ceil_div(cached + n, self.page_size) - len(match.pages)
        future = self._reserved_pages([req]) if n == n_new else 0
        return need, future, n < n_new

    def _fits(self, req: Req, match, batch, budget: int, reserve: int) -> bool:
        """Whether ``req`` would be admitted this step once the lower-tier part of
        ``match`` is on the device (the same test admission makes after loading)."""
        need, future, chunked = self._pages_for(req, match, budget)
        if chunked and batch:
            return False
        return self.available_pages >= need + reserve + future

    def _shares_with_batch(self, ids: list[int], matched: int, batch) -> bool:
        """Whether ``ids`` shares an uncached prefix of at least IN_BATCH_PREFIX_TOKENS with
        a request already in this prefill batch (computing it twice would waste the step)."""
        for other, _ in batch:
            if len(os.path.commonprefix([ids, other.all_ids])) - matched >= IN_BATCH_PREFIX_TOKENS:
                return True
        return False

    def _mixed_decode_rows(self, plan: list[tuple[Req, int]]) -> list[Req]:
        """The decoding requests that ride along in this prefill step (each with a slot for
        its next token), or [] when their next tokens do not all fit without retracting
        (then this step only prefills, and the next decode step makes room as usual)."""
        in_plan = set(map(id, (r for r, _ in plan)))
        decoding = [r for r in self._decoding() if id(r) not in in_plan]
        need = sum(1 for r in decoding if r.seq_len > len(r.pages) * self.page_size)
        if need > self.allocator.num_free_pages:
            self.cache.evict(need - self.allocator.num_free_pages)
        if need > self.allocator.num_free_pages:
            return []
        for req in decoding:
            if req.seq_len > len(req.pages) * self.page_size:
                req.pages.extend(self.allocator.allocate(1))
        return decoding

    # ------------------------------------------------------------ decode
    def _decoding(self) -> list[Req]:
        return [r for r in self.running if r.output_ids and not r.in_prefill]

    def _prepare_decode(self) -> list[Req]:
        """Give every decoding request a slot for its next token, retracting if needed."""
        while True:
            decoding = self._decoding()
            need = sum(1 for r in decoding if r.seq_len > len(r.pages) * self.page_size)
            if need > self.allocator.num_free_pages:
                self.cache.evict(need - self.allocator.num_free_pages)
            if need <= self.allocator.num_free_pages:
                break
            if len(decoding) == 1 or not self._retract_one():
                raise RuntimeError("the KV pool cannot hold one request's next token "
                                   "(its admission should have been refused)")
        for req in decoding:
            if req.seq_len > len(req.pages) * self.page_size:
                req.pages.extend(self.allocator.allocate(1))
        return decoding

    def _retract_one(self, exclude: Req | None = None) -> bool:
        """Retract the decoding request with the least progress; False if there is none."""
        candidates = [r for r in self._decoding() if r is not exclude]
        if not candidates:
            return False
        urgent = self.args.enable_priority_scheduling  # then the least urgent goes first
        self._retract(min(candidates, key=lambda r: (-r.priority if urgent else 0, len(r.output_ids),
                                                     -len(r.input_ids))))
        return True

    def _retract(self, req: Req, preempted: bool = False) -> None:
        """Put an admitted request back in the waiting queue (its computed pages go to the
        cache). ``preempted``: for a more urgent request, not for want of memory."""
        self.running.remove(req)
        self._release(req)
        req.num_retractions += 1
        self.waiting.appendleft(req)
        if preempted:
            req.num_preemptions += 1
            self.stats.num_preemptions += 1
            logger.info("preempted request %s (priority %d) after %d tokens", req.rid, req.priority,
                        len(req.output_ids))
            return
        self.stats.num_retractions += 1
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO
        logger.info("retracted request %s after %d tokens", req.rid, len(req.output_ids))

    # --------------------------------------------------------------- step
    def step(self) -> list[Req]:
        """Run one forward step. Returns the requests that took part."""
        if self.overlap is not None:  # an overlapped decode step, unless this one must run sequentially
            done = self.overlap.step()
            if done is not None:
                return done
        t0 = time.monotonic()
        self._poll_grammars()
        plan = self._schedule_prefill()
        failed: list[Req] = []
        if plan:
            riders = self._mixed_decode_rows(plan) if self.mixed_chunk else []
            mode = ForwardMode.MIXED if riders else ForwardMode.EXTEND
            reqs, lens, logits, batch = self._forward([r for r, _ in plan] + riders, mode,
                                                      [n for _, n in plan] + [1] * len(riders), failed)
            decoded = set(map(id, riders))
            done_rows = [i for i, req in enumerate(reqs) if id(req) in decoded]
            for i in done_rows:
                reqs[i].kv_len = reqs[i].seq_len
            # the prefill rows come first in ``reqs`` (riders last), so a prefill row's index
            # in ``plan`` is its row in ``reqs`` and ``logits``
            plan = [(req, n) for req, n in zip(reqs, lens) if id(req) not in decoded]
            if done_rows:
                self.stats.num_decode_tokens += len(done_rows)
                self.stats.num_mixed_steps += 1
                self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
            self._take_prompt_logprobs(batch)
            take_hidden_states(batch)
            for i, (req, n) in enumerate(plan):
                req.kv_len += n
                # Cache the computed prompt now, so requests sharing it reuse it while this
                # one still decodes (and the next chunk of a chunked prefill builds on it).
                self.cache.cache_unfinished_req(req)
                if req.kv_len == len(req.all_ids):
                    done_rows.append(i)
            num_prefilled = sum(n for _, n in plan)
            self.stats.num_prefill_tokens += num_prefilled
            scored = [reqs[i] for i in done_rows if reqs[i].max_new_tokens == 0]  # prompt logprobs only
            done_rows = sorted(i for i in done_rows if reqs[i].max_new_tokens != 0)
            finished = self._sample_and_update([reqs[i] for i in done_rows], logits[done_rows]) if done_rows else []
            for req in scored:
                self._finish(req, {"type": "length", "length": 0}, notify=False)
                finished.append(req)
            if self.spec is not None and reqs:
                self.spec.observe_extend(plan, batch)
            seconds = time.monotonic() - t0
            self.stats.prefill_seconds += seconds
            self.cache.observe_prefill(num_prefilled, seconds)  # HiCache: what recomputing costs
        else:
            reqs = self._prepare_decode()
            if not reqs:
                if self._waiting_on_storage:  # only requests whose prefix is still being fetched
                    self.cache.wait_prefetch(GRAMMAR_WAIT_SECONDS)
                    return []
                if self.waiting and not self.running:  # nothing can ever free memory for it
                    raise RuntimeError(f"scheduler stalled: request {self.waiting[0].rid} cannot be "
                                       f"admitted into an empty engine ({self.allocator.num_free_pages} free pages)")
                if self.grammar_queue:  # nothing to run until a grammar compiles
                    self.grammar.wait_any([r.grammar_job for r in self.grammar_queue],
                                          GRAMMAR_WAIT_SECONDS)
                    self._poll_grammars()
                self._maybe_check_idle()
                return []
            if self.spec is not None:
                reqs, finished = self.spec.decode(reqs, failed)
            else:
                reqs, _, logits, batch = self._forward(reqs, ForwardMode.DECODE, None, failed)
                take_hidden_states(batch)
                for req in reqs:
                    req.kv_len = req.seq_len
                self.stats.num_decode_tokens += len(reqs)
                finished = self._sample_and_update(reqs, logits) if reqs else []
            self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
            self.stats.decode_seconds += time.monotonic() - t0
        self.stats.num_forward_steps += 1
        self._retire(failed + finished)
        if self.consecutive_failed_steps >= self.args.max_consecutive_failed_steps:
            raise EngineFailure(f"{self.consecutive_failed_steps} forward steps in a row failed "
                                f"(--max-consecutive-failed-steps); last error: {self._last_step_error}")
        self._maybe_check_idle()
        return reqs + failed

    def _retire(self, finished: list[Req]) -> None:
        """Drop a step's finished (or failed) requests from the running list, then tell
        their owners: a request is reported done only once it is out of every queue."""
        if finished:
            self.running = [r for r in self.running if not r.finished]
            for req in finished:
                self._notify(req, 0, True)

    # ------------------------------------------------------------ failures
    def _forward(self, reqs: list[Req], mode: ForwardMode, lens: list | None, failed: list[Req],
                 build=None) -> tuple[list[Req], list | None, torch.Tensor | None, ForwardBatch | None]:
        """One forward pass over ``reqs``, isolating failures.

        If the batch raises, each request is run alone (K/V writes go to the same slots
        and are simply redone): requests that fail alone end with status 500 and the
        others run again as one batch. If none fails alone, or the retry fails too, the
        whole batch ends with 500. ``lens`` holds one item per request for ``build(reqs,
        lens)`` (default: the runner's batch of ``mode`` with these extend lengths).
        Returns the requests that ran, their ``lens``, their logits and the batch; failed
        requests are finished and appended to ``failed``."""
        if build is None:
            def build(rs, ls):
                return self.runner.build_batch(rs, mode, ls)

        def run(rs, ls):
            batch = build(rs, ls)
            batch.extra["reqs"] = rs
            if self.overlap is not None:  # every forward on the overlap's worker thread, in order
                return self.overlap.call(self.runner.forward, batch), batch
            return self.runner.forward(batch), batch

        self.cache.ready_for_forward()  # HiCache: pages loaded back from the host are in place

        try:
            logits, batch = run(reqs, lens)
        except Exception as e:  # noqa: BLE001 - one batch's failure must not stop the engine
            error: BaseException = e
            logger.exception("forward pass over %d requests failed", len(reqs))
        else:
            self.consecutive_failed_steps = 0
            return self._drop_nan_rows(reqs, lens, logits, batch, failed)
        if len(reqs) > 1:
            culprits: dict[int, BaseException] = {}
            for i, req in enumerate(reqs):
                try:
                    run([req], [lens[i]] if lens else None)
                except Exception as e:  # noqa: BLE001
                    culprits[i] = e
            if culprits and len(culprits) < len(reqs):
                for i, e in culprits.items():
                    logger.error("request %s: its forward pass fails alone: %r", reqs[i].rid, e)
                    self._fail(reqs[i], f"the forward pass failed for this request: {type(e).__name__}: {e}",
                               failed)
                keep = [i for i in range(len(reqs)) if i not in culprits]
                reqs = [reqs[i] for i in keep]
                lens = [lens[i] for i in keep] if lens else None
                try:
                    logits, batch = run(reqs, lens)
                except Exception as e:  # noqa: BLE001
                    error = e
                    logger.exception("forward pass failed again without the failing requests")
                else:
                    self.consecutive_failed_steps = 0
                    return self._drop_nan_rows(reqs, lens, logits, batch, failed)
        self.consecutive_failed_steps += 1
        self.stats.num_failed_steps += 1
        self._last_step_error = f"{type(error).__name__}: {error}"
        for req in reqs:
            self._fail(req, f"the forward pass of this request's batch failed: {self._last_step_error}", failed)
        return [], [] if lens is not None else None, None, None

    @staticmethod
    def _take_prompt_logprobs(batch: ForwardBatch | None) -> None:
        """Append the prompt logprobs an extend step computed to their requests."""
        if batch is None:
            return
        for req, lps, tops in batch.extra.get("prompt_logprobs", ()):
            if req.finished:  # failed in this step
                continue
            req.input_token_logprobs.extend(lps)
            if req.params.top_logprobs_num:
                req.input_top_logprobs.extend(tops)

    def _drop_nan_rows(self, reqs: list[Req], lens: list | None, logits: torch.Tensor, batch: ForwardBatch,
                       failed: list[Req]) -> tuple[list[Req], list | None, torch.Tensor, ForwardBatch]:
        """Fail the requests whose logits hold NaN (before their new K/V, NaN too, could
        enter the prefix cache); the rest go on. A verify batch has one row per tree node:
        its ``logits`` and aux hidden states are then kept whole (the caller slices them by
        the requests' row spans)."""
        # a row's max is NaN iff the row holds NaN: one reduction, ~20x faster than isnan().any()
        bad_rows = torch.isnan(logits.amax(dim=-1))  # [rows]
        if not bool(bad_rows.any()):
            return reqs, lens, logits, batch
        per_req = logits.shape[0] != len(reqs)
        if per_req:
            spans = torch.tensor(batch.extend_lens_cpu)
            owner = torch.repeat_interleave(torch.arange(len(reqs)), spans)
            bad = torch.zeros(len(reqs), dtype=torch.bool).index_put_((owner,), bad_rows.cpu(), accumulate=True)
            rows = bad.tolist()
        else:
            rows = bad_rows.tolist()
        for req, is_bad in zip(reqs, rows):
            if is_bad:
                logger.error("request %s: the model produced NaN logits", req.rid)
                self._fail(req, "the model produced NaN logits for this request", failed)
        keep = [i for i, is_bad in enumerate(rows) if not is_bad]
        if per_req:  # the caller maps the kept requests back to their rows
            batch.extra["kept_requests"] = keep
            return [reqs[i] for i in keep], [lens[i] for i in keep] if lens else None, logits, batch
        return ([reqs[i] for i in keep], [lens[i] for i in keep] if lens else None,
                logits[keep], batch)

    def _fail(self, req: Req, message: str, failed: list[Req] | None = None) -> None:
        """End ``req`` with an internal error (status 500); its pages and slot are freed.
        Listed in ``failed`` (notified once out of every queue), or notified at once."""
        self.stats.num_failed += 1
        if req in self.running:
            self.running.remove(req)
        try:
            self._finish(req, {"type": "abort", "status_code": 500, "message": message},
                         notify=failed is None)
        except Exception:  # noqa: BLE001 - e.g. the caller's callback raised
            logger.exception("request %s: could not report its failure", req.rid)
        if failed is not None:
            failed.append(req)

    def _maybe_check_idle(self) -> None:
        if self.args.enable_leak_check and not self.has_work:
            self.check_idle_invariant()

    def _sample_and_update(self, batch: list[Req], logits: torch.Tensor) -> list[Req]:
        """Sample one token per row and advance each request; returns those that finished
        (or failed: an error in one request's row ends that request only)."""
        errors: dict[int, str] = {}
        constrained = [i for i, r in enumerate(batch) if r.grammar is not None and i not in errors]
        mask = self._fill_bitmask(batch, constrained, errors) if constrained else None
        next_ids, logprobs, tops = self._sample(batch, logits, mask, errors)
        return self._take_tokens(batch, next_ids, logprobs, tops, errors)

    def _take_tokens(self, batch: list[Req], next_ids: list[int], logprobs: list | None = None,
                     tops: list | None = None, errors: dict[int, str] | None = None) -> list[Req]:
        """Append each request's sampled token (and logprobs), advance its grammar, check
        whether it finished and hand the token to its owner; returns the requests that
        finished or failed (an error in one request ends that request only)."""
        finished: list[Req] = []
        for i, req in enumerate(batch):
            if errors and i in errors:
                self._fail(req, errors[i], finished)
                continue
            try:
                tok = next_ids[i]
                req.output_ids.append(tok)
                if req.params.return_logprob:
                    req.output_token_logprobs.append(logprobs[i])
                    if req.params.top_logprobs_num:
                        req.output_top_logprobs.append(tops[i])
                reason = self._advance_grammar(req, tok) if req.grammar is not None else None
                if reason is None:
                    reason = self._check_finished(req, tok)
            except Exception as e:  # noqa: BLE001 - ends this request only
                logger.exception("request %s failed while taking its next token", req.rid)
                self._fail(req, f"{type(e).__name__}: {e}", finished)
                continue
            if reason is not None:
                self._finish(req, reason, notify=False)
                finished.append(req)
            elif not self._notify(req, 1, False):
                self._fail(req, "its output callback raised", finished)
        return finished

    def _sample(self, batch: list[Req], logits: torch.Tensor, mask: torch.Tensor | None,
                errors: dict[int, str]) -> tuple[list, list | None, list | None]:
        """Next token ids (and logprobs) of every row. If the batched sampler raises, rows
        are sampled one by one and a row that raises alone is recorded in ``errors``."""
        try:
            return self._sample_rows(batch, logits, mask)
        except Exception:  # noqa: BLE001
            logger.exception("sampling a batch of %d failed; sampling its rows one by one", len(batch))
        next_ids: list = [None] * len(batch)
        logprobs: list = [None] * len(batch)
        tops: list = [None] * len(batch)
        for i, req in enumerate(batch):
            if i in errors:
                continue
            try:
                ids, lps, top = self._sample_rows([req], logits[i:i + 1],
                                                  None if mask is None else mask[i:i + 1])
            except Exception as e:  # noqa: BLE001
                logger.exception("request %s: sampling failed", req.rid)
                errors[i] = f"sampling failed: {type(e).__name__}: {e}"
                continue
            next_ids[i] = ids[0]
            logprobs[i] = lps[0] if lps is not None else None
            tops[i] = top[0] if top is not None else None
        return next_ids, logprobs, tops

    def _sample_rows(self, batch: list[Req], logits: torch.Tensor, mask: torch.Tensor | None):
        info = SamplingBatchInfo.build(
            [r.params for r in batch], [r.generator for r in batch],
            [(r.input_ids, r.output_ids) for r in batch], [len(r.output_ids) for r in batch],
            self.eos_token_ids, self.vocab_size, logits.device,
            penalty_states=[r.penalty_state_for(self.vocab_size) for r in batch])
        info.vocab_mask = mask
        if self.overlap is not None:
            out = self.overlap.call(self.sampler.sample, logits, info)
        else:
            out = self.sampler.sample(logits, info)
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        return out.next_token_ids.tolist(), logprobs, out.top_logprobs

    def _fill_bitmask(self, batch: list[Req], rows: list[int], errors: dict[int, str]) -> torch.Tensor:
        """The allowed-token bitmask of this step: matchers fill their rows, others allow all.
        A matcher that raises fails its request (its row stays all-allowed)."""
        if self._bitmask is None or self._bitmask.shape[0] < len(batch):
            size = max(len(batch), self.runner.max_running_requests)
            self._bitmask = allocate_token_bitmask(size, self.vocab_size)
        mask = self._bitmask[:len(batch)]  # [B, W]
        mask.fill_(-1)
        for i in rows:
            try:
                batch[i].grammar.fill_bitmask(mask, i)
            except Exception as e:  # noqa: BLE001 - a matcher bug ends its request only
                logger.exception("request %s: the grammar matcher failed to fill its mask", batch[i].rid)
                errors[i] = f"the grammar backend failed: {type(e).__name__}: {e}"
                mask[i].fill_(-1)
        return mask

    def _advance_grammar(self, req: Req, tok: int) -> dict | None:
        """Feed the sampled token to the request's matcher; a finish reason if it ended."""
        if not req.grammar.accept_token(tok):
            logger.error("request %s: the grammar rejected token %d that its mask allowed", req.rid, tok)
            return {"type": "abort", "status_code": 500,
                    "message": f"the grammar backend rejected token {tok} that its own mask allowed"}
        if req.grammar.is_terminated():
            return {"type": "stop", "matched": tok}
        return None

    def _check_finished(self, req: Req, tok: int) -> dict | None:
        p = req.params
        checking = len(req.output_ids) >= p.min_new_tokens
        if p.stop or p.stop_regex:  # every token goes through the matcher; only the new text is searched
            if req.stop_matcher is None:
                req.stop_matcher = StopStringMatcher(self.tokenizer, p.stop, p.skip_special_tokens, p.stop_regex)
            hit = req.stop_matcher.add(tok, check=checking)
            if hit is not None:
                pos, matched = hit
                text = req.stop_matcher.text
                req.stop_text = text if p.no_stop_trim else text[:pos]
                return {"type": "stop", "matched": matched}
        if checking:
            if tok in (p.stop_token_ids or ()) or (not p.ignore_eos and tok in self.eos_token_ids):
                if not p.no_stop_trim:  # the matched token's text is not part of the output
                    req.stop_text = self.tokenizer.decode(req.output_ids[:-1],
                                                          skip_special_tokens=p.skip_special_tokens)
                return {"type": "stop", "matched": tok}
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if req.seq_len >= self.runner.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Req, reason: dict, notify: bool = True) -> None:
        req.finish_reason = reason
        req.grammar = None
        self._release(req)
        self.cache.on_request_done(req)
        if reason["type"] == "abort":
            self.stats.num_aborted += 1
        else:
            self.stats.num_finished += 1
        if notify:
            self._notify(req, 0, True)

    @staticmethod
    def _notify(req: Req, num_new: int, finished: bool) -> bool:
        """Tell the request's owner; False (logged) if its callback raised."""
        if req.on_output is None:
            return True
        try:
            req.on_output(req, num_new, finished)
        except Exception:  # noqa: BLE001 - a caller's bug must not stop the scheduler
            logger.exception("request %s: its output callback raised", req.rid)
            return False
        return True

    # ------------------------------------------------------------ checks
    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are admitted."""
        if self.running:
            return False
        self.cache.reset()
        return True

    def get_stats(self) -> dict:
        s = self.stats
        usable = self.allocator.num_usable_pages
        used = usable - self.allocator.num_free_pages
        return {
            "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "max_total_num_tokens": self.runner.max_total_tokens,
            "num_used_tokens": used * self.page_size,
            "num_cached_tokens": self.cache.total_pages * self.page_size,
            "token_usage": used / usable if usable else 0.0,
            "cache_hit_rate": s.num_cached_prompt_tokens / s.num_prompt_tokens if s.num_prompt_tokens else 0.0,
            "num_prompt_tokens": s.num_prompt_tokens,
            "num_cached_prompt_tokens": s.num_cached_prompt_tokens,
            "num_prefill_tokens": s.num_prefill_tokens,
            "num_decode_tokens": s.num_decode_tokens,
            "prefill_throughput": s.num_prefill_tokens / s.prefill_seconds if s.prefill_seconds else 0.0,
            "decode_throughput": s.num_decode_tokens / s.decode_seconds if s.decode_seconds else 0.0,
            "num_retractions": s.num_retractions,
            "num_preemptions": s.num_preemptions,
            "num_overlap_steps": s.num_overlap_steps,
            "num_finished_reqs": s.num_finished,
            "num_aborted_reqs": s.num_aborted,
            "new_token_ratio": self.new_token_ratio,
            "num_grammar_queue_reqs": len(self.grammar_queue),
            **(self.grammar.stats() if self.grammar is not None else {}),
            **(self.spec.get_stats() if self.spec is not None else {}),
            **self.cache.stats(),
            **(self.runner.expert_distribution.totals() if self.runner.expert_distribution is not None else {}),
            **(self.runner.graph_runner.stats() if self.runner.graph_runner is not None else {}),
        }

    def expert_distribution_record(self, action: str) -> str | None:
        """``start``, ``stop`` or ``dump`` the expert distribution recording (``dump``
        returns the file's path). ValueError for a model without MoE layers."""
        rec = self.runner.expert_distribution
        if rec is None:
            raise ValueError("the model has no MoE layers: there is no expert distribution to record")
        if action == "start":
            rec.start()
        elif action == "stop":
            rec.stop()
        elif action == "dump":
            return rec.dump()
        else:
            raise ValueError(f"unknown expert distribution action {action!r}; choose from: start, stop, dump")
        return None

    def check_idle_invariant(self) -> None:
        """When idle: every page is free or owned by the prefix cache, nothing in the cache
        is locked, and every request slot is free."""
        problems = []
        if self.has_work:
            problems.append(f"{len(self.waiting)} waiting, {len(self.running)} running and "
                            f"{len(self.grammar_queue)} compiling requests")
        free = self.allocator.num_free_pages
        cached = self.cache.total_pages
        if free + cached != self.allocator.num_usable_pages:
            problems.append(f"{self.allocator.num_usable_pages - free - cached} KV pages leaked "
                            f"({free} free + {cached} cached of {self.allocator.num_usable_pages})")
        if cached != self.cache.evictable_pages:
            problems.append(f"{cached - self.cache.evictable_pages} cached pages still locked")
        if len(set(self.allocator._free)) != free or set(self.allocator._free) & set(self.cache.all_pages()):
            problems.append("a page is both free and cached, or freed twice")
        in_use = self.req_pool.size - self.req_pool.num_reserved - self.req_pool.num_free
        if in_use:
            problems.append(f"{in_use} request slots leaked")
        problems.extend(self.cache.invariant_problems())
        if problems:
            raise AssertionError("idle invariant broken: " + "; ".join(problems))


def _bad_grammar(message: str, status_code: int = 400) -> dict:
    """The finish reason of a request whose grammar cannot be used (the server's 400, or
    429 when the compile queue is full)."""
    return {"type": "abort", "message": message, "status_code": status_code}
