"""Pipeline parallelism (``--pp-size P``): the layers split into P contiguous stages, each
stage a group of ``--tp-size`` ranks holding only its layers' weights and KV.

Rank 0 (stage 0) still runs the scheduler and sends every step to every rank
(:mod:`radixserve.distributed.step_sync`); each rank then runs :meth:`PipelineStage.run` on
the step's batch:

* the batch is cut into micro-batches of whole requests (at most
  ``--pp-max-micro-batch-size`` each; by default the batch in P parts), and every stage
  takes them in order: the first stage embeds the tokens, a later one receives
  ``[hidden | residual]`` of the micro-batch from the same TP rank of the stage before
  (point-to-point on the replica's world: gloo here, NCCL on GPUs); a stage runs its layers
  and sends the result on without waiting for it to be received, so while stage 1 runs
  micro-batch 1, stage 0 already runs micro-batch 2 (a step of M micro-batches over P
  stages takes M + P - 1 micro-batch times instead of M * P);
* the last stage ends each micro-batch with the final norm and the LM head; its TP rank 0
  sends the logits (and, when a request asked, the final hidden states) to rank 0, which
  posted a receive for every micro-batch before computing its own part.

Batches are split only where a request's rows stand alone: decode, extend and mixed batches
(a mixed batch's parts become extend, decode or mixed batches of their own); a target-verify
batch, one that keeps hidden states (``return_hidden_states``) and one smaller than two
micro-batches go through whole.

The layers per stage: ``SGLANG_PP_LAYER_PARTITION`` (SGLang's variable: comma-separated
counts, one per stage, summing to the model's layers), else as even as possible with the
first stages taking one more.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from radixserve.distributed import get_parallel_state, split_range
from radixserve.flags import ConfigError
from radixserve.layers.attention import ForwardBatch, ForwardMode

PARTITION_ENV = "SGLANG_PP_LAYER_PARTITION"


def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> tuple[int, int]:
    """``[start, end)`` of the layers stage ``pp_rank`` holds."""
    raw = os.environ.get(PARTITION_ENV, "").strip()
    if raw and pp_size > 1:
        try:
            counts = [int(x) for x in raw.split(",")]
        except ValueError:
            raise ConfigError(f"{PARTITION_ENV}={raw!r}: expected comma-separated layer counts") from None
        if len(counts) != pp_size or sum(counts) != num_layers or min(counts) < 1:
            raise ConfigError(f"{PARTITION_ENV}={raw!r} with --pp-size {pp_size}: give {pp_size} counts of at "
                              f"least 1 layer each, summing to the model's {num_layers} layers")
        start = sum(counts[:pp_rank])
        return start, start + counts[pp_rank]
    if num_layers < pp_size:
        raise ConfigError(f"--pp-size {pp_size}: the model has {num_layers} layers; every stage needs at least "
                          f"one, so use a --pp-size of at most {num_layers}")
    start, n = split_range(num_layers, pp_size, pp_rank)
    return start, start + n


def micro_bounds(batch: ForwardBatch, pp_size: int, max_micro: int | None) -> list[tuple[int, int]]:
    """Request ranges ``[lo, hi)`` of the micro-batches ``batch`` is cut into."""
    b = batch.batch_size
    whole = [(0, b)]
    if (batch.mode not in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED) or batch.capture_final_hidden
            or batch.capture_hidden_layers):
        return whole
    size = max_micro or -(-b // pp_size)
    count = -(-b // size)
    if count < 2:
        return whole
    return [(s, s + n) for s, n in (split_range(b, count, i) for i in range(count))]


def split_batch(batch: ForwardBatch, lo: int, hi: int) -> ForwardBatch:
    """Requests ``[lo, hi)`` of ``batch`` as a batch of their own (rows, slots and logits
    rows re-based; the attention metadata is built for it anew)."""
    if (lo, hi) == (0, batch.batch_size):
        return batch
    ext = batch.extend_lens_cpu
    t0, t1 = sum(ext[:lo]), sum(ext[:hi])
    li = batch.logits_indices
    li = li[(li >= t0) & (li < t1)] - t0
    mode, num_decode = batch.mode, 0
    if mode is ForwardMode.MIXED:  # its last num_decode requests decode
        first_decode = batch.batch_size - batch.num_decode
        num_decode = max(0, hi - max(lo, first_decode))
        mode = (ForwardMode.EXTEND if num_decode == 0 else ForwardMode.DECODE if num_decode == hi - lo
                else ForwardMode.MIXED)
        num_decode = num_decode if mode is ForwardMode.MIXED else 0
    return dataclasses.replace(
        batch, mode=mode, batch_size=hi - lo, input_ids=batch.input_ids[t0:t1], positions=batch.positions[t0:t1],
        req_pool_indices=batch.req_pool_indices[lo:hi], seq_lens=batch.seq_lens[lo:hi],
        out_cache_loc=batch.out_cache_loc[t0:t1], seq_lens_cpu=batch.seq_lens_cpu[lo:hi],
        prefix_lens_cpu=batch.prefix_lens_cpu[lo:hi], extend_lens_cpu=ext[lo:hi], logits_indices=li,
        attn_metadata=None, extra={}, num_decode=num_decode)


class PipelineStage:
    """This rank's part of every step of a pipeline-parallel replica (see the module docstring)."""

    def __init__(self, runner, max_micro: int | None) -> None:
        ps = get_parallel_state()
        self.runner = runner
        self.ps = ps
        self.max_micro = max_micro
        self.prev = ps.rank - ps.tp_size if not ps.is_first_stage else None
        self.next = ps.rank + ps.tp_size if not ps.is_last_stage else None
        self.last_sender = (ps.pp_size - 1) * ps.tp_size  # TP rank 0 of the last stage
        self.hidden = runner.model_config.hidden_size
        self.num_micro_batches = 0  # micro-batches run (stats)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits ``# [rows, V]`` on rank 0 (and on the last stage); None elsewhere."""
        runner, ps = self.runner, self.ps
        parts = [split_batch(batch, lo, hi) for lo, hi in micro_bounds(batch, ps.pp_size, self.max_micro)]
        self.num_micro_batches += len(parts)
        incoming = self._post_logit_receives(parts) if ps.rank == 0 else []
        pending, logits = [], []
        for part in parts:
            runner.attn_backend.init_forward_metadata(part)
            hidden = None
            if self.prev is not None:
                buf = torch.empty(2, part.input_ids.shape[0], self.hidden, dtype=runner.dtype, device=runner.device)
                dist.recv(buf, src=self.prev)
                hidden = (buf[0], buf[1])
            out = runner.model(part, hidden)
            if self.next is not None:
                pending.append(dist.isend(torch.stack(out).contiguous(), dst=self.next))
                continue
            logits.append(out)
            if ps.tp_rank == 0:
                pending.append(dist.isend(out.contiguous(), dst=0))
                if part.capture_final_hidden:
                    pending.append(dist.isend(part.extra["final_hidden"].contiguous(), dst=0))
        for work in pending:
            work.wait()
        if ps.rank == 0:
            for work, *_ in incoming:
                work.wait()
            if batch.capture_final_hidden:
                batch.extra["final_hidden"] = incoming[0][2]
            return torch.cat([t for _, t, _ in incoming])
        return torch.cat(logits) if logits else None

    def _post_logit_receives(self, parts: list[ForwardBatch]) -> list[tuple]:
        """Rank 0: a receive of each micro-batch's logits (and final hidden states) from the
        last stage, posted before its own work so the last stage never waits on it."""
        vocab, dev = self.runner.model_config.vocab_size, self.runner.device
        out = []
        for part in parts:
            logits = torch.empty(part.logits_indices.shape[0], vocab, dtype=torch.float32, device=dev)
            work = dist.irecv(logits, src=self.last_sender)
            final = None
            if part.capture_final_hidden:
                final = torch.empty(part.input_ids.shape[0], self.hidden, dtype=self.runner.dtype, device=dev)
                fw = dist.irecv(final, src=self.last_sender)
                out.append((_Both(work, fw), logits, final))
                continue
            out.append((work, logits, final))
        return out


class _Both:
    def __init__(self, *works) -> None:
        self.works = works

    def wait(self) -> None:
        for w in self.works:
            w.wait()


__all__ = ["PARTITION_ENV", "PipelineStage", "micro_bounds", "split_batch", "stage_layers"]
