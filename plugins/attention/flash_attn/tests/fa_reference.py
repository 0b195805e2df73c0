"""Torch stand-ins for the flash-attn functions the backend calls, for CPU tests only.

Each follows the library's documented signature and semantics (the docstrings of
``flash_attn/flash_attn_interface.py`` for FlashAttention-2 and
``hopper/flash_attn_interface.py`` for FlashAttention-3): the causal mask and the sliding
window aligned to the bottom-right corner (query ``i`` of ``Sq`` sits at key position
``i + Sk - Sq``), a paged KV cache read through an int32 page table, ragged queries through
int32 ``cu_seqlens``, GQA by head groups, the softmax log-sum-exp returned as ``[H, total_q]``
(varlen) or ``[B, H, Sq]`` (batched), and FA2's 256-token page limit. A row with no key gives
zeros and lse +inf in FA2 (its ``flash_fwd_kernel.h``), -inf in FA3 (its
``epilogue_fwd.hpp``). They check the argument dtypes, shapes and layouts the kernels check.

They run the backend's metadata and call logic on CPU. They do not test the real kernels:
those run in ``test_flash_attn_gpu.py``. Unlike the kernels they also accept float32.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)  # the kernels: float16, bfloat16


def _int32(name: str, t: torch.Tensor | None) -> None:
    if t is None:
        return
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must have dtype torch.int32, got {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension")


def _check(q, k, v) -> None:
    if q.dtype not in DTYPES:
        raise TypeError(f"FlashAttention only supports fp16 and bf16, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"query and key/value must have the same dtype: {q.dtype}, {k.dtype}, {v.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must have a contiguous last dimension")
    if q.shape[-2] % k.shape[-2]:
        raise ValueError("Number of heads in key/value must divide number of heads in query")


def _attend(q, k, v, *, causal: bool, window, scale: float, empty_lse: float):
    """One sequence: ``q  # [Sq, H, D]`` over ``k, v  # [Sk, Hkv, D]``; returns
    ``out  # [Sq, H, D]`` in q's dtype and ``lse  # [H, Sq]`` float32."""
    sq, heads, _ = q.shape
    sk, kv_heads, _ = k.shape
    left, right = window
    if causal:
        right = 0
    i = torch.arange(sq)[:, None] + sk - sq  # the query's position among the keys
    j = torch.arange(sk)[None, :]
    allow = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        allow &= j <= i + right
    if left >= 0:
        allow &= j >= i - left
    group = heads // kv_heads
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    scores = scores.masked_fill(~allow[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, Sq]
    empty = lse == float("-inf")
    probs = torch.exp(scores - lse.masked_fill(empty, 0.0)[..., None])
    out = torch.einsum("hqk,khd->qhd", probs, vf)
    return out.to(q.dtype), lse.masked_fill(empty, empty_lse)


def _paged_keys(cache, table_row, length: int):
    page = cache.shape[1]
    pages = table_row[: math.ceil(length / page)].long()
    return cache[pages].reshape(-1, *cache.shape[2:])[:length]


def _lens(cu: torch.Tensor) -> list[int]:
    cu = cu.tolist()
    return [b - a for a, b in zip(cu[:-1], cu[1:])]


def _run(q_seqs, kv_seqs, *, causal, window, scale, empty_lse):
    outs, lses = [], []
    for qi, (ki, vi) in zip(q_seqs, kv_seqs):
        o, lse = _attend(qi, ki, vi, causal=causal, window=window, scale=scale, empty_lse=empty_lse)
        outs.append(o)
        lses.append(lse)
    return outs, lses


def _with_kvcache(q, k_cache, v_cache, *, cache_seqlens, table, cu_seqlens_q, max_seqlen_q,
                  softmax_scale, causal, window_size, empty_lse, page_multiple):
    _check(q, k_cache, v_cache)
    _int32("cache_seqlens", cache_seqlens)
    _int32("page_table", table)
    _int32("cu_seqlens_q", cu_seqlens_q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    lens = cache_seqlens.tolist()
    if table is not None:
        if k_cache.dim() != 4 or table.shape[0] != len(lens):
            raise ValueError(f"paged k_cache must be [num_pages, page, Hkv, D] with one table row "
                             f"per request: {tuple(k_cache.shape)}, table {tuple(table.shape)}")
        if k_cache.shape[1] % page_multiple:
            raise RuntimeError(f"Paged KV cache block size must be divisible by {page_multiple}")
        capacity = table.shape[1] * k_cache.shape[1]
        if max(lens) > capacity:
            raise ValueError(f"cache_seqlens {max(lens)} past the page table's capacity {capacity}")
        kv = [(_paged_keys(k_cache, table[b], n), _paged_keys(v_cache, table[b], n))
              for b, n in enumerate(lens)]
    else:
        kv = [(k_cache[b, :n], v_cache[b, :n]) for b, n in enumerate(lens)]
    if cu_seqlens_q is not None:  # ragged queries [T, H, D]
        q_lens = _lens(cu_seqlens_q)
        if max_seqlen_q is None or max(q_lens) > max_seqlen_q:
            raise ValueError(f"max_seqlen_q {max_seqlen_q} is below a query length {max(q_lens)}")
        if sum(q_lens) != q.shape[0] or len(q_lens) != len(lens):
            raise ValueError("cu_seqlens_q does not match q or cache_seqlens")
        outs, lses = _run(list(q.split(q_lens)), kv, causal=causal, window=window_size,
                          scale=scale, empty_lse=empty_lse)
        return torch.cat(outs), torch.cat(lses, dim=1)  # [T, H, D], [H, T]
    if q.dim() != 4 or q.shape[0] != len(lens):
        raise ValueError(f"q must be [batch, seqlen, H, D] with one row per request, got {tuple(q.shape)}")
    outs, lses = _run(list(q), kv, causal=causal, window=window_size, scale=scale, empty_lse=empty_lse)
    return torch.stack(outs), torch.stack(lses)  # [B, Sq, H, D], [B, H, Sq]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, softmax_scale,
            causal, window_size, block_table, empty_lse, page_multiple):
    _check(q, k, v)
    _int32("cu_seqlens_q", cu_seqlens_q)
    _int32("cu_seqlens_k", cu_seqlens_k)
    _int32("block_table", block_table)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    q_lens, k_lens = _lens(cu_seqlens_q), _lens(cu_seqlens_k)
    if len(q_lens) != len(k_lens) or sum(q_lens) != q.shape[0]:
        raise ValueError("cu_seqlens_q / cu_seqlens_k do not match q")
    if max(q_lens) > max_seqlen_q or max(k_lens) > max_seqlen_k:
        raise ValueError(f"max_seqlen_q/k ({max_seqlen_q}, {max_seqlen_k}) below the lengths "
                         f"({max(q_lens)}, {max(k_lens)})")
    if block_table is not None:
        if k.shape[1] % page_multiple:
            raise RuntimeError(f"Paged KV cache block size must be divisible by {page_multiple}")
        kv = [(_paged_keys(k, block_table[b], n), _paged_keys(v, block_table[b], n))
              for b, n in enumerate(k_lens)]
    else:
        if sum(k_lens) != k.shape[0]:
            raise ValueError("cu_seqlens_k does not match k")
        kv = list(zip(k.split(k_lens), v.split(k_lens)))
    outs, lses = _run(list(q.split(q_lens)), kv, causal=causal, window=window_size, scale=scale,
                      empty_lse=empty_lse)
    return torch.cat(outs), torch.cat(lses, dim=1)


# ------------------------------------------------------------------ FlashAttention-3
def fa3_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, qv=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, page_table=None, cu_seqlens_q=None,
                                cu_seqlens_k_new=None, max_seqlen_q=None, rotary_seqlens=None,
                                q_descale=None, k_descale=None, v_descale=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), attention_chunk=0, softcap=0.0,
                                rotary_interleaved=True, scheduler_metadata=None, num_splits=0,
                                pack_gqa=None, sm_margin=0, return_softmax_lse=False):
    unused = (k, v, qv, rotary_cos, cache_batch_idx, cache_leftpad, cu_seqlens_k_new, q_descale)
    if any(x is not None for x in unused) or softcap or attention_chunk:
        raise NotImplementedError("the double covers what the backend passes")
    out, lse = _with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, table=page_table,
                             cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
                             softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                             empty_lse=float("-inf"), page_multiple=1)
    return (out, lse, None, None) if return_softmax_lse else out


