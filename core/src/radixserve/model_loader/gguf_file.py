"""Read a GGUF checkpoint: metadata -> ModelConfig, tensors -> dequantised HF-named tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from radixserve.models.config import ModelConfig

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

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
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def _field(reader, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


class GGUFCheckpoint:
    def __init__(self, path: str) -> None:
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(path)
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
        return ModelConfig(
            architecture=_ARCH[a],
            vocab_size=int(vocab),
            hidden_size=int(hidden),
            intermediate_size=int(_field(r, f"{a}.feed_forward_length")),
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
            raw={"gguf_architecture": a},
        )

    def weights(self, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        from gguf import dequantize

        for t in self.reader.tensors:
            name = t.name
            if name.startswith("blk."):
                _, layer, rest = name.split(".", 2)
                if rest not in _LAYER_NAMES:
                    raise ValueError(f"{self.path}: unexpected GGUF tensor {name!r}")
                hf = f"model.layers.{layer}.{_LAYER_NAMES[rest]}"
            elif name in _GLOBAL_NAMES:
                hf = _GLOBAL_NAMES[name]
            elif name == "rope_freqs.weight":
                continue
            else:
                raise ValueError(f"{self.path}: unexpected GGUF tensor {name!r}")
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            data = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            w = torch.from_numpy(np.ascontiguousarray(data)) if data.flags.writeable else torch.from_numpy(data.copy())
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
