"""Retraction and preemption: a running request put back in the waiting queue, its
computed pages in the prefix cache (or on the host tier with HiCache), its stream intact.

* **For memory**: when a decode step cannot fit even after evicting unlocked cache leaves,
  the decoding request with the least progress is retracted (greedy outputs are unchanged).
* **Priority** (``--enable-priority-scheduling``): when the most urgent waiting request finds
  no running slot or too few KV pages, less urgent decoding requests are preempted for it;
  the rules are in :mod:`radixserve.engine.priority`.
* **HiCache's first-token rule** (unless ``--disable-hicache-first-token-preemption``; not
  with priority scheduling): a waiting request that has no token yet goes first, and when
  it finds no room, decoding requests are paused for it, their pages demoted to the host
  tier. A request is paused at most once, and only with at least
  ``FIRST_TOKEN_PREEMPT_MIN_LEFT`` tokens of its budget left; once the paused requests
  waiting hold as many tokens as the host tier, nothing more is paused and they go first.
  When a burst arrives at a pool that holds one or two requests, every request gets its
  first token after the prefills ahead of it instead of after their whole answers.
"""

from __future__ import annotations

import logging

from radixserve.engine.priority import preemption_victims
from radixserve.engine.request import Req

logger = logging.getLogger(__name__)

FIRST_TOKEN_PREEMPT_MIN_LEFT = 8  # HiCache: decoding requests with fewer tokens left are not paused


class Preemption:
    def __init__(self, args, queues, kv, stats, max_running: int) -> None:
        self.args = args
        self.queues = queues
        self.kv = kv
        self.stats = stats
        self.max_running = max_running
        self.pause_capacity = getattr(kv.cache, "host_capacity_tokens", 0)  # tokens the host tier holds
        self.first_token_rule = (self.pause_capacity > 0
                                 and not args.disable_hicache_first_token_preemption
                                 and not args.enable_priority_scheduling)

    def retract(self, req: Req, preempted: bool = False) -> None:
        """Put an admitted request back in the waiting queue (its computed pages go to the
        cache). ``preempted``: for a more urgent request, not for want of memory."""
        self.queues.running.remove(req)
        self.kv.release(req)
        req.num_retractions += 1
        self.queues.waiting.appendleft(req)
        if preempted:
            req.num_preemptions += 1
            self.stats.num_preemptions += 1
            logger.info("preempted request %s (priority %d) after %d tokens", req.rid, req.priority,
                        len(req.output_ids))
            return
        self.stats.num_retractions += 1
        self.kv.reset_reservation()
        logger.info("retracted request %s after %d tokens", req.rid, len(req.output_ids))

    def retract_one(self, exclude: Req | None = None) -> bool:
        """Retract the decoding request with the least progress; False if there is none."""
        candidates = [r for r in self.queues.decoding() if r is not exclude]
        if not candidates:
            return False
        urgent = self.args.enable_priority_scheduling  # then the least urgent goes first
        self.retract(min(candidates, key=lambda r: (-r.priority if urgent else 0, len(r.output_ids),
                                                    -len(r.input_ids))))
        return True

    def decode_batch(self) -> list[Req]:
        """The decoding requests, each with a KV slot for its next token; retracts the
        least advanced ones while the pool cannot hold that step."""
        while True:
            decoding = self.queues.decoding()
            if self.kv.grow_by_one(decoding):
                return decoding
            if len(decoding) == 1 or not self.retract_one():
                raise RuntimeError("the KV pool cannot hold one request's next token "
                                   "(its admission should have been refused)")

    def make_room(self, order: list[Req], budget: int) -> list[Req]:
        """Before admission: preempt or pause for the first of ``order`` when the rules say
        so; returns the admission order for this step."""
        if not order:
            return order
        if self.args.enable_priority_scheduling and not self.args.disable_priority_preemption:
            self._preempt_for(order[0], budget)
            return order
        if self.first_token_rule:
            return self._pause_for_first_token(order, budget)
        return order

    def _preempt_for(self, req: Req, budget: int) -> None:
        """While ``req`` (the most urgent waiting request) cannot be admitted for want of a
        running slot or KV pages, retract the least urgent decoding requests it may preempt.
        Nothing is retracted when even all of them leaving would not make room."""
        victims = preemption_victims(req, self.queues.decoding(), self.args.priority_scheduling_preemption_threshold)
        if not victims or budget <= 0 or not self.kv.cache.prefetch_ready(req):
            return
        if self.room_for(req, budget, []) or not self.room_for(req, budget, victims):
            return
        for victim in victims:
            self.retract(victim, preempted=True)
            if self.room_for(req, budget, []):
                return

    def _pause_for_first_token(self, order: list[Req], budget: int) -> list[Req]:
        """The first request of ``order`` with no output yet goes first when it fits (a
        paused request, whose long match puts it ahead in prefix-aware orders, would
        otherwise take the room); when it does not, decoding requests are paused for it
        (fewest output tokens first). When even that cannot make room, ``order`` is kept, so
        that what fits runs meanwhile."""
        req = next((r for r in order if not r.output_ids), None)
        if req is None or budget <= 0 or not self.kv.cache.prefetch_ready(req):
            return order
        paused = sum(r.seq_len for r in self.queues.waiting if r.output_ids and r.num_preemptions)
        if paused >= self.pause_capacity:
            return order
        victims = sorted((r for r in self.queues.decoding() if r.num_preemptions == 0
                          and r.max_new_tokens - len(r.output_ids) >= FIRST_TOKEN_PREEMPT_MIN_LEFT),
                         key=lambda r: (len(r.output_ids), -len(r.input_ids)))
        if not self.room_for(req, budget, []):
            if not victims or not self.room_for(req, budget, victims):
                return order  # it must wait anyway: let whatever fits run meanwhile
            for victim in victims:
                self.retract(victim, preempted=True)
                if self.room_for(req, budget, []):
                    break
        return [req] + [r for r in order if r is not req]

    def room_for(self, req: Req, budget: int, leaving: list[Req]) -> bool:
        """Whether a running slot and the KV pages for ``req``'s next prefill chunk would be
        there once ``leaving`` were retracted (their pages counted as freed: an upper bound)."""
        if len(self.queues.running) - len(leaving) >= self.max_running \
                or self.kv.free_request_slots + len(leaving) == 0:
            return False
        staying = [r for r in self.queues.decoding() if r not in leaving]
        return self.kv.fits_once_released(req, budget, staying, leaving)
