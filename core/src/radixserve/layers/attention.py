"""The attention backend contract and the per-step batch description it reads.

A backend is chosen once at start-up. Each forward step the model runner calls
:meth:`AttentionBackend.init_forward_metadata` once, then every attention layer calls
:meth:`AttentionBackend.forward` with that step's :class:`ForwardBatch`. The backend
stores the new tokens' K/V in the paged pool (at ``batch.out_cache_loc``) and attends:

* extend (prefill, or a chunk of it): the new tokens of each request attend to the
  request's cached prefix (read through ``req_to_token``) and causally to each other;
* decode: one new token per request attends to all of that request's tokens;
* target verify (speculative decoding): an extend over each request's draft tokens, where
  the new tokens form a tree instead of a chain: new token ``a`` attends to the whole
  cached prefix and to the new tokens ``b`` with ``batch.tree_mask_of(i)[a, b]`` (its
  ancestors and itself), and to nothing else. Backends that implement it set
  :attr:`AttentionBackend.supports_target_verify`.

Prefill and decode may come from different backends; :class:`HybridAttentionBackend`
pairs them.

KV storage dtype (``--kv-cache-dtype``): the pool may store K/V narrower than the
activations (``AttentionContext.kv_dtype``: bfloat16, float16, float8_e4m3fn, float8_e5m2).
A backend stores through :meth:`KVPool.set_kv` (or rounds the same way, see
:func:`radixserve.mem.kv_pool.to_storage`), widens what it reads from the pool to the
activation dtype and computes there; the new tokens of an extend attend to each other as
rounded to the storage dtype too, exactly as later steps will read them. A backend lists
the storage dtypes it reads besides the activation dtype in
:attr:`AttentionBackend.supported_kv_dtypes`; the core refuses any other at start-up
(:func:`check_kv_dtype`).
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
    TARGET_VERIFY = "target_verify"
    # an extend batch whose last ``num_decode`` requests are decoding requests (one new
    # token each over their whole sequence): running requests keep producing tokens in
    # the same forward as a prefill chunk (--enable-mixed-chunk)
    MIXED = "mixed"


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
    # target verify only: request i's new tokens form a tree; its [E_i, E_i] bool mask
    # (row a: the new tokens a sees, itself and its ancestors) is stored row-major at
    # tree_mask[tree_mask_offsets_cpu[i] : + E_i * E_i]. Token j of request i has its K/V
    # slot at out_cache_loc and at req_to_token[row, prefix_i + j] (column = index in the
    # tree, not position); its position is prefix_i + its depth.
    tree_mask: torch.Tensor | None = None  # [sum E_i^2] bool
    tree_mask_offsets_cpu: list[int] | None = None  # [B]
    # layers whose output hidden states the model keeps for every new token (speculative
    # proposers such as EAGLE-3 read them); the model stores them in extra["aux_hidden"]
    capture_hidden_layers: tuple[int, ...] = ()
    # a request asked for its final (normed) hidden states: the model keeps every row's in
    # extra["final_hidden"] ([T, hidden])
    capture_final_hidden: bool = False
    # mixed only: the last ``num_decode`` requests are decode rows (extend length 1,
    # prefix = seq_len - 1); the requests before them are extends (prefill chunks)
    num_decode: int = 0
    # DP attention (--enable-dp-attention): each request's attention group, whose ranks hold
    # its KV and run its rows (radixserve.distributed.dp_attention); None otherwise
    dp_groups: list[int] | None = None
    # LoRA (--enable-lora): each request's adapter slot (-1: the base model); None: no adapter
    lora_slots: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        return self.mode is ForwardMode.DECODE

    @property
    def is_verify(self) -> bool:
        return self.mode is ForwardMode.TARGET_VERIFY

    @property
    def is_mixed(self) -> bool:
        return self.mode is ForwardMode.MIXED

    @property
    def num_extend(self) -> int:
        """Requests computed as extends (all of them unless the batch is mixed or decode)."""
        return self.batch_size - self.num_decode

    def tree_mask_of(self, i: int) -> torch.Tensor:
        """Request ``i``'s ``[E_i, E_i]`` tree mask (target verify only)."""
        n = self.extend_lens_cpu[i]
        start = self.tree_mask_offsets_cpu[i]
        return self.tree_mask[start:start + n * n].view(n, n)


@dataclass(frozen=True)
class AttentionLayer:
    """Static description of one attention layer, handed to the backend on every call."""

    layer_id: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    sliding_window: int | None = None  # attend to at most this many most recent tokens
    # MLA's latent attention (absorbed form): V is the first v_head_dim dims of K, which the
    # pool stores alone (one KV head: the latent plus the rotary key), and the output has
    # v_head_dim per head. None: V has head_dim of its own.
    v_head_dim: int | None = None

    @property
    def out_dim(self) -> int:
        """Per-head size of the attention output (and of V)."""
        return self.v_head_dim if self.v_head_dim is not None else self.head_dim


