"""Scheduler: the waiting and running queues, admission, and one step of work at a time.

Each :meth:`Scheduler.step` either prefills newly admitted requests (prefill first, as
SGLang does) or decodes every running request by one token, then samples, checks stop
conditions and frees finished requests' memory. Admission reserves pages for a request's
prompt plus its whole ``max_new_tokens`` budget, so a running request never runs out of
KV memory.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from radixserve.engine.model_runner import ModelRunner
from radixserve.engine.request import Req
from radixserve.layers.attention import ForwardMode
from radixserve.sampling import Sampler, SamplingBatchInfo

logger = logging.getLogger(__name__)


class RequestRejected(ValueError):
    """A request that can never run (too long for the context or the KV pool)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class SchedulerStats:
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_forward_steps: int = 0
    num_finished: int = 0
    started: float = field(default_factory=time.monotonic)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class Scheduler:
    def __init__(self, runner: ModelRunner, tokenizer, eos_token_ids: set[int]) -> None:
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.page_size = runner.kv_pool.page_size
        self.allocator = runner.kv_pool.allocator
        self.req_pool = runner.req_to_token_pool
        self.sampler = Sampler()
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.reserved_pages = 0  # pages promised to running requests but not yet allocated
        self.stats = SchedulerStats()
        self.vocab_size = runner.model_config.vocab_size

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

    def add_request(self, req: Req) -> None:
        self.check_fits(len(req.input_ids), req.max_new_tokens)
        self.waiting.append(req)

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        for req in self.running:
            if req.rid == rid:
                self.running.remove(req)
                self._finish(req, {"type": "abort", "message": "aborted"})
                return True
        return False

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---------------------------------------------------------- admission
    def _budget_pages(self, req: Req) -> int:
        return _ceil_div(len(req.input_ids) + req.max_new_tokens, self.page_size)

    def _admit(self) -> list[Req]:
        batch: list[Req] = []
        tokens = 0
        max_running = self.runner.max_running_requests
        while self.waiting and len(self.running) + len(batch) < max_running and self.req_pool.num_free:
            req = self.waiting[0]
            need = self._budget_pages(req)
            if self.allocator.num_free_pages - self.reserved_pages < need:
                break
            if batch and tokens + len(req.input_ids) > self.runner.args.max_prefill_tokens:
                break
            self.waiting.popleft()
            req.req_pool_idx = self.req_pool.alloc()
            prompt_pages = _ceil_div(len(req.input_ids), self.page_size)
            req.pages = self.allocator.allocate(prompt_pages)
            self.reserved_pages += need - prompt_pages
            tokens += len(req.input_ids)
            batch.append(req)
        return batch

    def _grow(self, req: Req) -> None:
        """Make sure ``req`` has a page for its next token (drawn from its reservation)."""
        if req.seq_len > len(req.pages) * self.page_size:
            req.pages.extend(self.allocator.allocate(1))
            self.reserved_pages -= 1

    # --------------------------------------------------------------- step
    def step(self) -> list[Req]:
        """Run one forward step. Returns the requests that got new output (finished or not)."""
        batch = self._admit()
        if batch:
            mode = ForwardMode.EXTEND
        elif self.running:
            batch, mode = list(self.running), ForwardMode.DECODE
            for req in batch:
                self._grow(req)
        else:
            return []
        fb = self.runner.build_batch(batch, mode)
        logits = self.runner.forward(fb)
        if mode is ForwardMode.EXTEND:
            for req in batch:
                req.kv_len = req.seq_len
            self.stats.num_prefill_tokens += len(fb.input_ids)
            self.running.extend(batch)
        else:
            for req in batch:
                req.kv_len = req.seq_len
            self.stats.num_decode_tokens += len(batch)
        self.stats.num_forward_steps += 1
        finished = self._sample_and_update(batch, logits)
        if finished:
            self.running = [r for r in self.running if not r.finished]
            for req in finished:  # notify only once the request is out of every queue
                self._notify(req, 0, True)
        return batch

    def _sample_and_update(self, batch: list[Req], logits: torch.Tensor) -> list[Req]:
        info = SamplingBatchInfo.build(
            [r.params for r in batch], [r.generator for r in batch],
            [(r.input_ids, r.output_ids) for r in batch], [len(r.output_ids) for r in batch],
            self.eos_token_ids, self.vocab_size, logits.device)
        out = self.sampler.sample(logits, info)
        next_ids = out.next_token_ids.tolist()
        logprobs = out.logprobs.tolist() if out.logprobs is not None else None
        finished = []
        for i, (req, tok) in enumerate(zip(batch, next_ids)):
            req.output_ids.append(tok)
            if req.params.return_logprob:
                req.output_token_logprobs.append(logprobs[i])
                if req.params.top_logprobs_num:
                    req.output_top_logprobs.append(out.top_logprobs[i])
            reason = self._check_finished(req, tok)
            if reason is not None:
                self._finish(req, reason, notify=False)
                finished.append(req)
            else:
                self._notify(req, 1, False)
        return finished

    def _check_finished(self, req: Req, tok: int) -> dict | None:
        p = req.params
        if len(req.output_ids) >= p.min_new_tokens:
            if tok in (p.stop_token_ids or ()):
                return {"type": "stop", "matched": tok}
            if not p.ignore_eos and tok in self.eos_token_ids:
                return {"type": "stop", "matched": tok}
            if p.stop:
                text = self.tokenizer.decode(req.output_ids, skip_special_tokens=p.skip_special_tokens)
                tail_from = max(0, len(text) - max(len(s) for s in p.stop) - 16)
                for s in p.stop:
                    pos = text.find(s, tail_from)
                    if pos >= 0:
                        req.stop_text = text if p.no_stop_trim else text[:pos]
                        return {"type": "stop", "matched": s}
        if len(req.output_ids) >= req.max_new_tokens:
            return {"type": "length", "length": len(req.output_ids)}
        if req.seq_len >= self.runner.context_len:
            return {"type": "length", "length": len(req.output_ids)}
        return None

    def _finish(self, req: Req, reason: dict, notify: bool = True) -> None:
        req.finish_reason = reason
        self._release(req)
        self.stats.num_finished += 1
        if notify:
            self._notify(req, 0, True)

    @staticmethod
    def _notify(req: Req, num_new: int, finished: bool) -> None:
        if req.on_output is not None:
            req.on_output(req, num_new, finished)

    def _release(self, req: Req) -> None:
        if req.req_pool_idx is None:
            return
        self.reserved_pages -= self._budget_pages(req) - len(req.pages)
        self.allocator.free(req.pages)
        req.pages = []
        self.req_pool.free(req.req_pool_idx)
        req.req_pool_idx = None

    # ------------------------------------------------------------ checks
    def check_idle_invariant(self) -> None:
        """When idle every page is free and every request slot is free."""
        problems = []
        if self.has_work:
            problems.append(f"{len(self.waiting)} waiting and {len(self.running)} running requests")
        if self.allocator.num_free_pages != self.allocator.num_usable_pages:
            problems.append(f"{self.allocator.num_usable_pages - self.allocator.num_free_pages} KV pages leaked")
        if self.req_pool.num_free != self.req_pool.size:
            problems.append(f"{self.req_pool.size - self.req_pool.num_free} request slots leaked")
        if self.reserved_pages != 0:
            problems.append(f"page reservation off by {self.reserved_pages}")
        if problems:
            raise AssertionError("idle invariant broken: " + "; ".join(problems))
