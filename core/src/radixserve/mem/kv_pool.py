"""Paged KV memory: the page allocator, the per-layer K/V buffers and the
request-to-token-slot table.

A *slot* holds the K and V of one token in one layer's buffer; slots are grouped into
pages of ``page_size`` consecutive slots (slot = page * page_size + offset). Page 0 is
reserved as a scratch page (padding writes land there) and is never handed out.

The buffers hold K and V in the pool's *storage* dtype (``--kv-cache-dtype``), which may be
narrower than the activations (bfloat16, float16, or fp8 without scales): :meth:`KVPool.set_kv`
rounds what it stores, and attention backends widen what they read back to the activation
dtype before computing.
"""

from __future__ import annotations

import torch

# fp8 formats: K/V are stored with a plain saturating cast (scale 1.0, no calibration), so
# values beyond the format's finite range clamp to it instead of becoming inf/NaN. Per-layer or
# per-head k/v scales (amax calibration) were measured not to help the default model, whose K/V
# lie in e4m3's normal range already (BENCHMARKS.md, benchmarks/bench_kv_fp8_scales.py).
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Storage dtypes whose finite range is narrower than bf16/fp32 activations: stores clamp first.
_CLAMPED = {dt: torch.finfo(dt).max for dt in (*FP8_DTYPES, torch.float16)}


def to_storage(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` rounded to the KV storage ``dtype``: clamped to its finite range first (fp8,
    float16), so nothing stored is inf or NaN unless ``x`` was."""
    if x.dtype == dtype:
        return x
    limit = _CLAMPED.get(dtype)
    if limit is not None:
        x = x.clamp(-limit, limit)
    return x.to(dtype)


class PageAllocator:
    """Owns the free list of KV pages. Ask with :meth:`can_allocate`, then :meth:`allocate`."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages, got {num_pages}")
        self.page_size = page_size
        self.num_pages = num_pages
        self._free: list[int] = list(range(num_pages - 1, 0, -1))  # pop() hands out low pages first

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_usable_pages(self) -> int:
        return self.num_pages - 1

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        out = self._free[len(self._free) - num_pages:]
        del self._free[len(self._free) - num_pages:]
        return out[::-1]

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))


class KVPool:
    """Per-layer K and V buffers of shape ``[num_slots, num_kv_heads, head_dim]`` in ``dtype``,
    the storage dtype (the activation dtype unless ``--kv-cache-dtype`` narrows it).

    ``v_head_dim`` (MLA's latent cache): V is the first ``v_head_dim`` dims of K, so the pool
    holds K only and each layer's V buffer is a view into it (``[num_slots, num_kv_heads,
    v_head_dim]``, not contiguous); :meth:`set_kv` then writes K alone."""

    def __init__(self, *, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str, v_head_dim: int | None = None) -> None:
        self.page_size = page_size
        self.num_slots = num_pages * page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.v_head_dim = v_head_dim  # None: V has its own buffer of head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.num_layers = num_layers
        # One allocation, [K|V, layer, slot, head, dim] ([K, ...] with V inside K): each layer's K and V
        # buffer is a view of it, and a copy of some pages over every layer (HiCache's host
        # tier) is one indexing operation. Left uninitialised (the OS maps pages lazily);
        # only the scratch page must be finite, since padded reads of decode land there.
        parts = 1 if v_head_dim is not None else 2
        self.buffer = torch.empty((parts, num_layers, self.num_slots, num_kv_heads, head_dim), dtype=dtype,
                                  device=device)
        self.buffer[:, :, :page_size].zero_()
        self.k_buffers = [self.buffer[0, i] for i in range(num_layers)]
        self.v_buffers = [self.buffer[1, i] for i in range(num_layers)] if v_head_dim is None else \
            [k[..., :v_head_dim] for k in self.k_buffers]
        self.allocator = PageAllocator(num_pages, page_size)

    def set_kv(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k, v  # [T, Hkv, D]`` into the slots ``loc  # [T]``, rounded to the
        storage dtype (see :func:`to_storage`)."""
        self.k_buffers[layer_id][loc] = to_storage(k, self.dtype)
        if self.v_head_dim is None:  # (MLA: V is part of K)
            self.v_buffers[layer_id][loc] = to_storage(v, self.dtype)

    def move_kv(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy every layer's K/V from the slots ``src  # [N]`` to the slots ``dst  # [N]``
        (speculative decoding moves accepted tree nodes onto their path's slots)."""
        self.buffer[:, :, dst] = self.buffer[:, :, src]

    def get_kv(self, layer_id: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Read back ``k, v  # [L, Hkv, D]`` stored at the slots ``loc  # [L]`` (a copy, in
        the storage dtype)."""
        return self.k_buffers[layer_id][loc], self.v_buffers[layer_id][loc]

    @property
    def bytes_per_token(self) -> int:
        """K and V of one token over every layer, in the storage dtype."""
        return self.bytes_per_token_for(len(self.k_buffers), self.num_kv_heads, self.head_dim, self.dtype,
                                        v_in_k=self.v_head_dim is not None)

    @staticmethod
    def bytes_per_token_for(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                            v_in_k: bool = False) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return (1 if v_in_k else 2) * num_layers * num_kv_heads * head_dim * elem


def page_slots(pages: list[int] | torch.Tensor, page_size: int, device=None) -> torch.Tensor:
    """The slots of ``pages``, page by page: ``[len(pages) * page_size]`` int64."""
    p = torch.as_tensor(pages, dtype=torch.int64, device=device)
    if page_size == 1:
        return p
    return (p[:, None] * page_size + torch.arange(page_size, device=p.device)).reshape(-1)


class ReqToTokenPool:
    """Maps each running request (a row) to the KV slots of its tokens, position by position."""

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int64, device=device)
        self._free: list[int] = list(range(size - 1, -1, -1))
        self.num_reserved = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise MemoryError("no free request slot")
        return self._free.pop()

    def free(self, index: int) -> None:
        self._free.append(index)

    def reserve(self) -> int:
        """A row taken for good (CUDA graphs' padding row), not counted as in use by a request."""
        row = self.alloc()
        self.num_reserved += 1
        return row

    def unreserve(self, row: int) -> None:
        self.num_reserved -= 1
        self.free(row)

    def write(self, row: int, pages: list[int], page_size: int, start: int, end: int) -> None:
        """Point positions ``[start, end)`` of ``row`` at their slots in ``pages``."""
        if end <= start:
            return
        if page_size == 1:
            slots = pages[start:end]
        else:
            slots = [pages[p // page_size] * page_size + p % page_size for p in range(start, end)]
        self.req_to_token[row, start:end] = torch.tensor(slots, dtype=torch.int64, device=self.req_to_token.device)
