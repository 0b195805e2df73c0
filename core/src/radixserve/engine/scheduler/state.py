"""What the scheduler's parts share: the request queues and the counters."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from radixserve.engine.request import Req


@dataclass
class Queues:
    waiting: deque[Req] = field(default_factory=deque)  # ready for admission
    grammar: list[Req] = field(default_factory=list)  # waiting for their grammar to compile
    running: list[Req] = field(default_factory=list)  # admitted: decoding, or mid chunked prefill

    def decoding(self) -> list[Req]:
        """Running requests past their prefill."""
        return [r for r in self.running if r.output_ids and not r.in_prefill]

    @property
    def num_queued(self) -> int:
        """Requests waiting for admission (queued, or waiting for their grammar)."""
        return len(self.waiting) + len(self.grammar)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.grammar)


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

    def as_dict(self) -> dict:
        return {
            "cache_hit_rate": (self.num_cached_prompt_tokens / self.num_prompt_tokens
                               if self.num_prompt_tokens else 0.0),
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_prompt_tokens": self.num_cached_prompt_tokens,
            "num_prefill_tokens": self.num_prefill_tokens,
            "num_decode_tokens": self.num_decode_tokens,
            "prefill_throughput": self.num_prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
            "decode_throughput": self.num_decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "num_retractions": self.num_retractions,
            "num_preemptions": self.num_preemptions,
            "num_overlap_steps": self.num_overlap_steps,
            "num_finished_reqs": self.num_finished,
            "num_aborted_reqs": self.num_aborted,
        }