@dataclass(frozen=True)
class AttentionContext:
    """What a backend factory receives at start-up."""

    num_heads: int  # this rank's query heads (all of them on one rank; see distributed.partition)
    num_kv_heads: int  # this rank's KV heads, as its KV pool holds them
    head_dim: int
    num_layers: int
    dtype: torch.dtype
    device: torch.device
    page_size: int
    max_context_len: int
    max_batch_size: int
    # the KV pool's storage dtype (--kv-cache-dtype); None: the activation dtype
    kv_dtype: torch.dtype | None = None
    # the options the backend declares (radixserve.options), as the flags set them; None: it declares none
    options: Any = field(default=None, compare=False)
    # MLA models: the pool's one latent head (head_dim = kv_lora_rank + rope dims) holds V in its
    # first v_head_dim dims (every layer's AttentionLayer.v_head_dim); None: not an MLA model
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if self.kv_dtype is None:
            object.__setattr__(self, "kv_dtype", self.dtype)


class AttentionBackend(ABC):
    """Paged attention for one or both phases.

    ``supports_target_verify``: the backend honours ``batch.tree_mask`` in
    :meth:`forward_extend` when ``batch.mode`` is ``TARGET_VERIFY``; speculative decoding
    refuses a backend without it.

    ``supported_kv_dtypes``: KV storage dtypes (``AttentionContext.kv_dtype``) the backend
    reads besides the activation dtype ``ctx.dtype``, which every backend reads; the
    default, none, means a backend written without ``--kv-cache-dtype`` in mind is refused
    rather than run on a pool it would misread. An instance may narrow the set it was
    built with (e.g. when a kernel cannot run one format on this device).

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
        """Extend attention over each request's cached prefix plus its new tokens (also
        called for target verify, with ``batch.tree_mask`` in place of the causal mask)."""

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """Decode attention: one query token per request over its whole sequence."""

    def forward_mixed(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """A mixed batch (``batch.is_mixed``): prefill chunks, then ``batch.num_decode``
        decode rows. Each decode row is an extend of one token over its prefix, so the
        default runs the whole batch as an extend; a backend may instead run the decode
        rows through its decode path (their metadata built in
        :meth:`init_forward_metadata`)."""
        return self.forward_extend(q, k, v, layer, batch)

    supports_target_verify: bool = False
    supported_kv_dtypes: frozenset[torch.dtype] = frozenset()
    # MLA (DeepSeek's latent attention): the backend attends with ``layer.v_head_dim`` set (V
    # read as the first v_head_dim dims of each K row of a pool that stores K only, the output
    # v_head_dim wide), and :meth:`forward_mla_prefill` computes the expanded form's prefill.
    # A backend without it is refused at start-up for an MLA model.
    supports_mla: bool = False

    def forward_mla_prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        """MLA's expanded-form prefill: an extend batch with no cached prefix, every request's
        new tokens attending to its own new tokens causally, over K/V given per head
        (``q, k  # [T, H, Dqk]``, ``v  # [T, H, Dv]`` -> ``# [T, H, Dv]``); nothing is read
        from or written to the pool (the layer stores the latent itself). This default runs
        scaled-dot-product attention per request; a backend may run a ragged kernel."""
        out = q.new_empty(q.shape[0], q.shape[1], v.shape[-1])
        start = 0
        for n in batch.extend_lens_cpu:
            qi, ki, vi = (t[start:start + n].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
            out[start:start + n] = torch.nn.functional.scaled_dot_product_attention(
                qi, ki, vi, is_causal=True, scale=layer.scaling)[0].transpose(0, 1)
            start += n
        return out

    def forward(self, q, k, v, layer: AttentionLayer, batch: ForwardBatch) -> torch.Tensor:
        if batch.mode is ForwardMode.DECODE:
            return self.forward_decode(q, k, v, layer, batch)
        if batch.mode is ForwardMode.MIXED:
            return self.forward_mixed(q, k, v, layer, batch)
        return self.forward_extend(q, k, v, layer, batch)

    # ------------------------------------------------------------------ CUDA graphs
    # Decode steps can be captured once per bucketed batch size and replayed
    # (radixserve.engine.cuda_graph; --cuda-graph-max-bs, --cuda-graph-bs,
    # --disable-cuda-graph). A backend opts in with ``supports_cuda_graph``; the core runs a
    # backend without it eagerly (and logs that once). The protocol, per bucket size ``bs``:
    #
    # 1. ``init_cuda_graph_state(max_bs)`` once, before any capture: allocate every buffer
    #    the decode kernels will read (index arrays, split counts, planner workspaces) for up
    #    to ``max_bs`` requests of up to ``ctx.max_context_len`` tokens.
    # 2. ``init_forward_metadata_capture_cuda_graph(batch)``, outside the graph, with a
    #    decode batch of ``bs`` requests whose tensors are the runner's static buffers (the
    #    same tensor objects at every replay of this bucket): set ``batch.attn_metadata``
    #    to metadata that lives in the buffers of step 1. The runner then runs the model
    #    over ``batch`` (warm-up), and captures it.
    # 3. ``init_forward_metadata_replay_cuda_graph(batch)``, outside the graph, before each
    #    replay: the same batch object, its static tensors and its CPU lists
    #    (``seq_lens_cpu``, ``prefix_lens_cpu``) now holding this step's values padded to
    #    ``bs``. Rewrite the metadata *in place* (the captured kernels read those buffers'
    #    addresses); never allocate a tensor that a captured kernel reads. Return False to
    #    have this one step run eagerly instead (e.g. a batch the backend would compute
    #    another way); anything else replays.
    #
    # On CPU the same protocol drives kernel tapes (radixserve.kernels.tape): the decode
    # forward must then call only compiled kernels that have tape twins (see cpu_common.h).
    #
    # Padding rows (the bucket's rows past the real batch) point at the reserved scratch
    # slot 0: ``req_pool_indices`` a request row whose table is all zeros, ``seq_lens`` 1,
    # ``out_cache_loc`` 0. Their outputs are discarded.
    supports_cuda_graph: bool = False

    def init_cuda_graph_state(self, max_batch_size: int) -> None:  # noqa: B027
        pass

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:  # noqa: B027
        pass

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> bool | None:  # noqa: B027
        pass


class HybridAttentionBackend(AttentionBackend):
    """Extend through one backend and decode through another."""

    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend) -> None:
        self.prefill = prefill
        self.decode = decode
        self.supports_target_verify = prefill.supports_target_verify  # verify is an extend
        self.supported_kv_dtypes = prefill.supported_kv_dtypes & decode.supported_kv_dtypes
        self.supports_cuda_graph = decode.supports_cuda_graph  # only decode steps are captured
        self.supports_mla = prefill.supports_mla and decode.supports_mla

    def _pick(self, batch: ForwardBatch) -> AttentionBackend:
        return self.decode if batch.mode is ForwardMode.DECODE else self.prefill

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        self._pick(batch).init_forward_metadata(batch)

    def forward_extend(self, q, k, v, layer, batch):
        return self.prefill.forward_extend(q, k, v, layer, batch)

    def forward_decode(self, q, k, v, layer, batch):
        return self.decode.forward_decode(q, k, v, layer, batch)

    def forward_mla_prefill(self, q, k, v, layer, batch):
        return self.prefill.forward_mla_prefill(q, k, v, layer, batch)

    def forward_mixed(self, q, k, v, layer, batch):  # its metadata is the prefill backend's
        return self.prefill.forward_mixed(q, k, v, layer, batch)

    def init_cuda_graph_state(self, max_batch_size: int) -> None:
        self.decode.init_cuda_graph_state(max_batch_size)

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        self.decode.init_forward_metadata_capture_cuda_graph(batch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> bool | None:
        return self.decode.init_forward_metadata_replay_cuda_graph(batch)


def check_kv_dtype(backend: AttentionBackend, ctx: AttentionContext, what: str) -> None:
    """Refuse, at start-up, a backend that cannot read the KV storage dtype ``ctx.kv_dtype``;
    ``what`` names the backend as the user chose it (``--attention-backend toy``)."""
    if ctx.kv_dtype == ctx.dtype or ctx.kv_dtype in backend.supported_kv_dtypes:
        return
    names = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float8_e4m3fn: "fp8_e4m3",
             torch.float8_e5m2: "fp8_e5m2"}
    ok = ["auto"] + [names[d] for d in names if d in backend.supported_kv_dtypes]
    kv = names.get(ctx.kv_dtype, str(ctx.kv_dtype).removeprefix("torch."))
    act = str(ctx.dtype).removeprefix("torch.")
    raise ValueError(
        f"{what}: this attention backend cannot read a KV cache stored as {kv} (--kv-cache-dtype {kv}) "
        f"with {act} activations on {ctx.device.type}; it supports --kv-cache-dtype {', '.join(ok)} "
        f"(auto: the activation dtype). Choose one of those, or an attention backend that reads {kv} "
        f"(torch_native reads every --kv-cache-dtype)")
