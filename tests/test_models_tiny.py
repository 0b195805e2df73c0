"""Tiny random-weight Llama / Qwen2 / Qwen3 checkpoints: our engine against transformers.

Each variant is built from a transformers config, given random weights with a useful
spread (transformers' own init makes logits nearly flat and zeroes biases, which would
hide loading bugs), saved with ``save_pretrained(safe_serialization=True)`` next to a
tiny word-level tokenizer, and loaded by both sides from that directory. We compare

* ``runner.prompt_logits`` with transformers' logits at every position, and
* greedy continuations of several prompts run as one batch with transformers' greedy
  ``generate`` run one prompt at a time,

for KV page sizes 1 and 16 (prompt lengths are not page multiples, so decode starts and
continues mid-page).
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import pytest
import torch
from tiny_models import EOS, VARIANTS, VOCAB, build_checkpoint

NEW_TOKENS = 16
PROMPT_LENGTHS = (5, 23, 90)  # 90 > original_max_position_embeddings of the llama3 variant
# float32 on both sides; the only differences allowed are in summation order (fused QKV
# and gate/up projections, paged attention). Logits here reach about 4 (60 when tied).
LOGITS_RTOL = 1e-4  # max |ours - hf| <= LOGITS_RTOL * max(1, max |hf|)

@dataclass
class TinyCheckpoint:
    name: str
    path: str
    hf_model: torch.nn.Module
    prompts: list[list[int]]
    hf_greedy: list[list[int]]  # NEW_TOKENS greedy tokens per prompt, EOS not special


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    """Greedy tokens from transformers ``generate`` with EOS treated as an ordinary token."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                         max_new_tokens=NEW_TOKENS, eos_token_id=None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    assert len(new) == NEW_TOKENS, "transformers stopped early; the reference is unusable"
    return new


@pytest.fixture(scope="module", params=list(VARIANTS))
def tiny(request, tmp_path_factory) -> TinyCheckpoint:
    from transformers import AutoModelForCausalLM

    name = request.param
    seed = sorted(VARIANTS).index(name)
    path = str(tmp_path_factory.mktemp(name))
    build_checkpoint(path, name, seed)

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    g = torch.Generator().manual_seed(100 + seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in PROMPT_LENGTHS]
    with torch.no_grad():
        greedy = [_hf_greedy(hf, p) for p in prompts]
    return TinyCheckpoint(name, path, hf, prompts, greedy)


@pytest.fixture(scope="module", params=[1, 16], ids=lambda n: f"page{n}")
def tiny_engine(request, tiny):
    import radixserve

    engine = radixserve.Engine(tiny.path, dtype="float32", page_size=request.param, max_total_tokens=2048)
    yield engine
    engine.shutdown()


def test_checkpoint_layout(tiny):
    """The sharded variant must exercise model.safetensors.index.json; the tied one has no lm_head."""
    from safetensors import safe_open

    files = glob.glob(os.path.join(tiny.path, "*.safetensors"))
    sharded = VARIANTS[tiny.name][2] is not None
    assert os.path.exists(os.path.join(tiny.path, "model.safetensors.index.json")) == sharded
    assert (len(files) > 1) == sharded
    names = set()
    for f in files:
        with safe_open(f, framework="pt") as st:
            names.update(st.keys())
    assert ("lm_head.weight" in names) == (not tiny.hf_model.config.tie_word_embeddings)


