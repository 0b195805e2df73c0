"""The step loop: admit, plan, run one forward, retire.

Each :meth:`Scheduler.step` is one forward pass: prefill first (the planner's batch, with
decoding riders unless ``--disable-mixed-chunk``; every step's measured length feeds the
stall-free budget, ``budget.py``), otherwise decode every running request
by one token (plain or speculative). Overlapped scheduling, when on, runs decode steps
pipelined ahead of this loop and hands back to it whenever a step must run sequentially.
A request with ``max_new_tokens: 0`` is prefilled (so its prompt enters the prefix cache:
SGLang's frontend caches a prefix this way), then finished without sampling.
"""

from __future__ import annotations

import contextlib
import logging
import time

from radixserve.engine.request import Req
from radixserve.engine.scheduler.admission import GRAMMAR_WAIT_SECONDS, Admission
from radixserve.engine.scheduler.budget import AUTO_CHUNK, StepBudget
from radixserve.engine.scheduler.dp_kv import GroupedKV
from radixserve.engine.scheduler.drivers import DecodeDriver, PrefillDriver
from radixserve.engine.scheduler.faults import IsolatedForward
from radixserve.engine.scheduler.kv import KVManager
from radixserve.engine.scheduler.output import OutputProcessor, run_here
from radixserve.engine.scheduler.overlap import (
    OverlapScheduler,
    overlap_unsupported,
    overlap_wanted,
)
from radixserve.engine.scheduler.planner import PrefillPlanner
from radixserve.engine.scheduler.preemption import Preemption
from radixserve.engine.scheduler.state import Queues, SchedulerStats
from radixserve.grammar.manager import GrammarManager
from radixserve.kernels import cpu as cpu_kernels
from radixserve.kernels import tape as kernel_tape
from radixserve.mem.radix_cache import BasePrefixCache, NullPrefixCache, RadixCache
from radixserve.reasoning import ReasoningSpec
from radixserve.speculative.runtime import SpecDecoder

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner, tokenizer, eos_token_ids: set[int], grammar: GrammarManager | None = None,
                 proposer=None, cache: BasePrefixCache | None = None, reasoning: ReasoningSpec | None = None) -> None:
        args = self.args = runner.args
        self.runner = runner
        self.eos_token_ids = eos_token_ids
        self.grammar = grammar
        if args.attn_dp_size > 1:  # DP attention: a KV manager and prefix cache per attention group
            self.kv = GroupedKV(runner, args.attn_dp_size, args.disable_radix_cache)
            cache = self.kv.cache
        elif cache is None:
            cache_cls = NullPrefixCache if args.disable_radix_cache else RadixCache
            cache = cache_cls(runner.kv_pool.allocator, runner.kv_pool.page_size, runner.req_to_token_pool)
        self.cache: BasePrefixCache = cache
        max_running, vocab = runner.max_running_requests, runner.model_config.vocab_size
        self.queues = Queues()
        self.stats = SchedulerStats()
        if args.attn_dp_size == 1:
            self.kv = KVManager(runner, cache)
        self.outputs = OutputProcessor(tokenizer, eos_token_ids, vocab, max_running, runner.context_len,
                                       self.kv, self.queues, self.stats)
        self.admission = Admission(args, self.queues, self.kv, self.outputs, runner.context_len,
                                   runner.max_total_tokens, grammar, reasoning)
        self.preemption = Preemption(args, self.queues, self.kv, self.stats, max_running)
        self.disagg = None  # --disaggregation-mode prefill/decode: radixserve.disaggregation.setup
        self.planner = PrefillPlanner(args, self.queues, self.kv, self.preemption, self.stats, max_running, vocab)
        # --enable-lora: a request waits for a slot for its adapter; one unloaded meanwhile is refused
        self.planner.lora = self.admission.lora = getattr(runner, "lora", None)
        self.forward = IsolatedForward(runner, cache, self.outputs, self.stats, args.max_consecutive_failed_steps)
        # speculative decoding (--speculative-algorithm): decode steps verify drafts
        self.spec = None
        if proposer is not None:
            self.spec = SpecDecoder(proposer, runner, self.kv, self.outputs, self.forward, self.stats)
            self.kv.release_hooks.append(self.spec.release)
        self.decoder = self.spec or DecodeDriver(self.forward, self.outputs, self.kv, self.stats)
        self.prefill = PrefillDriver(self.forward, self.outputs, self.kv, self.stats, self.spec)
        # mixed steps (unless --disable-mixed-chunk): decoding requests ride along in prefill
        # steps (not while speculating: a verify step is its own kind of extend); without
        # --chunked-prefill-size their prefill tokens follow the measured step budget
        self.mixed_chunk = not args.disable_mixed_chunk and self.spec is None
        target_ms = args.mixed_chunk_target_itl_ms
        self.budget = StepBudget(min(AUTO_CHUNK, args.max_prefill_tokens),
                                 None if target_ms is None else target_ms / 1e3)
        if self.mixed_chunk and args.chunked_prefill_size is None:
            self.planner.step_budget = self.budget
        # overlapped scheduling (unless --disable-overlap-schedule): see overlap.py
        self._overlap: OverlapScheduler | None = None
        if overlap_wanted(args, runner.device):
            why_not = overlap_unsupported(args, runner, cache, proposer)
            if why_not is None:
                self.overlap = OverlapScheduler(self)
            else:
                logger.info("overlapped scheduling is off with %s", why_not)

    # ------------------------------------------------------------ the loop
    def step(self) -> list[Req]:
        """Run one forward step. Returns the requests that took part."""
        if self.overlap is None:
            return self._step()
        # forwards and sampling run on the overlap worker: this thread's own ops stay serial, so
        # the worker's OpenMP pool is the only one on CPU (radixserve.kernels.cpu.serial_section)
        with cpu_kernels.serial_section() if self.runner.device.type == "cpu" else contextlib.nullcontext():
            done = self.overlap.step()  # an overlapped decode step, unless this one must run sequentially
            return done if done is not None else self._step()

    def _step(self) -> list[Req]:
        if self.disagg is not None:
            self.disagg.poll()
        t0 = time.monotonic()
        records = kernel_tape.records  # a step that records a decode tape is no measure of its cost
        self.admission.poll_grammars()
        failed: list[Req] = []
        plan = self.planner.plan()
        if plan:
            riders = self.planner.riders(plan) if self.mixed_chunk else []
            num_prefill = sum(n for _, n in plan)
            reqs, finished = self.prefill.run(plan, riders, failed, t0)
            if not failed and kernel_tape.records == records:
                self.budget.observe_step(num_prefill, len(riders), time.monotonic() - t0)
        else:
            reqs = self.preemption.decode_batch()
            if not reqs:
                return self._idle()
            reqs, finished = self.decoder.run(reqs, failed)
            self.kv.decay_reservation()
            seconds = time.monotonic() - t0
            self.stats.decode_seconds += seconds
            if self.spec is None and not failed and kernel_tape.records == records:
                self.budget.observe_decode(len(reqs), seconds)
        self.stats.num_forward_steps += 1
        self.retire(failed + finished)
        self.after_step()
        return reqs + failed

    def _idle(self) -> list[Req]:
        """Nothing to run this step: wait a little for what could change that."""
        q = self.queues
        if self.disagg is not None and self.disagg.busy:  # KV on its way in or out
            self.disagg.wait(GRAMMAR_WAIT_SECONDS)
            return []
        if self.planner.waiting_on_storage:  # only requests whose prefix is still being fetched
            self.cache.wait_prefetch(GRAMMAR_WAIT_SECONDS)
            return []
        if q.waiting and not q.running:  # nothing can ever free memory for it
            raise RuntimeError(f"scheduler stalled: request {q.waiting[0].rid} cannot be admitted into "
                               f"an empty engine ({self.kv.allocator.num_free_pages} free pages)")
        if q.grammar:  # nothing to run until a grammar compiles
            self.admission.wait_for_grammars()
        self._maybe_check_idle()
        return []

    def retire(self, finished: list[Req]) -> None:
        """Drop a step's finished (or failed) requests from the running list, then tell
        their owners: a request is reported done only once it is out of every queue."""
        if finished:
            self.queues.running = [r for r in self.queues.running if not r.finished]
            for req in finished:
                self.outputs.notify(req, 0, True)

    def after_step(self) -> None:
        """Stop the engine after too many failed steps in a row; check the memory rule
        when idle (``--enable-leak-check``)."""
        self.forward.check()
        self._maybe_check_idle()

    @property
    def overlap(self) -> OverlapScheduler | None:
        return self._overlap

    @overlap.setter
    def overlap(self, overlap: OverlapScheduler | None) -> None:
        """Every forward and sampling call runs on the overlap's worker while it is on."""
        self._overlap = overlap
        self.outputs.call = overlap.call if overlap is not None else run_here

    # ------------------------------------------------------------ intake
    def check_fits(self, num_prompt: int, max_new_tokens: int) -> None:
        self.admission.check_fits(num_prompt, max_new_tokens)

    def add_request(self, req: Req) -> None:
        self.admission.add(req)

    def abort(self, rid: str) -> bool:
        """Abort a queued, prefilling or decoding request; its caller gets finish reason
        ``abort`` with the tokens produced so far."""
        req = self.admission.abort(rid)
        if req is not None and self.overlap is not None:
            self.overlap.drain_if_idle()
        return req is not None

    def abort_all(self, reason: dict) -> int:
        """End every queued, compiling and running request with ``reason``; returns how many."""
        n = self.admission.abort_all(reason)
        if self.overlap is not None:
            self.overlap.drain_if_idle()
        return n

    @property
    def num_queued(self) -> int:
        return self.queues.num_queued

    @property
    def has_work(self) -> bool:
        return self.queues.has_work or (self.disagg is not None and self.disagg.busy)

    def attach_disaggregation(self, disagg) -> None:
        """Serve as the prefill or the decode side of disaggregated requests."""
        self.disagg = self.admission.disagg = disagg

    @property
    def waiting(self):
        return self.queues.waiting

    @property
    def running(self) -> list[Req]:
        return self.queues.running

    @property
    def grammar_queue(self) -> list[Req]:
        return self.queues.grammar

    # ------------------------------------------------------------ admin
    def close(self) -> None:
        """At shutdown: the prefix cache's pending storage writes land and its threads stop;
        the grammar compile processes are killed."""
        try:
            if self.disagg is not None:
                self.disagg.close()
            self.cache.close()
        finally:
            if self.grammar is not None:
                self.grammar.close()

    def flush_cache(self) -> bool:
        """Drop every cached prefix; refused (False) while requests are admitted."""
        if self.queues.running:
            return False
        self.cache.reset()
        return True

    def get_stats(self) -> dict:
        runner = self.runner
        return {
            "num_running_reqs": len(self.queues.running),
            "num_waiting_reqs": len(self.queues.waiting),
            "max_total_num_tokens": runner.max_total_tokens,
            **self.kv.usage(),
            **self.stats.as_dict(),
            **(self.budget.stats() if self.planner.step_budget is not None else {}),
            **(self.disagg.stats() if self.disagg is not None else {}),
            "num_grammar_queue_reqs": len(self.queues.grammar),
            **(self.grammar.stats() if self.grammar is not None else {}),
            **(self.spec.get_stats() if self.spec is not None else {}),
            **self.cache.stats(),
            **(runner.expert_distribution.totals() if runner.expert_distribution is not None else {}),
            **(runner.graph_runner.stats() if runner.graph_runner is not None else {}),
            **(runner.verify_tapes.stats() if runner.verify_tapes is not None else {}),
        }

    def expert_distribution_record(self, action: str) -> str | None:
        """``start``, ``stop`` or ``dump`` the expert distribution recording (``dump``
        returns the file's path). ValueError for a model without MoE layers."""
        rec = self.runner.expert_distribution
        if rec is None:
            raise ValueError("the model has no MoE layers: there is no expert distribution to record")
        if action not in ("start", "stop", "dump"):
            raise ValueError(f"unknown expert distribution action {action!r}; choose from: start, stop, dump")
        out = getattr(rec, action)()
        return out if action == "dump" else None

    def _maybe_check_idle(self) -> None:
        if self.args.enable_leak_check and not self.has_work:
            self.check_idle_invariant()

    def check_idle_invariant(self) -> None:
        """When idle: every page is free or owned by the prefix cache, nothing in the cache
        is locked, and every request slot is free."""
        q = self.queues
        problems = []
        if q.has_work:
            problems.append(f"{len(q.waiting)} waiting, {len(q.running)} running and "
                            f"{len(q.grammar)} compiling requests")
        problems.extend(self.kv.idle_problems())
        if problems:
            raise AssertionError("idle invariant broken: " + "; ".join(problems))
