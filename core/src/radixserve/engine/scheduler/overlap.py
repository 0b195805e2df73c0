"""Overlapped scheduling (``--disable-overlap-schedule`` turns it off).

A forward worker thread runs every forward pass (and its sampling) of the scheduler, one
after another in submission order. In an overlapped decode step the scheduler thread

1. forms step N+1's decode batch (a KV slot for each request's next position, the
   request-to-token table, the sampling tensors) while step N's forward still runs, with
   each request's input token left as a *future*: the worker fills it from step N's
   sampled ids just before step N+1's forward;
2. submits step N+1, then waits for step N and resolves it one step late: appends the
   tokens, checks stop strings, stop tokens, EOS and lengths, hands the new tokens to the
   request's owner (detokenisation, streaming) and frees the requests that finished.

A request that finished (or was aborted) at step N has already been given one more
decode in step N+1; that row is computed and discarded. Its KV slot belonged to the
request's own pages, which its finish returned to the pool or the prefix cache (only full
pages of tokens computed by resolved steps enter the cache), and every K/V write happens
on the worker in submission order, so a page reused later is written only after the
discarded row. Tokens are identical to the sequential loop: the same batches run the same
forward and the same sampler, and each request's generator draws in the same order.

A step runs sequentially (the in-flight step is resolved first) when it may admit or
prefill (a waiting request, a chunked prefill, mixed steps), when the KV pool has no free
slot for every request's next position without evicting or retracting, and when a
running request reads what the late resolution would not have yet: a grammar, a
repetition, frequency or presence penalty, logprobs. Overlap is off altogether with
speculative decoding, HiCache and ``--expert-distribution-recorder-mode`` (a recording started
later through the engine's endpoints may count the expert load of a pass in flight at its
start or stop in the wrong window). On several ranks the
worker's forward sends each step to the other ranks as it starts it (the table entries that
step reads were written before it was submitted; the next step's are written while it runs
and travel with that step). A forward that raises, or NaN logits, makes the in-flight step
redo the failed one sequentially (with the scheduler's per-request isolation) and drop
the step that depended on it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from dataclasses import dataclass, field

import torch

from radixserve.engine.request import Req
from radixserve.engine.scheduler.dp_kv import GroupedPrefixCache
from radixserve.layers.attention import ForwardBatch, ForwardMode
from radixserve.mem.radix_cache import NullPrefixCache, RadixCache
from radixserve.sampling import SamplingBatchInfo

logger = logging.getLogger(__name__)

# CPU default, from the measurement in BENCHMARKS.md ("Overlapped scheduling"); on CUDA
# overlap is on unless --disable-overlap-schedule
CPU_OVERLAP_DEFAULT = False


def overlap_wanted(args, device: torch.device) -> bool:
    """Whether the flags ask for overlapped scheduling on ``device``."""
    if args.disable_overlap_schedule:
        return False
    if args.enable_overlap_schedule:
        return True
    return device.type == "cuda" or CPU_OVERLAP_DEFAULT


def overlap_unsupported(args, runner, cache, proposer) -> str | None:
    """Why overlap cannot run with this engine at all (None: it can)."""
    if proposer is not None:
        return "speculative decoding"
    if args.disaggregation_mode != "null":
        return "prefill-decode disaggregation"
    caches = cache.caches if isinstance(cache, GroupedPrefixCache) else [cache]  # (DP attention: one per group)
    if any(type(c) not in (RadixCache, NullPrefixCache) for c in caches):
        return "HiCache"
    if args.expert_distribution_recorder_mode is not None:  # per-pass records from launch: one pass at a time
        return "--expert-distribution-recorder-mode"
    return None


@dataclass
class _Step:
    """One submitted decode step."""

    reqs: list[Req]
    future: concurrent.futures.Future | None = None
    # filled by the worker
    next_ids: list[int] | None = None
    next_ids_t: torch.Tensor | None = None
    error: str | None = None  # the forward or the sampler raised, or NaN logits: redo sequentially
    skipped: bool = False  # the step it depends on failed: nothing ran
    t0: float = field(default_factory=time.monotonic)


class OverlapScheduler:
    """The forward worker and the one step in flight for a :class:`Scheduler`; it drives
    the scheduler's parts through their public methods."""

    def __init__(self, sched) -> None:
        self.runner = sched.runner
        self.queues, self.kv, self.stats = sched.queues, sched.kv, sched.stats
        self.outputs, self.forward, self.admission = sched.outputs, sched.forward, sched.admission
        self.retire, self.after_step = sched.retire, sched.after_step
        self.budget = sched.budget  # overlapped decode steps are measured too (the stall-free budget)
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="radixserve-forward")
        self.inflight: _Step | None = None
        self.num_threads = torch.get_num_threads()

    # ------------------------------------------------------------ worker
    def call(self, fn, *args):
        """Run ``fn(*args)`` on the forward worker (after what is queued there); its
        result, or its exception raised here."""
        return self.executor.submit(self._in_worker, fn, *args).result()

    def _in_worker(self, fn, *args):
        if torch.get_num_threads() != self.num_threads:
            torch.set_num_threads(self.num_threads)
        with torch.inference_mode():
            return fn(*args)

    def _run(self, step: _Step, batch: ForwardBatch, info: SamplingBatchInfo, prev: _Step | None,
             src: torch.Tensor | None) -> None:
        """Worker side of one step: resolve the future input tokens, forward, sample."""
        if prev is not None:
            if prev.next_ids_t is None:
                step.skipped = True
                return
            batch.input_ids = prev.next_ids_t[src]
        try:
            logits = self.runner.forward(batch)
            if bool(torch.isnan(logits.amax(dim=-1)).any()):  # a row's max is NaN iff the row holds NaN
                step.error = "NaN logits"
                return
            out = self.outputs.sampler.sample(logits, info)
            step.next_ids = out.next_token_ids.tolist()
            step.next_ids_t = out.next_token_ids
        except Exception as e:  # noqa: BLE001 - the scheduler redoes the step with isolation
            logger.warning("overlapped step over %d requests failed (%s: %s); redoing it sequentially",
                           len(step.reqs), type(e).__name__, e)
            step.error = f"{type(e).__name__}: {e}"

    # ------------------------------------------------------------- steps
    def step(self) -> list[Req] | None:
        """One overlapped decode step: returns the requests of the resolved step, or None
        when this step must run sequentially (nothing is in flight then)."""
        t0 = time.monotonic()
        self.admission.poll_grammars()
        prev = self.inflight
        reqs = self._plan(prev)
        if reqs is None:
            if prev is not None:
                self.inflight = None
                self._resolve(prev, t0)
            return None
        try:
            self.inflight = self._launch(reqs, prev)
        except Exception:  # noqa: BLE001 - e.g. a sampling parameter the sampler refuses
            logger.exception("could not form an overlapped decode step; running it sequentially")
            if prev is not None:
                self.inflight = None
                self._resolve(prev, t0)
            return None  # the sequential step isolates the request to blame
        self.kv.decay_reservation()
        if prev is None:
            return []
        self.stats.num_overlap_steps += 1
        return self._resolve(prev, t0)

    @staticmethod
    def eligible(req: Req) -> bool:
        """Whether ``req``'s next token can be sampled before its last one is resolved."""
        p = req.params
        return req.grammar is None and not p.return_logprob and not p.has_penalties

    def _plan(self, prev: _Step | None) -> list[Req] | None:
        """The requests of the next overlapped decode step, each with a KV slot for the
        position it computes; None when the step must run sequentially."""
        running = self.queues.running
        if self.queues.waiting or not running:
            return None
        in_prev = set(map(id, prev.reqs)) if prev is not None else set()
        ahead = 1 if prev is not None else 0
        for r in running:
            if not r.output_ids or r.in_prefill or not self.eligible(r):
                return None
            if prev is not None and id(r) not in in_prev:
                return None
        if not self.kv.grow_by_one(running, ahead):
            return None  # the sequential step retracts if it must
        return list(running)

    def _launch(self, reqs: list[Req], prev: _Step | None) -> _Step:
        ahead = 1 if prev is not None else 0
        batch = self._build(reqs, ahead)
        batch.extra["reqs"] = reqs
        info = self.outputs.sampling_info(reqs, batch.input_ids.device, ahead=ahead, penalties=False)
        src = None
        if prev is not None:
            row = {id(r): i for i, r in enumerate(prev.reqs)}
            src = torch.tensor([row[id(r)] for r in reqs], dtype=torch.int64, device=batch.input_ids.device)
        step = _Step(reqs)
        step.future = self.executor.submit(self._in_worker, self._run, step, batch, info, prev, src)
        return step

    def _build(self, reqs: list[Req], ahead: int) -> ForwardBatch:
        """The decode batch of ``reqs``, each ``ahead`` tokens past what it holds now (1:
        its input token is the one step N samples, filled in by the worker)."""
        if ahead == 0:
            return self.runner.build_batch(reqs, ForwardMode.DECODE)
        runner = self.runner
        dev = runner.device
        seq_lens = [r.seq_len + ahead for r in reqs]
        positions = [n - 1 for n in seq_lens]
        slots = [runner.slots_for(r, n - 1, n)[0] for r, n in zip(reqs, seq_lens)]
        table = runner.req_to_token_pool.req_to_token
        rows_t = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        slots_t = torch.tensor(slots, dtype=torch.int64, device=dev)
        table[rows_t, pos_t] = slots_t
        dp_groups = [r.dp_group for r in reqs] if runner.dp_attention is not None else None
        return ForwardBatch(
            mode=ForwardMode.DECODE, batch_size=len(reqs),
            input_ids=torch.zeros(len(reqs), dtype=torch.int64, device=dev),  # the future tokens
            positions=pos_t, req_pool_indices=rows_t,
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            out_cache_loc=slots_t, seq_lens_cpu=seq_lens, prefix_lens_cpu=positions,
            extend_lens_cpu=[1] * len(reqs), req_to_token=table, kv_pool=runner.kv_pool,
            logits_indices=torch.arange(len(reqs), device=dev), capture_hidden_layers=runner.capture_hidden_layers,
            dp_groups=dp_groups, lora_slots=runner.lora.slots_for(reqs) if getattr(runner, "lora", None) else None,
        )

    def _resolve(self, step: _Step, t0: float) -> list[Req]:
        """Wait for ``step`` and apply its tokens (the scheduler's decode bookkeeping);
        returns its requests (those that failed included)."""
        step.future.result()
        failed: list[Req] = []
        if step.error is not None or step.skipped:
            finished = self._redo(step, failed)
        else:
            self.forward.succeeded()
            live = [(req, tok) for req, tok in zip(step.reqs, step.next_ids) if not req.finished]
            for req, _ in live:
                req.kv_len = req.seq_len
            self.stats.num_decode_tokens += len(live)
            # no grammar or logprobs here (such steps run sequentially): tokens and stop checks
            finished = self.outputs.take_tokens([req for req, _ in live], [tok for _, tok in live])
            self.budget.observe_decode(len(step.reqs), time.monotonic() - t0)
        self.stats.decode_seconds += time.monotonic() - t0
        self.stats.num_forward_steps += 1
        self.retire(failed + finished)
        self.drain_if_idle()
        self.after_step()
        return step.reqs

    def _redo(self, step: _Step, failed: list[Req]) -> list[Req]:
        """``step`` failed (or depended on one that did): drop the step queued after it and
        run it again sequentially, where a failure ends only the requests to blame."""
        later, self.inflight = self.inflight, None
        if later is not None:
            later.future.result()  # skipped: it read this step's tokens
        if step.skipped:  # its own predecessor failed and was redone; it is run again later
            return []
        reqs = [r for r in step.reqs if not r.finished]
        if not reqs:
            return []
        reqs, _, logits, _ = self.forward(reqs, ForwardMode.DECODE, None, failed)
        for req in reqs:
            req.kv_len = req.seq_len
        self.stats.num_decode_tokens += len(reqs)
        return self.outputs.sample_and_update(reqs, logits) if reqs else []

    def drain_if_idle(self) -> None:
        """Wait for (and discard) the step in flight once none of its requests runs any
        more (all finished or aborted), so that an idle scheduler has nothing in flight."""
        step = self.inflight
        if step is not None and all(r.finished for r in step.reqs):
            self.inflight = None
            step.future.result()

    def close(self) -> None:
        self.executor.shutdown(wait=True)
