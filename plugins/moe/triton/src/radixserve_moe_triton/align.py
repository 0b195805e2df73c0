"""Token-to-expert alignment: the (token, choice) pairs sorted by expert, each expert's
segment padded to a multiple of the GEMM's ``BLOCK_M``.

A pair is named by its flat index ``p = token * top_k + choice`` in ``[0, P)``, ``P = N * K``.
The result, for ``B = max_blocks(P, E, BLOCK_M)`` blocks::

    sorted_pairs      # [B * BLOCK_M] int32  pair indices, expert by expert; padding = P
    expert_ids        # [B] int32            the expert of each block (-1 past the end)
    num_post_padded   # [1] int32            slots in use, sum_e ceil(count_e / BLOCK_M) * BLOCK_M

Pairs whose id is ``-1`` (expert on another rank) are left out. Within an expert, pairs
keep their order (a stable sort), so a block's rows are gathered in token order.

Plain torch ops, about twenty small launches, and no host sync: the number of blocks is
bounded from shapes alone (``B``), counts are a ``scatter_add_`` (``bincount`` would read
its maximum back to the host), and the GEMM programs past ``num_post_padded`` return at
once. So a decode step stays capturable in a CUDA graph. A block holds at least one pair
and an expert wastes less than one block, hence ``B <= min(P, ceil(P / BLOCK_M) + E)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Alignment:
    sorted_pairs: torch.Tensor  # [B * BLOCK_M] int32
    expert_ids: torch.Tensor  # [B] int32
    num_post_padded: torch.Tensor  # [1] int32
    num_pairs: int  # P
    block_m: int

    @property
    def num_blocks(self) -> int:
        return self.expert_ids.shape[0]


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most ``BLOCK_M`` blocks ``num_pairs`` pairs over ``num_experts`` experts can fill."""
    return min(num_pairs, -(-num_pairs // block_m) + num_experts)


def align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """``topk_ids  # [N, K]`` (``-1``: skip) -> :class:`Alignment` for ``block_m``."""
    flat = topk_ids.reshape(-1)
    num_pairs = flat.numel()
    device = flat.device
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    # Pairs with id -1 go to an extra bucket E, which sorts last and gets no blocks.
    bucket = torch.where(flat < 0, num_experts, flat.to(torch.int64))  # [P]
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))  # [E + 1]
    padded = (counts[:num_experts] + block_m - 1) // block_m * block_m  # [E]
    seg_end = torch.cumsum(padded, 0)  # [E] end of each expert's padded segment
    seg_start = torch.cat([seg_end.new_zeros(1), seg_end])  # [E + 1]; bucket E: the dump slot
    seg_start[num_experts] = num_blocks * block_m

    order = torch.argsort(bucket, stable=True)  # [P] pairs by expert, -1 pairs last
    sorted_bucket = bucket[order]
    first_of_bucket = torch.cumsum(counts, 0) - counts  # [E + 1] first sorted position
    rank = torch.arange(num_pairs, device=device) - first_of_bucket[sorted_bucket]
    dest = seg_start[sorted_bucket] + rank
    dest = torch.where(sorted_bucket == num_experts, num_blocks * block_m, dest)
    sorted_pairs = torch.full((num_blocks * block_m + 1,), num_pairs, dtype=torch.int32,
                              device=device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))  # -1 pairs all land in the last slot
    sorted_pairs = sorted_pairs[:-1]

    block_start = torch.arange(num_blocks, device=device, dtype=torch.int64) * block_m
    expert_ids = torch.searchsorted(seg_end, block_start, right=True)  # first e with end > start
    expert_ids = torch.where(expert_ids < num_experts, expert_ids, -1).to(torch.int32)
    num_post_padded = seg_end[-1:].to(torch.int32)
    return Alignment(sorted_pairs, expert_ids, num_post_padded, num_pairs, block_m)
