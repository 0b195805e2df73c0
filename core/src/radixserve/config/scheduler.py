"""Engine flags: admission caps, prefill budgets, the schedule policy and priorities,
overlapped scheduling, CUDA graphs."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.config.common import Checks, flag
from radixserve.flags import ConfigError

SCHEDULE_POLICIES = ("lpm", "fcfs", "dfs-weight", "lof", "random")


@dataclass
class SchedulerArgs(Checks):
    max_running_requests: int | None = flag(None, "most requests running at once")
    max_queued_requests: int | None = flag(
        None,
        "most requests waiting for admission (queued or compiling a grammar); beyond it new requests "
        "are refused (HTTP 429)",
    )
    max_consecutive_failed_steps: int = flag(
        3,
        "stop the engine after this many forward steps in a row fail (each failure ends only that "
        "step's requests, with status 500)",
    )
    max_prefill_tokens: int = flag(16384, "most prompt tokens in one prefill batch")
    chunked_prefill_size: int | None = flag(
        None,
        "split prompts into chunks of at most this many tokens (-1: off); not given: 2048 for a step "
        "with no decoding request, and a budget from measured step costs for a mixed step (see "
        "--mixed-chunk-target-itl-ms)",
    )
    enable_mixed_chunk: bool = flag(
        False,
        "accepted for SGLang compatibility: mixed steps (decoding requests run in the same forward as "
        "a prefill chunk) are radixserve's default; --disable-mixed-chunk turns them off",
    )
    disable_mixed_chunk: bool = flag(
        False,
        "run each prefill chunk as a step of its own, with running requests waiting for it, instead of "
        "decoding them in the same forward (mixed steps, the default; always off with speculative "
        "decoding)",
    )
    mixed_chunk_target_itl_ms: float | None = flag(
        None,
        "radixserve: with mixed steps and no --chunked-prefill-size, the length in ms a step holding "
        "decoding requests aims at (its prefill tokens follow from measured costs, at least 64); "
        "default: twice the measured plain decode step at the running batch size",
    )
    schedule_policy: str = flag(
        "lpm",
        "order of the waiting queue (lpm needs the radix cache; fcfs without it)",
        choices=SCHEDULE_POLICIES,
    )
    lpm_max_queue: int = flag(
        128,
        "above this many waiting requests, lpm and dfs-weight admit in arrival order (matching every "
        "waiting request against the cache each step would cost more than it saves)",
    )
    enable_priority_scheduling: bool = flag(
        False,
        "order the waiting queue by each request's priority first (lower values are served first), "
        "and let a more urgent request preempt running ones",
    )
    schedule_low_priority_values_first: bool = flag(
        False,
        "accepted for SGLang compatibility: radixserve always serves lower priority values first (as "
        "vLLM); SGLang users used to higher-first should negate their values",
    )
    priority_scheduling_preemption_threshold: int = flag(
        0,
        "a waiting request preempts a running one only if its priority value is lower by more than "
        "this",
    )
    disable_priority_preemption: bool = flag(
        False,
        "with --enable-priority-scheduling: order the queue by priority but never preempt running "
        "requests",
    )
    default_priority_value: int = flag(0, "priority of requests that give none")
    abort_on_priority_when_disabled: bool = flag(
        False,
        "without --enable-priority-scheduling, refuse (400) requests that give a priority instead of "
        "ignoring it",
    )
    enable_leak_check: bool = flag(
        False,
        "raise in the scheduler whenever it goes idle with a KV page or request slot unaccounted for",
    )
    disable_overlap_schedule: bool = flag(
        False,
        "turn off overlapped scheduling, where a decode step's CPU work (next batch, sampling "
        "bookkeeping, stop checks, output hand-off) runs while the previous step's forward runs; "
        "overlap is on by default on CUDA, off on CPU (see --enable-overlap-schedule)",
    )
    enable_overlap_schedule: bool = flag(
        False,
        "overlapped scheduling also on CPU, where it is off by default (it did not pay reliably on "
        "the 2-core CPU measured, BENCHMARKS.md)",
    )
    disable_cuda_graph: bool = flag(
        False,
        "run decode steps eagerly on CUDA instead of replaying captured CUDA graphs",
    )
    cuda_graph_max_bs: int | None = flag(
        None,
        "largest decode batch captured in a CUDA graph (default: 160, at most "
        "--max-running-requests); larger batches run eagerly",
    )
    cuda_graph_bs: list[int] | None = flag(
        None,
        "the decode batch sizes to capture (default: 1 2 4 8 16 24 ... up to --cuda-graph-max-bs); a "
        "batch replays in the smallest captured size that holds it",
        nargs="+",
    )
    disable_cuda_graph_padding: bool = flag(
        False,
        "replay a CUDA graph only for a batch whose size was captured exactly (others run eagerly) "
        "instead of padding it to the next captured size",
    )

    def check_scheduler(self) -> None:
        self._check_int("max_running_requests", minimum=1, optional=True)
        self._check_int("max_prefill_tokens", minimum=1)
        self._check_int("max_queued_requests", minimum=1, optional=True)
        self._check_int("max_consecutive_failed_steps", minimum=1)
        self._check_int("lpm_max_queue", minimum=1)
        self._check_int("chunked_prefill_size", minimum=-1, optional=True)
        if self.chunked_prefill_size == 0:
            raise ConfigError("--chunked-prefill-size must be -1 (off) or >= 1, got 0")
        if self.enable_mixed_chunk and self.disable_mixed_chunk:
            raise ConfigError("--enable-mixed-chunk and --disable-mixed-chunk contradict each other")
        target = self.mixed_chunk_target_itl_ms
        if target is not None and (isinstance(target, bool) or not isinstance(target, (int, float))
                                   or not 0 < target < float("inf")):
            raise ConfigError(f"--mixed-chunk-target-itl-ms must be a positive number, got {target!r}")
        if self.disable_overlap_schedule and self.enable_overlap_schedule:
            raise ConfigError("--disable-overlap-schedule and --enable-overlap-schedule contradict each other")
        self._check_int("cuda_graph_max_bs", minimum=1, optional=True)
        bs = self.cuda_graph_bs
        if bs is not None and (not isinstance(bs, (list, tuple)) or not bs
                               or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in bs)):
            raise ConfigError(f"--cuda-graph-bs: expected one or more batch sizes >= 1, got {bs!r}")
        self._check_int("priority_scheduling_preemption_threshold", minimum=0)
        self._check_int("default_priority_value", minimum=-2**63)
