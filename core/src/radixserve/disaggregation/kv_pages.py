"""A request's KV pages as transfer segments between two servers' KV pools.

Both pools are one allocation ``[K|V, layer, slot, kv_head, head_dim]``
(:class:`radixserve.mem.kv_pool.KVPool`), so token slot ``s`` of layer ``l`` holds its K at
``base + ((0 * L + l) * S + s) * slot_bytes`` and its V ``L * S * slot_bytes`` further.
:class:`PoolLayout` is what a server tells its peer about its pool (a JSON-able dict), and
:func:`segments` turns "these prompt tokens' slots here" and "those slots there" into
``(src, dst, length)`` triples, slot runs that are consecutive on both sides merged into one
(a page of ``page_size`` tokens is always one run, consecutive pages often are). The two
pools must agree on layers, heads, head size and storage dtype (:meth:`PoolLayout.check`);
their page sizes and pool sizes may differ.

With tensor parallelism a rank's pool holds only its KV heads (``kv_start`` and on, of the
model's ``total_kv_heads``); :func:`plan_pieces` says which prefill rank sends which heads to
which decode rank (any TP sizes on either side), and :func:`segments` moves a head range of
each token when a piece is not a whole slot on both sides.

:func:`checksum` is what both sides compute over a request's K/V (a piece's heads), in token
order, to know that what arrived is what was sent: CRC-32 over the bytes of every layer's K
then V rows.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass

import numpy as np
import torch

from radixserve.disaggregation.transfer import TransferError


@dataclass(frozen=True)
class PoolLayout:
    base: int  # address of the pool's buffer
    num_layers: int
    num_slots: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # the storage dtype, e.g. "torch.float32"
    slot_bytes: int  # one token's K (or V) in one layer
    kv_start: int = 0  # the model's KV head this pool's first head is (tensor parallelism)
    total_kv_heads: int = 0  # the model's KV heads (0: this pool holds them all)

    def __post_init__(self) -> None:
        if self.total_kv_heads == 0:
            object.__setattr__(self, "total_kv_heads", self.num_kv_heads)
        if self.num_kv_heads <= 0 or not 0 <= self.kv_start <= self.total_kv_heads - self.num_kv_heads:
            raise TransferError(f"bad KV pool layout: heads {self.kv_start}..{self.kv_start + self.num_kv_heads} "
                                f"of {self.total_kv_heads}")

    @classmethod
    def from_pool(cls, pool, kv_start: int = 0, total_kv_heads: int = 0) -> PoolLayout:
        buf = pool.buffer
        if not buf.is_contiguous():
            raise TransferError("the KV pool's buffer is not contiguous")
        return cls(base=buf.data_ptr(), num_layers=pool.num_layers, num_slots=pool.num_slots,
                   num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=str(pool.dtype),
                   slot_bytes=pool.num_kv_heads * pool.head_dim * buf.element_size(), kv_start=kv_start,
                   total_kv_heads=total_kv_heads)

    @classmethod
    def from_dict(cls, d: dict) -> PoolLayout:
        try:
            return cls(**{k: (str(v) if k == "dtype" else int(v)) for k, v in d.items()})
        except (TypeError, ValueError) as e:
            raise TransferError(f"bad KV pool layout {d!r}: {e}") from e

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def nbytes(self) -> int:
        return 2 * self.num_layers * self.num_slots * self.slot_bytes

    @property
    def head_bytes(self) -> int:
        return self.slot_bytes // self.num_kv_heads

    def holds(self, head: int) -> bool:
        return self.kv_start <= head < self.kv_start + self.num_kv_heads

    def check(self, other: PoolLayout) -> None:
        """Raise TransferError unless K/V of one head of one token means the same bytes in both pools."""
        mine = (self.num_layers, self.total_kv_heads, self.head_dim, self.dtype, self.head_bytes)
        theirs = (other.num_layers, other.total_kv_heads, other.head_dim, other.dtype, other.head_bytes)
        if mine != theirs:
            raise TransferError(f"the KV pools differ (layers, KV heads, head size, dtype, bytes per head): "
                                f"{mine} here, {theirs} there; both servers must serve the same model with "
                                f"the same --kv-cache-dtype")

    def offsets(self, slots: np.ndarray) -> np.ndarray:
        """``[2, L, T]`` byte addresses of K and V of ``slots`` in every layer."""
        kv = np.arange(2, dtype=np.int64).reshape(2, 1, 1)
        layer = np.arange(self.num_layers, dtype=np.int64).reshape(1, -1, 1)
        return self.base + ((kv * self.num_layers + layer) * self.num_slots + slots.reshape(1, 1, -1)) * self.slot_bytes


def _as_slots(slots, layout: PoolLayout) -> np.ndarray:
    out = np.asarray(slots.tolist() if isinstance(slots, torch.Tensor) else slots, dtype=np.int64).reshape(-1)
    if out.size and (out.min() < 0 or out.max() >= layout.num_slots):
        raise TransferError(f"slot ids outside the pool's {layout.num_slots} slots")
    return out


@dataclass(frozen=True)
class Piece:
    """Heads ``[src_head, src_head + num_heads)`` of prefill rank ``src_rank``'s pool go to
    ``[dst_head, ...)`` of decode rank ``dst_rank``'s (local head indices)."""

    src_rank: int
    dst_rank: int
    src_head: int
    dst_head: int
    num_heads: int


