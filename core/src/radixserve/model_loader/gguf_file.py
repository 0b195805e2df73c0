"""Read a GGUF checkpoint: metadata -> ModelConfig, tensors -> dequantised HF-named tensors.

Tensor and metadata names are llama.cpp's (gguf-py ``constants.py``). Sparse MoE: arches
``qwen2moe`` and ``qwen3moe``, and ``llama`` with ``llama.expert_count`` > 0 (Mixtral). A
layer is sparse when it has a router (``blk.N.ffn_gate_inp``); its experts are stacked 3-D
tensors ``ffn_{gate,up,down}_exps`` (older Mixtral files: one ``ffn_{gate,up,down}.E`` per
expert), Qwen2-MoE's shared expert ``ffn_{gate,up,down}_shexp`` with its gate
``ffn_gate_inp_shexp``. llama.cpp renormalises the top-k weights of ``llama`` and
``qwen3moe`` and not of ``qwen2moe`` unless ``{arch}.expert_weights_norm`` says otherwise.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from radixserve.models.config import ModelConfig

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_LLAMA_MOE = "MixtralForCausalLM"  # arch "llama" with experts
# whether llama.cpp renormalises the top-k routing weights of an arch (no expert_weights_norm key)
_NORM_TOPK = {"llama": True, "qwen2moe": False, "qwen3moe": True}

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # sparse MoE: router, stacked experts [E, rows, cols], Qwen2-MoE's shared expert and its gate
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.gate_proj",
    "ffn_up_exps.weight": "mlp.experts.up_proj",
    "ffn_down_exps.weight": "mlp.experts.down_proj",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
}
# HF names whose GGUF blocks a quantized model keeps: dense linear layers (not routed experts,
# routers or gates) and the embedding / LM head
_BLOCK_WEIGHTS = re.compile(r"^(model\.embed_tokens\.weight|lm_head\.weight|model\.layers\.\d+\."
                            r"(self_attn\.[qkvo]_proj|mlp\.(shared_expert\.)?(gate|up|down)_proj)\.weight)$")
_PER_EXPERT = re.compile(r"^ffn_(gate|up|down)\.(\d+)\.weight$")  # older Mixtral files: one tensor per expert
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default: Any = None) -> Any:
    return reader.fields.get(key, default)


class GGUFCheckpoint:
    def __init__(self, path: str) -> None:
        from radixserve.model_loader.gguf_reader import GGUFHeader

        self.path = path
        self.reader = GGUFHeader(path)
        self.gguf_arch = _field(self.reader, "general.architecture")
        if self.gguf_arch not in _ARCH:
            raise ValueError(f"{path}: GGUF architecture {self.gguf_arch!r} is not supported; "
                             f"supported: {', '.join(sorted(_ARCH))}")

    def config(self) -> ModelConfig:
        r, a = self.reader, self.gguf_arch
        names = {t.name for t in r.tensors}
        heads = _field(r, f"{a}.attention.head_count")
        hidden = _field(r, f"{a}.embedding_length")
        head_dim = _field(r, f"{a}.attention.key_length") or hidden // heads
        vocab = _field(r, f"{a}.vocab_size") or len(_field(r, "tokenizer.ggml.tokens"))
        rope_scaling = None
        if _field(r, f"{a}.rope.scaling.type") == "linear":
            rope_scaling = {"rope_type": "linear", "factor": _field(r, f"{a}.rope.scaling.factor")}
        eos = _field(r, "tokenizer.ggml.eos_token_id")
        moe = self._moe_config(names)
        arch = _LLAMA_MOE if a == "llama" and moe else _ARCH[a]
        if a in ("qwen2moe", "qwen3moe") and not moe:
            raise ValueError(f"{self.path}: GGUF architecture {a!r} without {a}.expert_count")
        ffn = _field(r, f"{a}.feed_forward_length") or _field(r, f"{a}.expert_feed_forward_length")
        return ModelConfig(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(ffn),
            num_hidden_layers=int(_field(r, f"{a}.block_count")),
            num_attention_heads=int(heads),
            num_key_value_heads=int(_field(r, f"{a}.attention.head_count_kv") or heads),
            head_dim=int(head_dim),
            max_position_embeddings=int(_field(r, f"{a}.context_length", 2048)),
            rms_norm_eps=float(_field(r, f"{a}.attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(_field(r, f"{a}.rope.freq_base", 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings="output.weight" not in names,
            attention_bias="blk.0.attn_q.bias" in names,
            bos_token_id=_field(r, "tokenizer.ggml.bos_token_id"),
            eos_token_ids=[int(eos)] if eos is not None else [],
            **moe,
            raw={"gguf_architecture": a},
        )

    def _moe_config(self, names: set[str]) -> dict[str, Any]:
        """The ModelConfig MoE fields from ``{arch}.expert_*`` metadata ({} for a dense model)."""
        r, a = self.reader, self.gguf_arch
        num = int(_field(r, f"{a}.expert_count") or 0)
        if num == 0:
            return {}
        layers = int(_field(r, f"{a}.block_count"))
        inter = _field(r, f"{a}.expert_feed_forward_length") or _field(r, f"{a}.feed_forward_length")
        shared = _field(r, f"{a}.expert_shared_feed_forward_length")
        if shared is None and "blk.0.ffn_gate_shexp.weight" in names:
            shared = next(int(t.shape[1]) for t in r.tensors if t.name == "blk.0.ffn_gate_shexp.weight")
        norm = _field(r, f"{a}.expert_weights_norm")
        return dict(num_experts=num, num_experts_per_tok=int(_field(r, f"{a}.expert_used_count")),
                    moe_intermediate_size=int(inter), shared_expert_intermediate_size=int(shared or 0),
                    norm_topk_prob=bool(_NORM_TOPK.get(a, False) if norm is None else norm),
                    mlp_only_layers=[i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" not in names])

    def weights(self, cfg: ModelConfig, keep_gguf_blocks: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named tensors. With ``keep_gguf_blocks``, the dense linear weights and the
        embedding/LM head of a block type that has a kernel, and those stored as float16 or
        bfloat16, come as :class:`~radixserve.quantization.GGUFTensor` (as stored); everything
        else, and everything without it, is dequantised to float32."""
        from gguf import dequantize

        from radixserve.kernels.gguf import HALF_TYPES, KERNEL_TYPES
        from radixserve.quantization import GGUFTensor

        for t in self.reader.tensors:
            name = t.name
            if name.startswith("blk."):
                _, layer, rest = name.split(".", 2)
                expert = _PER_EXPERT.match(rest)
                if expert is not None:
                    hf = f"model.layers.{layer}.mlp.experts.{expert[2]}.{expert[1]}_proj.weight"
                elif rest in _LAYER_NAMES:
                    hf = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
                else:
                    raise ValueError(f"{self.path}: unexpected GGUF tensor {name!r}")
            elif name in _GLOBAL_NAMES:
                hf = _GLOBAL_NAMES[name]
            elif name == "rope_freqs.weight":
                continue
            else:
                raise ValueError(f"{self.path}: unexpected GGUF tensor {name!r}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            qtype = int(t.tensor_type)
            kept = qtype in KERNEL_TYPES or qtype in HALF_TYPES
            if keep_gguf_blocks and kept and len(shape) == 2 and _BLOCK_WEIGHTS.match(hf):
                raw = self.reader.read(t)  # a fresh copy, read without mapping the file's pages in
                raw = raw.view(np.uint8) if qtype in HALF_TYPES else raw  # F16/BF16 data come typed: their bytes
                blocks = GGUFTensor(qtype, torch.from_numpy(raw), shape[1])
                if self.gguf_arch == "llama" and rest_is(name, ("attn_q.weight",)):
                    blocks = blocks.take_rows(_unpermute(torch.arange(shape[0]), cfg.num_attention_heads))
                elif self.gguf_arch == "llama" and rest_is(name, ("attn_k.weight",)):
                    blocks = blocks.take_rows(_unpermute(torch.arange(shape[0]), cfg.num_key_value_heads))
                yield hf, blocks
                continue
            data = np.asarray(dequantize(self.reader.read(t), t.tensor_type), dtype=np.float32).reshape(shape)
            w = torch.from_numpy(np.ascontiguousarray(data)) if data.flags.writeable else torch.from_numpy(data.copy())
            if rest_is(name, ("ffn_gate_inp_shexp.weight",)):
                w = w.reshape(1, -1)  # the shared expert's gate: [1, H], stored as [H] or [1, H]
            if self.gguf_arch == "llama" and rest_is(name, ("attn_q.weight", "attn_q.bias")):
                w = _unpermute(w, cfg.num_attention_heads)
            elif self.gguf_arch == "llama" and rest_is(name, ("attn_k.weight", "attn_k.bias")):
                w = _unpermute(w, cfg.num_key_value_heads)
            yield hf, w


def rest_is(name: str, suffixes: tuple[str, ...]) -> bool:
    return name.startswith("blk.") and name.split(".", 2)[2] in suffixes


def _unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's conversion, which interleaves the two RoPE halves of each head's rows."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)
