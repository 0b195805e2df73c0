"""The host-memory KV tier: a pool of pages in RAM (pinned when the device is CUDA) and the
copies between it and the device pool.

Layout is page-first, ``[page, K|V, layer, token, kv_head, dim]``: one page's K and V over
every layer are contiguous, which is the unit the storage tier stores
(:meth:`HostKVPool.payload`). ``--hicache-io-backend`` picks how a copy runs:

* ``kernel``: every layer at once (the device pool is a single ``[K|V, layer, slot, ...]``
  allocation): on CUDA one fused gather/scatter over the pages; on CPU, where both pools
  are RAM, one strided block copy per run of consecutive pages (a page's slots are
  contiguous in every layer), with no gathered temporary;
* ``direct``: one copy per layer and K/V (what a device pool split per layer needs).

The host pool holds pages in the device pool's storage dtype (``--kv-cache-dtype``), so a
narrow device pool halves or quarters the host tier's bytes per page too; copies move the
stored bits unchanged (fp8 pages through a byte view, for ops CPU torch lacks for fp8).

Copies are called from the cache's I/O worker thread; on CUDA they run on a side stream
that the thread waits for, so the scheduler's stream never stalls on them.
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.mem.kv_pool import FP8_DTYPES, KVPool, PageAllocator, page_slots


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or for fp8 a uint8 view of the same bytes (``index_copy_`` has no fp8
    CPU kernel; a copy of the bits is what is wanted anyway)."""
    return t.view(torch.uint8) if t.dtype in FP8_DTYPES else t


def _runs(a: list[int], b: list[int]) -> list[tuple[int, int, int]]:
    """``(a[i], b[i], n)`` for each maximal run where both lists go up by one at a time."""
    runs, i = [], 0
    while i < len(a):
        j = i + 1
        while j < len(a) and a[j] == a[j - 1] + 1 and b[j] == b[j - 1] + 1:
            j += 1
        runs.append((a[i], b[i], j - i))
        i = j
    return runs


class HostKVPool:
    def __init__(self, device_pool: KVPool, num_pages: int, io_backend: str = "kernel") -> None:
        if io_backend not in ("kernel", "direct"):
            raise ValueError(f"--hicache-io-backend: invalid value {io_backend!r}; choose from: kernel, direct")
        self.device_pool = device_pool
        self.page_size = page = device_pool.page_size
        self.io_backend = io_backend
        self.num_layers = device_pool.num_layers
        self.parts = device_pool.buffer.shape[0]  # K and V, or K alone (MLA's latent rows)
        shape = (num_pages + 1, self.parts, self.num_layers, page, device_pool.num_kv_heads, device_pool.head_dim)
        cuda = device_pool.device.type == "cuda"
        self.buffer = torch.empty(shape, dtype=device_pool.dtype, device="cpu", pin_memory=cuda)
        self.allocator = PageAllocator(num_pages + 1, page)  # page 0 unused, like the device pool's scratch
        self.stream = torch.cuda.Stream(device_pool.device) if cuda else None
        self.page_bytes = self.buffer[0].numel() * self.buffer.element_size()

    @property
    def num_pages(self) -> int:
        return self.allocator.num_usable_pages

    # ------------------------------------------------------------ copies
    def _device_block(self, first: int, n: int) -> torch.Tensor:
        """Device pages ``first .. first + n - 1`` as a ``[n, K|V, layer, page, Hkv, D]``
        view of the device pool (the host pool's page layout, strided)."""
        dev, page = self.device_pool, self.page_size
        block = _bits(dev.buffer)[:, :, first * page:(first + n) * page]
        return block.view(self.parts, self.num_layers, n, page, *block.shape[3:]).permute(2, 0, 1, 3, 4, 5)

    def _block_copies(self) -> bool:
        return self.io_backend == "kernel" and self.device_pool.device.type == "cpu"

    def backup(self, device_pages: list[int], host_pages: list[int]) -> None:
        """Device pages -> host pages (same order)."""
        if not device_pages:
            return
        if self._block_copies():
            host = _bits(self.buffer)
            for d, h, n in _runs(device_pages, host_pages):
                host[h:h + n].copy_(self._device_block(d, n))
            return
        with self._on_stream():
            dev = self.device_pool
            n, page = len(device_pages), self.page_size
            slots = page_slots(device_pages, page, dev.device)
            dst = torch.as_tensor(host_pages, dtype=torch.int64)
            if self.io_backend == "kernel":
                src = dev.buffer[:, :, slots]  # [K|V, L, n * page, Hkv, D]
                src = src.view(self.parts, self.num_layers, n, page, *src.shape[3:]).permute(2, 0, 1, 3, 4, 5)
                _bits(self.buffer).index_copy_(0, dst, _bits(src.to("cpu")))
            else:
                for kv, bufs in enumerate((dev.k_buffers, dev.v_buffers)[:self.parts]):
                    for layer, buf in enumerate(bufs):
                        self.buffer[dst, kv, layer] = buf[slots].view(n, page, *buf.shape[1:]).to("cpu")
        self._sync()

    def load(self, host_pages: list[int], device_pages: list[int]) -> None:
        """Host pages -> device pages (same order)."""
        if not host_pages:
            return
        if self._block_copies():
            host = _bits(self.buffer)
            for h, d, n in _runs(host_pages, device_pages):
                self._device_block(d, n).copy_(host[h:h + n])
            return
        with self._on_stream():
            dev = self.device_pool
            n, page = len(host_pages), self.page_size
            slots = page_slots(device_pages, page, dev.device)
            src_idx = torch.as_tensor(host_pages, dtype=torch.int64)
            if self.io_backend == "kernel":
                src = self.buffer[src_idx]  # [n, K|V, L, page, Hkv, D]
                src = src.permute(1, 2, 0, 3, 4, 5).reshape(self.parts, self.num_layers, n * page, *src.shape[4:])
                dev.buffer[:, :, slots] = src.to(dev.device, non_blocking=True)
            else:
                for kv, bufs in enumerate((dev.k_buffers, dev.v_buffers)[:self.parts]):
                    for layer, buf in enumerate(bufs):
                        buf[slots] = self.buffer[src_idx, kv, layer].reshape(n * page, *buf.shape[1:]).to(dev.device)
        self._sync()

    def payload(self, host_page: int) -> bytes:
        """The bytes of one host page (what the storage tier stores, before framing)."""
        return self.buffer[host_page].reshape(-1).view(torch.uint8).numpy().tobytes()

    def set_payload(self, host_page: int, data: bytes | memoryview) -> None:
        """Fill one host page from :meth:`payload` bytes."""
        dst = self.buffer[host_page].reshape(-1).view(torch.uint8).numpy()  # shares the pool's memory
        dst[:] = np.frombuffer(data, dtype=np.uint8)

    # ------------------------------------------------------------ helpers
    def _on_stream(self):
        if self.stream is None:
            import contextlib

            return contextlib.nullcontext()
        return torch.cuda.stream(self.stream)

    def _sync(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()
