"""Per-step metadata for the flash-attn backends, and the pieces computed in plain torch.

Nothing here imports flash-attn: it runs (and is tested) on CPU.

How radixserve's pool maps onto FlashAttention's paged KV cache: layer ``l``'s
``k_buffers[l]  # [num_slots, Hkv, D]`` viewed as ``[num_pages, page_size, Hkv, D]`` is the
kernel's ``k_cache``; slot ``s`` is row ``s % page_size`` of page ``s // page_size``. A
request's positions ``0, page_size, 2 * page_size, ...`` start its pages (the pool places
position ``p`` at offset ``p % page_size`` of its page), so its page-table row is
``req_to_token[row, 0:seq_len:page_size] // page_size``. ``cache_seqlens`` is the request's
whole length: this step's K/V are in the pool before the kernel runs.

Invariants the builders keep:

* every tensor a kernel reads is int32 with a contiguous last dimension;
* a page-table row past a request's length holds any valid page (stale table entries are
  valid slots; CUDA-graph padding rows point at the scratch page 0): the kernel reads only
  ``ceil(cache_seqlens / page_size)`` pages of it;
* ``cu_seqlens_q`` / ``cu_seqlens_k`` are exclusive prefix sums with a leading 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from radixserve.plugin_api.attention import ForwardBatch


@dataclass
class VerifyMeta:
    """Target verify: the draft-tree tokens, padded to ``[B, E_max]`` for the torch part."""

    prefix_lens: torch.Tensor  # [B] int32: the cached prefix each tree attends to
    cu_prefix: torch.Tensor  # [B + 1] int32
    max_prefix: int
    has_prefix: torch.Tensor  # [T] bool: the token's request has a non-empty prefix
    tree_index: torch.Tensor  # [B, E_max] int64 rows of q/k/v (0 where padded)
    tree_valid: torch.Tensor  # [B, E_max] bool
    tree_allow: torch.Tensor  # [B, E_max, E_max] bool: token a sees token b (the tree mask)
    tree_pos: torch.Tensor  # [B, E_max] int64 positions (prefix + depth)
    prefix_slots: torch.Tensor | None = None  # gather path: [sum prefix] int64


@dataclass
class FlashMetadata:
    cache_seqlens: torch.Tensor  # [B] int32: tokens each request attends over
    max_seqlen_k: int
    page_table: torch.Tensor | None = None  # [B, max_pages] int32 (kernels that read the pool)
    cu_seqlens_q: torch.Tensor | None = None  # [B + 1] int32 (extend; decode on the gather path)
    max_seqlen_q: int = 1
    cu_seqlens_k: torch.Tensor | None = None  # [B + 1] int32
    kv_slots: torch.Tensor | None = None  # gather path: [sum seq_len] int64, request by request
    verify: VerifyMeta | None = None


def cumsum0(lens: list[int], device) -> torch.Tensor:
    """``[0, l0, l0 + l1, ...]`` as int32 on ``device``: ``[len(lens) + 1]``."""
    out = [0]
    for n in lens:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=torch.int32).to(device, non_blocking=True)


def write_page_table(out: torch.Tensor, req_to_token: torch.Tensor, rows: torch.Tensor,
                     page_size: int) -> torch.Tensor:
    """Fill ``out  # [B, P] int32`` in place with the first ``P`` pages of each request
    ``rows  # [B]``; returns ``out``. Columns past the table's width are left as they are."""
    num_cols = min(out.shape[1], math.ceil(req_to_token.shape[1] / page_size))
    first_slots = req_to_token[rows][:, 0:num_cols * page_size:page_size]  # [B, P]
    out[:, :num_cols].copy_(first_slots // page_size)
    return out


def page_table(req_to_token: torch.Tensor, rows: torch.Tensor, page_size: int,
               max_seq_len: int) -> torch.Tensor:
    """A fresh ``[B, ceil(max_seq_len / page_size)]`` int32 page table (eager steps)."""
    num_cols = max(1, math.ceil(max_seq_len / page_size))
    out = torch.zeros(rows.shape[0], num_cols, dtype=torch.int32, device=req_to_token.device)
    return write_page_table(out, req_to_token, rows, page_size)


def token_slots(req_to_token: torch.Tensor, rows: torch.Tensor, lens: list[int],
                start: list[int] | None = None) -> torch.Tensor:
    """Slots of positions ``start_i .. start_i + lens_i - 1`` of each request, concatenated:
    ``[sum lens]`` int64 (the gather path's index into the pool)."""
    dev = req_to_token.device
    counts = torch.tensor(lens, dtype=torch.int64)
    total = int(counts.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.int64, device=dev)
    firsts = torch.cumsum(counts, 0) - counts  # [B] where each request's run begins
    which = torch.repeat_interleave(torch.arange(len(lens)), counts)  # [N] request of each
    cols = torch.arange(total) - firsts[which]
    if start is not None:
        cols += torch.tensor(start, dtype=torch.int64)[which]
    which, cols = which.to(dev, non_blocking=True), cols.to(dev, non_blocking=True)
    return req_to_token[rows[which], cols]


def extend_metadata(batch: ForwardBatch, page_size: int, *, paged: bool) -> FlashMetadata:
    """Extend, mixed and target-verify steps: ragged new tokens over each request's
    cached prefix (``paged``: through a page table, else through gathered slots)."""
    dev = batch.req_to_token.device
    seq = batch.seq_lens_cpu
    meta = FlashMetadata(
        cache_seqlens=batch.seq_lens.to(torch.int32),
        max_seqlen_k=max(seq),
        cu_seqlens_q=cumsum0(batch.extend_lens_cpu, dev),
        max_seqlen_q=max(batch.extend_lens_cpu),
        cu_seqlens_k=cumsum0(seq, dev),
    )
    if paged:
        meta.page_table = page_table(batch.req_to_token, batch.req_pool_indices, page_size, max(seq))
    elif not batch.is_verify:  # verify reads only the prefix (VerifyMeta.prefix_slots)
        meta.kv_slots = token_slots(batch.req_to_token, batch.req_pool_indices, seq)
    if batch.is_verify:
        meta.verify = verify_metadata(batch, paged=paged)
    return meta


def decode_metadata(batch: ForwardBatch, page_size: int, *, paged: bool) -> FlashMetadata:
    """An eager decode step: one query per request over its whole sequence."""
    dev = batch.req_to_token.device
    seq = batch.seq_lens_cpu
    meta = FlashMetadata(cache_seqlens=batch.seq_lens.to(torch.int32), max_seqlen_k=max(seq))
    if paged:
        meta.page_table = page_table(batch.req_to_token, batch.req_pool_indices, page_size, max(seq))
    else:
        meta.cu_seqlens_q = torch.arange(batch.batch_size + 1, dtype=torch.int32, device=dev)
        meta.cu_seqlens_k = cumsum0(seq, dev)
        meta.kv_slots = token_slots(batch.req_to_token, batch.req_pool_indices, seq)
    return meta


def verify_metadata(batch: ForwardBatch, *, paged: bool) -> VerifyMeta:
    """The draft trees of a target-verify step, padded for the torch part (built once per
    step; the sliding-window masks are added per layer)."""
    if batch.tree_mask is None or batch.tree_mask_offsets_cpu is None:
        raise ValueError("target verify needs batch.tree_mask and batch.tree_mask_offsets_cpu")
    dev = batch.req_to_token.device
    ext, pre = batch.extend_lens_cpu, batch.prefix_lens_cpu
    n, e_max = len(ext), max(ext)
    index = torch.zeros(n, e_max, dtype=torch.int64)
    valid = torch.zeros(n, e_max, dtype=torch.bool)
    start = 0
    for i, e in enumerate(ext):
        index[i, :e] = torch.arange(start, start + e)
        valid[i, :e] = True
        start += e
    index, valid = index.to(dev), valid.to(dev)
    allow = torch.zeros(n, e_max, e_max, dtype=torch.bool, device=dev)
    for i, e in enumerate(ext):
        allow[i, :e, :e] = batch.tree_mask_of(i)
    has_prefix = torch.repeat_interleave(torch.tensor([p > 0 for p in pre]), torch.tensor(ext))
    return VerifyMeta(
        prefix_lens=torch.tensor(pre, dtype=torch.int32).to(dev),
        cu_prefix=cumsum0(pre, dev),
        max_prefix=max(pre),
        has_prefix=has_prefix.to(dev),
        tree_index=index,
        tree_valid=valid,
        tree_allow=allow,
        tree_pos=batch.positions[index].masked_fill(~valid, 0),
        prefix_slots=None if paged else token_slots(batch.req_to_token, batch.req_pool_indices, pre),
    )


def window_size(sliding_window: int | None) -> tuple[int, int]:
    """FlashAttention's ``window_size=(left, right)`` for radixserve's sliding window (attend
    to at most ``sliding_window`` most recent tokens, itself included): ``(W - 1, 0)``;
    ``(-1, -1)``, no window, when ``None``."""
    if sliding_window is None:
        return (-1, -1)
    return (sliding_window - 1, 0)


# ------------------------------------------------------------------ torch attention pieces
def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allow: torch.Tensor,
                     scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention with an explicit mask, returning its log-sum-exp.

    ``q  # [B, M, H, D]``, ``k, v  # [B, N, Hkv, D]``, ``allow  # [B, M, N]`` bool. Returns
    ``out  # [B, M, H, D]`` and ``lse  # [B, M, H]`` (natural log of the softmax
    denominator of ``scale * q.k``), both float32. A row that sees no key gets ``out`` 0 and
    ``lse`` -inf, so it drops out of :func:`merge_by_lse`.
    """
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=2)  # [B, N, H, D]
    vf = v.float().repeat_interleave(group, dim=2)
    scores = torch.einsum("bmhd,bnhd->bhmn", q.float(), kf) * scale  # [B, H, M, N]
    scores = scores.masked_fill(~allow[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [B, H, M]
    probs = torch.exp(scores - lse.masked_fill(lse == float("-inf"), 0.0)[..., None])
    out = torch.einsum("bhmn,bnhd->bmhd", probs, vf)
    return out, lse.transpose(1, 2)  # [B, M, H, D], [B, M, H]


def merge_by_lse(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over two disjoint key sets, combined: ``out  # [..., D]`` with ``lse  # [...]``
    per part (float32, -inf for a part with no keys). Returns the attention over the union
    and its lse. At least one part of every row must see a key."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse)[..., None]  # exp(-inf) = 0 for an empty part
    w_b = torch.exp(lse_b - lse)[..., None]
    return out_a * w_a + out_b * w_b, lse
