"""What FlashInfer's planners are given, built from a radixserve :class:`ForwardBatch` in
plain torch (no flashinfer import: these run and are tested on CPU).

FlashInfer reads a paged KV cache as CSR arrays over pages (kv layout ``NHD``: each
layer's K, and V, viewed as ``[num_pages, page_size, Hkv, D]``):

* ``paged_kv_indptr  # [B + 1]`` int32: request ``i``'s pages are
  ``paged_kv_indices[indptr[i] : indptr[i + 1]]``;
* ``paged_kv_indices  # [indptr[-1]]`` int32: page ids, in position order;
* ``paged_kv_last_page_len  # [B]`` int32: tokens in each request's last page, 1..page_size;
* ``qo_indptr  # [B + 1]`` int32: request ``i``'s query rows are ``q[qo_indptr[i] : qo_indptr[i + 1]]``.

radixserve's pool maps position ``p`` of a request to slot ``req_to_token[row, p]``, and
slot = page * page_size + offset with positions laid out page by page, so the request's
page ids are ``req_to_token[row, 0:seq_len:page_size] // page_size``. Padding rows of a
CUDA-graph bucket (a table row of zeros, seq_len 1) come out as one page, page 0, holding
one token: the scratch page.

The CSR arrays the planner reads on the host (indptr, last_page_len, qo_indptr) are built
on the CPU from the batch's CPU lists, so planning never waits for the GPU; the page ids
are gathered on the batch's device without a host sync.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from radixserve.plugin_api.attention import ForwardBatch


@dataclass
class PagedKV:
    """One step's page table in FlashInfer's CSR form."""

    indptr: torch.Tensor  # [B + 1] int32, CPU
    indices: torch.Tensor  # [indptr[-1]] int32, on the batch's device
    last_page_len: torch.Tensor  # [B] int32, CPU
    seq_lens: list[int]  # [B] tokens per request, as planned


def pages_per_request(seq_lens: list[int], page_size: int) -> list[int]:
    """Pages each request's KV spans (every request holds at least one token)."""
    return [-(-n // page_size) for n in seq_lens]


def paged_kv(batch: ForwardBatch, page_size: int, seq_lens: list[int] | None = None) -> PagedKV:
    """The page table of every request of ``batch`` over its first ``seq_lens[i]`` tokens
    (default ``batch.seq_lens_cpu``: the whole sequence, this step's new tokens included)."""
    seq_lens = list(batch.seq_lens_cpu if seq_lens is None else seq_lens)
    if len(seq_lens) != batch.batch_size:
        raise ValueError(f"{len(seq_lens)} sequence lengths for a batch of {batch.batch_size}")
    if min(seq_lens, default=1) < 1:
        raise ValueError(f"every request needs at least one token in the KV pool, got {seq_lens}")
    num_pages = pages_per_request(seq_lens, page_size)
    indptr = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    indptr[1:] = torch.tensor(num_pages, dtype=torch.int32).cumsum(0)
    last = torch.tensor([(n - 1) % page_size + 1 for n in seq_lens], dtype=torch.int32)
    total = int(indptr[-1])
    device = batch.req_to_token.device
    counts = torch.tensor(num_pages, dtype=torch.int64).to(device, non_blocking=True)  # [B]
    starts = indptr[:-1].to(torch.int64).to(device, non_blocking=True)  # [B]
    # request of each page, then the page's rank within its request: no host sync
    req = torch.repeat_interleave(torch.arange(len(seq_lens), device=device), counts, output_size=total)
    rank = torch.arange(total, device=device) - starts[req]  # [N]
    rows = batch.req_pool_indices.to(torch.int64)[req]  # [N]
    slots = batch.req_to_token[rows, rank * page_size]  # [N] first slot of each page
    indices = torch.div(slots, page_size, rounding_mode="floor").to(torch.int32)
    return PagedKV(indptr, indices, last, seq_lens)


def qo_indptr(extend_lens: list[int]) -> torch.Tensor:
    """``[B + 1]`` int32 (CPU): where each request's query rows start in ``q``."""
    out = torch.zeros(len(extend_lens) + 1, dtype=torch.int32)
    out[1:] = torch.tensor(extend_lens, dtype=torch.int32).cumsum(0)
    return out


def window_left(sliding_window: int | None) -> int:
    """FlashInfer's ``window_left`` (a query at position ``t`` sees keys ``t - window_left
    .. t``; -1: no window) for radixserve's ``sliding_window`` (at most that many most
    recent tokens, the query's own included)."""
    if sliding_window is None:
        return -1
    if sliding_window < 1:
        raise ValueError(f"sliding_window must be at least 1, got {sliding_window}")
    return sliding_window - 1


def tree_custom_mask(batch: ForwardBatch, sliding_window: int | None = None) -> torch.Tensor:
    """Target verify: FlashInfer's flattened ``custom_mask`` (bool, on the batch's device),
    request by request a row-major ``[E_i, prefix_i + E_i]`` block: draft token ``a`` sees
    the cached prefix and the draft tokens ``b`` with ``batch.tree_mask_of(i)[a, b]``.

    A sliding window is folded in by position (``batch.positions``: prefix + depth in the
    tree), since FlashInfer's own ``window_left`` would compare column indices, which in a
    tree are not positions; plan this mask with ``window_left=-1``."""
    if batch.tree_mask is None or batch.tree_mask_offsets_cpu is None:
        raise ValueError("target verify needs batch.tree_mask and batch.tree_mask_offsets_cpu")
    device = batch.tree_mask.device
    blocks, row = [], 0
    for i in range(batch.batch_size):
        prefix, ext = batch.prefix_lens_cpu[i], batch.extend_lens_cpu[i]
        tree = batch.tree_mask_of(i).to(torch.bool)  # [E, E]
        block = torch.cat([torch.ones(ext, prefix, dtype=torch.bool, device=device), tree], dim=1)
        if sliding_window is not None:
            qpos = batch.positions[row:row + ext].to(device)  # [E] prefix + depth
            kpos = torch.cat([torch.arange(prefix, device=device), qpos])  # [prefix + E]
            block &= kpos[None, :] > qpos[:, None] - sliding_window
        blocks.append(block.reshape(-1))
        row += ext
    return torch.cat(blocks)

