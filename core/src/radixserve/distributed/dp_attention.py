"""DP attention for MoE models (``--enable-dp-attention --dp-size D``, SGLang's names).

The ``--tp-size T`` ranks of a replica form ``D`` attention groups of ``T / D`` ranks. Each
request belongs to one group (the scheduler picks it when the request is queued:
:mod:`radixserve.engine.scheduler.dp_kv`), and only that group's ranks hold its KV pages and
run its attention, its embedding, dense MLPs and LM head rows (split over the group's own
ranks as tensor parallelism splits them). MoE layers stay expert-parallel over all ``T``
ranks: before each one every group's tokens are gathered onto every rank, the layer runs as
on a ``T``-rank replica (router replicated, experts split by ``--ep-size`` and each expert's
intermediate slice over the rest, the ``--moe-a2a-backend`` moving tokens), and each rank
keeps its group's rows of the result.

Rank 0 still runs the only scheduler and sends every step to every rank
(:mod:`radixserve.distributed.step_sync`); a step carries each request's group
(``ForwardBatch.dp_groups``). Each rank runs :meth:`DPAttention.run`: it cuts its group's
requests out of the batch (:func:`select_requests`) and runs the model on them, or, when its
group has none this step, only the MoE layers' collectives with no rows of its own
(:meth:`DPAttention.idle`), since the other groups' MoE layers need every rank. The first
TP rank of each group sends its rows' logits to rank 0, which puts them back in batch order.

Every group's KV pool holds as many pages as one rank's memory allows, so the replica holds
``D`` times the KV of a tensor-parallel one whose ranks each hold a slice of every token
(for models with few KV heads, a TP rank holds whole heads many times over), and attention
costs each rank only its own group's rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from radixserve.distributed import get_parallel_state
from radixserve.layers.attention import ForwardBatch, ForwardMode


@dataclass
class DPStep:
    """What a rank knows of the current step's token split across the attention groups."""

    counts: list[int]  # tokens of each attention group this step
    group: int  # this rank's attention group

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """``x  # [counts[group], H]`` -> every group's rows, group by group ``# [sum(counts), H]``."""
        return torch.cat(gather_rows(x, self.counts, get_parallel_state().attn_dp_group))

    def mine(self, y: torch.Tensor) -> torch.Tensor:
        """This group's rows of a gathered ``y``."""
        start = sum(self.counts[:self.group])
        return y[start:start + self.counts[self.group]]


def gather_rows(x: torch.Tensor, counts: list[int], group) -> list[torch.Tensor]:
    """Every rank's ``x  # [counts[r], ...]`` over ``group``, in group rank order (padded to
    the longest for the all-gather, then cut back)."""
    padded = x.new_zeros((max(counts, default=0), *x.shape[1:]))
    padded[:x.shape[0]] = x
    parts = [torch.empty_like(padded) for _ in counts]
    dist.all_gather(parts, padded, group=group)
    return [p[:n] for p, n in zip(parts, counts, strict=True)]


_current: DPStep | None = None


def current_step() -> DPStep | None:
    """The DP attention step being run in this process (None: no DP attention)."""
    return _current


@contextlib.contextmanager
def dp_step(step: DPStep) -> Iterator[None]:
    global _current
    _current = step
    try:
        yield
    finally:
        _current = None


def request_groups(batch: ForwardBatch) -> list[int]:
    if batch.dp_groups is None or len(batch.dp_groups) != batch.batch_size:
        raise ValueError("a DP attention step must say each request's attention group (ForwardBatch.dp_groups)")
    return list(batch.dp_groups)


def select_requests(batch: ForwardBatch, reqs: list[int]) -> ForwardBatch:
    """Requests ``reqs`` (ascending indices) of ``batch`` as a batch of their own, in order:
    their tokens, slots and logits rows re-based; a mixed batch stays one whose decode rows
    come last (or becomes an extend or decode batch)."""
    if reqs == list(range(batch.batch_size)):
        return batch
    if batch.mode not in (ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.MIXED):
        raise ValueError(f"a {batch.mode.name} batch cannot be split by requests")
    ext = batch.extend_lens_cpu
    starts = [0]
    for n in ext:
        starts.append(starts[-1] + n)
    dev = batch.input_ids.device
    tokens = torch.cat([torch.arange(starts[i], starts[i + 1], device=dev) for i in reqs]) if reqs \
        else torch.zeros(0, dtype=torch.int64, device=dev)
    new_index = torch.full((starts[-1],), -1, dtype=torch.int64, device=dev)
    new_index[tokens] = torch.arange(tokens.shape[0], device=dev)
    li = new_index[batch.logits_indices]
    li = li[li >= 0]
    idx = torch.tensor(reqs, dtype=torch.int64, device=dev)
    mode, num_decode = batch.mode, 0
    if mode is ForwardMode.MIXED:
        first_decode = batch.batch_size - batch.num_decode
        num_decode = sum(1 for i in reqs if i >= first_decode)
        mode = (ForwardMode.EXTEND if num_decode == 0 else ForwardMode.DECODE if num_decode == len(reqs)
                else ForwardMode.MIXED)
        num_decode = num_decode if mode is ForwardMode.MIXED else 0
    return dataclasses.replace(
        batch, mode=mode, batch_size=len(reqs), input_ids=batch.input_ids[tokens], positions=batch.positions[tokens],
        req_pool_indices=batch.req_pool_indices[idx], seq_lens=batch.seq_lens[idx],
        out_cache_loc=batch.out_cache_loc[tokens], seq_lens_cpu=[batch.seq_lens_cpu[i] for i in reqs],
        prefix_lens_cpu=[batch.prefix_lens_cpu[i] for i in reqs], extend_lens_cpu=[ext[i] for i in reqs],
        logits_indices=li, attn_metadata=None, extra={}, num_decode=num_decode,
        dp_groups=None if batch.dp_groups is None else [batch.dp_groups[i] for i in reqs],
        lora_slots=None if batch.lora_slots is None else [batch.lora_slots[i] for i in reqs])


