"""The ``torch_native`` attention backend: paged extend and decode in plain PyTorch.

Runs anywhere torch runs. Decode gathers each request's K/V through the token-slot
table once per layer into a padded ``[B, L, Hkv, D]`` block and attends with GQA
grouping (no K/V repetition); extend runs scaled-dot-product attention per request
over its cached prefix plus the new tokens with an offset causal mask (target verify:
the tree mask in its place).

On CPU in float32, decode without a sliding window or shared-prefix groups runs
the backend's compiled paged-decode kernel instead (``decode_attention.c``, :mod:`.kernel`): it
reads K/V straight from the pool, so there is no gather copy and one call per layer
replaces about a dozen small ops. Without the kernels the PyTorch path runs.

MLA (``layer.v_head_dim`` set: DeepSeek's latent cache, one KV head whose first v_head_dim
dims are V) takes the PyTorch paths with V sliced from the gathered K rows; its expanded-form
prefill is the base class's per-request SDPA.

A KV pool narrower than the activations (``--kv-cache-dtype`` bfloat16, float16, fp8_e4m3,
fp8_e5m2) is gathered in its storage dtype and widened to the activation dtype right after
the gather, so SDPA always computes in the activation dtype; such pools take the PyTorch
path (the compiled kernel reads float32 pools only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from radixserve.plugin_api.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
)

from radixserve_attention_torch import cascade
from radixserve_attention_torch import kernel as decode_kernel


@dataclass
class _DecodeMeta:
    kv_indices: torch.Tensor  # [B, Lmax] slots, padded with slot 0
    mask: torch.Tensor | None  # [B, 1, 1, Lmax] True where a real token; None when no padding
    groups: list[cascade.PrefixGroup]  # requests sharing a long cached prefix
    rest: _DecodeMeta | None = None  # the other rows, when there are groups
    rest_rows: torch.Tensor | None = None


@dataclass
class _ExtendMeta:
    kv_indices: list[torch.Tensor]  # per request: [prefix + extend] slots
    q_starts: list[int]  # per request: first row of its new tokens in q
    # per request, [extend, prefix + extend]: a chunk after a prefix, 0 where allowed and -inf elsewhere (the
    # activation dtype); target verify, True where allowed; None for plain causal
    masks: list[torch.Tensor | None]
    # target verify through the decode kernel: tree node n attends over the first
    # node_lens[n] slots of node_table[n] (its request's prefix, then its ancestors and itself)
    node_table: torch.Tensor | None = None  # [E, max_len] int64
    node_lens: torch.Tensor | None = None  # [E] int64
    node_rows: torch.Tensor | None = None  # [E] int64: arange
    # mixed batch: the trailing decode rows (their own decode metadata; the lists above
    # cover only the extend requests before them)
    decode: _DecodeMeta | None = None


def _node_table(batch: ForwardBatch, kv_indices: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each verify tree node as a decode row: ``[E, max_len]`` slots (prefix, then the
    node's ancestors and itself, in tree order) and ``[E]`` lengths."""
    rows, lens = [], []
    for i, (prefix, ext) in enumerate(zip(batch.prefix_lens_cpu, batch.extend_lens_cpu)):
        idx = kv_indices[i]
        tree = batch.tree_mask_of(i).to(idx.device)  # [ext, ext]: ancestors and self
        new = idx[prefix:]
        for j in range(ext):
            path = new[tree[j]]
            rows.append(torch.cat([idx[:prefix], path]))
            lens.append(prefix + path.shape[0])
    width = max(lens)
    table = torch.zeros(len(rows), width, dtype=torch.int64, device=kv_indices[0].device)
    for n, r in enumerate(rows):
        table[n, :r.shape[0]] = r
    return table, torch.tensor(lens, dtype=torch.int64, device=table.device)


def _decode_meta(idx: torch.Tensor, seq_lens: torch.Tensor, seq_lens_cpu: list[int]) -> _DecodeMeta:
    max_len = idx.shape[1]
    mask = None
    if min(seq_lens_cpu) != max_len:
        valid = torch.arange(max_len, device=idx.device)[None, :] < seq_lens[:, None]
        idx = idx.masked_fill(~valid, 0)
        mask = valid[:, None, None, :]
    return _DecodeMeta(idx, mask, [])


def _window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


def _tree_mask(prefix: int, tree: torch.Tensor) -> torch.Tensor:
    """``[E, prefix + E]``: every new token sees the whole prefix and its tree ancestors."""
    seen = torch.ones(tree.shape[0], prefix, dtype=torch.bool, device=tree.device)
    return torch.cat([seen, tree], dim=1)


