"""The model facts the engine needs, read from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    # sparse MoE (0 experts: a dense model)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # per routed expert
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    norm_topk_prob: bool = False  # renormalise the top-k routing weights to sum to one
    decoder_sparse_step: int = 1  # layer i is sparse when (i + 1) % step == 0 ...
    mlp_only_layers: list[int] = field(default_factory=list)  # ... and i is not listed here
    # MLA (DeepSeek-V2/V3): the KV cache holds one latent "head" of kv_lora_rank + qk_rope_head_dim
    # per token (head_dim above, num_key_value_heads 1), V being its first kv_lora_rank dims;
    # 0: ordinary attention
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: q projected from the hidden state directly (V2-Lite)
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    raw: dict[str, Any] = field(default_factory=dict)

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    def is_sparse_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id`` has a sparse MoE block (else a dense MLP of
        ``intermediate_size``), by the rule the Qwen-MoE configs define."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        if not archs:
            raise ValueError("config.json has no 'architectures' entry; cannot pick a model class")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        rope_params = cfg.get("rope_parameters") or {}
        rope_scaling = cfg.get("rope_scaling") or None
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = rope_params
        theta = cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        eos = cfg.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        sliding = cfg.get("sliding_window") if cfg.get("use_sliding_window", False) else None
        if archs[0] in _MLA_ARCHS:
            return cls(architecture=archs[0], vocab_size=cfg["vocab_size"], hidden_size=hidden,
                       intermediate_size=cfg["intermediate_size"], num_hidden_layers=cfg["num_hidden_layers"],
                       num_attention_heads=heads, max_position_embeddings=cfg.get("max_position_embeddings", 2048),
                       rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_theta=float(theta), rope_scaling=rope_scaling,
                       tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                       attention_bias=bool(cfg.get("attention_bias", False)), hidden_act=cfg.get("hidden_act", "silu"),
                       bos_token_id=cfg.get("bos_token_id"), eos_token_ids=eos_ids, raw=cfg, **_mla_fields(cfg))
        return cls(
            architecture=archs[0],
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", cfg.get("qkv_bias", archs[0] in _QKV_BIAS_ARCHS))),
            hidden_act=cfg.get("hidden_act", "silu"),
            sliding_window=sliding,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_moe_fields(cfg, archs[0]),
            raw=cfg,
        )


# DeepSeek's multi-head latent attention
_MLA_ARCHS = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


def _mla_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3's attention and MoE fields: the latent cache row (``kv_lora_rank +
    qk_rope_head_dim``, one KV head), routed experts in every layer from
    ``first_k_dense_replace`` on, ``n_shared_experts`` shared experts as one MLP."""
    freq = int(cfg.get("moe_layer_freq") or 1)
    if freq != 1:
        raise ValueError(f"moe_layer_freq {freq}: only DeepSeek models with a MoE block in every layer after "
                         "first_k_dense_replace are supported")
    rank, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
    experts = int(cfg.get("n_routed_experts") or 0)
    moe = dict(num_experts=experts, num_experts_per_tok=int(cfg.get("num_experts_per_tok") or 0),
               moe_intermediate_size=int(cfg.get("moe_intermediate_size") or 0),
               shared_expert_intermediate_size=int(cfg.get("moe_intermediate_size") or 0)
               * int(cfg.get("n_shared_experts") or 0),
               norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
               mlp_only_layers=list(range(int(cfg.get("first_k_dense_replace") or 0)))) if experts else {}
    return dict(num_key_value_heads=1, head_dim=rank + rope, kv_lora_rank=rank, q_lora_rank=cfg.get("q_lora_rank"),
                qk_nope_head_dim=int(cfg["qk_nope_head_dim"]), qk_rope_head_dim=rope,
                v_head_dim=int(cfg["v_head_dim"]), **moe)


# architectures whose attention has QKV bias when the config does not say
_QKV_BIAS_ARCHS = ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """The sparse-MoE fields of a config.json: Mixtral's experts are ``intermediate_size``
    wide and always renormalised; the Qwen-MoE family says ``moe_intermediate_size`` and
    ``norm_topk_prob``. The expert count is ``num_experts`` or ``num_local_experts`` (the
    name transformers 5 saves for both families)."""
    if arch == "MixtralForCausalLM":
        return dict(num_experts=int(cfg["num_local_experts"]), num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True)
    num = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers 5 writes the latter
    if num == 0:
        return {}
    return dict(num_experts=num, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                decoder_sparse_step=int(cfg.get("decoder_sparse_step") or 1),
                mlp_only_layers=[int(i) for i in cfg.get("mlp_only_layers") or []])