class DPAttention:
    """This rank's part of every step of a DP-attention replica (see the module docstring)."""

    def __init__(self, runner, moe_layers: list) -> None:
        self.runner = runner
        self.ps = get_parallel_state()
        self.moe = moe_layers  # the model's SparseMoE layers, in order
        self.hidden = runner.model_config.hidden_size
        self.num_idle_steps = 0  # steps where this rank's group had no request (stats)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:
        """Logits ``# [rows, V]`` in batch order on rank 0; this group's rows (or None) elsewhere."""
        runner, ps = self.runner, self.ps
        groups = request_groups(batch)
        size = ps.attn_dp_size
        if any(not 0 <= g < size for g in groups):
            raise ValueError(f"a request's attention group is outside [0, {size})")
        counts = [0] * size
        for g, n in zip(groups, batch.extend_lens_cpu, strict=True):
            counts[g] += n
        mine = [i for i, g in enumerate(groups) if g == ps.attn_dp_rank]
        part = select_requests(batch, mine)
        with dp_step(DPStep(counts, ps.attn_dp_rank)):
            if mine:
                runner.attn_backend.init_forward_metadata(part)
                logits = runner.model(part)
            else:
                self.idle()
                logits = None
        if ps.tp_rank != 0:
            return logits
        return self._gather_logits(batch, groups, part, logits)

    @torch.inference_mode()
    def idle(self) -> None:
        """No request of this group in the step: take part in every MoE layer's collectives
        with no rows (the other groups' tokens still need this rank's experts)."""
        self.num_idle_steps += 1
        empty = torch.zeros(0, self.hidden, dtype=self.runner.dtype, device=self.runner.device)
        for layer in self.moe:
            layer.forward(empty)

    def _gather_logits(self, batch: ForwardBatch, groups: list[int], part: ForwardBatch,
                       logits: torch.Tensor | None) -> torch.Tensor:
        """Every group's logits rows (and final hidden states when a request keeps them) to
        every group's first rank; rank 0 puts them in batch order."""
        ps, dev = self.ps, batch.input_ids.device
        ext = batch.extend_lens_cpu
        tok_group = torch.repeat_interleave(torch.tensor(groups, device=dev), torch.tensor(ext, device=dev))
        row_group = tok_group[batch.logits_indices]  # [rows] the group of each logits row
        rows = [torch.nonzero(row_group == g).squeeze(1) for g in range(ps.attn_dp_size)]
        vocab = self.runner.model_config.vocab_size
        if logits is None:
            logits = torch.zeros(0, vocab, dtype=torch.float32, device=dev)
        out = torch.empty(batch.logits_indices.shape[0], vocab, dtype=torch.float32, device=dev)
        for g, got in enumerate(gather_rows(logits, [int(r.shape[0]) for r in rows], ps.attn_dp_group)):
            out[rows[g]] = got
        if batch.capture_final_hidden:
            mine = part.extra.get("final_hidden") if part.batch_size else None
            if mine is None:
                mine = torch.zeros(0, self.hidden, dtype=self.runner.dtype, device=dev)
            tok_rows = [torch.nonzero(tok_group == g).squeeze(1) for g in range(ps.attn_dp_size)]
            final = torch.empty(tok_group.shape[0], self.hidden, dtype=mine.dtype, device=dev)
            for g, got in enumerate(gather_rows(mine, [int(r.shape[0]) for r in tok_rows], ps.attn_dp_group)):
                final[tok_rows[g]] = got
            batch.extra["final_hidden"] = final
        return out


__all__ = ["DPAttention", "DPStep", "current_step", "dp_step", "gather_rows", "select_requests"]
