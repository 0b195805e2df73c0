"""The ``fa3`` / ``fa2`` attention backend: FlashAttention kernels over radixserve's paged pool.

One class serves both versions; an adapter (:class:`Fa3Api`, :class:`Fa2Api`) turns its three
calls (paged attention, paged decode, attention over gathered K/V) into the library's own
functions. The library module is handed in by the factory (``radixserve_attention_flash_attn``),
so this file imports no flash-attn and tests can hand in a torch double of it. Every argument
an adapter passes is listed in ``probes.FA2_CALLS`` / ``probes.FA3_CALLS``: the probes refuse
a library that does not take one of them, so add a new argument there too.

Two ways to read the pool:

* *paged*: the kernel reads K/V through a page table (FA3 for any page size; FA2 only when
  ``--page-size`` is a multiple of 256, its paged-KV limit). Decode metadata lives in fixed
  buffers, so decode steps can be captured in CUDA graphs.
* *gather*: each layer gathers every request's K/V through the token-slot table into one
  contiguous ragged buffer, widened to the activation dtype, then runs the varlen kernel.
  Used by FA2 at other page sizes, and by both versions when ``--kv-cache-dtype`` is
  narrower than the activations (FlashAttention reads K/V only in the query's dtype). No
  CUDA graphs on this path: the gathered buffer's size changes every step.

Target verify: FlashAttention has no arbitrary mask, so each draft token attends to its
request's cached prefix through the kernel (non-causal, with the softmax log-sum-exp
returned), to its tree ancestors in torch (a few tokens per request), and the two parts are
merged by log-sum-exp. Under a sliding window the prefix part runs in torch too (the
kernel's window is by query index, a draft token's by its depth).
"""

from __future__ import annotations

import logging
import math

import torch
from radixserve.plugin_api.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
    to_storage,
)

from radixserve_attention_flash_attn.metadata import (
    FlashMetadata,
    decode_metadata,
    extend_metadata,
    masked_attention,
    merge_by_lse,
    window_size,
    write_page_table,
)

logger = logging.getLogger(__name__)

FA2_PAGE_MULTIPLE = 256  # flash-attn 2: "Paged KV cache block size must be divisible by 256"
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
MAX_HEAD_DIM = 256


class _FlashApi:
    """What both versions call alike: the varlen function over contiguous K/V."""

    def __init__(self, lib) -> None:
        self.lib = lib

    def varlen(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
               window, scale, return_lse=False):
        # FA2 returns (out, lse, probs) with return_attn_probs, FA3 (out, lse)
        res = self.lib.flash_attn_varlen_func(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale=scale,
            causal=causal, window_size=window, return_attn_probs=return_lse)
        return (res[0], res[1]) if return_lse else res


class Fa3Api(_FlashApi):
    """FlashAttention-3 (module ``flash_attn_interface``, the ``hopper/`` build of 2025-08-29 or
    later); its calls: ``probes.FA3_CALLS``."""

    version = 3

    def reads_pages(self, page_size: int) -> bool:
        return True  # "page_block_size can be arbitrary"

    def paged(self, q, k_cache, v_cache, meta: FlashMetadata, *, cache_seqlens, cu_seqlens_k,
              max_seqlen_k, causal, window, scale, return_lse=False):
        """``q  # [T, H, D]`` ragged by ``meta.cu_seqlens_q``; returns ``out`` or
        ``(out, lse  # [H, T])``."""
        res = self.lib.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=cache_seqlens, page_table=meta.page_table,
            cu_seqlens_q=meta.cu_seqlens_q, max_seqlen_q=meta.max_seqlen_q,
            softmax_scale=scale, causal=causal, window_size=window, return_softmax_lse=return_lse)
        return (res[0], res[1]) if return_lse else res

    def decode(self, q, k_cache, v_cache, meta: FlashMetadata, *, window, scale):
        """``q  # [B, H, D]``, one token per request; returns ``# [B, H, D]``."""
        out = self.lib.flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.cache_seqlens,
            page_table=meta.page_table, softmax_scale=scale, causal=True, window_size=window)
        return out.squeeze(1)


