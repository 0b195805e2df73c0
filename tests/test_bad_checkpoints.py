"""A checkpoint the engine cannot serve is refused before any weight is read, with a
message that says what is wrong: the unsupported architecture (and the supported ones),
the missing weights, the missing tokenizer, a config.json that lacks a field."""

from __future__ import annotations

import json

import pytest
import radixserve
from radixserve.model_loader import load_checkpoint
from tiny_models import build_checkpoint

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 16,
         "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
         "num_key_value_heads": 2, "max_position_embeddings": 64}


def _dir(tmp_path, config, files=()):
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in files:
        (tmp_path / name).write_bytes(b"")
    return str(tmp_path)


def test_unsupported_architecture_names_it_and_the_supported_ones(tmp_path):
    path = _dir(tmp_path, {"architectures": ["GPT2LMHeadModel"], "n_embd": 16}, ["model.safetensors"])
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*not supported; supported: .*LlamaForCausalLM"):
        radixserve.Engine(path)


def test_directory_without_weights(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"has config.json but no weights \(\*.safetensors"):
        load_checkpoint(_dir(tmp_path, LLAMA))


def test_config_without_architectures(tmp_path):
    with pytest.raises(ValueError, match="no 'architectures'"):
        load_checkpoint(_dir(tmp_path, {"model_type": "llama"}, ["model.safetensors"]))


def test_config_missing_a_field(tmp_path):
    cfg = dict(LLAMA)
    del cfg["num_attention_heads"]
    with pytest.raises(ValueError, match="lacks 'num_attention_heads'"):
        load_checkpoint(_dir(tmp_path, cfg, ["model.safetensors"]))


def test_directory_without_a_tokenizer(tmp_path):
    path = str(tmp_path / "m")
    build_checkpoint(path, "llama", seed=0)
    for f in (tmp_path / "m").iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "vocab")):
            f.unlink()
    with pytest.raises(FileNotFoundError, match="has no tokenizer .*--tokenizer-path"):
        radixserve.Engine(path)
