"""The EAGLE-3 draft head (``LlamaForCausalLMEagle3``): its configuration and its math.

A head is one Llama decoder layer whose attention reads a ``2H``-wide input, in front of
a final norm and an LM head over a smaller *draft* vocabulary. It runs on the target's
own hidden states: the outputs of three target layers (low, middle, high; config
``eagle_config.eagle_aux_hidden_state_layer_ids``, by default ``[1, L//2 - 1, L - 4]``)
concatenated in that order. One draft row carries the target's hidden state of token
``j`` and the (target's) embedding of token ``j + 1``, sits at RoPE position ``j`` and
predicts token ``j + 2``::

    h   = fc(aux)                      # [T, H]  from [T, 3H]; later steps: the previous h2
    a   = cat(input_layernorm(embed(next_ids)), hidden_norm(h))   # [T, 2H], embeds first
    h1  = h + o_proj(attention(q_proj(a), k_proj(a), v_proj(a)))  # GQA, RoPE, causal
    h2  = h1 + mlp(post_attention_layernorm(h1))                   # fed to the next step
    logits = lm_head(norm(h2))         # [T, Vd]; target id = draft id + d2t[draft id]

Parameter names are the checkpoint's (see :mod:`radixserve_speculative_eagle3.checkpoint`),
so a loaded state dict maps one to one. Attention is a callable handed to
:meth:`Eagle3Head.forward`: radixserve's attention backend over the draft KV pool when
serving, the training-time-test attention when training.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from radixserve.plugin_api.speculative import (
    Linear,
    ModelConfig,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary,
)
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"

# q, k, v  # [T, H, D], [T, Hkv, D], [T, Hkv, D]  ->  o  # [T, H, D]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers (0-based) whose outputs feed the head when its config names none."""
    n = num_target_layers
    return 1, n // 2 - 1, n - 4


@dataclass(frozen=True)
class Eagle3Config:
    """What the head needs from its config.json."""

    hidden_size: int
    target_hidden_size: int  # width of each aux hidden state (fc reads 3x this)
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    vocab_size: int  # the target's
    draft_vocab_size: int
    fc_bias: bool
    aux_layer_ids: tuple[int, ...] | None  # None: default_aux_layers(target layers)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> Eagle3Config:
        base = ModelConfig.from_hf_dict(cfg)
        eagle = cfg.get("eagle_config") or {}
        aux = eagle.get("eagle_aux_hidden_state_layer_ids")
        return cls(
            hidden_size=base.hidden_size,
            target_hidden_size=cfg.get("target_hidden_size") or base.hidden_size,
            intermediate_size=base.intermediate_size,
            num_attention_heads=base.num_attention_heads,
            num_key_value_heads=base.num_key_value_heads,
            head_dim=base.head_dim,
            rms_norm_eps=base.rms_norm_eps,
            rope_theta=base.rope_theta,
            rope_scaling=base.rope_scaling,
            vocab_size=base.vocab_size,
            draft_vocab_size=cfg.get("draft_vocab_size") or base.vocab_size,
            fc_bias=bool(cfg.get("bias", False)),
            aux_layer_ids=None if aux is None else tuple(int(i) for i in aux),
        )


class Eagle3Attention(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = Linear(2 * h, self.num_heads * d)
        self.k_proj = Linear(2 * h, self.num_kv_heads * d)
        self.v_proj = Linear(2 * h, self.num_kv_heads * d)
        self.o_proj = Linear(self.num_heads * d, h)

    def forward(self, a: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        t = a.shape[0]
        q = self.q_proj(a).view(t, self.num_heads, self.head_dim)  # [T, H, D]
        k = self.k_proj(a).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(a).view(t, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, rope)
        o = attend(q, k, v)  # [T, H, D]
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Eagle3Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = Eagle3MLP(cfg)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope, attend: Attend) -> torch.Tensor:
        a = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)  # [T, 2H]
        h1 = hidden + self.self_attn(a, rope, attend)
        return h1 + self.mlp(self.post_attention_layernorm(h1))  # [T, H], before the final norm


class Eagle3Head(nn.Module):
    """The draft head. Its token embedding is the target's (:meth:`set_embed`), never a
    parameter of its own; ``d2t`` and ``t2d`` map the draft vocabulary to the target's."""

    def __init__(self, cfg: Eagle3Config) -> None:
        super().__init__()
        self.config = cfg
        self.fc = Linear(3 * cfg.target_hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(cfg.vocab_size, dtype=torch.bool))
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = None  # ids [T] -> [T, H], the target's
        self.rotary: RotaryEmbedding | None = None  # build_rotary()

    def set_embed(self, embed: torch.Tensor | nn.Module) -> None:
        """Share the target's embedding (not copied, not trained): a ``[V, H]`` table, or the
        target's embedding module itself (``num_embeddings``/``embedding_dim``, called on ids),
        which is how a table kept in GGUF blocks is shared."""
        v, h = self.config.vocab_size, self.config.hidden_size
        if isinstance(embed, torch.Tensor):
            shape = tuple(embed.shape)
            self.embed = lambda ids: F.embedding(ids, embed)
        else:
            shape = (embed.num_embeddings, embed.embedding_dim)
            self.embed = lambda ids: embed(ids)  # a call, not a submodule: the table stays the target's
        if shape != (v, h):
            raise ValueError(f"the target's embedding is {shape}, the EAGLE-3 head expects ({v}, {h})")

    def build_rotary(self, max_positions: int) -> None:
        cfg = self.config
        device = self.fc.weight.device if self.fc.weight is not None else self.d2t.device
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling,
                                      torch.float32).to(device)

    def finalize(self, dtype: torch.dtype, device: torch.device, max_positions: int) -> None:
        """For serving, once the weights are placed: RoPE tables, packed linear layers."""
        self.build_rotary(max_positions)
        self.rotary.cos, self.rotary.sin = self.rotary.cos.to(dtype), self.rotary.sin.to(dtype)
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def project(self, aux: torch.Tensor) -> torch.Tensor:
        """``aux  # [T, 3 Ht]`` (the target's low, middle, high hidden states) -> ``[T, H]``."""
        return self.fc(aux)

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                attend: Attend) -> torch.Tensor:
        """One draft step over ``T`` rows: ``input_ids  # [T]`` (target ids of the next
        tokens), ``hidden  # [T, H]`` (projected aux states or the previous step's output),
        ``positions  # [T]``. Returns ``h2  # [T, H]``, the pre-norm output."""
        embeds = self.embed(input_ids)  # [T, H]
        rope = self.rotary(positions)
        return self.midlayer(embeds, hidden, rope, attend)

    def logits(self, h2: torch.Tensor) -> torch.Tensor:
        """``[T, Vd]`` draft-vocabulary logits (float32)."""
        return self.lm_head(self.norm(h2)).float()

    def to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary ids -> target ids."""
        return draft_ids + self.d2t[draft_ids]
