"""A draft cut from the target: its first decoder layers, final norm and LM head.

The result is a smaller model with the target's tokenizer, written as a Hugging Face
directory (``config.json``, ``model.safetensors``, the tokenizer), loadable by
``--speculative-draft-model-path``. Its hidden states after layer ``N`` go straight to the
final norm (early exit), so it predicts the target's next token less well than a trained
draft, but costs about ``N / num_hidden_layers`` of the target's layers.
"""

from __future__ import annotations

import json
import os
import re

import torch

_MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.")


def _hf_config(ckpt, num_layers: int) -> dict:
    cfg = ckpt.config
    if ckpt.format == "hf":
        raw = dict(cfg.raw)
        if isinstance(raw.get("layer_types"), list):
            raw["layer_types"] = raw["layer_types"][:num_layers]
    else:
        raw = {
            "architectures": [cfg.architecture], "model_type": _MODEL_TYPES.get(cfg.architecture, "llama"),
            "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_attention_heads": cfg.num_attention_heads,
            "num_key_value_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position_embeddings, "rms_norm_eps": cfg.rms_norm_eps,
            "rope_theta": cfg.rope_theta, "rope_scaling": cfg.rope_scaling,
            "tie_word_embeddings": cfg.tie_word_embeddings, "attention_bias": cfg.attention_bias,
            "hidden_act": cfg.hidden_act, "bos_token_id": cfg.bos_token_id,
            "eos_token_id": cfg.eos_token_ids[0] if len(cfg.eos_token_ids) == 1 else cfg.eos_token_ids,
        }
    raw["num_hidden_layers"] = num_layers
    return raw


def write_layerskip_draft(src: str | None, out: str, num_layers: int, dtype: torch.dtype = torch.float32) -> str:
    """Write the first ``num_layers`` decoder layers of the checkpoint ``src`` (default:
    the shipped model) plus its final norm, LM head and tokenizer to the directory ``out``.
    Returns ``out``."""
    from radixserve.plugin_api.speculative import load_checkpoint, load_tokenizer
    from safetensors.torch import save_file

    ckpt = load_checkpoint(src)
    total = ckpt.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in [1, {total}] (the checkpoint's decoder layers), got {num_layers}")
    tensors = {}
    for name, tensor in ckpt.weights():
        m = _LAYER.match(name)
        if m and int(m.group(1)) >= num_layers:
            continue
        if name == "lm_head.weight" and ckpt.config.tie_word_embeddings:
            continue
        tensors[name] = tensor.to(dtype).contiguous()
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out, "config.json"), "w") as fh:
        json.dump(_hf_config(ckpt, num_layers), fh, indent=2)
    load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file, None).hf.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="directory to write")
    parser.add_argument("--model", default=None, help="source checkpoint (default: the shipped SmolLM2 GGUF)")
    parser.add_argument("--num-layers", type=int, default=8, help="decoder layers to keep (default 8)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    a = parser.parse_args(argv)
    path = write_layerskip_draft(a.model, a.out, a.num_layers, getattr(torch, a.dtype))
    print(path)


if __name__ == "__main__":
    main()
