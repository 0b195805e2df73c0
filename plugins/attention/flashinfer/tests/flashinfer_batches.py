"""Decode steps shaped like a CUDA-graph bucket, for the flashinfer tests (CPU and GPU).

:func:`decode_step` builds a one-layer pool in which every real request owns pages for a
whole context of random K/V, and a decode batch padded to ``bucket`` rows the way the
engine's graph runner pads (table row 0 all zeros, seq_len 1, slot 0). Its tensors are
fixed; :meth:`DecodeStep.set_lengths` rewrites them in place for the next step, as the
runner copies a step into its static buffers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from radixserve.layers.attention import AttentionContext, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.mem.kv_pool import KVPool, ReqToTokenPool
from radixserve.testing.attention_conformance import reference


@dataclass
class DecodeStep:
    ctx: AttentionContext
    batch: ForwardBatch
    layer: AttentionLayer
    q: torch.Tensor  # [bucket, H, D]
    k: torch.Tensor  # [bucket, Hkv, D] this step's new K (padding rows too)
    v: torch.Tensor
    rows: list[int]  # table rows of the real requests
    num_real: int

    def set_lengths(self, seq_lens: list[int]) -> None:
        """The next step: new lengths (and new-token slots) written into the same tensors."""
        b = self.batch
        if len(seq_lens) != self.num_real or max(seq_lens) > self.ctx.max_context_len:
            raise ValueError(f"{seq_lens}: one length per real request, at most max_context_len")
        table = b.req_to_token
        pad = b.batch_size - self.num_real
        b.seq_lens[:self.num_real].copy_(torch.tensor(seq_lens))
        b.out_cache_loc[:self.num_real].copy_(
            torch.stack([table[r, n - 1] for r, n in zip(self.rows, seq_lens)]))
        b.seq_lens_cpu = list(seq_lens) + [1] * pad
        b.prefix_lens_cpu = [n - 1 for n in seq_lens] + [0] * pad

    def eager(self, layer: AttentionLayer | None = None) -> torch.Tensor:
        """The real rows' attention ``# [num_real, H, D]`` by the dense reference (float32,
        on the CPU), over the pool as it stands with this step's new K/V stored."""
        layer = layer or self.layer
        b, pool = self.batch, self.batch.kv_pool
        n = self.num_real
        pool.set_kv(0, b.out_cache_loc[:n], self.k[:n], self.v[:n])
        outs = []
        for i, row in enumerate(self.rows):
            slots = b.req_to_token[row, :b.seq_lens_cpu[i]]
            k = pool.k_buffers[0][slots].cpu().float()  # the reference runs on the CPU
            v = pool.v_buffers[0][slots].cpu().float()
            outs.append(reference(self.q[i:i + 1].cpu().float(), k, v, b.seq_lens_cpu[i] - 1,
                                  layer.scaling, layer.sliding_window))
        return torch.cat(outs).to(self.q.device, self.q.dtype)


