"""A CPU stand-in for the FlashInfer wrapper classes the backend uses, written from
FlashInfer's documented semantics (the docstrings of ``BatchPrefillWithPagedKVCacheWrapper``
and ``BatchDecodeWithPagedKVCacheWrapper`` in flashinfer 0.7.0; for MLA,
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` and ``BatchPrefillWithRaggedKVCacheWrapper``
as flashinfer 0.6.17 and 0.7.2 define them: page-count ``kv_indptr``, token ``kv_len_arr``,
causal aligned bottom-right, strided ckv/kpe views), in plain torch.

It lets the CPU tests run the backend end to end (page tables, masks, windows, the KV
write, the CUDA-graph buffers) against the conformance suite. It checks what FlashInfer
checks or assumes: int32 CSR arrays of matching lengths, ``1 <= last_page_len <=
page_size``, q and KV dtypes equal to the planned ones, a custom mask of
``sum(qo_len * kv_len)`` entries, a fixed batch size and big-enough buffers in
``use_cuda_graph`` mode. In that mode ``run`` reads the page table from the buffers given
at construction, as captured kernels would, so a backend that does not rewrite them in
place computes over stale tables here too.

What it cannot tell: whether the real kernels agree with the documentation (the GPU tests).
"""

from __future__ import annotations

import types

import torch

LOG = []  # (wrapper class name, method, kwargs) of every call, for tests that inspect them


def _check_csr(indptr, indices, last_page_len, page_size):
    for name, t in (("indptr", indptr), ("indices", indices), ("last_page_len", last_page_len)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
    if len(indptr) != len(last_page_len) + 1:
        raise ValueError("indptr must have batch_size + 1 entries")
    if len(indices) < int(indptr[-1]):
        raise ValueError("indices shorter than indptr[-1]")
    if ((last_page_len < 1) | (last_page_len > page_size)).any():
        raise ValueError(f"last_page_len must be in [1, {page_size}]: {last_page_len.tolist()}")


class _Paged:
    """The state shared by both wrappers: a planned page table and the attention over it."""

    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, **kw):
        if kv_layout != "NHD":
            raise ValueError("the stand-in reads NHD only")
        if workspace.dtype != torch.uint8:
            raise TypeError("the float workspace is a uint8 buffer")
        self.use_cuda_graph = use_cuda_graph
        self.kw = kw
        self.planned = None

    def _store(self, indptr, indices, last_page_len, bufs):
        if not self.use_cuda_graph:
            return indptr.clone(), indices.clone(), last_page_len.clone()
        ip, ix, lp = bufs
        if len(indptr) != len(ip):
            raise ValueError(f"batch size {len(indptr) - 1} differs from the CUDA-graph buffer's {len(ip) - 1}")
        if len(indices) > len(ix):
            raise ValueError("the length of paged_kv_indices exceeds the allocated buffer size")
        ip.copy_(indptr)
        ix[:len(indices)].copy_(indices)
        lp.copy_(last_page_len)
        return ip, ix, lp  # run() reads the buffers as they are then

    def _attend(self, q, kv_cache, qo_indptr, causal, custom_mask):
        k_cache, v_cache = kv_cache
        p = self.planned
        if q.dtype != p["q_data_type"] or k_cache.dtype != p["kv_data_type"]:
            raise ValueError(f"q {q.dtype} / kv {k_cache.dtype} differ from the planned "
                             f"{p['q_data_type']} / {p['kv_data_type']}")
        indptr, indices, last = p["csr"]
        page = k_cache.shape[1]
        heads, kv_heads = p["num_qo_heads"], p["num_kv_heads"]
        if q.shape[1:] != (heads, p["head_dim"]) or k_cache.shape[2:] != (kv_heads, p["head_dim"]):
            raise ValueError("q / kv shapes differ from the planned head counts")
        out = torch.empty_like(q)
        mask_at = 0
        for i in range(len(indptr) - 1):
            pages = indices[int(indptr[i]):int(indptr[i + 1])].long()
            kv_len = (len(pages) - 1) * page + int(last[i])
            k = k_cache[pages].reshape(-1, kv_heads, p["head_dim"])[:kv_len].float()
            v = v_cache[pages].reshape(-1, kv_heads, p["head_dim"])[:kv_len].float()
            k = k.repeat_interleave(heads // kv_heads, dim=1)
            v = v.repeat_interleave(heads // kv_heads, dim=1)
            q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
            qo_len = q1 - q0
            qi = q[q0:q1].float()
            scores = torch.einsum("qhd,khd->hqk", qi, k) * p["sm_scale"]
            qpos = torch.arange(kv_len - qo_len, kv_len)[:, None]  # bottom-right aligned
            kpos = torch.arange(kv_len)[None, :]
            allowed = torch.ones(qo_len, kv_len, dtype=torch.bool)
            if custom_mask is not None:
                allowed = custom_mask[mask_at:mask_at + qo_len * kv_len].view(qo_len, kv_len).cpu()
                mask_at += qo_len * kv_len
            elif causal:
                allowed = kpos <= qpos
            if p["window_left"] >= 0:
                allowed = allowed & (kpos >= qpos - p["window_left"])
            scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
            out[q0:q1] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
        if custom_mask is not None and mask_at != custom_mask.numel():
            raise ValueError(f"custom_mask has {custom_mask.numel()} entries, the batch needs {mask_at}")
        return out


class BatchPrefillWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, backend="auto", **kw):
        super().__init__(workspace, kv_layout, use_cuda_graph, **kw)
        self.backend = backend

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             num_qo_heads, num_kv_heads, head_dim_qk, page_size, *, custom_mask=None,
             causal=False, sm_scale=None, window_left=-1, q_data_type=torch.float16,
             kv_data_type=None):
        _check_csr(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, page_size)
        if qo_indptr.dtype != torch.int32 or len(qo_indptr) != len(paged_kv_indptr):
            raise ValueError("qo_indptr must be int32 with batch_size + 1 entries")
        if custom_mask is not None and custom_mask.dtype != torch.bool:
            raise TypeError("custom_mask must be bool")
        LOG.append((type(self).__name__, "plan", dict(causal=causal, window_left=window_left,
                                                     custom_mask=custom_mask is not None)))
        self.planned = dict(
            csr=self._store(paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len, None),
            qo_indptr=qo_indptr.clone(), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim_qk, causal=causal, custom_mask=custom_mask,
            sm_scale=head_dim_qk ** -0.5 if sm_scale is None else sm_scale, window_left=window_left,
            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache):
        p = self.planned
        if q.shape[0] != int(p["qo_indptr"][-1]):
            raise ValueError("q rows differ from qo_indptr[-1]")
        return self._attend(q, paged_kv_cache, p["qo_indptr"], p["causal"], p["custom_mask"])


