"""radixserve attention backend ``toy``: the simplest correct paged attention.

Each request's keys and values are gathered from the paged pool through the
request-to-token table and attended to with an explicit masked softmax, one request at a
time. Slow on purpose, and written against nothing but the core's ``AttentionBackend``
contract, so it shows what a third-party backend needs and nothing more.

To let tests prove the backend really ran, every step is counted in ``CALLS`` and, when
its own flag ``--toy-attention-log`` (or ``RADIXSERVE_TOY_ATTENTION_LOG``) names a file, one
line per step (``extend`` or ``decode``) is appended to it.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch
from radixserve.plugin_api import hookimpl, option
from radixserve.plugin_api.attention import (
    AttentionBackend,
    AttentionContext,
    AttentionLayer,
    ForwardBatch,
)

LOG_ENV = "RADIXSERVE_TOY_ATTENTION_LOG"
CALLS: Counter[str] = Counter()  # steps seen, by mode ("extend" / "decode")


@dataclass
class ToyOptions:
    toy_attention_log: str | None = option(None, "--attention-backend toy: append one line per step "
                                                 "(extend or decode) to this file")


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, q_pos: torch.Tensor,
            layer: AttentionLayer) -> torch.Tensor:
    """``q  # [n, H, D]`` at positions ``q_pos  # [n]`` over ``keys, values  # [L, Hkv, D]``."""
    group = layer.num_heads // layer.num_kv_heads
    keys = keys.repeat_interleave(group, dim=1)  # [L, H, D]
    values = values.repeat_interleave(group, dim=1)  # [L, H, D]
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys.float()) * layer.scaling  # [H, n, L]
    k_pos = torch.arange(keys.shape[0], device=q.device)  # [L]
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, L]
    if layer.sliding_window is not None:
        allowed &= k_pos[None, :] > q_pos[:, None] - layer.sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)  # [H, n, L]
    return torch.einsum("hnl,lhd->nhd", probs, values.float()).to(q.dtype)  # [n, H, D]


class ToyAttention(AttentionBackend):
    def __init__(self, ctx: AttentionContext) -> None:
        self.ctx = ctx
        self.log_path = (ctx.options.toy_attention_log if ctx.options else None) or os.environ.get(LOG_ENV)

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        mode = "decode" if batch.is_decode else "extend"
        CALLS[mode] += 1
        if self.log_path:
            with open(self.log_path, "a") as f:
                f.write(mode + "\n")
        # Per request: the rows of q it owns and the KV slots of its whole sequence.
        rows = batch.req_pool_indices.tolist()
        spans, start = [], 0
        for row, seq_len, ext in zip(rows, batch.seq_lens_cpu, batch.extend_lens_cpu):
            spans.append((start, ext, seq_len, batch.req_to_token[row, :seq_len]))
            start += ext
        batch.attn_metadata = spans

    def _forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        pool = batch.kv_pool
        pool.set_kv(layer.layer_id, batch.out_cache_loc, k, v)
        out = torch.empty_like(q)
        for start, ext, seq_len, slots in batch.attn_metadata:
            keys = pool.k_buffers[layer.layer_id][slots]  # [L, Hkv, D]
            values = pool.v_buffers[layer.layer_id][slots]  # [L, Hkv, D]
            q_pos = torch.arange(seq_len - ext, seq_len, device=q.device)  # [ext]
            out[start:start + ext] = _attend(q[start:start + ext], keys, values, q_pos, layer)
        return out

    def forward_extend(self, q, k, v, layer, batch):
        return self._forward(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer, batch):
        return self._forward(q, k, v, layer, batch)


@hookimpl
def register_attention_backends(register):
    register("toy", ToyAttention, options=ToyOptions,
             description="test-only paged attention (explicit softmax, one request at a time)")
