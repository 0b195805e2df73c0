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

:func:`checksum` is what both sides compute over a request's K/V, in token order, to know that
what arrived is what was sent: CRC-32 over the bytes of every layer's K then V rows.
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

    @classmethod
    def from_pool(cls, pool) -> PoolLayout:
        buf = pool.buffer
        if not buf.is_contiguous():
            raise TransferError("the KV pool's buffer is not contiguous")
        return cls(base=buf.data_ptr(), num_layers=pool.num_layers, num_slots=pool.num_slots,
                   num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim, dtype=str(pool.dtype),
                   slot_bytes=pool.num_kv_heads * pool.head_dim * buf.element_size())

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

    def check(self, other: PoolLayout) -> None:
        """Raise TransferError unless K/V of one token means the same bytes in both pools."""
        mine = (self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, self.slot_bytes)
        theirs = (other.num_layers, other.num_kv_heads, other.head_dim, other.dtype, other.slot_bytes)
        if mine != theirs:
            raise TransferError(f"the KV pools differ (layers, KV heads, head size, dtype, bytes per slot): "
                                f"{mine} here, {theirs} there; both servers must serve the same model with "
                                f"the same --kv-cache-dtype and tensor parallel size")

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


def segments(src: PoolLayout, src_slots, dst: PoolLayout, dst_slots) -> tuple[list[int], list[int], list[int]]:
    """``(src addresses, dst addresses, lengths)`` moving the K/V of tokens whose slots are
    ``src_slots`` here into ``dst_slots`` there (one slot per token, same order)."""
    src.check(dst)
    s, d = _as_slots(src_slots, src), _as_slots(dst_slots, dst)
    if s.shape != d.shape:
        raise TransferError(f"{s.size} source slots for {d.size} destination slots")
    if not s.size:
        return [], [], []
    # runs of tokens whose slots go up by one on both sides
    breaks = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate([[0], breaks])
    lengths = np.diff(np.concatenate([starts, [s.size]])) * src.slot_bytes
    so, do = src.offsets(s[starts]), dst.offsets(d[starts])  # [2, L, runs]
    n = np.broadcast_to(lengths.reshape(1, 1, -1), so.shape)
    return so.reshape(-1).tolist(), do.reshape(-1).tolist(), n.reshape(-1).tolist()


def checksum(pool, slots) -> int:
    """CRC-32 of the K/V bytes of ``slots`` (token order), every layer's K then V."""
    idx = torch.as_tensor(_as_slots(slots, PoolLayout.from_pool(pool)), device=pool.buffer.device)
    rows = pool.buffer.index_select(2, idx).contiguous().cpu()  # [2, L, T, H, D]
    return zlib.crc32(rows.view(torch.uint8).numpy().tobytes())