def plan_pieces(srcs: list[PoolLayout], dsts: list[PoolLayout]) -> list[Piece]:
    """Who sends what: every KV head of every decode rank comes from one prefill rank that holds
    it (with replicated heads, decode rank ``d`` takes the ``d``-th holder in turn, spreading
    the work), consecutive heads from one rank joined into one piece."""
    pieces: list[Piece] = []
    for d, dst in enumerate(dsts):
        for src in srcs:
            src.check(dst)
        for head in range(dst.kv_start, dst.kv_start + dst.num_kv_heads):
            holders = [r for r, src in enumerate(srcs) if src.holds(head)]
            if not holders:
                raise TransferError(f"no prefill rank holds KV head {head}")
            p = holders[d % len(holders)]
            sh, dh = head - srcs[p].kv_start, head - dst.kv_start
            last = pieces[-1] if pieces else None
            if last is not None and (last.src_rank, last.dst_rank) == (p, d) and \
                    (last.src_head + last.num_heads, last.dst_head + last.num_heads) == (sh, dh):
                pieces[-1] = Piece(p, d, last.src_head, last.dst_head, last.num_heads + 1)
            else:
                pieces.append(Piece(p, d, sh, dh, 1))
    return pieces


def segments(src: PoolLayout, src_slots, dst: PoolLayout, dst_slots,
             piece: Piece | None = None) -> tuple[list[int], list[int], list[int]]:
    """``(src addresses, dst addresses, lengths)`` moving the K/V of tokens whose slots are
    ``src_slots`` here into ``dst_slots`` there (one slot per token, same order); all heads, or
    ``piece``'s."""
    src.check(dst)
    s, d = _as_slots(src_slots, src), _as_slots(dst_slots, dst)
    if s.shape != d.shape:
        raise TransferError(f"{s.size} source slots for {d.size} destination slots")
    if not s.size:
        return [], [], []
    if piece is None:
        if src.num_kv_heads != dst.num_kv_heads:
            raise TransferError("the pools hold different heads: say which (a Piece)")
        piece = Piece(0, 0, 0, 0, src.num_kv_heads)
    whole = piece.num_heads == src.num_kv_heads == dst.num_kv_heads
    if whole:  # runs of tokens whose slots go up by one on both sides are one segment
        breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
        starts = np.concatenate([[0], breaks])
        lengths = np.diff(np.concatenate([starts, [s.size]])) * src.slot_bytes
    else:  # a head range is contiguous within one token's slot only
        starts = np.arange(s.size)
        lengths = np.full(s.size, piece.num_heads * src.head_bytes, dtype=np.int64)
    so = src.offsets(s[starts]) + piece.src_head * src.head_bytes  # [2, L, runs]
    do = dst.offsets(d[starts]) + piece.dst_head * dst.head_bytes
    n = np.broadcast_to(lengths.reshape(1, 1, -1), so.shape)
    return so.reshape(-1).tolist(), do.reshape(-1).tolist(), n.reshape(-1).tolist()


def checksum(pool, slots, head: int = 0, num_heads: int | None = None) -> int:
    """CRC-32 of the K/V bytes of ``slots`` (token order), every layer's K then V; of heads
    ``[head, head + num_heads)`` only when given."""
    idx = torch.as_tensor(_as_slots(slots, PoolLayout.from_pool(pool)), device=pool.buffer.device)
    rows = pool.buffer.index_select(2, idx)  # [2, L, T, H, D]
    if num_heads is not None:
        rows = rows[:, :, :, head:head + num_heads]
    return zlib.crc32(rows.contiguous().cpu().view(torch.uint8).numpy().tobytes())