def fa3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               seqused_q=None, seqused_k=None, softmax_scale=None, causal=False,
                               qv=None, q_descale=None, k_descale=None, v_descale=None,
                               window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1,
                               pack_gqa=None, deterministic=False, sm_margin=0,
                               return_attn_probs=False):
    if seqused_q is not None or seqused_k is not None or qv is not None or softcap:
        raise NotImplementedError("the double covers what the backend passes")
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       block_table=None, empty_lse=float("-inf"), page_multiple=1)
    return (out, lse) if return_attn_probs else out


# ------------------------------------------------------------------ FlashAttention-2
def fa2_flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                                rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                                cache_leftpad=None, block_table=None, softmax_scale=None,
                                causal=False, window_size=(-1, -1), softcap=0.0,
                                rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                                return_softmax_lse=False):
    if any(x is not None for x in (k, v, rotary_cos, cache_batch_idx, cache_leftpad, alibi_slopes)):
        raise NotImplementedError("the double covers what the backend passes")
    out, lse = _with_kvcache(q, k_cache, v_cache, cache_seqlens=cache_seqlens, table=block_table,
                             cu_seqlens_q=None, max_seqlen_q=None, softmax_scale=softmax_scale,
                             causal=causal, window_size=window_size, empty_lse=float("inf"),
                             page_multiple=256)
    return (out, lse) if return_softmax_lse else out


def fa2_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                               dropout_p=0.0, softmax_scale=None, causal=False,
                               window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                               deterministic=False, return_attn_probs=False, block_table=None):
    if dropout_p or softcap or alibi_slopes is not None:
        raise NotImplementedError("the double covers what the backend passes")
    out, lse = _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       block_table=block_table, empty_lse=float("inf"), page_multiple=256)
    return (out, lse, None) if return_attn_probs else out


FA3 = SimpleNamespace(flash_attn_with_kvcache=fa3_flash_attn_with_kvcache,
                      flash_attn_varlen_func=fa3_flash_attn_varlen_func)
FA2 = SimpleNamespace(flash_attn_with_kvcache=fa2_flash_attn_with_kvcache,
                      flash_attn_varlen_func=fa2_flash_attn_varlen_func)
