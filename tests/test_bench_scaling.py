"""benchmarks/bench_scaling.py writes GGUF files the engine reads as the weights it generated:
a tiny Llama written as Q8_0 and F16 loads with the declared shapes and gives the greedy tokens
of a transformers model holding the same weights as stored (quantized, then dequantized by
gguf-py), and the driver measures a file in its own process."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from engine_checks import leak_checked_engine

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "bench_scaling.py")


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_scaling", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("bench_scaling", module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load_script()
# larger weights than the benchmark's 0.02: logits stand apart, so greedy choices are no near-ties
TINY = dataclasses.replace(bench.MODELS["tiny"], scale=0.3)


@pytest.fixture(scope="module")
def tiny_files(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("bench_scaling"))
    return bench.write_models(TINY, ["Q8_0", "F16"], out, "tiny", seed=7)


def _oracle(quant: str):
    """transformers' Llama with the tiny model's weights as the file stores them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    s = TINY
    cfg = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                      num_hidden_layers=s.layers, num_attention_heads=s.heads, num_key_value_heads=s.kv_heads,
                      head_dim=s.head_dim, rms_norm_eps=s.rms_eps, rope_theta=s.rope_theta,
                      max_position_embeddings=s.context, tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg).float().eval()
    state = {}
    for i, (name, shape) in enumerate(bench.hf_shapes(s)):
        value = bench.hf_tensor(s, i, name, shape, seed=7)
        state[name] = torch.from_numpy(bench.stored_value(value, bench.ggml_type(name, shape, quant)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    model.tie_weights()
    return model


@pytest.mark.parametrize("quant", ["Q8_0", "F16"])
def test_written_file_loads_with_its_shapes_and_matches_transformers(tiny_files, quant):
    from radixserve.model_loader.gguf_reader import GGUFHeader

    path, s = tiny_files[quant], TINY
    header = GGUFHeader(path)
    types = {t.name: t.tensor_type.name for t in header.tensors}
    assert types["blk.0.ffn_down.weight"] == quant and types["blk.1.attn_q.weight"] == quant
    assert types["token_embd.weight"] == ("F16" if quant == "F16" else "Q8_0")
    assert types["blk.0.attn_norm.weight"] == "F32" and "output.weight" not in types  # tied
    assert len(header.fields["tokenizer.ggml.tokens"]) == s.vocab
    hf = _oracle(quant)
    with leak_checked_engine(path) as engine:
        cfg = engine.runner.model_config
        got = (cfg.architecture, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
               cfg.num_key_value_heads, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size, cfg.tie_word_embeddings)
        assert got == ("LlamaForCausalLM", s.hidden, s.layers, s.heads, s.kv_heads, s.head_dim, s.intermediate,
                       s.vocab, True)
        g = torch.Generator().manual_seed(3)
        for _ in range(2):
            prompt = torch.randint(100, s.vocab, (20,), generator=g).tolist()
            out = engine.generate(input_ids=prompt, sampling_params={"temperature": 0.0, "max_new_tokens": 10,
                                                                     "ignore_eos": True})
            with torch.no_grad():
                want = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False,
                                   min_new_tokens=10)[0, len(prompt):].tolist()
            assert out["output_ids"] == want


def test_padded_vocabulary_and_qwen2_bias_tensors():
    """A vocabulary larger than the copied tokenizer's is padded; Qwen2 files carry QKV biases."""
    s = bench.MODELS["qwen2-0.5b"]
    names = dict(bench.hf_shapes(s))
    assert names["model.embed_tokens.weight"] == (151936, 896)
    assert names["model.layers.0.self_attn.k_proj.bias"] == (128,)
    assert sum(n.endswith("bias") for n in names) == 3 * s.layers
    assert "lm_head.weight" not in names


def test_driver_measures_a_file_in_a_subprocess(tiny_files, tmp_path):
    out = tmp_path / "result.json"
    keep = os.path.dirname(tiny_files["Q8_0"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, SCRIPT, "--models", "tiny", "--quantizations", "Q8_0", "--no-default",
                           "--keep", keep, "--decode-steps", "2", "--serve", "2,16,4", "--output", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(out.read_text())["rows"]["tiny Q8_0"]
    assert row["file_bytes"] == os.path.getsize(tiny_files["Q8_0"])
    assert row["peak_rss"] >= row["rss_anon"] > 0 and row["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert row["decode"]["1"]["step_ms"] > 0 and row["decode"]["16"]["roofline_share"] > 0
    assert row["serve"]["requests"] == 2 and row["serve"]["out_tok_s"] > 0 and row["prefill_tok_s"] > 0
    assert "| tiny Q8_0 |" in proc.stdout