def _gather(buf: torch.Tensor, index: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rows ``buf[index]`` of a ``[N, Hkv, D]`` pool as ``[*index.shape, Hkv, D]``, widened
    to ``dtype`` (the activation dtype) when the pool stores K/V narrower.

    ``index_select`` on the flattened rows is ~6x faster on CPU than advanced indexing.
    """
    rows = buf.view(buf.shape[0], -1).index_select(0, index.reshape(-1))
    if dtype is not None and rows.dtype != dtype:
        rows = rows.to(dtype)
    return rows.view(*index.shape, *buf.shape[1:])


def _values(keys: torch.Tensor, v_buf: torch.Tensor, index: torch.Tensor, dtype, layer: AttentionLayer):
    """V rows of ``index``: gathered from the V buffer, or (MLA) the first v_head_dim dims of
    the K rows already gathered (``keys``, ``[..., Hkv, D]`` before any transpose)."""
    if layer.v_head_dim is not None:
        return keys[..., :layer.v_head_dim]
    return _gather(v_buf, index, dtype)


class TorchNativeAttention(AttentionBackend):
    supports_target_verify = True
    supports_mla = True
    supported_kv_dtypes = frozenset({torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2})

    def __init__(self, ctx: AttentionContext, use_kernels: bool = True) -> None:
        self.ctx = ctx
        self.kernels = None
        if use_kernels and ctx.device.type == "cpu" and ctx.dtype == torch.float32:
            self.kernels = decode_kernel.load()
        # decode steps replay as kernel tapes on CPU (radixserve.kernels.tape): the compiled kernel
        # reads everything it needs from the batch's own tensors, so there is no metadata to keep
        if self.kernels is not None:
            self.supports_cuda_graph = True

        self._verify: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # node table, lens, rows

    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        """Buffers of a recorded target-verify step's node table, for up to ``max_batch_size``
        tree nodes (grown, never shrunk: only verify tapes read them, all recorded after this)."""
        if self._verify is None or self._verify[0].shape[0] < max_batch_size:
            n, width = max_batch_size, self.ctx.max_context_len
            self._verify = (torch.zeros(n, width, dtype=torch.int64), torch.ones(n, dtype=torch.int64),
                            torch.arange(n, dtype=torch.int64))

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        if batch.is_verify:  # every node a decode row of the kernel (see _node_table)
            n = batch.input_ids.shape[0]
            table, lens, rows = (t[:n] for t in self._verify)
            table.zero_()
            lens.fill_(1)
            batch.attn_metadata = _ExtendMeta([], [], [], node_table=table, node_lens=lens, node_rows=rows)
            return
        batch.attn_metadata = _DecodeMeta(torch.empty(0, dtype=torch.int64), None, [])

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> bool:
        """A verify step: this step's node table written into the recorded one. A decode
        step: False (run it eagerly) when requests share a long cached prefix, which the
        eager step attends to once per group (:mod:`.cascade`): a replay must give its tokens."""
        if batch.is_verify:
            rows = batch.req_pool_indices.tolist()
            kv_indices = [batch.req_to_token[row, :p + e]
                          for row, p, e in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu)]
            table, lens = _node_table(batch, kv_indices)
            meta: _ExtendMeta = batch.attn_metadata
            meta.node_table[:table.shape[0], :table.shape[1]].copy_(table)
            meta.node_lens.copy_(lens)
            return True
        lens = batch.seq_lens_cpu
        if len(lens) < 2 or sorted(lens)[-2] <= cascade.MIN_SHARED_TOKENS:
            return True
        firsts = batch.req_to_token[batch.req_pool_indices, 0].tolist()
        long_firsts = [f for f, n in zip(firsts, lens) if n > cascade.MIN_SHARED_TOKENS]
        if len(set(long_firsts)) == len(long_firsts):
            return True
        meta = self._decode_metadata(batch.req_to_token, batch.req_pool_indices, batch.seq_lens, lens)
        return not meta.groups

    # ------------------------------------------------------------ metadata
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        if batch.is_decode:
            batch.attn_metadata = self._decode_metadata(batch.req_to_token, batch.req_pool_indices,
                                                        batch.seq_lens, batch.seq_lens_cpu)
            return
        n_ext = batch.num_extend if batch.is_mixed else batch.batch_size
        rows = batch.req_pool_indices[:n_ext].tolist()
        kv_indices, q_starts, masks = [], [], []
        start = 0
        for row, prefix, ext in zip(rows, batch.prefix_lens_cpu, batch.extend_lens_cpu):
            total = prefix + ext
            kv_indices.append(batch.req_to_token[row, :total])
            q_starts.append(start)
            start += ext
            if batch.is_verify:
                masks.append(_tree_mask(prefix, batch.tree_mask_of(len(masks))))
            elif prefix == 0:
                masks.append(None)
            else:  # additive (0 / -inf) once per step: SDPA would convert a bool mask in every layer
                pos = torch.arange(total, device=batch.req_to_token.device)
                allowed = _window_mask(pos[prefix:], pos, None)
                masks.append(torch.zeros(allowed.shape, dtype=self.ctx.dtype, device=allowed.device)
                             .masked_fill_(~allowed, float("-inf")))
        meta = _ExtendMeta(kv_indices, q_starts, masks)
        if n_ext < batch.batch_size:  # mixed: the decode rows
            meta.decode = self._decode_metadata(batch.req_to_token, batch.req_pool_indices[n_ext:],
                                                batch.seq_lens[n_ext:], batch.seq_lens_cpu[n_ext:])
        if batch.is_verify and self.kernels is not None:
            meta.node_table, meta.node_lens = _node_table(batch, kv_indices)
            meta.node_rows = torch.arange(meta.node_lens.shape[0], device=meta.node_lens.device)
        batch.attn_metadata = meta

    @staticmethod
    def _decode_metadata(req_to_token, req_pool_indices, seq_lens, seq_lens_cpu) -> _DecodeMeta:
        max_len = max(seq_lens_cpu)
        idx = req_to_token[req_pool_indices, :max_len]  # [B, Lmax]
        meta = _decode_meta(idx, seq_lens, seq_lens_cpu)
        groups, rest = cascade.find_groups(meta.kv_indices, seq_lens_cpu)
        if groups:
            meta.groups = groups
            if rest:
                rows = torch.tensor(rest, device=idx.device)
                lens = [seq_lens_cpu[r] for r in rest]
                meta.rest = _decode_meta(idx[rows, :max(lens)], seq_lens[rows], lens)
                meta.rest_rows = rows
        return meta

    # --------------------------------------------------------------- mixed
    def forward_mixed(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Prefill rows through the extend path, decode rows through the decode path
        (the compiled kernel on CPU): as fast as the two steps apart, in one forward."""
        meta: _ExtendMeta = batch.attn_metadata
        if meta.decode is None:
            return self.forward_extend(q, k, v, layer, batch)
        n_ext = batch.num_extend
        t = sum(batch.extend_lens_cpu[:n_ext])  # rows of the extend part
        out = q.new_empty(*q.shape[:2], layer.out_dim)
        if n_ext:
            out[:t] = self._extend(q[:t], k[:t], v[:t], layer, batch, meta, batch.out_cache_loc[:t])
        out[t:] = self._decode(q[t:], k[t:], v[t:], layer, batch.kv_pool,
                               meta.decode, batch.out_cache_loc[t:], batch.req_to_token,
                               batch.req_pool_indices[n_ext:], batch.seq_lens[n_ext:])
        return out

    # -------------------------------------------------------------- extend
    def forward_extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self._extend(q, k, v, layer, batch, batch.attn_metadata, batch.out_cache_loc)

    def _extend(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch, meta: _ExtendMeta,
                out_cache_loc: torch.Tensor) -> torch.Tensor:
        """Extend attention of the requests ``meta`` lists (the first ones of ``batch``),
        whose new tokens are the rows of ``q``/``k``/``v`` and go to ``out_cache_loc``."""
        pool = batch.kv_pool
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        if (meta.node_table is not None and layer.sliding_window is None and layer.v_head_dim is None
                and q.dtype == k_buf.dtype == torch.float32 and k_buf.is_contiguous() and v_buf.is_contiguous()
                and self.kernels.rows_fit(q, k, v)):
            # target verify: every tree node is a decode row over its prefix and ancestors
            # (the kernel writes every node's K/V before any row attends)
            return self.kernels.decode_attention(q, k, v, k_buf, v_buf, batch.out_cache_loc, meta.node_table,
                                                 meta.node_rows, meta.node_lens, layer.scaling)
        pool.set_kv(layer.layer_id, out_cache_loc, k, v)
        out = q.new_empty(*q.shape[:2], layer.out_dim)
        for i, ext in enumerate(batch.extend_lens_cpu[:len(meta.q_starts)]):
            s = meta.q_starts[i]
            idx = meta.kv_indices[i]
            qi = q[s:s + ext].transpose(0, 1)  # [H, ext, D]
            keys = _gather(k_buf, idx, q.dtype)  # [L, Hkv, D]
            ki, vi = keys.transpose(0, 1), _values(keys, v_buf, idx, q.dtype, layer).transpose(0, 1)
            mask = meta.masks[i]
            if mask is not None and mask.dtype not in (torch.bool, q.dtype):
                mask = mask.to(q.dtype)
            if layer.sliding_window is not None:
                total = idx.shape[0]
                if batch.is_verify:  # the tree's keys sit at their own positions
                    prefix = total - ext
                    q_pos = batch.positions[s:s + ext]
                    k_pos = torch.cat([torch.arange(prefix, device=q.device), q_pos])
                    mask = mask & (k_pos[None, :] > q_pos[:, None] - layer.sliding_window)
                else:
                    pos = torch.arange(total, device=q.device)
                    mask = _window_mask(pos[total - ext:], pos, layer.sliding_window)
            o = F.scaled_dot_product_attention(
                qi.unsqueeze(0), ki.unsqueeze(0), vi.unsqueeze(0),
                attn_mask=mask, is_causal=mask is None, scale=layer.scaling,
                enable_gqa=layer.num_heads != layer.num_kv_heads,
            )  # [1, H, ext, D]
            out[s:s + ext] = o[0].transpose(0, 1)
        return out

    # -------------------------------------------------------------- decode
    def forward_decode(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        return self._decode(q, k, v, layer, batch.kv_pool, batch.attn_metadata, batch.out_cache_loc,
                            batch.req_to_token, batch.req_pool_indices, batch.seq_lens)

    def _decode(self, q, k, v, layer: AttentionLayer, pool, meta: _DecodeMeta, out_cache_loc,
                req_to_token, req_pool_indices, seq_lens) -> torch.Tensor:
        """Decode attention of one new token per request (the rows of ``q``)."""
        k_buf, v_buf = pool.k_buffers[layer.layer_id], pool.v_buffers[layer.layer_id]
        if (self.kernels is not None and not meta.groups and layer.sliding_window is None and layer.v_head_dim is None
                and q.dtype == k_buf.dtype == torch.float32 and k_buf.is_contiguous() and v_buf.is_contiguous()
                and self.kernels.rows_fit(q, k, v)):  # writes k, v too
            return self.kernels.decode_attention(q, k, v, k_buf, v_buf, out_cache_loc, req_to_token,
                                                 req_pool_indices, seq_lens, layer.scaling)
        pool.set_kv(layer.layer_id, out_cache_loc, k, v)
        if not meta.groups or layer.sliding_window is not None or layer.v_head_dim is not None:
            return self._decode_rows(q, k_buf, v_buf, meta, layer, seq_lens)
        bsz = q.shape[0]
        hkv, group = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
        qg = q.view(bsz, hkv, group, layer.head_dim)
        out = torch.empty_like(qg)
        for grp in meta.groups:
            out[grp.rows] = cascade.group_attention(qg[grp.rows], k_buf, v_buf, grp, layer.scaling,
                                                    lambda buf, idx: _gather(buf, idx, q.dtype))
        if meta.rest is not None:
            rest = self._decode_rows(q[meta.rest_rows], k_buf, v_buf, meta.rest, layer, None)
            out[meta.rest_rows] = rest.view(-1, hkv, group, layer.head_dim)
        return out.view(bsz, layer.num_heads, layer.head_dim)

    @staticmethod
    def _decode_rows(q, k_buf, v_buf, meta: _DecodeMeta, layer: AttentionLayer, seq_lens) -> torch.Tensor:
        bsz = q.shape[0]
        hkv, group = layer.num_kv_heads, layer.num_heads // layer.num_kv_heads
        rows = _gather(k_buf, meta.kv_indices, q.dtype)  # [B, L, Hkv, D]
        keys = rows.transpose(1, 2)  # [B, Hkv, L, D]
        values = _values(rows, v_buf, meta.kv_indices, q.dtype, layer).transpose(1, 2)  # [B, Hkv, L, Dv]
        mask = meta.mask
        if layer.sliding_window is not None:
            length = meta.kv_indices.shape[1]
            pos = torch.arange(length, device=q.device)[None, :]
            recent = pos > seq_lens[:, None] - 1 - layer.sliding_window  # [B, L]
            recent = recent[:, None, None, :]
            mask = recent if mask is None else (mask & recent)
        # The G query heads sharing a KV head attend like G query positions of that head
        # (a decode query sees every key), which avoids SDPA's slower GQA path.
        out = F.scaled_dot_product_attention(
            q.view(bsz, hkv, group, layer.head_dim), keys, values, attn_mask=mask, scale=layer.scaling,
        )  # [B, Hkv, G, Dv]
        return out.reshape(bsz, layer.num_heads, layer.out_dim)
