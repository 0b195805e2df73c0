"""The ``triton`` attention backend: launches the kernels of :mod:`.kernels`.

Per step (:meth:`TritonAttention.init_forward_metadata`) it builds a few small index
tensors; per layer it writes the new K/V into the pool and launches one extend kernel, or
the two decode stages.

Target verify (speculative decoding, ``batch.mode`` ``TARGET_VERIFY``, through
:meth:`~TritonAttention.forward_extend`) is an extend whose new tokens form a tree: the
same kernel, compiled with ``TREE``, reads each request's ``[E, E]`` block of
``batch.tree_mask`` (its offset travels to the device with the other per-request lengths)
in place of the causal mask, and takes the new tokens' positions (prefix + depth) from
``batch.positions`` for sliding windows. Plain extend compiles without that path.

MLA (``supports_mla``): the absorbed form reads the latent pool's one KV head as K, in a
``kv_lora_rank`` tile and a RoPE tile, and takes V from the first tile (``V_IN_K``); the
expanded prefill (:meth:`~TritonAttention.forward_mla_prefill`) is the extend kernel over the
new tokens' per-head K and V, with no cached prefix and nothing written to the pool.

Decode keeps everything it launches with fixed shapes: the grid's split dimension is
``max_kv_splits`` whatever the lengths, the per-request split counts live in a
preallocated ``[max_batch_size]`` tensor computed on the device, and the split partials
go to preallocated ``[max_batch_size, H, max_kv_splits, D]`` buffers, so a decode step can
later be captured in a CUDA graph.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from radixserve.plugin_api.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
    to_storage,
)

from radixserve_attention_triton import kernels

LOG2_E = 1.4426950408889634
MAX_HEAD_DIM = 256
MAX_LATENT_DIM = 512  # MLA: the kv_lora_rank tile (DeepSeek-V2/V3: 512)


@dataclass(frozen=True)
class _Dims:
    """How the kernels tile one layer's rows (the kernels' module doc, "Head dims"): ``head``
    K dims in the first tile, ``pe`` in a second, V ``v`` dims (the first tile's, with ``v_in_k``)."""

    head: int
    pe: int
    v: int
    v_in_k: bool

    @classmethod
    def of(cls, layer: AttentionLayer, v_in_k: bool) -> _Dims:
        if layer.v_head_dim is None:
            return cls(layer.head_dim, 0, layer.head_dim, False)
        first = min(layer.head_dim, layer.v_head_dim)
        return cls(first, layer.head_dim - first, layer.v_head_dim, v_in_k)

    def constexprs(self) -> dict:
        return dict(HEAD_DIM=self.head, BLOCK_D=_block_d(self.head), PE_DIM=self.pe,
                    BLOCK_PE=_block_d(self.pe), V_DIM=self.v, BLOCK_DV=_block_d(self.v), V_IN_K=self.v_in_k)


@dataclass
class _ExtendMeta:
    prefix_lens: torch.Tensor  # [B] int32 cached tokens before this step
    extend_lens: torch.Tensor  # [B] int32 new tokens
    qo_start: torch.Tensor  # [B] int32 first row of each request's new tokens in q
    max_extend: int
    # target verify only: [B] int32 start of each request's [E, E] block in tree_mask
    mask_offsets: torch.Tensor | None = None


@dataclass
class _DecodeMeta:
    num_splits: torch.Tensor  # [B] int32 view of the preallocated split-count buffer


@dataclass(frozen=True)
class KernelConfig:
    """Tile sizes and launch options; the defaults depend on the device (GPU or interpreter)."""

    extend_block_m: int
    extend_block_n: int
    extend_warps: int
    extend_stages: int
    decode_block_n: int
    decode_block_h: int
    decode_warps: int
    decode_stages: int

    @classmethod
    def for_device(cls, device: torch.device, head_dim: int, dtype: torch.dtype) -> KernelConfig:
        if device.type == "cpu":  # the interpreter: large tiles mean fewer Python-level steps
            return cls(32, 32, 1, 1, 32, 16, 1, 1)
        if head_dim > 256:  # MLA's 512-wide latent tile: small N tiles, more warps
            return cls(32, 16, 8, 1, 16, 16, 4, 1)
        if dtype == torch.float32:  # 4-byte tiles, one stage: under 100 KB of shared memory
            return cls(32 if head_dim > 128 else 64, 32, 4, 1, 32, 16, 4, 1)
        if head_dim > 128:  # keep K/V tiles of 256-wide heads within shared memory
            return cls(64, 32, 8, 1, 32, 16, 4, 2)
        return cls(64, 64, 4, 2, 64, 16, 4, 2)


def _check_device(device: torch.device) -> None:
    if device.type == "cpu" and not kernels.INTERPRETED:
        raise RuntimeError(
            "the triton attention backend got a CPU model, but its kernels were not built for "
            "Triton's interpreter: set TRITON_INTERPRET=1 before radixserve starts (before "
            "triton kernels are imported), run on a GPU, or use --attention-backend torch_native"
        )


def _kv_dtypes_on(device: torch.device) -> frozenset[torch.dtype]:
    """The KV storage dtypes the kernels can widen on ``device`` (see ``--kv-cache-dtype``):
    Triton converts float8_e4m3fn only on NVIDIA GPUs of compute capability 8.9 and up
    (and the interpreter); ROCm's fp8 is the fnuz variant."""
    dtypes = TritonAttention.supported_kv_dtypes
    if device.type == "cuda" and (torch.version.hip or torch.cuda.get_device_capability(device) < (8, 9)):
        dtypes = dtypes - {torch.float8_e4m3fn}
    return dtypes


class TritonAttention(AttentionBackend):
    """Paged extend (and target verify) and split-K decode attention in Triton.

    ``max_kv_splits`` bounds how many programs share one request's KV in decode (the size
    of the grid's split dimension); ``min_split_tokens`` is the fewest tokens worth a split
    of their own. Both default by device.
    """

    supports_target_verify = True
    supports_mla = True
    supports_cuda_graph = True  # decode metadata is rewritten in place into fixed buffers
    supported_kv_dtypes = frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2})

    def __init__(
        self,
        ctx: AttentionContext,
        *,
        max_kv_splits: int | None = None,
        min_split_tokens: int | None = None,
        config: KernelConfig | None = None,
    ) -> None:
        _check_device(ctx.device)
        if ctx.v_head_dim is not None:  # MLA: a latent tile and a RoPE tile
            if ctx.v_head_dim > MAX_LATENT_DIM or ctx.head_dim - ctx.v_head_dim > MAX_HEAD_DIM:
                raise ValueError(
                    f"the triton attention backend supports an MLA latent of up to {MAX_LATENT_DIM} "
                    f"dims plus up to {MAX_HEAD_DIM} RoPE dims, got {ctx.v_head_dim} + "
                    f"{ctx.head_dim - ctx.v_head_dim}; use --attention-backend torch_native"
                )
        elif ctx.head_dim > MAX_HEAD_DIM:
            raise ValueError(
                f"the triton attention backend supports head_dim up to {MAX_HEAD_DIM}, "
                f"got {ctx.head_dim}; use --attention-backend torch_native"
            )
        if ctx.num_heads % ctx.num_kv_heads:
            raise ValueError(
                f"num_heads ({ctx.num_heads}) must be a multiple of num_kv_heads "
                f"({ctx.num_kv_heads})"
            )
        on_gpu = ctx.device.type != "cpu"
        self.supported_kv_dtypes = _kv_dtypes_on(ctx.device)
        self.ctx = ctx
        self.out_dim = ctx.v_head_dim or ctx.head_dim  # decode output width
        self.config = config or KernelConfig.for_device(ctx.device, self.out_dim, ctx.dtype)
        self.max_kv_splits = max_kv_splits or (16 if on_gpu else 4)
        self.min_split_tokens = min_split_tokens or (256 if on_gpu else 32)
        if on_gpu and ctx.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(ctx.device).multi_processor_count
        else:
            self.num_sms = 0  # no occupancy target: split by length alone
        self._alloc_decode_buffers(max(ctx.max_batch_size, 1))

    def _alloc_decode_buffers(self, max_batch_size: int) -> None:
        ctx, dev = self.ctx, self.ctx.device
        self.max_batch_size = max_batch_size
        self._num_splits = torch.ones(max_batch_size, dtype=torch.int32, device=dev)
        self._mid_o = torch.empty(
            max_batch_size,
            ctx.num_heads,
            self.max_kv_splits,
            self.out_dim,
            dtype=torch.float32,
            device=dev,
        )
        self._mid_lse = torch.empty(
            max_batch_size, ctx.num_heads, self.max_kv_splits, dtype=torch.float32, device=dev
        )

    # ------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            batch.attn_metadata = self._decode_metadata(batch)
            return
        dev = batch.req_to_token.device
        starts = [0]
        for n in batch.extend_lens_cpu[:-1]:
            starts.append(starts[-1] + n)
        rows = [batch.prefix_lens_cpu, batch.extend_lens_cpu, starts]
        if batch.is_verify:
            if batch.tree_mask is None or batch.tree_mask_offsets_cpu is None:
                raise ValueError("target verify needs batch.tree_mask and tree_mask_offsets_cpu")
            rows.append(batch.tree_mask_offsets_cpu)
        lens = torch.tensor(rows, dtype=torch.int32).to(dev, non_blocking=True)  # [3 or 4, B]
        batch.attn_metadata = _ExtendMeta(
            lens[0],
            lens[1],
            lens[2],
            max(batch.extend_lens_cpu),
            lens[3] if batch.is_verify else None,
        )

    def _decode_metadata(self, batch: ForwardBatch) -> _DecodeMeta:
        bsz = batch.batch_size
        if bsz > self.max_batch_size:  # more than the context promised: grow (not graph-safe)
            self._alloc_decode_buffers(bsz)
        # Split only as much as needed to occupy the GPU, and never below min_split_tokens
        # (the kernels cut the count further for layers whose sliding window is shorter).
        by_len = (batch.seq_lens + self.min_split_tokens - 1) // self.min_split_tokens  # [B]
        cap = self.max_kv_splits
        if self.num_sms:
            head_blocks = math.ceil(
                self.ctx.num_heads // self.ctx.num_kv_heads / self.config.decode_block_h
            )
            programs = bsz * self.ctx.num_kv_heads * head_blocks
            cap = min(cap, max(1, math.ceil(2 * self.num_sms / programs)))
        num_splits = self._num_splits[:bsz]
        num_splits.copy_(by_len.clamp(1, cap))
        return _DecodeMeta(num_splits)

    # CUDA graphs: decode metadata is written in place into fixed buffers, so capture and
    # replay only need those buffers to exist at the captured batch size.
    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        if max_batch_size > self.max_batch_size:
            self._alloc_decode_buffers(max_batch_size)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.init_forward_metadata(batch)

    # -------------------------------------------------------------- extend
    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        # the new tokens attend to each other as the pool stores them (rounded to its dtype)
        k, v = to_storage(k, pool.dtype), to_storage(v, pool.dtype)
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        return self._extend(q, k, v, k_buf, v_buf, layer, batch, _Dims.of(layer, v_in_k=True))

    def forward_mla_prefill(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """The expanded form: the extend kernel over per-head K/V with no cached prefix (every
        ``prefix_lens`` is 0, so the pool arguments are never read)."""
        if max(layer.head_dim - min(layer.head_dim, layer.v_head_dim), layer.v_head_dim) > MAX_HEAD_DIM:
            raise ValueError(f"MLA prefill head dims {layer.head_dim}/{layer.v_head_dim}: the triton "
                             f"attention backend tiles up to {MAX_HEAD_DIM}")
        return self._extend(q, k, v, k, v, layer, batch, _Dims.of(layer, v_in_k=False))

    def _extend(self, q, k, v, k_buf, v_buf, layer: AttentionLayer, batch: ForwardBatch, dims: _Dims):
        meta: _ExtendMeta = batch.attn_metadata
        q, k, v = _last_dim_contiguous(q), _last_dim_contiguous(k), _last_dim_contiguous(v)
        out = q.new_empty(q.shape[0], q.shape[1], dims.v)  # [T, H, Dv]
        cfg = self.config
        grid = (batch.batch_size, layer.num_heads, triton_cdiv(meta.max_extend, cfg.extend_block_m))
        r2t = batch.req_to_token
        tree = meta.mask_offsets is not None
        if tree:  # the same bytes as uint8: one byte per mask entry either way
            mask_offsets, tree_mask = meta.mask_offsets, batch.tree_mask.view(torch.uint8)
        else:  # never read without TREE
            mask_offsets = tree_mask = meta.prefix_lens
        kernels.extend_kernel[grid](
            q,
            k,
            v,
            out,
            k_buf,
            v_buf,
            r2t,
            batch.req_pool_indices,
            meta.prefix_lens,
            meta.extend_lens,
            meta.qo_start,
            mask_offsets,
            tree_mask,
            batch.positions,
            layer.scaling * LOG2_E,
            layer.sliding_window or 0,
            q.stride(0),
            q.stride(1),
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            out.stride(0),
            out.stride(1),
            k_buf.stride(0),
            k_buf.stride(1),
            v_buf.stride(0),
            v_buf.stride(1),
            r2t.stride(0),
            GROUP=layer.num_heads // layer.num_kv_heads,
            BLOCK_M=cfg.extend_block_m,
            BLOCK_N=cfg.extend_block_n,
            UPCAST=kernels.INTERPRETED,
            TREE=tree,
            **dims.constexprs(),
            num_warps=cfg.extend_warps,
            num_stages=cfg.extend_stages,
            enable_fp_fusion=True,
        )
        return out

    # -------------------------------------------------------------- decode
    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        meta: _DecodeMeta = batch.attn_metadata
        q = _last_dim_contiguous(q)  # [B, H, D]
        dims = _Dims.of(layer, v_in_k=True)
        out = q.new_empty(q.shape[0], q.shape[1], dims.v)
        cfg = self.config
        group = layer.num_heads // layer.num_kv_heads
        bsz, window = batch.batch_size, layer.sliding_window or 0
        mid_o, mid_lse, r2t = self._mid_o, self._mid_lse, batch.req_to_token
        grid1 = (
            bsz,
            layer.num_kv_heads * triton_cdiv(group, cfg.decode_block_h),
            self.max_kv_splits,
        )
        kernels.decode_stage1_kernel[grid1](
            q,
            k_buf,
            v_buf,
            r2t,
            batch.req_pool_indices,
            batch.seq_lens,
            meta.num_splits,
            mid_o,
            mid_lse,
            layer.scaling * LOG2_E,
            window,
            self.min_split_tokens,
            q.stride(0),
            q.stride(1),
            k_buf.stride(0),
            k_buf.stride(1),
            v_buf.stride(0),
            v_buf.stride(1),
            r2t.stride(0),
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            GROUP=group,
            BLOCK_H=cfg.decode_block_h,
            BLOCK_N=cfg.decode_block_n,
            UPCAST=kernels.INTERPRETED,
            **dims.constexprs(),
            num_warps=cfg.decode_warps,
            num_stages=cfg.decode_stages,
            enable_fp_fusion=True,
        )
        kernels.decode_stage2_kernel[(bsz, layer.num_heads)](
            mid_o,
            mid_lse,
            out,
            batch.seq_lens,
            meta.num_splits,
            window,
            self.min_split_tokens,
            mid_o.stride(0),
            mid_o.stride(1),
            mid_o.stride(2),
            mid_lse.stride(0),
            mid_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=dims.v,
            BLOCK_D=_block_d(dims.v),
            BLOCK_S=kernels.next_power_of_2(self.max_kv_splits),
            num_warps=4 if dims.v > 64 else 2,
            enable_fp_fusion=True,
        )
        return out


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_d(head_dim: int) -> int:
    """Head dims pad to a power of two (96 -> 128); tl.dot needs at least 16 (so does an
    unused tile: 0 -> 16)."""
    return max(16, kernels.next_power_of_2(head_dim))


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()
