"""The prefill plan: which waiting requests a step admits, and how many tokens of each it
computes.

Waiting requests are admitted in ``--schedule-policy`` order (by priority first with
``--enable-priority-scheduling``) while running slots, tokens (``--max-prefill-tokens``,
``--chunked-prefill-size``) and KV pages allow; each reuses the longest cached prefix of
its tokens and computes only the rest; a request sharing an uncached prefix with one
already in the batch waits a step, then finds that prefix cached. The prefix-aware
policies fall back to arrival order above ``--lpm-max-queue`` waiting requests. A prompt
longer than the chunk budget is prefilled in chunks over several steps (a request in the
middle of one goes first); only the first request of a batch may be chunked.

Prompt logprobs (``return_logprob`` with ``logprob_start_len`` k): such a request takes at
most its first k - 1 tokens from the prefix cache, so every position whose logits give one
is computed; one step computes at most ``prompt_logprob_rows`` of them (chunks are cut to
fit), which bounds the logits it materialises.

Mixed steps (the default; ``--disable-mixed-chunk`` turns them off): decoding requests
ride along in a prefill step when their next tokens all fit without retracting. Without
``--chunked-prefill-size`` such a step's prompt tokens are the stall-free budget
(:mod:`radixserve.engine.scheduler.budget`), so a long prompt holds decoding requests for
one budgeted step at a time.
"""

from __future__ import annotations

import os
import random

from radixserve.engine.priority import order_by_priority
from radixserve.engine.request import Req
from radixserve.engine.scheduler.budget import AUTO_CHUNK, StepBudget

IN_BATCH_PREFIX_TOKENS = 32  # defer a request sharing this much with one being prefilled
PROMPT_LOGPROB_LOGITS_BYTES = 256 << 20  # float32 logits one step may hold for prompt logprobs


def fit_logprob_rows(req: Req, start: int, n: int, rows_left: int) -> tuple[int, int]:
    """``n`` cut so that the prompt-logprob rows of ``req``'s chunk ``[start, start + n)`` fit
    in ``rows_left``, and that chunk's row count."""
    a, b = req.prompt_logprob_span(start, start + n)
    if b - a <= rows_left:
        return n, b - a
    return a + rows_left - start, rows_left


def shares_with_batch(ids: list[int], matched: int, batch) -> bool:
    """Whether ``ids`` shares an uncached prefix of at least IN_BATCH_PREFIX_TOKENS with a
    request already in this prefill batch (computing it twice would waste the step)."""
    for other, _ in batch:
        if len(os.path.commonprefix([ids, other.cache_ids])) - matched >= IN_BATCH_PREFIX_TOKENS:
            return True
    return False