class Fa2Api(_FlashApi):
    """FlashAttention-2 (package ``flash_attn`` 2.6+); its calls: ``probes.FA2_CALLS``."""

    version = 2

    def reads_pages(self, page_size: int) -> bool:
        return page_size % FA2_PAGE_MULTIPLE == 0

    def paged(self, q, k_cache, v_cache, meta: FlashMetadata, *, cache_seqlens, cu_seqlens_k,
              max_seqlen_k, causal, window, scale, return_lse=False):
        # varlen with block_table: K lengths come from cu_seqlens_k (cumulative), pages from
        # the table
        res = self.lib.flash_attn_varlen_func(
            q, k_cache, v_cache, meta.cu_seqlens_q, cu_seqlens_k, meta.max_seqlen_q, max_seqlen_k,
            softmax_scale=scale, causal=causal, window_size=window, return_attn_probs=return_lse,
            block_table=meta.page_table)
        return (res[0], res[1]) if return_lse else res

    def decode(self, q, k_cache, v_cache, meta: FlashMetadata, *, window, scale):
        out = self.lib.flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=meta.cache_seqlens,
            block_table=meta.page_table, softmax_scale=scale, causal=True, window_size=window)
        return out.squeeze(1)


def check_context(ctx: AttentionContext, name: str) -> None:
    """Refuse, at start-up, what FlashAttention kernels cannot compute."""
    flags = f"--attention-backend {name} (or --prefill/--decode-attention-backend {name})"
    if ctx.device.type != "cuda":
        raise ValueError(f"{flags} runs on CUDA devices, not {ctx.device.type}; "
                         "use --attention-backend torch_native there")
    if ctx.dtype not in ACTIVATION_DTYPES:
        act = str(ctx.dtype).removeprefix("torch.")
        raise ValueError(f"{flags}: FlashAttention computes in float16 or bfloat16, the model runs "
                         f"in {act}; pass --dtype bfloat16 (or float16), or choose "
                         "--attention-backend triton or torch_native")
    if ctx.head_dim > MAX_HEAD_DIM or ctx.head_dim % 8:
        raise ValueError(f"{flags}: FlashAttention needs a head dim that is a multiple of 8 and at "
                         f"most {MAX_HEAD_DIM}, the model's is {ctx.head_dim}; choose "
                         "--attention-backend triton or torch_native")
    if ctx.num_heads % ctx.num_kv_heads:
        raise ValueError(f"{flags}: num_heads ({ctx.num_heads}) must be a multiple of "
                         f"num_kv_heads ({ctx.num_kv_heads})")


