"""How tensor parallelism splits attention heads over the ranks of a replica.

Heads split by KV-head group, so every query head stays on the rank that holds the KV head
it reads, and each rank's KV pool holds only its own KV heads:

* ``num_kv_heads >= tp_size``: the KV heads are split as evenly as possible in rank order
  (the first ``num_kv_heads % tp_size`` ranks get one more), each with its whole group of
  ``num_heads // num_kv_heads`` query heads. SmolLM2-135M (9 query heads, 3 KV heads) on
  two ranks: rank 0 holds KV heads 0-1 and query heads 0-5, rank 1 KV head 2 and query
  heads 6-8.
* ``num_kv_heads < tp_size``: the ranks are split over the KV heads instead (as evenly as
  possible, in order); every rank of a KV head holds a replica of it, and the query heads of
  its group are split over those ranks. Each rank needs at least one query head, so more
  ranks than query heads is an error.

Invariants: every query head lives on exactly one rank; a rank's query heads are
contiguous and all read its KV heads, which are contiguous too.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.distributed import split_range


@dataclass(frozen=True)
class HeadShard:
    """The heads one rank holds: query heads ``[q_start, q_start + num_heads)`` and KV heads
    ``[kv_start, kv_start + num_kv_heads)`` of the full model."""

    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int

    kv_replicated: bool = False  # other ranks hold this rank's KV head too (fewer KV heads than ranks)


def partition_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    """Rank ``tp_rank``'s share of ``num_heads`` query heads over ``num_kv_heads`` KV heads
    when the replica has ``tp_size`` ranks (see the module docstring)."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} key/value heads")
    if not 0 <= tp_rank < tp_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} out of range for --tp-size {tp_size}")
    group = num_heads // num_kv_heads  # query heads per KV head
    if tp_size > num_heads:
        raise ValueError(
            f"--tp-size {tp_size}: the model has {num_heads} attention heads ({num_kv_heads} key/value heads with "
            f"{group} query heads each); every rank needs at least one query head, so use a --tp-size of at most "
            f"{num_heads}")
    if num_kv_heads >= tp_size:
        kv_start, n_kv = split_range(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, n_kv * group, kv_start, n_kv)
    # fewer KV heads than ranks: ranks of KV head h are split_range(tp_size, num_kv_heads, h), at most
    # ceil(tp_size / num_kv_heads) <= group of them since tp_size <= num_heads
    for kv in range(num_kv_heads):
        first, n_ranks = split_range(tp_size, num_kv_heads, kv)
        if first <= tp_rank < first + n_ranks:
            break
    q_off, n_q = split_range(group, n_ranks, tp_rank - first)
    return HeadShard(kv * group + q_off, n_q, kv, 1, kv_replicated=True)


__all__ = ["HeadShard", "partition_heads"]
