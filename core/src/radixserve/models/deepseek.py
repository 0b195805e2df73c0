"""DeepSeek-V2 and DeepSeek-V3: multi-head latent attention (MLA) over a latent KV cache,
dense first layers, MoE layers with shared experts and grouped top-k routing.

**MLA.** Per token the layer caches one latent row: ``c_kv`` (``kv_lora_rank`` dims, the
compressed K and V after ``kv_a_layernorm``) followed by the rotary key ``k_pe``
(``qk_rope_head_dim`` dims, after RoPE), shared by every head: the pool holds one KV "head" of
``kv_lora_rank + qk_rope_head_dim`` dims and V is its first ``kv_lora_rank`` dims
(:class:`~radixserve.mem.kv_pool.KVPool` with ``v_head_dim``). Each head's key is
``[W_UK c_kv | k_pe]`` and its value ``W_UV c_kv``, ``W_UK``/``W_UV`` being the two parts of
``kv_b_proj``. Two ways to attend, as in DeepSeek-V2's paper:

* **expanded** (a prefill step with no cached prefix): ``kv_b_proj`` expands the new tokens'
  latents into per-head K (``qk_nope_head_dim + qk_rope_head_dim``) and V (``v_head_dim``),
  and the backend's :meth:`~radixserve.layers.attention.AttentionBackend.forward_mla_prefill`
  attends over them; the latents are written to the pool;
* **absorbed** (decode, and extends over a cached prefix): ``W_UK`` is folded into the query
  (``q_nope W_UK`` per head, ``kv_lora_rank`` dims) so every head attends over the latent rows
  themselves, an MQA of one KV head whose V is the latent (``AttentionLayer.v_head_dim``);
  ``W_UV`` turns the attention output back into each head's value space.

The softmax scale is ``(qk_nope_head_dim + qk_rope_head_dim) ** -0.5``, times YaRN's
``mscale(factor, mscale_all_dim) ** 2`` under YaRN scaling. RoPE rotates pairs of adjacent
dims (DeepSeek's interleaved layout; V3 with ``rope_interleave`` false: the half-split one).

**MoE.** Layers from ``first_k_dense_replace`` on are sparse: ``n_routed_experts`` experts
through the ``--moe-runner-backend`` and transport like any :class:`SparseMoE`, plus
``n_shared_experts`` shared experts as one MLP added to every token. Routing (as transformers
defines it): V2 takes the top-k of the softmax scores, within the ``topk_group`` groups of
highest maximum with ``topk_method: group_limited_greedy``; V3 scores with a sigmoid, picks
the ``topk_group`` groups by the sum of their two best scores plus ``e_score_correction_bias``
(noaux_tc) and the top-k within them by the same biased score, weights by the unbiased scores,
renormalised with ``norm_topk_prob``; both scale the weights by ``routed_scaling_factor``.

Tensor parallelism splits the query heads (and with them ``q_b_proj``/``q_proj``,
``kv_b_proj`` and ``o_proj``); the latent row is replicated on every rank.
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.distributed import get_parallel_state
from radixserve.distributed.partition import partition_heads
from radixserve.layers.attention import AttentionBackend, AttentionLayer, ForwardBatch, ForwardMode
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import ColumnParallelLinear, Linear, RowParallelLinear
from radixserve.layers.moe import SparseMoE
from radixserve.layers.rotary import rope_kind, rotate, yarn_mscale
from radixserve.models.config import ModelConfig
from radixserve.models.llama import MLP, mark_loaded
from radixserve.models.moe import MoEForCausalLM


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE over adjacent pairs ``(x0, x1), (x2, x3), ...`` (DeepSeek's layout), written out as
    ``[rotated evens | rotated odds]``; q and k get the same permutation, so their products
    are the interleaved rotation's."""
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class MLAAttention(nn.Module):
    """DeepSeek's multi-head latent attention (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        ps = get_parallel_state()
        heads = partition_heads(cfg.num_attention_heads, 1, ps.tp_size, ps.tp_rank)
        h, h0, full = heads.num_heads, heads.q_start, cfg.num_attention_heads
        self.num_heads = h
        self.rank, self.nope, self.rope = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim = cfg.v_head_dim
        qk = self.nope + self.rope
        q_rows = (full * qk, h0 * qk, h * qk)
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.hidden_size, cfg.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, {"": q_rows})
            self.q_proj = None
        else:
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
            self.q_proj = ColumnParallelLinear(cfg.hidden_size, {"": q_rows})
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, self.rank + self.rope, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, cfg.rms_norm_eps)
        # this rank's heads of kv_b_proj, [h, nope + v, rank]: W_UK rows then W_UV rows per head,
        # kept plain (both forms multiply by parts of it)
        self.kv_b_proj = nn.Parameter(torch.empty(h * (self.nope + self.v_dim), self.rank))
        self.kv_b_rows = (full * (self.nope + self.v_dim), h0 * (self.nope + self.v_dim))
        self.o_proj = RowParallelLinear(full * self.v_dim, cfg.hidden_size, bias=cfg.attention_bias,
                                        shard=(full * self.v_dim, h0 * self.v_dim, h * self.v_dim))
        scaling = qk ** -0.5
        scale_cfg = cfg.rope_scaling
        if rope_kind(scale_cfg) == "yarn" and scale_cfg.get("mscale_all_dim"):
            scaling *= yarn_mscale(scale_cfg["factor"], scale_cfg["mscale_all_dim"]) ** 2
        self.interleaved = cfg.architecture == "DeepseekV2ForCausalLM" or bool(cfg.raw.get("rope_interleave", True))
        # absorbed: one latent KV head, V its first kv_lora_rank dims; expanded: h heads of their own
        self.layer = AttentionLayer(layer_id, h, 1, self.rank + self.rope, scaling, v_head_dim=self.rank)
        self.expanded = AttentionLayer(layer_id, h, h, qk, scaling, v_head_dim=self.v_dim)
        self.backend: AttentionBackend | None = None  # set by the runner

    def _rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        cos, sin = rope  # [T, 1, rope / 2]
        return rotate_pairs(x, cos, sin) if self.interleaved else rotate(x, cos, sin)

    def forward(self, x: torch.Tensor, rope, batch: ForwardBatch) -> torch.Tensor:
        t, h = x.shape[0], self.num_heads
        if self.q_proj is not None:
            q = self.q_proj.forward(x)
        else:
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x)))
        q = q.view(t, h, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa.forward(x).split([self.rank, self.rope], dim=-1)
        c = self.kv_a_layernorm.forward(c.contiguous())  # [T, rank]
        q_pe = self._rotate(q_pe, rope)
        k_pe = self._rotate(k_pe.unsqueeze(1), rope)  # [T, 1, rope]
        latent = torch.cat([c.unsqueeze(1), k_pe], dim=-1)  # [T, 1, rank + rope]: what the pool holds
        w = self.kv_b_proj.view(h, self.nope + self.v_dim, self.rank)
        w_uk, w_uv = w[:, :self.nope], w[:, self.nope:]  # [h, nope, rank], [h, v, rank]
        if expanded_prefill(batch):
            batch.kv_pool.set_kv(self.layer.layer_id, batch.out_cache_loc, latent, None)
            kv = torch.einsum("tr,hdr->thd", c, w)  # [T, h, nope + v]
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat([k_nope, k_pe.expand(t, h, self.rope)], dim=-1)
            o = self.backend.forward_mla_prefill(torch.cat([q_nope, q_pe], dim=-1), k, v.contiguous(),
                                                 self.expanded, batch)  # [T, h, v]
        else:
            q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # W_UK folded into the query
            o = self.backend.forward(torch.cat([q_lat, q_pe], dim=-1), latent, latent[..., :self.rank],
                                     self.layer, batch)  # [T, h, rank]
            o = torch.einsum("thr,hvr->thv", o, w_uv)  # [T, h, v]
        return self.o_proj.forward(o.reshape(t, h * self.v_dim))

    @torch.no_grad()
    def load_kv_b(self, tensor: torch.Tensor, name: str) -> None:
        full, start = self.kv_b_rows
        if tuple(tensor.shape) != (full, self.rank):
            raise ValueError(f"checkpoint tensor {name!r} of shape {tuple(tensor.shape)}: expected ({full}, "
                             f"{self.rank})")
        self.kv_b_proj.copy_(tensor[start:start + self.kv_b_proj.shape[0]])


def expanded_prefill(batch: ForwardBatch) -> bool:
    """Whether MLA attends in the expanded form this step: an extend whose requests have no
    cached prefix (anything else reads latents from the pool: the absorbed form)."""
    return batch.mode is ForwardMode.EXTEND and not any(batch.prefix_lens_cpu)


class DeepseekMoE(SparseMoE):
    """Routed experts with DeepSeek's router, plus the shared experts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                         renormalize=False)
        raw = cfg.raw
        self.v3 = cfg.architecture == "DeepseekV3ForCausalLM"
        self.grouped = self.v3 or raw.get("topk_method") == "group_limited_greedy"
        if not self.v3 and raw.get("topk_method", "greedy") not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"DeepSeek-V2 topk_method {raw.get('topk_method')!r}: supported greedy, "
                             "group_limited_greedy")
        self.n_group, self.topk_group = int(raw.get("n_group") or 1), int(raw.get("topk_group") or 1)
        if self.grouped and cfg.num_experts % self.n_group:
            raise ValueError(f"n_group {self.n_group} does not divide the {cfg.num_experts} routed experts")
        self.norm_topk = self.v3 and cfg.norm_topk_prob  # (V2's router never renormalises)
        self.scale = float(raw.get("routed_scaling_factor") or 1.0)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(cfg.num_experts)) if self.v3 else None
        shared = cfg.shared_expert_intermediate_size
        self.shared_experts = MLP(cfg, shared, reduce_results=False) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()  # [T, E]
        t, e = logits.shape
        scores = logits.sigmoid() if self.v3 else logits.softmax(dim=-1)
        choice = scores + self.e_score_correction_bias.float() if self.v3 else scores
        if self.grouped:
            per_group = choice.view(t, self.n_group, e // self.n_group)
            group_score = per_group.topk(2, dim=-1).values.sum(-1) if self.v3 else per_group.amax(dim=-1)
            keep = torch.zeros_like(group_score, dtype=torch.bool)
            keep.scatter_(1, group_score.topk(self.topk_group, dim=-1).indices, True)
            keep = keep.unsqueeze(-1).expand(t, self.n_group, e // self.n_group).reshape(t, e)
            choice = choice.masked_fill(~keep, float("-inf") if self.v3 else 0.0)
        ids = choice.topk(self.top_k, dim=-1).indices
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids.to(torch.int32), weights * self.scale

    def shared_output(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.shared_experts.forward(x) if self.shared_experts is not None else None  # this rank's part

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_with_shared(x)


class DeepseekV2ForCausalLM(MoEForCausalLM):
    """DeepSeek-V2 (and V2-Lite: no ``q_lora_rank``): MLA, softmax routing."""

    rotary_kernel = False  # MLA rotates its own rotary dims with the step's (cos, sin) rows

    @staticmethod
    def rotary_dim(cfg: ModelConfig) -> int:
        return cfg.qk_rope_head_dim

    def build_attention(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        return MLAAttention(cfg, layer_id)

    def build_mlp(self, cfg: ModelConfig, layer_id: int) -> nn.Module:
        if not cfg.is_sparse_layer(layer_id):
            return MLP(cfg)
        return DeepseekMoE(cfg)

    def load_tensor(self, name, tensor, modules, params, loaded) -> None:
        if name.endswith(".self_attn.kv_b_proj.weight"):
            modules[name.removesuffix(".kv_b_proj.weight")].load_kv_b(tensor, name)
            mark_loaded(loaded, name.removesuffix(".weight"), name)  # a plain parameter
            return
        if name.endswith(".self_attn.q_proj.weight"):  # V2-Lite's one q projection (not part of a fused QKV)
            module = name.removesuffix(".weight")
            modules[module].load("weight", tensor)
            mark_loaded(loaded, name, name)
            return
        name = name.replace(".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias")
        super().load_tensor(name, tensor, modules, params, loaded)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """DeepSeek-V3: V2's MLA, sigmoid routing with the score-correction bias."""


ARCHITECTURES = {
    "DeepseekV2ForCausalLM": DeepseekV2ForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
}