def decode_step(seq_lens: list[int], *, bucket: int, page: int = 16, heads: int = 8, kv_heads: int = 2,
                dim: int = 32, max_context_len: int = 128, dtype: torch.dtype = torch.float32,
                device: str = "cpu", seed: int = 0) -> DecodeStep:
    gen = torch.Generator().manual_seed(seed)
    num_real = len(seq_lens)
    if bucket < num_real:
        raise ValueError(f"bucket {bucket} is smaller than the {num_real} requests")
    pages_each = -(-max_context_len // page)
    pool = KVPool(num_layers=1, num_pages=num_real * pages_each + 1, page_size=page, num_kv_heads=kv_heads,
                  head_dim=dim, dtype=dtype, device=device)
    pool.allocator._free = random.Random(seed).sample(pool.allocator._free, len(pool.allocator._free))
    table = ReqToTokenPool(num_real + 1, max_context_len, device)
    pad_row = table.alloc()  # row 0: the padding rows' table, all zeros (scratch slot 0)
    rows = []
    for _ in range(num_real):
        row = table.alloc()
        table.write(row, pool.allocator.allocate(pages_each), page, 0, max_context_len)
        slots = table.req_to_token[row]
        shape = (max_context_len, kv_heads, dim)
        pool.k_buffers[0][slots] = torch.randn(shape, generator=gen).to(device, dtype)
        pool.v_buffers[0][slots] = torch.randn(shape, generator=gen).to(device, dtype)
        rows.append(row)
    pad = bucket - num_real
    batch = ForwardBatch(
        mode=ForwardMode.DECODE, batch_size=bucket,
        input_ids=torch.zeros(bucket, dtype=torch.int64, device=device),
        positions=torch.zeros(bucket, dtype=torch.int64, device=device),
        req_pool_indices=torch.tensor(rows + [pad_row] * pad, device=device),
        seq_lens=torch.ones(bucket, dtype=torch.int64, device=device),
        out_cache_loc=torch.zeros(bucket, dtype=torch.int64, device=device),
        seq_lens_cpu=[1] * bucket, prefix_lens_cpu=[0] * bucket, extend_lens_cpu=[1] * bucket,
        req_to_token=table.req_to_token, kv_pool=pool,
        logits_indices=torch.arange(bucket, device=device))
    ctx = AttentionContext(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, num_layers=1, dtype=dtype,
                           device=torch.device(device), page_size=page, max_context_len=max_context_len,
                           max_batch_size=bucket)
    layer = AttentionLayer(0, heads, kv_heads, dim, dim ** -0.5)
    q = torch.randn(bucket, heads, dim, generator=gen).to(device, dtype)
    k = torch.randn(bucket, kv_heads, dim, generator=gen).to(device, dtype)
    v = torch.randn(bucket, kv_heads, dim, generator=gen).to(device, dtype)
    step = DecodeStep(ctx, batch, layer, q, k, v, rows, num_real)
    step.set_lengths(seq_lens)
    return step


@dataclass
class Step:
    ctx: AttentionContext
    batch: ForwardBatch
    layer: AttentionLayer
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, Hkv, D] the new tokens'
    v: torch.Tensor


def paged_step(mode: ForwardMode, prefix_lens, extend_lens, *, page: int = 16, heads: int = 32,
               kv_heads: int = 8, dim: int = 128, dtype: torch.dtype = torch.bfloat16,
               device: str = "cuda", seed: int = 0) -> Step:
    """An extend or decode step of a one-layer pool holding each request's random prefix
    (for the timings: sizes the conformance suite does not reach)."""
    gen = torch.Generator().manual_seed(seed)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens)]
    pages = [-(-t // page) for t in totals]
    pool = KVPool(num_layers=1, num_pages=sum(pages) + 1, page_size=page, num_kv_heads=kv_heads,
                  head_dim=dim, dtype=dtype, device=device)
    table = ReqToTokenPool(len(totals), max(totals), device)
    rows, new_slots = [], []
    for t, n, pre in zip(totals, pages, prefix_lens):
        row = table.alloc()
        table.write(row, pool.allocator.allocate(n), page, 0, t)
        slots = table.req_to_token[row, :t]
        pool.k_buffers[0][slots[:pre]] = torch.randn(pre, kv_heads, dim, generator=gen).to(device, dtype)
        pool.v_buffers[0][slots[:pre]] = torch.randn(pre, kv_heads, dim, generator=gen).to(device, dtype)
        rows.append(row)
        new_slots.append(slots[pre:])
    num = sum(extend_lens)
    batch = ForwardBatch(
        mode=mode, batch_size=len(totals), input_ids=torch.zeros(num, dtype=torch.int64, device=device),
        positions=torch.cat([torch.arange(p, t) for p, t in zip(prefix_lens, totals)]).to(device),
        req_pool_indices=torch.tensor(rows, device=device), seq_lens=torch.tensor(totals, device=device),
        out_cache_loc=torch.cat(new_slots), seq_lens_cpu=totals, prefix_lens_cpu=list(prefix_lens),
        extend_lens_cpu=list(extend_lens), req_to_token=table.req_to_token, kv_pool=pool,
        logits_indices=torch.tensor(extend_lens).cumsum(0).to(device) - 1)
    ctx = AttentionContext(num_heads=heads, num_kv_heads=kv_heads, head_dim=dim, num_layers=1, dtype=dtype,
                           device=torch.device(device), page_size=page, max_context_len=max(totals),
                           max_batch_size=len(totals))
    layer = AttentionLayer(0, heads, kv_heads, dim, dim ** -0.5)
    q, k, v = (torch.randn(num, h, dim, generator=gen).to(device, dtype) for h in (heads, kv_heads, kv_heads))
    return Step(ctx, batch, layer, q, k, v)