class BatchDecodeWithPagedKVCacheWrapper(_Paged):
    def __init__(self, workspace, kv_layout="NHD", use_cuda_graph=False, use_tensor_cores=False,
                 paged_kv_indptr_buffer=None, paged_kv_indices_buffer=None,
                 paged_kv_last_page_len_buffer=None, backend="auto"):
        super().__init__(workspace, kv_layout, use_cuda_graph)
        self.use_tensor_cores = use_tensor_cores
        self.bufs = (paged_kv_indptr_buffer, paged_kv_indices_buffer, paged_kv_last_page_len_buffer)
        if use_cuda_graph and any(b is None for b in self.bufs):
            raise ValueError("use_cuda_graph needs the indptr, indices and last_page_len buffers")

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim,
             page_size, *, window_left=-1, sm_scale=None, q_data_type=torch.float16,
             kv_data_type=None):
        _check_csr(indptr, indices, last_page_len, page_size)
        LOG.append((type(self).__name__, "plan", dict(window_left=window_left,
                                                     use_cuda_graph=self.use_cuda_graph)))
        self.planned = dict(
            csr=self._store(indptr, indices, last_page_len, self.bufs),
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            sm_scale=head_dim ** -0.5 if sm_scale is None else sm_scale, window_left=window_left,
            q_data_type=q_data_type, kv_data_type=kv_data_type or q_data_type)

    def run(self, q, paged_kv_cache):
        batch = len(self.planned["csr"][0]) - 1
        if q.shape[0] != batch:
            raise ValueError(f"decode q has {q.shape[0]} rows for a batch of {batch}")
        return self._attend(q, paged_kv_cache, torch.arange(batch + 1), False, None)


