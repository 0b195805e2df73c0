"""The ``flashinfer`` attention backend: FlashInfer's paged-KV wrappers over radixserve's pool.

Per step, :meth:`FlashInferAttention.init_forward_metadata` turns the batch into
FlashInfer's CSR page table (:mod:`.planner`) and calls ``plan`` once on each wrapper the
step needs; every layer then writes its new K/V into the pool and calls ``run``:

* extend, and mixed batches (each decode row is an extend of one token):
  ``BatchPrefillWithPagedKVCacheWrapper`` over each request's whole sequence, causal
  (bottom-right aligned: query row ``a`` of a request with ``E`` new tokens of ``L`` sits
  at position ``L - E + a``), so the cached prefix and the new tokens, already stored,
  are read through one page table;
* target verify: the same wrapper class, a separate instance planned with a
  ``custom_mask`` per request (the cached prefix, then the draft tree);
* decode: ``BatchDecodeWithPagedKVCacheWrapper`` (tensor-core kernels when a KV head
  serves 4 or more query heads); under CUDA graphs one wrapper per bucket size, built with
  ``use_cuda_graph=True`` over fixed index buffers that every re-plan rewrites in place.

``plan`` fixes the softmax scale and the sliding window (``window_left``), and FlashInfer
compiles windowed kernels separately, so the wrappers are kept per (sliding window,
scale) pair. The pairs are learned from the layers: the model's default scale without a
window is planned from the start; a layer with another pair plans it on first use (once
per step, outside any graph capture) and every later step plans it up front.

K/V are read as the pool stores them (``kv_data_type``): the activation dtype, or fp8
(e4m3/e5m2, scale 1.0) widened inside FlashInfer's kernels, with float16/bfloat16 queries.

MLA models (``ctx.v_head_dim`` set: DeepSeek's latent pool, one head of ``kv_lora_rank +
rope`` dims whose first ``kv_lora_rank`` are V): every step is planned on
``flashinfer.mla.BatchMLAPagedAttentionWrapper`` (the page table in pages, ``kv_len_arr``
in tokens, causal bottom-right aligned for extends), which reads the latent and the rotary
key as two strided views of the pool's K buffer (FlashInfer's kernels take each cache's
page and row strides); the expanded-form prefill runs on
``BatchPrefillWithRaggedKVCacheWrapper`` (per-head K of ``qk`` dims, V of ``v`` dims, causal).
No target verify (the MLA wrapper takes no custom mask) and no CUDA graphs for MLA yet: the
instance narrows ``supports_target_verify`` and ``supports_cuda_graph``. FlashInfer's MLA
kernels want fp16/bf16 and a ``kv_lora_rank`` that is a multiple of 128.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

import torch
from radixserve.plugin_api.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
)

from radixserve_attention_flashinfer.planner import (
    PagedKV,
    paged_kv,
    qo_indptr,
    tree_custom_mask,
    window_left,
)

WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace (split-KV partials)
ACTIVATION_DTYPES = (torch.float16, torch.bfloat16)
# a query group this large decodes faster through the prefill (tensor-core) kernels
TENSOR_CORE_MIN_GROUP = 4

Key = tuple[int | None, float]  # (sliding window, softmax scale) of a layer


@dataclass
class _StepPlan:
    """``batch.attn_metadata``: this step's page table and its planned wrappers."""

    kind: str  # "extend" (also mixed), "verify" or "decode"
    # the page table the step was planned from (a captured plan keeps the capture's: each
    # replay plans from a fresh one without storing it, so that the metadata's tensors stay
    # the ones captured, and no key can be new during a replay)
    paged: PagedKV
    qo_indptr: torch.Tensor | None  # [B + 1] int32 CPU; decode: None
    wrappers: dict[Key, Any] = field(default_factory=dict)  # planned for this step
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)  # verify, by window
    graph_bs: int | None = None  # decode inside a CUDA graph of this bucket size


