"""Prefill-decode disaggregation with tensor parallelism on either side, the KV side of it:
the plan of who sends which heads covers every head once for any pair of TP sizes (replicated
heads too), and the segments of a head range move exactly those bytes (servers of TP 2 and 1
paired every way: server/tests/test_disaggregation_tp_http.py)."""

from __future__ import annotations

import ctypes

import pytest
import torch
from radixserve.disaggregation.kv_pages import Piece, PoolLayout, checksum, plan_pieces, segments
from radixserve.disaggregation.transfer import TransferError
from radixserve.distributed.partition import partition_heads
from radixserve.mem.kv_pool import KVPool


def layouts(num_heads: int, num_kv_heads: int, tp: int) -> list[PoolLayout]:
    out = []
    for r in range(tp):
        shard = partition_heads(num_heads, num_kv_heads, tp, r)
        out.append(PoolLayout(base=1 << 20, num_layers=2, num_slots=64, num_kv_heads=shard.num_kv_heads, head_dim=4,
                              dtype="torch.float32", slot_bytes=shard.num_kv_heads * 16, kv_start=shard.kv_start,
                              total_kv_heads=num_kv_heads))
    return out


@pytest.mark.parametrize("heads, kv_heads", [(8, 4), (8, 2), (8, 1), (6, 3)])
@pytest.mark.parametrize("src_tp, dst_tp", [(1, 1), (1, 2), (2, 1), (2, 2), (4, 2), (2, 4), (1, 4)])
def test_the_plan_gives_every_decode_head_once_from_a_rank_that_holds_it(heads, kv_heads, src_tp, dst_tp):
    srcs, dsts = layouts(heads, kv_heads, src_tp), layouts(heads, kv_heads, dst_tp)
    pieces = plan_pieces(srcs, dsts)
    for d, dst in enumerate(dsts):
        got = []
        for p in (p for p in pieces if p.dst_rank == d):
            for k in range(p.num_heads):
                src_global = srcs[p.src_rank].kv_start + p.src_head + k
                dst_global = dst.kv_start + p.dst_head + k
                assert src_global == dst_global and srcs[p.src_rank].holds(src_global)
                got.append(p.dst_head + k)
        assert sorted(got) == list(range(dst.num_kv_heads))
    if src_tp == dst_tp and kv_heads >= src_tp:  # the same split: one whole-pool piece per rank
        assert pieces == [Piece(r, r, 0, 0, dsts[r].num_kv_heads) for r in range(dst_tp)]


def test_a_plan_between_different_models_is_refused():
    with pytest.raises(TransferError, match="differ"):
        plan_pieces(layouts(8, 4, 2), layouts(8, 2, 2))


def shard_pool(full: KVPool, kv_start: int, n: int) -> KVPool:
    p = KVPool(num_layers=full.num_layers, num_pages=full.num_slots, page_size=1, num_kv_heads=n,
               head_dim=full.head_dim, dtype=full.dtype, device="cpu")
    p.buffer.copy_(full.buffer[:, :, :, kv_start:kv_start + n])
    return p


def test_pieces_move_exactly_their_heads_between_sharded_pools():
    """A 4-KV-head pool split over 2 prefill ranks sends into 1 and into 4 decode ranks
    (plain memory copies of the segments): every decode rank ends with exactly its heads of the
    request's tokens, other slots untouched, and the per-piece checksums agree."""
    full = KVPool(num_layers=3, num_pages=64, page_size=1, num_kv_heads=4, head_dim=8, dtype=torch.float32,
                  device="cpu")
    full.buffer.copy_(torch.randn(full.buffer.shape))
    src_slots, dst_slots = [3, 4, 5, 9, 20], [40, 41, 7, 8, 60]
    srcs = [shard_pool(full, 0, 2), shard_pool(full, 2, 2)]
    src_layouts = [PoolLayout.from_pool(p, 2 * r, 4) for r, p in enumerate(srcs)]
    for dst_tp in (1, 4):
        n = 4 // dst_tp
        dsts = [KVPool(num_layers=3, num_pages=64, page_size=1, num_kv_heads=n, head_dim=8, dtype=torch.float32,
                       device="cpu") for _ in range(dst_tp)]
        dst_layouts = [PoolLayout.from_pool(p, n * r, 4) for r, p in enumerate(dsts)]
        for p in dsts:
            p.buffer.normal_()  # a pool's memory starts uninitialised (NaNs never equal themselves)
        before = [p.buffer.clone() for p in dsts]
        pieces = plan_pieces(src_layouts, dst_layouts)
        for piece in pieces:
            for s, d, k in zip(*segments(src_layouts[piece.src_rank], src_slots, dst_layouts[piece.dst_rank],
                                         dst_slots, piece), strict=True):
                ctypes.memmove(d, s, k)
            assert checksum(srcs[piece.src_rank], src_slots, piece.src_head, piece.num_heads) == \
                checksum(dsts[piece.dst_rank], dst_slots, piece.dst_head, piece.num_heads)
        for r, (pool, old) in enumerate(zip(dsts, before, strict=True)):
            want = old.clone()
            want[:, :, dst_slots] = full.buffer[:, :, src_slots, n * r:n * (r + 1)]
            assert torch.equal(pool.buffer, want), (dst_tp, r)