class FlashAttention(AttentionBackend):
    """Extend, decode, mixed and target verify through FlashAttention's kernels.

    ``lib``: the library module (``flash_attn_interface`` for ``version=3``, ``flash_attn``
    for 2) or a stand-in with the same functions.
    """

    supports_target_verify = True
    # narrower pools are read through the gather path, widened to the activation dtype
    supported_kv_dtypes = frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn,
                                     torch.float8_e5m2})

    def __init__(self, ctx: AttentionContext, *, version: int, lib, name: str | None = None) -> None:
        if version not in (2, 3):
            raise ValueError(f"FlashAttention version must be 2 or 3, got {version}")
        self.ctx = ctx
        self.name = name or f"fa{version}"
        self.api = Fa3Api(lib) if version == 3 else Fa2Api(lib)
        self.page_size = ctx.page_size
        same_dtype = ctx.kv_dtype == ctx.dtype
        self.paged = same_dtype and self.api.reads_pages(ctx.page_size)
        # decode can be captured only when its kernel reads the pool through fixed buffers
        self.supports_cuda_graph = self.paged
        if not self.paged:
            why = (f"--page-size {ctx.page_size} is not a multiple of {FA2_PAGE_MULTIPLE}"
                   if same_dtype else
                   f"the KV cache is stored as {str(ctx.kv_dtype).removeprefix('torch.')}, "
                   "FlashAttention reads K/V only in the activation dtype")
            logger.info("%s: %s, so each layer gathers K/V into a contiguous buffer before the "
                        "varlen kernel (slower than reading pages; decode runs without CUDA "
                        "graphs)", self.name, why)
        self.max_pages = math.ceil(ctx.max_context_len / ctx.page_size)
        self._graph_page_table: torch.Tensor | None = None
        self._graph_seqlens: torch.Tensor | None = None

    # ------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            batch.attn_metadata = decode_metadata(batch, self.page_size, paged=self.paged)
        else:
            batch.attn_metadata = extend_metadata(batch, self.page_size, paged=self.paged)

    # CUDA graphs (decode, paged path): the page table and lengths live in fixed buffers of
    # max_bs rows and max_context_len / page_size columns, rewritten in place before replay.
    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        if not self.paged:
            raise RuntimeError(f"{self.name}: decode on the gather path cannot be captured in a "
                               "CUDA graph (supports_cuda_graph is False)")
        dev = self.ctx.device
        self._graph_page_table = torch.zeros(max_batch_size, self.max_pages, dtype=torch.int32,
                                             device=dev)
        self._graph_seqlens = torch.ones(max_batch_size, dtype=torch.int32, device=dev)

    def _graph_metadata(self, batch: ForwardBatch) -> None:
        if self._graph_page_table is None:
            raise RuntimeError(f"{self.name}: init_cuda_graph_state was not called before capture")
        bs = batch.batch_size
        if bs > self._graph_page_table.shape[0]:
            raise ValueError(f"{self.name}: a captured batch of {bs} requests is larger than the "
                             f"{self._graph_page_table.shape[0]} of init_cuda_graph_state")
        table = self._graph_page_table[:bs]
        write_page_table(table, batch.req_to_token, batch.req_pool_indices, self.page_size)
        seqlens = self._graph_seqlens[:bs]
        seqlens.copy_(batch.seq_lens)
        batch.attn_metadata = FlashMetadata(cache_seqlens=seqlens, max_seqlen_k=self.ctx.max_context_len,
                                            page_table=table)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self._graph_metadata(batch)

    # ------------------------------------------------------------ forward
    def _pages(self, batch: ForwardBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        pool = batch.kv_pool
        shape = (-1, self.page_size, pool.num_kv_heads, pool.head_dim)
        return pool.k_buffers[layer_id].view(shape), pool.v_buffers[layer_id].view(shape)

    def _gather(self, batch: ForwardBatch, layer_id: int, slots: torch.Tensor, dtype: torch.dtype):
        pool = batch.kv_pool
        return pool.k_buffers[layer_id][slots].to(dtype), pool.v_buffers[layer_id][slots].to(dtype)

    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta: FlashMetadata = batch.attn_metadata
        if meta.verify is not None:
            return self._verify(q, k, v, layer, batch, meta)
        window = window_size(layer.sliding_window)
        if self.paged:
            k_cache, v_cache = self._pages(batch, layer.layer_id)
            return self.api.paged(q, k_cache, v_cache, meta, cache_seqlens=meta.cache_seqlens,
                                  cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_k=meta.max_seqlen_k,
                                  causal=True, window=window, scale=layer.scaling)
        keys, values = self._gather(batch, layer.layer_id, meta.kv_slots, q.dtype)
        return self.api.varlen(q, keys, values, cu_seqlens_q=meta.cu_seqlens_q,
                               cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=meta.max_seqlen_q,
                               max_seqlen_k=meta.max_seqlen_k, causal=True, window=window,
                               scale=layer.scaling)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        batch.kv_pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        meta: FlashMetadata = batch.attn_metadata
        window = window_size(layer.sliding_window)
        if self.paged:
            k_cache, v_cache = self._pages(batch, layer.layer_id)
            return self.api.decode(q, k_cache, v_cache, meta, window=window, scale=layer.scaling)
        keys, values = self._gather(batch, layer.layer_id, meta.kv_slots, q.dtype)
        return self.api.varlen(q, keys, values, cu_seqlens_q=meta.cu_seqlens_q,
                               cu_seqlens_k=meta.cu_seqlens_k, max_seqlen_q=1,
                               max_seqlen_k=meta.max_seqlen_k, causal=True, window=window,
                               scale=layer.scaling)

    # ------------------------------------------------------------ target verify
    def _verify(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch,
                meta: FlashMetadata) -> torch.Tensor:
        vm = meta.verify
        pool = batch.kv_pool
        width = layer.sliding_window
        num_tokens, heads, dim = q.shape
        # the tree part: each draft token over its ancestors and itself, as the pool stores them
        k_new = to_storage(k, pool.dtype).to(q.dtype)
        v_new = to_storage(v, pool.dtype).to(q.dtype)
        idx = vm.tree_index
        allow = vm.tree_allow
        if width is not None:
            allow = allow & (vm.tree_pos[:, None, :] > vm.tree_pos[:, :, None] - width)
        out_t, lse_t = masked_attention(q[idx], k_new[idx], v_new[idx], allow, layer.scaling)
        out_t, lse_t = out_t[vm.tree_valid], lse_t[vm.tree_valid]  # [T, H, D], [T, H]
        if vm.max_prefix == 0:
            return out_t.to(q.dtype)
        if width is None:
            out_p, lse_p = self._verify_prefix(q, layer, batch, meta)
        else:
            out_p, lse_p = self._verify_prefix_window(q, layer, batch, meta)
        out, _ = merge_by_lse(out_p, lse_p, out_t, lse_t)
        return out.to(q.dtype).view(num_tokens, heads, dim)

    def _verify_prefix(self, q, layer, batch, meta):
        """Each draft token over its request's whole cached prefix, through the kernel."""
        vm = meta.verify
        scale, window = layer.scaling, (-1, -1)
        if self.paged:
            k_cache, v_cache = self._pages(batch, layer.layer_id)
            out, lse = self.api.paged(q, k_cache, v_cache, meta, cache_seqlens=vm.prefix_lens,
                                      cu_seqlens_k=vm.cu_prefix, max_seqlen_k=vm.max_prefix,
                                      causal=False, window=window, scale=scale, return_lse=True)
        else:
            keys, values = self._gather(batch, layer.layer_id, vm.prefix_slots, q.dtype)
            out, lse = self.api.varlen(q, keys, values, cu_seqlens_q=meta.cu_seqlens_q,
                                       cu_seqlens_k=vm.cu_prefix, max_seqlen_q=meta.max_seqlen_q,
                                       max_seqlen_k=vm.max_prefix, causal=False, window=window,
                                       scale=scale, return_lse=True)
        lse = lse.transpose(0, 1).float()  # [T, H]
        # a request without a prefix: FA2 reports lse +inf for a row with no keys, FA3 -inf
        has = vm.has_prefix[:, None]
        lse = lse.masked_fill(~has, float("-inf"))
        out = out.float().masked_fill(~has[..., None], 0.0)
        return out, lse

    def _verify_prefix_window(self, q, layer, batch, meta):
        """Under a sliding window of ``W``: token ``a`` (position ``pos_a``) sees prefix key
        ``j`` iff ``j > pos_a - W``, so only the last ``W - 1`` prefix keys can matter."""
        vm = meta.verify
        pool = batch.kv_pool
        width = layer.sliding_window
        span = min(width - 1, vm.max_prefix)
        num_tokens, heads, dim = q.shape
        if span <= 0:
            empty = torch.full((num_tokens, heads), float("-inf"), device=q.device)
            return torch.zeros(num_tokens, heads, dim, device=q.device), empty
        cols = vm.prefix_lens.long()[:, None] - span + torch.arange(span, device=q.device)  # [B, S]
        in_prefix = cols >= 0
        rows = batch.req_pool_indices[:, None]
        slots = batch.req_to_token[rows, cols.clamp(min=0)]  # [B, S]
        keys = pool.k_buffers[layer.layer_id][slots].to(q.dtype)  # [B, S, Hkv, D]
        values = pool.v_buffers[layer.layer_id][slots].to(q.dtype)
        allow = in_prefix[:, None, :] & (cols[:, None, :] > vm.tree_pos[:, :, None] - width)
        out, lse = masked_attention(q[vm.tree_index], keys, values, allow, layer.scaling)
        return out[vm.tree_valid], lse[vm.tree_valid]