def test_config_read_as_transformers_reads_it(tiny, tiny_engine):
    cfg, hf_cfg = tiny_engine.model_config, tiny.hf_model.config
    assert cfg.architecture == type(tiny.hf_model).__name__
    assert cfg.head_dim == getattr(hf_cfg, "head_dim", hf_cfg.hidden_size // hf_cfg.num_attention_heads)
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert EOS in cfg.eos_token_ids


def test_prompt_logits_match_transformers(tiny, tiny_engine, assert_idle):
    for prompt in tiny.prompts:
        ours = tiny_engine.runner.prompt_logits(prompt)  # [T, V]
        with torch.no_grad():
            ref = tiny.hf_model(torch.tensor([prompt])).logits[0].float()  # [T, V]
        assert ours.shape == ref.shape
        scale = max(1.0, ref.abs().max().item())
        diff = (ours - ref).abs().max().item()
        assert diff <= LOGITS_RTOL * scale, (
            f"{tiny.name}, prompt of {len(prompt)} tokens: max |diff| {diff:.3g} over {LOGITS_RTOL} * {scale:.3g}")
    assert_idle(tiny_engine)


def test_greedy_batch_matches_transformers_generate(tiny, tiny_engine, assert_idle):
    params = {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}
    outs = tiny_engine.generate(input_ids=tiny.prompts, sampling_params=params)
    for prompt, out, ref in zip(tiny.prompts, outs, tiny.hf_greedy, strict=True):
        assert out["output_ids"] == ref, f"{tiny.name}, prompt of {len(prompt)} tokens"
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["prompt_tokens"] == len(prompt)
        assert out["meta_info"]["completion_tokens"] == NEW_TOKENS
    assert_idle(tiny_engine)


def test_greedy_requests_finishing_at_different_steps(tiny, tiny_engine, assert_idle):
    """Requests leaving the batch early free their pages; the rest continue unchanged."""
    lengths = [NEW_TOKENS, 3, 11]
    params = [{"temperature": 0.0, "max_new_tokens": n, "ignore_eos": True} for n in lengths]
    outs = tiny_engine.generate(input_ids=tiny.prompts, sampling_params=params)
    for n, out, ref in zip(lengths, outs, tiny.hf_greedy, strict=True):
        assert out["output_ids"] == ref[:n], tiny.name
    assert_idle(tiny_engine)


PENALTIES = {"repetition_penalty": 1.4, "frequency_penalty": 0.6, "presence_penalty": 0.3}


def _hf_penalised_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy ``generate`` with its repetition penalty (prompt and output tokens)
    followed by OpenAI's frequency and presence penalties over the output tokens."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FrequencyPresence(LogitsProcessor):
        def __call__(self, input_ids, scores):
            out = input_ids[0, len(prompt):]
            counts = torch.zeros_like(scores[0]).index_add_(0, out, torch.ones(len(out)))
            scores[0] -= PENALTIES["frequency_penalty"] * counts + PENALTIES["presence_penalty"] * (counts > 0)
            return scores

    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW_TOKENS,
                         eos_token_id=None, pad_token_id=0, repetition_penalty=PENALTIES["repetition_penalty"],
                         logits_processor=LogitsProcessorList([FrequencyPresence()]))
    return out[0, len(prompt):].tolist()


def test_penalised_greedy_batch_matches_transformers(tiny, tiny_engine, assert_idle):
    """Repetition, frequency and presence penalties in a batch whose rows finish at different
    steps, next to an unpenalised row: each row's running token statistics (kept across
    steps, not rebuilt from the history) give transformers' tokens."""
    with torch.no_grad():
        refs = [_hf_penalised_greedy(tiny.hf_model, p) for p in tiny.prompts[:2]]
    assert refs != tiny.hf_greedy[:2], "the penalties change nothing here; the test would prove nothing"
    params = [{"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True, **PENALTIES},
              {"temperature": 0.0, "max_new_tokens": 9, "ignore_eos": True, **PENALTIES},
              {"temperature": 0.0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True}]
    outs = tiny_engine.generate(input_ids=tiny.prompts, sampling_params=params)
    assert outs[0]["output_ids"] == refs[0], tiny.name
    assert outs[1]["output_ids"] == refs[1][:9], tiny.name
    assert outs[2]["output_ids"] == tiny.hf_greedy[2], tiny.name
    assert_idle(tiny_engine)
