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
# DeepSeek (MLA attention, MoE with shared experts), built like the MoE variants.
_MLA = dict(num_hidden_layers=3, num_key_value_heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
            v_head_dim=16, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            first_k_dense_replace=1)
_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
         "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.8}
MLA_VARIANTS = {
    # V2-Lite: q projected directly (no q_lora_rank), softmax top-2 of 8, two shared experts, layer 0 dense
    "deepseek_v2_lite": ("DeepseekV2Config", dict(_MLA, q_lora_rank=None, n_shared_experts=2, topk_method="greedy"),
                         None),
    # V2: q through its low-rank pair, group-limited routing (2 of 4 groups), scaled weights, YaRN
    "deepseek_v2": ("DeepseekV2Config", dict(_MLA, q_lora_rank=48, n_shared_experts=1,
                                             topk_method="group_limited_greedy", n_group=4, topk_group=2,
                                             routed_scaling_factor=2.0, rope_parameters=_YARN), None),
    # V3: sigmoid scores with the correction bias (noaux_tc), groups by their top-2 sum, renormalised
    # and scaled weights, YaRN with mscale_all_dim (the softmax scale too)
    "deepseek_v3": ("DeepseekV3Config", dict(_MLA, q_lora_rank=48, n_shared_experts=1, n_group=4, topk_group=2,
                                             routed_scaling_factor=2.5, norm_topk_prob=True,
                                             rope_parameters=_YARN), None),
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
            elif name.endswith("mlp.gate.weight"):  # MoE router [E, H] (sigmoid scores: kept off saturation)
                scale = 1.0 if getattr(model.config, "model_type", "") == "deepseek_v3" else ROUTER_SCALE
                p.copy_(scale * noise / math.sqrt(p.shape[-1]))
            else:  # [out, in], or [E, out, in] for stacked experts
                p.copy_(noise / math.sqrt(p.shape[-1]))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias (a buffer there)
                b.copy_(0.1 * torch.randn(b.shape, generator=g))


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
    """Save a random-weight ``variant`` (a key of VARIANTS, MOE_VARIANTS or MLA_VARIANTS) with a word-level tokenizer to
    ``path``; returns the transformers model."""
    import transformers
    from transformers import AutoModelForCausalLM

    config_cls, variant_overrides, default_shard = {**VARIANTS, **MOE_VARIANTS, **MLA_VARIANTS}[variant]
    config = getattr(transformers, config_cls)(**{**_COMMON, **variant_overrides, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    randomize(model, seed)
    shard = shard_size or default_shard
    model.save_pretrained(path, safe_serialization=True, **({"max_shard_size": shard} if shard else {}))
    save_tokenizer(path)
    return model


def build_lora_adapter(path: str, base: torch.nn.Module, rank: int, alpha: int, targets: list[str], seed: int,
                       scale: float = 4.0):
    """Save a PEFT LoRA adapter with random weights (times ``scale``, so it changes greedy tokens)
    over a copy of the transformers model ``base`` to ``path``; returns the ``PeftModel`` (the
    oracle: base plus the adapter)."""
    import copy

    import peft

    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                             lora_dropout=0.0)
    torch.manual_seed(seed)
    model = peft.get_peft_model(copy.deepcopy(base), config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.mul_(scale)
    model.save_pretrained(path)
    return model.eval()


def greedy(model: torch.nn.Module, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy tokens of ``model`` for each prompt (no EOS)."""
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def random_prompts(num: int, length: int, seed: int = 0) -> list[list[int]]:
    """``num`` prompts of ``length`` random token ids (no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(num)]


# transformers model_type -> llama.cpp arch name (Mixtral is "llama" with experts)
GGUF_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mixtral": "llama",
              "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}
_GGUF_LAYER = {  # transformers in-memory name after "model.layers.N." -> llama.cpp name after "blk.N."
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}


def round_to_f16(model: torch.nn.Module) -> None:
    """Round every weight to float16 and back, so a float16 GGUF holds exactly the model's weights."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.half().float())


def save_gguf(model: torch.nn.Module, path: str, per_expert: bool = False, matrix_type: str = "F16") -> None:
    """Write a transformers Llama/Qwen/Mixtral/Qwen-MoE model as a GGUF file under llama.cpp's
    tensor and metadata names: matrices float16 (call :func:`round_to_f16` first for an exact
    copy; ``matrix_type="BF16"``: bfloat16, round to bfloat16 first), vectors float32, q/k
    rows of arch ``llama`` interleaved as llama.cpp's converter does, experts as stacked 3-D
    ``ffn_*_exps`` tensors (``per_expert``: one ``ffn_*.E`` tensor per expert, as older Mixtral
    files hold them). No tokenizer: pass the HF
    directory as ``tokenizer_path``."""
    import gguf
    import numpy as np

    cfg = model.config
    arch = GGUF_ARCHS[cfg.model_type]
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_vocab_size(cfg.vocab_size)
    w.add_eos_token_id(EOS)
    num_experts = getattr(cfg, "num_local_experts", None) or getattr(cfg, "num_experts", 0)
    if num_experts:
        w.add_expert_count(num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
        if getattr(cfg, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)

    def permute(t: torch.Tensor, n_head: int) -> torch.Tensor:  # each head's rows: halves -> pairs
        return t.reshape(n_head, 2, t.shape[0] // n_head // 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape)

    def add(name: str, t: torch.Tensor) -> None:
        t = t.detach().float()
        if t.dim() > 1 and matrix_type == "BF16":
            bf16 = gguf.GGMLQuantizationType.BF16
            w.add_tensor(name, gguf.quants.quantize(t.numpy(), bf16), raw_dtype=bf16)
            return
        w.add_tensor(name, t.numpy().astype(np.float16 if t.dim() > 1 else np.float32))

    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # a tied model has no output.weight (as llama.cpp's converter writes it)
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            add({"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}[name], t)
            continue
        _, _, layer, rest = name.split(".", 3)
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            inter = t.shape[1] // 2  # gate_up [E, 2I, H]: gate rows, then up rows; down [E, H, I]
            parts = ({"gate": t[:, :inter], "up": t[:, inter:]} if rest.endswith("gate_up_proj")
                     else {"down": t})
            for proj, stacked in parts.items():
                if per_expert:
                    for e in range(stacked.shape[0]):
                        add(f"blk.{layer}.ffn_{proj}.{e}.weight", stacked[e])
                else:
                    add(f"blk.{layer}.ffn_{proj}_exps.weight", stacked)
            continue
        if arch == "llama" and rest in ("self_attn.q_proj.weight", "self_attn.k_proj.weight"):
            t = permute(t, heads if "q_proj" in rest else kv_heads)
        add(f"blk.{layer}.{_GGUF_LAYER[rest]}", t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