class PrefillPlanner:
    def __init__(self, args, queues, kv, preemption, stats, max_running: int, vocab_size: int) -> None:
        self.args = args
        self.queues = queues
        self.kv = kv
        self.preemption = preemption
        self.stats = stats
        self.max_running = max_running
        self.policy = args.schedule_policy
        if args.disable_radix_cache and self.policy in ("lpm", "dfs-weight"):
            self.policy = "fcfs"  # prefix-aware orders mean nothing without the cache
        self.prompt_logprob_rows = max(1, PROMPT_LOGPROB_LOGITS_BYTES // (4 * vocab_size))
        self.waiting_on_storage = False  # the last plan skipped a request fetching from storage
        self.step_budget: StepBudget | None = None  # set by the scheduler for mixed steps with an auto chunk
        self.lora = None  # the runner's LoRA manager (--enable-lora), set by the scheduler
        self._rng = random.Random(0)

    # ------------------------------------------------------------ order
    def order(self) -> list[Req]:
        """The waiting queue in admission order: by priority first when priority scheduling
        is on (stable), then by ``--schedule-policy``."""
        order = self._policy_order()
        return order_by_priority(order) if self.args.enable_priority_scheduling else order

    def _policy_order(self) -> list[Req]:
        reqs = list(self.queues.waiting)
        if self.policy == "fcfs" or len(reqs) < 2:
            return reqs
        if self.policy in ("lpm", "dfs-weight") and len(reqs) > self.args.lpm_max_queue:
            return reqs  # matching every waiting request each step would cost more than it saves
        if self.policy == "random":
            self._rng.shuffle(reqs)
            return reqs
        if self.policy == "lof":
            return sorted(reqs, key=lambda r: -r.max_new_tokens)
        matches = {id(r): self.kv.prefix_match(r) for r in reqs}
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
        stack = list(self.kv.roots)  # one tree (a tree per attention group with DP attention)
        while stack:
            node = stack.pop()
            out.extend(at_node.get(id(node), ()))
            kids = [c for c in node.children.values() if id(c) in weight]
            stack.extend(sorted(kids, key=lambda c: weight[id(c)]))  # heaviest popped first
        return out

    # ------------------------------------------------------------ the plan
    def chunk_budget(self) -> int:
        """This step's chunk: ``--chunked-prefill-size`` when given; otherwise the stall-free
        budget while requests decode (with mixed steps), else the full automatic chunk."""
        chunk = self.args.chunked_prefill_size
        if chunk is not None:
            return chunk
        if self.step_budget is None:
            return AUTO_CHUNK
        return self.step_budget.prefill_tokens(len(self.queues.decoding()))

    def plan(self) -> list[tuple[Req, int]]:
        """(request, tokens to compute this step) for an extend batch; [] if none."""
        batch: list[tuple[Req, int]] = []
        chunk = self.chunk_budget()
        budget = self.args.max_prefill_tokens if chunk < 0 else min(chunk, self.args.max_prefill_tokens)
        lp_rows = self.prompt_logprob_rows  # logits rows for prompt logprobs this step
        req = next((r for r in self.queues.running if r.in_prefill), None)
        if req is not None:  # a request in the middle of a chunked prefill goes first
            n, rows = fit_logprob_rows(req, req.kv_len, min(len(req.all_ids) - req.kv_len, budget), lp_rows)
            lp_rows -= rows
            while not self.kv.grow_chunk(req, n):
                if not self.preemption.retract_one(exclude=req):
                    raise RuntimeError("the KV pool cannot hold a chunked prompt that passed admission")
            batch.append((req, n))
            budget -= n
        order = self.preemption.make_room(self.order(), budget)
        reserve = self.kv.reserved_pages(self.queues.decoding())
        dedupe = not self.args.disable_radix_cache
        cache = self.kv.cache
        self.waiting_on_storage = False
        for req in order:
            if budget <= 0 or len(self.queues.running) >= self.max_running or not self.kv.free_request_slots:
                break
            if not cache.prefetch_ready(req):  # HiCache: its prefix is still coming from storage
                self.waiting_on_storage = True
                continue
            if req.lora_name is not None and self.lora.ensure_slot(
                    req.lora_name, {r.lora_name for r in self.queues.running}) is None:
                continue  # every adapter slot holds an adapter that running requests use
            match = self.kv.match(req)
            if dedupe and shares_with_batch(req.cache_ids, match.num_tokens + match.lower_tokens, batch):
                continue  # wait one step: it will find that prefix in the cache
            if match.lower_tokens and not self.kv.fits(req, match, budget, reserve, alone=not batch):
                break  # HiCache: load its host pages back only once it will be admitted
            match = cache.load_back(match)  # HiCache: the part on the host comes back to the device
            n_new = len(req.all_ids) - match.num_tokens
            n, rows = fit_logprob_rows(req, match.num_tokens, min(n_new, budget), lp_rows)
            if n == 0 or (n < n_new and batch):
                break  # only the first request of a batch may be chunked
            future = self.kv.admit(req, match, n, reserve)
            if future is None:
                break
            self.queues.waiting.remove(req)
            if req.num_retractions == 0:
                req.cached_tokens = match.num_tokens if self.args.cache_report == "on" else 0
                self.stats.num_prompt_tokens += len(req.input_ids)
                self.stats.num_cached_prompt_tokens += match.num_tokens
            self.queues.running.append(req)
            batch.append((req, n))
            budget -= n
            lp_rows -= rows
            reserve += future
        return batch

    def riders(self, plan: list[tuple[Req, int]]) -> list[Req]:
        """The decoding requests that ride along in this prefill step (each with a slot for
        its next token), or [] when their next tokens do not all fit without retracting
        (then this step only prefills, and the next decode step makes room as usual)."""
        in_plan = set(map(id, (r for r, _ in plan)))
        decoding = [r for r in self.queues.decoding() if id(r) not in in_plan]
        return decoding if self.kv.grow_by_one(decoding) else []
