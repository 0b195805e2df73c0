"""Tiny random-weight checkpoints built from transformers configs, shared by the tests."""

from __future__ import annotations

import math

import torch

VOCAB = 300
BOS, EOS = 1, 2
_COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=BOS, eos_token_id=EOS, rms_norm_eps=1e-6)

VARIANTS = {
    "llama": ("LlamaConfig", dict(head_dim=16, rope_theta=10000.0), None),
    "llama3_rope": ("LlamaConfig", dict(
        head_dim=16, rope_theta=10000.0, num_hidden_layers=3,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}), None),
    "llama_tied": ("LlamaConfig", dict(head_dim=16, tie_word_embeddings=True), None),
    "llama_sharded": ("LlamaConfig", dict(head_dim=16, rope_theta=500000.0), "40KB"),
    "qwen2": ("Qwen2Config", dict(rope_theta=1000000.0), None),  # qkv bias
    "qwen3": ("Qwen3Config", dict(head_dim=24, rope_theta=1000000.0), None),  # q/k norm, H*D != hidden
}

# Sparse MoE variants (kept apart from VARIANTS, which the dense-model tests run over).
MOE_VARIANTS = {
    # every layer sparse, top-2 of 4, always renormalised; sharded (index json), Mixtral's
    # block_sparse_moe.experts.E.w1/w2/w3 names on disk
    "mixtral": ("MixtralConfig", dict(
        head_dim=16, rope_theta=1000000.0, num_local_experts=4, num_experts_per_tok=2, intermediate_size=96),
        "100KB"),
    # QKV bias, shared expert with its sigmoid gate, top-4 of 8 not renormalised; layer 1 dense
    # (mlp_only_layers) with the dense intermediate_size, layers 0 and 2 sparse
    "qwen2_moe": ("Qwen2MoeConfig", dict(
        num_hidden_layers=3, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=4,
        moe_intermediate_size=32, shared_expert_intermediate_size=80, norm_topk_prob=False,
        mlp_only_layers=[1]), None),
    # q/k norm, top-2 of 8 renormalised; decoder_sparse_step 2: layers 1 and 3 sparse, 0 and 2 dense
    "qwen3_moe": ("Qwen3MoeConfig", dict(
        num_hidden_layers=4, head_dim=16, rope_theta=1000000.0, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=48, norm_topk_prob=True, decoder_sparse_step=2), None),
}
ROUTER_SCALE = 4.0  # router logits ~N(0, 16): top-k choices stand well apart, no near-ties


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations and well-separated logits; norms and biases not trivial."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith(".bias"):
                p.copy_(0.5 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            elif name.endswith("mlp.gate.weight"):  # MoE router [E, H]
                p.copy_(ROUTER_SCALE * noise / math.sqrt(p.shape[-1]))
            else:  # [out, in], or [E, out, in] for stacked experts
                p.copy_(noise / math.sqrt(p.shape[-1]))


def save_tokenizer(path: str) -> None:
    """A word-level tokenizer over ``<unk> <s> </s> w3 .. w299``: the engine needs one to load."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": BOS, "</s>": EOS, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)




def build_checkpoint(path: str, variant: str = "llama", seed: int = 0, shard_size: str | None = None,
                     **overrides) -> torch.nn.Module:
    """Save a random-weight ``variant`` (a key of VARIANTS or MOE_VARIANTS) with a word-level tokenizer to
    ``path``; returns the transformers model."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_cls, variant_overrides, default_shard = {**VARIANTS, **MOE_VARIANTS}[variant]
    config = getattr(transformers, config_cls)(**{**_COMMON, **variant_overrides, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    shard = shard_size or default_shard
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(path)
    return model


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(num)]