def _causal_attend(q, k, v, scale, causal):
    """One request: ``q  # [qo, H, Dqk]`` over ``k  # [kv, H, Dqk]``, ``v  # [kv, H, Dv]``,
    causal aligned bottom-right; float32, in q's dtype."""
    qo_len, kv_len = q.shape[0], k.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        qpos = torch.arange(kv_len - qo_len, kv_len)[:, None]
        allowed = torch.arange(kv_len)[None, :] <= qpos
        scores = scores.masked_fill(~allowed.to(scores.device)[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.float()).to(q.dtype)


def _int32_1d(**tensors):
    for name, t in tensors.items():
        if t.dtype != torch.int32 or t.dim() != 1:
            raise TypeError(f"{name} must be a 1-D int32 tensor, got {t.dtype} of {t.dim()} dims")


class BatchMLAPagedAttentionWrapper:
    """``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (0.6.17 / 0.7.2 semantics): MQA over
    the latent pages, ``kv_indptr`` in pages, ``kv_len_arr`` in tokens, ckv and kpe caches
    ``[num_pages, page_size, D]`` that may be strided views; the output is ``q_nope``'s shape."""

    def __init__(self, float_workspace_buffer, use_cuda_graph=False, qo_indptr=None, kv_indptr=None,
                 kv_indices=None, kv_len_arr=None, backend="auto"):
        if use_cuda_graph:
            raise ValueError("the stand-in has no CUDA-graph mode for MLA")
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, kv_indices, kv_len_arr, num_heads, head_dim_ckv, head_dim_kpe,
             page_size, causal, sm_scale, q_data_type, kv_data_type, use_profiler=False):
        _int32_1d(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices, kv_len_arr=kv_len_arr)
        if not (len(qo_indptr) == len(kv_indptr) == len(kv_len_arr) + 1):
            raise ValueError("qo_indptr and kv_indptr need batch_size + 1 entries, kv_len_arr batch_size")
        pages = (kv_indptr[1:] - kv_indptr[:-1]).tolist()
        if pages != [-(-int(n) // page_size) for n in kv_len_arr]:
            raise ValueError("kv_indptr must hold ceil(kv_len / page_size) pages per request")
        LOG.append((type(self).__name__, "plan", dict(causal=causal)))
        self.planned = dict(qo=qo_indptr.clone(), kv=kv_indptr.clone(), idx=kv_indices.clone(),
                            lens=kv_len_arr.clone(), heads=num_heads, ckv=head_dim_ckv, kpe=head_dim_kpe,
                            causal=causal, scale=sm_scale, q_dtype=q_data_type, kv_dtype=kv_data_type)

    def run(self, q_nope=None, q_pe=None, ckv_cache=None, kpe_cache=None, out=None, lse=None, return_lse=False):
        p = self.planned
        if q_nope.dtype != p["q_dtype"] or ckv_cache.dtype != p["kv_dtype"]:
            raise ValueError("q / kv dtypes differ from the planned ones")
        if (q_nope.shape[1:], q_pe.shape[1:]) != ((p["heads"], p["ckv"]), (p["heads"], p["kpe"])):
            raise ValueError("q_nope / q_pe shapes differ from the planned heads and dims")
        if (ckv_cache.shape[2], kpe_cache.shape[2]) != (p["ckv"], p["kpe"]) or ckv_cache.stride(-1) != 1:
            raise ValueError("ckv / kpe caches must be [pages, page_size, D] with unit stride in D")
        result = torch.empty_like(q_nope)
        for i in range(len(p["lens"])):
            pages = p["idx"][int(p["kv"][i]):int(p["kv"][i + 1])].long()
            n = int(p["lens"][i])
            ckv = ckv_cache[pages].reshape(-1, p["ckv"])[:n]
            kpe = kpe_cache[pages].reshape(-1, p["kpe"])[:n]
            k = torch.cat([ckv, kpe], dim=-1)[:, None].expand(n, p["heads"], -1)
            q0, q1 = int(p["qo"][i]), int(p["qo"][i + 1])
            q = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], dim=-1)
            result[q0:q1] = _causal_attend(q, k, ckv[:, None].expand(n, p["heads"], -1), p["scale"], p["causal"])
        return result


class BatchPrefillWithRaggedKVCacheWrapper:
    """``flashinfer.BatchPrefillWithRaggedKVCacheWrapper``: attention over K/V given as ragged
    tensors (token offsets per request), ``head_dim_vo`` may differ from ``head_dim_qk``."""

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, **kw):
        if kv_layout != "NHD" or use_cuda_graph:
            raise ValueError("the stand-in reads NHD, without CUDA graphs")
        self.planned = None

    def plan(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, head_dim_vo=None, *,
             causal=False, sm_scale=None, q_data_type="float16", kv_data_type=None):
        _int32_1d(qo_indptr=qo_indptr, kv_indptr=kv_indptr)
        LOG.append((type(self).__name__, "plan", dict(causal=causal)))
        self.planned = dict(qo=qo_indptr.clone(), kv=kv_indptr.clone(), heads=num_qo_heads, kv_heads=num_kv_heads,
                            qk=head_dim_qk, vo=head_dim_vo or head_dim_qk, causal=causal,
                            scale=head_dim_qk ** -0.5 if sm_scale is None else sm_scale, q_dtype=q_data_type,
                            kv_dtype=kv_data_type or q_data_type)

    def run(self, q, k, v):
        p = self.planned
        if q.dtype != p["q_dtype"] or k.dtype != p["kv_dtype"] or q.shape[0] != int(p["qo"][-1]):
            raise ValueError("q / k differ from the plan (dtypes, or q rows from qo_indptr[-1])")
        if q.shape[1:] != (p["heads"], p["qk"]) or v.shape[1:] != (p["kv_heads"], p["vo"]):
            raise ValueError("q / v shapes differ from the planned heads and dims")
        group = p["heads"] // p["kv_heads"]
        out = q.new_empty(q.shape[0], p["heads"], p["vo"])
        for i in range(len(p["qo"]) - 1):
            q0, q1, k0, k1 = (int(x) for x in (p["qo"][i], p["qo"][i + 1], p["kv"][i], p["kv"][i + 1]))
            out[q0:q1] = _causal_attend(q[q0:q1], k[k0:k1].repeat_interleave(group, 1),
                                        v[k0:k1].repeat_interleave(group, 1), p["scale"], p["causal"])
        return out


def module() -> types.SimpleNamespace:
    """What the backend takes as ``lib``."""
    return types.SimpleNamespace(
        BatchPrefillWithPagedKVCacheWrapper=BatchPrefillWithPagedKVCacheWrapper,
        BatchDecodeWithPagedKVCacheWrapper=BatchDecodeWithPagedKVCacheWrapper,
        BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper,
        mla=types.SimpleNamespace(BatchMLAPagedAttentionWrapper=BatchMLAPagedAttentionWrapper),
    )