class FlashInferAttention(AttentionBackend):
    """Paged extend, target verify and decode through FlashInfer.

    ``lib``: the flashinfer module (default: imported here); tests pass a stand-in.
    ``prefill_backend``: FlashInfer's kernel family for the prefill wrappers, ``"fa2"``
    (any NVIDIA GPU, custom masks, fp8 KV with 16-bit queries) or ``"auto"`` (FA3 on
    Hopper where it applies). ``decode_use_tensor_cores``: default by query group size.
    """

    supports_target_verify = True
    supports_cuda_graph = True
    supports_mla = True
    supported_kv_dtypes = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        lib: Any = None,
        workspace_bytes: int = WORKSPACE_BYTES,
        prefill_backend: str = "fa2",
        decode_use_tensor_cores: bool | None = None,
    ) -> None:
        if ctx.num_heads % ctx.num_kv_heads:
            raise ValueError(
                f"num_heads ({ctx.num_heads}) must be a multiple of num_kv_heads ({ctx.num_kv_heads})"
            )
        if lib is None:
            _check_context(ctx)
            lib = importlib.import_module("flashinfer")
            if ctx.v_head_dim is not None:
                importlib.import_module("flashinfer.mla")  # (the MLA wrapper's package)
        self.lib = lib
        self.mla = ctx.v_head_dim is not None
        if self.mla:  # narrowed for this instance: see the module docstring
            self.supports_target_verify = self.supports_cuda_graph = False
            self.supported_kv_dtypes = frozenset()
        self.ctx = ctx
        self.prefill_backend = prefill_backend
        group = ctx.num_heads // ctx.num_kv_heads
        if decode_use_tensor_cores is None:
            decode_use_tensor_cores = group >= TENSOR_CORE_MIN_GROUP
        self.decode_use_tensor_cores = decode_use_tensor_cores
        # shared by every wrapper: they run one after another on one stream
        self.workspace = torch.zeros(workspace_bytes, dtype=torch.uint8, device=ctx.device)
        # planned every step (MLA: its layers' scale, learnt from the first step)
        self.keys: list[Key] = [] if self.mla else [(None, ctx.head_dim**-0.5)]
        self._eager: dict[tuple[str, Key], Any] = {}  # (kind, key) -> wrapper
        self._graph: dict[tuple[int, Key], Any] = {}  # (bucket size, key) -> wrapper
        self._graph_bufs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # ------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        page = batch.kv_pool.page_size
        if self.mla:
            self._plan_mla_step(batch)
            return
        if batch.is_decode:
            plan = _StepPlan("decode", paged_kv(batch, page), None)
        else:
            kind = "verify" if batch.is_verify else "extend"
            plan = _StepPlan(kind, paged_kv(batch, page), qo_indptr(batch.extend_lens_cpu))
        for key in self.keys:
            self._plan(plan, key, batch)
        batch.attn_metadata = plan

    def _plan(self, plan: _StepPlan, key: Key, batch: ForwardBatch, kv: PagedKV | None = None) -> Any:
        """Plan the wrapper for ``key`` over this step's page table (``kv``, default
        ``plan.paged``); returns it."""
        window, scale = key
        ctx, kv = self.ctx, kv or plan.paged
        common = dict(sm_scale=scale, q_data_type=ctx.dtype, kv_data_type=batch.kv_pool.dtype)
        heads = (ctx.num_heads, ctx.num_kv_heads, ctx.head_dim, batch.kv_pool.page_size)
        wrapper = self._wrapper(plan, key)
        if plan.kind == "decode":
            wrapper.plan(kv.indptr, kv.indices, kv.last_page_len, *heads,
                         window_left=window_left(window), **common)
        elif plan.kind == "verify":
            mask = plan.masks.get(window)
            if mask is None:
                mask = plan.masks[window] = tree_custom_mask(batch, window)
            # the window is in the mask, by position: FlashInfer's would count columns
            wrapper.plan(plan.qo_indptr, kv.indptr, kv.indices, kv.last_page_len, *heads,
                         custom_mask=mask, window_left=-1, **common)
        else:
            wrapper.plan(plan.qo_indptr, kv.indptr, kv.indices, kv.last_page_len, *heads,
                         causal=True, window_left=window_left(window), **common)
        plan.wrappers[key] = wrapper
        return wrapper

    # ------------------------------------------------------------ MLA
    def _plan_mla_step(self, batch: ForwardBatch) -> None:
        if batch.is_verify:
            raise ValueError("flashinfer attention: no target verify for MLA models (FlashInfer's MLA wrapper "
                             "takes no custom mask); use --attention-backend torch_native with speculative decoding")
        kind = "decode" if batch.is_decode else "extend"
        qo = qo_indptr([1] * batch.batch_size if batch.is_decode else batch.extend_lens_cpu)
        plan = _StepPlan(kind, paged_kv(batch, batch.kv_pool.page_size), qo)
        for key in self.keys:
            self._plan_mla(plan, key, batch)
        batch.attn_metadata = plan

    def _plan_mla(self, plan: _StepPlan, key: Key, batch: ForwardBatch) -> Any:
        _, scale = key
        ctx, kv = self.ctx, plan.paged
        wrapper = self._eager.get(("mla", key))
        if wrapper is None:
            wrapper = self._eager[("mla", key)] = self.lib.mla.BatchMLAPagedAttentionWrapper(self.workspace)
        wrapper.plan(qo_indptr=plan.qo_indptr, kv_indptr=kv.indptr, kv_indices=kv.indices,
                     kv_len_arr=torch.tensor(kv.seq_lens, dtype=torch.int32), num_heads=ctx.num_heads,
                     head_dim_ckv=ctx.v_head_dim, head_dim_kpe=ctx.head_dim - ctx.v_head_dim,
                     page_size=batch.kv_pool.page_size, causal=plan.kind == "extend", sm_scale=scale,
                     q_data_type=ctx.dtype, kv_data_type=batch.kv_pool.dtype)
        plan.wrappers[key] = wrapper
        return wrapper

    def _run_mla(self, q, k, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, None)  # the latent rows (V is inside)
        plan: _StepPlan = batch.attn_metadata
        key = (layer.sliding_window, layer.scaling)
        wrapper = plan.wrappers.get(key)
        if wrapper is None:
            if key not in self.keys:
                self.keys.append(key)
            wrapper = self._plan_mla(plan, key, batch)
        rank = layer.v_head_dim
        rows = pool.k_buffers[layer.layer_id].view(-1, pool.page_size, pool.head_dim)  # [pages, page, rank + rope]
        return wrapper.run(q_nope=q[..., :rank], q_pe=q[..., rank:], ckv_cache=rows[..., :rank],
                           kpe_cache=rows[..., rank:])  # [T, H, rank]

    def forward_mla_prefill(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """The expanded form: ragged causal attention over the new tokens' own per-head K/V."""
        plan: _StepPlan = batch.attn_metadata
        key = ("ragged", layer.scaling, layer.head_dim, layer.out_dim)
        wrapper = plan.wrappers.get(key)
        if wrapper is None:
            wrapper = self._eager.get(key)
            if wrapper is None:
                wrapper = self._eager[key] = self.lib.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD")
            qo = qo_indptr(batch.extend_lens_cpu)
            wrapper.plan(qo_indptr=qo, kv_indptr=qo, num_qo_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                         head_dim_qk=layer.head_dim, head_dim_vo=layer.out_dim, causal=True,
                         sm_scale=layer.scaling, q_data_type=q.dtype, kv_data_type=k.dtype)
            plan.wrappers[key] = wrapper
        return wrapper.run(q, k, v)  # [T, H, v]

    def _wrapper(self, plan: _StepPlan, key: Key) -> Any:
        if plan.graph_bs is not None:
            return self._graph_wrapper(plan.graph_bs, key)
        # verify keeps its own prefill wrapper: a plan with a mask and one without must not
        # share the planned state (nor the kernels FlashInfer picked at the first plan)
        kind = plan.kind
        wrapper = self._eager.get((kind, key))
        if wrapper is None:
            if kind == "decode":
                wrapper = self.lib.BatchDecodeWithPagedKVCacheWrapper(
                    self.workspace, "NHD", use_tensor_cores=self.decode_use_tensor_cores)
            else:
                wrapper = self.lib.BatchPrefillWithPagedKVCacheWrapper(
                    self.workspace, "NHD", backend=self.prefill_backend)
            self._eager[(kind, key)] = wrapper
        return wrapper

    def _for_layer(self, batch: ForwardBatch, layer: AttentionLayer) -> Any:
        plan: _StepPlan = batch.attn_metadata
        key = (layer.sliding_window, layer.scaling)
        wrapper = plan.wrappers.get(key)
        if wrapper is not None:
            return wrapper
        if self.ctx.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"flashinfer attention: layer {layer.layer_id} (sliding_window={layer.sliding_window}, "
                f"scale={layer.scaling}) was first seen inside a CUDA-graph capture, where a wrapper "
                "cannot be planned; run one eager step (the capture's warm-up does) before capturing")
        if key not in self.keys:
            self.keys.append(key)
        return self._plan(plan, key, batch)

    # ------------------------------------------------------------ CUDA graphs
    # Decode only. Every bucket size gets its own decode wrapper per key (FlashInfer fixes
    # the batch size of a use_cuda_graph wrapper), all built over one set of index
    # buffers sized for max_batch_size requests of max_context_len tokens; replays run one
    # at a time, each right after its own re-plan has rewritten those buffers in place.
    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        dev, page = self.ctx.device, self.ctx.page_size
        max_pages = max_batch_size * -(-self.ctx.max_context_len // page)
        self._graph_bufs = (
            torch.zeros(max_batch_size + 1, dtype=torch.int32, device=dev),  # indptr
            torch.zeros(max_pages, dtype=torch.int32, device=dev),  # indices
            torch.ones(max_batch_size, dtype=torch.int32, device=dev),  # last_page_len
        )
        self._graph.clear()

    def _graph_wrapper(self, bs: int, key: Key) -> Any:
        wrapper = self._graph.get((bs, key))
        if wrapper is None:
            if self._graph_bufs is None or bs + 1 > self._graph_bufs[0].numel():
                raise RuntimeError(
                    f"flashinfer attention: a CUDA-graph batch of {bs} needs init_cuda_graph_state"
                    f"(max_batch_size >= {bs}) first")
            indptr, indices, last = self._graph_bufs
            wrapper = self.lib.BatchDecodeWithPagedKVCacheWrapper(
                self.workspace, "NHD", use_cuda_graph=True,
                use_tensor_cores=self.decode_use_tensor_cores,
                paged_kv_indptr_buffer=indptr[:bs + 1],
                paged_kv_indices_buffer=indices,
                paged_kv_last_page_len_buffer=last[:bs])
            self._graph[(bs, key)] = wrapper
        return wrapper

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if not batch.is_decode:
            raise ValueError("flashinfer attention captures decode steps only")
        plan = _StepPlan("decode", paged_kv(batch, batch.kv_pool.page_size), None,
                         graph_bs=batch.batch_size)
        for key in self.keys:
            self._plan(plan, key, batch)
        batch.attn_metadata = plan

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        plan: _StepPlan = batch.attn_metadata  # the capture's: its wrappers read fixed buffers
        kv = paged_kv(batch, batch.kv_pool.page_size)
        for key in list(plan.wrappers):
            self._plan(plan, key, batch, kv)  # rewrites the buffers in place

    # -------------------------------------------------------------- forward
    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self._run(q, k, v, layer, batch)

    def _run(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        if self.mla:
            return self._run_mla(q, k, layer, batch)
        pool = batch.kv_pool
        # stored first (rounded to the pool's dtype): the new tokens are read from the pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        wrapper = self._for_layer(batch, layer)
        shape = (-1, pool.page_size, pool.num_kv_heads, pool.head_dim)
        k_cache = pool.k_buffers[layer.layer_id].view(shape)  # [num_pages, page_size, Hkv, D]
        v_cache = pool.v_buffers[layer.layer_id].view(shape)
        return wrapper.run(q.contiguous(), (k_cache, v_cache))  # [T, H, D]


def _check_context(ctx: AttentionContext) -> None:
    if ctx.device.type != "cuda":
        raise ValueError(
            f"the flashinfer attention backend runs on NVIDIA GPUs, got --device {ctx.device.type}; "
            "use --device cuda, or --attention-backend torch_native")
    if ctx.dtype not in ACTIVATION_DTYPES:
        raise ValueError(
            f"the flashinfer attention backend computes in float16 or bfloat16, got {ctx.dtype}; "
            "pass --dtype bfloat16 (or float16), or use --attention-backend triton or torch_native")
