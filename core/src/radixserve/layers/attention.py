"""The attention backend contract and the per-step batch description it reads.

A backend is chosen once at start-up. Each forward step the model runner calls
:meth:`AttentionBackend.init_forward_metadata` once, then every attention layer calls
:meth:`AttentionBackend.forward` with that step's :class:`ForwardBatch`. The backend
stores the new tokens' K/V in the paged pool (at ``batch.out_cache_loc``) and attends:

* extend (prefill, or a chunk of it): the new tokens of each request attend to the
  request's cached prefix (read through ``req_to_token``) and causally to each other;
* decode: one new token per request attends to all of that request's tokens.

Prefill and decode may come from different backends; :class:`HybridAttentionBackend`
pairs them.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.mem.kv_pool import KVPool


class ForwardMode(enum.Enum):
    EXTEND = "extend"
    DECODE = "decode"


@dataclass
class ForwardBatch:
    """What one forward step computes. Tensors live on the model's device."""

    mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    req_pool_indices: torch.Tensor  # [B] rows of req_to_token
    seq_lens: torch.Tensor  # [B] tokens per request after this step
    out_cache_loc: torch.Tensor  # [T] slot of each new token
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]  # extend: cached tokens before this step (decode: seq_len - 1)
    extend_lens_cpu: list[int]  # extend: new tokens per request (decode: all 1)
    req_to_token: torch.Tensor  # [R, max_context_len]
    kv_pool: KVPool
    logits_indices: torch.Tensor  # [B] rows of the hidden states that produce logits
    attn_metadata: Any = None  # set by the backend in init_forward_metadata
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer, handed to the backend on every call."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # attend to at most this many most recent tokens


@dataclass(frozen=True)
class AttentionContext:
    """What a backend factory receives at start-up."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    page_size: int
    max_context_len: int
    max_batch_size: int


class AttentionBackend(ABC):
    """Paged attention for one or both phases.

    Contract: ``q  # [T, H, D]``, ``k, v  # [T, Hkv, D]`` (``H`` a multiple of ``Hkv``);
    the result is ``# [T, H, D]`` in q's dtype. ``forward`` must write ``k, v`` to
    ``batch.kv_pool`` at ``batch.out_cache_loc`` before (or while) attending, so later
    steps and later layers of chunked prefill can read them. Metadata that does not depend
    on the layer is built in :meth:`init_forward_metadata`, never per layer.
    """

    @abstractmethod
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Build per-step metadata (index tensors, masks) and store it on ``batch``."""

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Extend attention over each request's cached prefix plus its new tokens."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Decode attention: one query token per request over its whole sequence."""

    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    # CUDA-graph hooks: part of the contract so GPU backends can capture decode; no-ops here.
    def init_cuda_graph_state(self, max_batch_size: int) -> None:  # noqa: B027
        pass

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:  # noqa: B027
        pass

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:  # noqa: B027
        pass


class HybridAttentionBackend(AttentionBackend):
    """Extend through one backend and decode through another."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode

    def _pick(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.mode is ForwardMode.DECODE else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._pick(batch).init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch):
        return self.prefill.forward_extend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer, batch):
        return self.decode.forward_decode(q, k, v, layer, batch)

    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        self.decode.init_cuda_graph_state(max_batch_size)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self.decode.init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        self.decode.init_forward_metadata_replay_cuda_graph(batch)
