"""Step drivers: what one forward step does with its batch.

:class:`PrefillDriver` runs an extend (or mixed) step over the planner's batch.
:class:`DecodeDriver` runs a plain decode step; speculative decoding
(:class:`radixserve.speculative.runtime.SpecDecoder`) is the other decode driver, with the
same ``run(reqs, failed) -> (ran, finished)``. Overlapped scheduling
(:mod:`radixserve.engine.scheduler.overlap`) pipelines plain decode steps in front of both.
"""

from __future__ import annotations

import time

from radixserve.engine.hidden_states import take_hidden_states
from radixserve.engine.request import Req
from radixserve.layers.attention import ForwardMode


class DecodeDriver:
    """Plain decode: one token per running request."""

    def __init__(self, forward, outputs, kv, stats) -> None:
        self.forward = forward  # IsolatedForward
        self.outputs = outputs
        self.kv = kv
        self.stats = stats

    def run(self, reqs: list[Req], failed: list[Req]) -> tuple[list[Req], list[Req]]:
        """Decode ``reqs`` by one token; (requests that ran, those that finished or failed
        while taking their token). Requests failed by the forward go to ``failed``."""
        reqs, _, logits, batch = self.forward(reqs, ForwardMode.DECODE, None, failed)
        take_hidden_states(batch)
        for req in reqs:
            req.kv_len = req.seq_len
        self.stats.num_decode_tokens += len(reqs)
        return reqs, self.outputs.sample_and_update(reqs, logits) if reqs else []


class PrefillDriver:
    """An extend step over ``(request, tokens)`` chunks, with decoding riders (mixed chunk)."""

    def __init__(self, forward, outputs, kv, stats, spec=None) -> None:
        self.forward = forward
        self.outputs = outputs
        self.kv = kv
        self.stats = stats
        self.spec = spec  # the speculative decoder sees every computed chunk

    def run(self, plan: list[tuple[Req, int]], riders: list[Req], failed: list[Req],
            t0: float) -> tuple[list[Req], list[Req]]:
        mode = ForwardMode.MIXED if riders else ForwardMode.EXTEND
        reqs, lens, logits, batch = self.forward([r for r, _ in plan] + riders, mode,
                                                 [n for _, n in plan] + [1] * len(riders), failed)
        decoded = set(map(id, riders))
        done_rows = [i for i, req in enumerate(reqs) if id(req) in decoded]
        for i in done_rows:
            reqs[i].kv_len = reqs[i].seq_len
        # the prefill rows come first in ``reqs`` (riders last), so a prefill row's index in
        # ``plan`` is its row in ``reqs`` and ``logits``
        plan = [(req, n) for req, n in zip(reqs, lens) if id(req) not in decoded]
        if done_rows:
            self.stats.num_decode_tokens += len(done_rows)
            self.stats.num_mixed_steps += 1
            self.kv.decay_reservation()
        self.outputs.take_prompt_logprobs(batch)
        take_hidden_states(batch)
        for i, (req, n) in enumerate(plan):
            req.kv_len += n
            # Cache the computed prompt now, so requests sharing it reuse it while this one
            # still decodes (and the next chunk of a chunked prefill builds on it).
            self.kv.cache_computed(req)
            if req.kv_len == len(req.all_ids):
                done_rows.append(i)
        num_prefilled = sum(n for _, n in plan)
        self.stats.num_prefill_tokens += num_prefilled
        scored = [reqs[i] for i in done_rows if reqs[i].max_new_tokens == 0]  # prompt logprobs only
        done_rows = sorted(i for i in done_rows if reqs[i].max_new_tokens != 0)
        finished = (self.outputs.sample_and_update([reqs[i] for i in done_rows], logits[done_rows])
                    if done_rows else [])
        for req in scored:
            self.outputs.finish(req, {"type": "length", "length": 0}, notify=False)
            finished.append(req)
        if self.spec is not None and reqs:
            self.spec.observe_extend(plan, batch)
        seconds = time.monotonic() - t0
        self.stats.prefill_seconds += seconds
        self.kv.cache.observe_prefill(num_prefilled, seconds)  # HiCache: what recomputing costs
        return reqs, finished
