"""Intake: a request's first checks, the queue caps, the grammar compile queue, abort.

Admission: beyond ``--max-queued-requests`` waiting requests a new one is refused with finish
reason ``{"type": "abort", "status_code": 429, ...}``. A request that can never run (longer
than the context, or than the whole KV pool) is refused with :class:`RequestRejected`.

Structured output: a request with a grammar (``json_schema``, ``regex``, ``ebnf``) waits in
the grammar queue while a compile worker compiles it, out of every batch, and joins the
waiting queue once compiled; a grammar that fails (or runs past the compile time limit)
finishes only its own request with an ``abort`` carrying ``status_code`` 400 (429 when the
compile queue is full or the request's client already has
``--grammar-max-compiles-per-client`` compiles in progress). With
``--reasoning-parser`` each matcher is wrapped in a
:class:`~radixserve.reasoning.ReasoningMatcher`: nothing is masked while the request is
still reasoning, the grammar starts after ``</think>``.
"""

from __future__ import annotations

import logging

from radixserve.engine.request import Req
from radixserve.grammar import grammar_key
from radixserve.grammar.manager import GrammarManager, no_backend_message
from radixserve.reasoning import ReasoningMatcher, ReasoningSpec

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_SECONDS = 0.05  # longest idle wait for a compile before the caller's loop runs again


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def bad_grammar(message: str, status_code: int = 400) -> dict:
    """The finish reason of a request whose grammar cannot be used (the server's 400, or
    429 when the compile queue is full)."""
    return {"type": "abort", "message": message, "status_code": status_code}


class Admission:
    def __init__(self, args, queues, kv, outputs, context_len: int, max_total_tokens: int,
                 grammar: GrammarManager | None, reasoning: ReasoningSpec | None) -> None:
        self.args = args
        self.queues = queues
        self.kv = kv
        self.outputs = outputs
        self.context_len = context_len
        self.max_total_tokens = max_total_tokens
        self.grammar = grammar  # None: constrained requests are refused
        self.reasoning = reasoning  # --reasoning-parser: grammars apply after the think block
        self.disagg = None  # prefill-decode disaggregation (the scheduler attaches it)
        self.lora = None  # the LoRA manager (--enable-lora; the scheduler attaches it)
        self._arrivals = 0

    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        total = num_prompt + max_new_tokens
        if num_prompt == 0:
            raise RequestRejected("the prompt is empty", "prompt")
        if total > self.context_len:
            raise RequestRejected(
                f"prompt ({num_prompt} tokens) plus max_new_tokens ({max_new_tokens}) is {total} tokens, "
                f"over the context length {self.context_len}", "max_new_tokens")
        if not self.kv.can_ever_hold(total):
            raise RequestRejected(
                f"prompt plus max_new_tokens ({total} tokens) can never fit in the KV pool "
                f"({self.max_total_tokens} tokens); raise --max-total-tokens", "max_new_tokens")

    def add(self, req: Req) -> None:
        refused = self.disagg.admit_check(req) if self.disagg is not None else None
        if req.lora_name is not None and (self.lora is None or req.lora_name not in self.lora.adapters):
            refused = f"lora_path: adapter {req.lora_name!r} was unloaded before the request was queued"
        if refused is not None:
            self.outputs.finish(req, {"type": "abort", "status_code": 400, "message": refused})
            return
        self.check_fits(len(req.input_ids), req.max_new_tokens)
        self._arrivals += 1
        req.arrival = self._arrivals
        limit = self.args.max_queued_requests
        queued = self.queues.num_queued + (self.disagg.num_queued if self.disagg is not None else 0)
        if limit is not None and queued >= limit:
            self.outputs.finish(req, {"type": "abort", "status_code": 429,
                                      "message": f"the server is busy: {queued} requests are already "
                                                 f"queued (--max-queued-requests {limit}); retry later"})
            return
        key = grammar_key(req.params)
        if key is None:
            self.enqueue(req)
            return
        if self.grammar is None:
            self.outputs.finish(req, bad_grammar(no_backend_message(self.args)))
            return
        req.grammar_job = self.grammar.get(key, req.client)
        self.queues.grammar.append(req)
        self.poll_grammars()

    def enqueue(self, req: Req) -> None:
        if self.disagg is not None and self.disagg.takes(req):  # decode side: its KV comes from elsewhere
            return
        self.queues.waiting.append(req)
        self.kv.cache.on_request_queued(req)  # HiCache: start fetching its prefix from storage

    def poll_grammars(self) -> None:
        """Move requests whose grammar compiled to the waiting queue; fail those whose
        compile failed or ran out of time."""
        if not self.queues.grammar:
            return
        still = []
        for req in self.queues.grammar:
            job = req.grammar_job
            self.grammar.check_timeout(job)
            if not job.is_done:
                still.append(req)
                continue
            req.grammar_job = None
            if job.error is not None:
                self.outputs.finish(req, bad_grammar(job.error, job.status_code))
                continue
            try:
                req.grammar = self.grammar.backend.new_matcher(job.compiled)
                if self.reasoning is not None:
                    req.grammar = ReasoningMatcher(req.grammar, self.reasoning,
                                                   self.reasoning.initial_state(req.input_ids))
            except Exception as e:  # noqa: BLE001 - a backend failure fails only this request
                logger.exception("grammar backend could not start a matcher")
                self.outputs.finish(req, bad_grammar(f"{type(e).__name__}: {e}"))
                continue
            self.enqueue(req)
        self.queues.grammar = still

    def wait_for_grammars(self) -> None:
        """Nothing runs until a grammar compiles: wait a little for one."""
        self.grammar.wait_any([r.grammar_job for r in self.queues.grammar], GRAMMAR_WAIT_SECONDS)
        self.poll_grammars()

    def abort(self, rid: str) -> Req | None:
        """Take request ``rid`` out of its queue (waiting, compiling or running) and end it
        with finish reason ``abort``; returns it, or None when it is not here."""
        q = self.queues
        for queue in (q.waiting, q.grammar, q.running):
            for req in queue:
                if req.rid == rid:
                    queue.remove(req)
                    req.grammar_job = None
                    self.outputs.finish(req, {"type": "abort", "message": "aborted"})
                    return req
        req = self.disagg.take(rid) if self.disagg is not None else None
        if req is not None:
            self.outputs.finish(req, {"type": "abort", "message": "aborted"})
        return req

    def abort_all(self, reason: dict) -> int:
        """End every queued, compiling and running request with ``reason``; returns how many."""
        q = self.queues
        reqs = list(q.waiting) + list(q.grammar) + list(q.running)
        if self.disagg is not None:
            reqs += self.disagg.take_all()
        q.waiting.clear()
        q.grammar = []
        q.running = []
        for req in reqs:
            req.grammar_job = None
            self.outputs.finish(req, dict(reason))
        return len(reqs)
