"""Speculative decoding on the default model: greedy outputs token-identical to plain
decoding on the transformers-equality prompts, in one batch and one at a time, with the
radix cache on, with chunked prefill and with a JSON-schema request in the batch.

Model-based methods (standalone, eagle3) have the same checks in their plugins' tests on
tiny targets; this module covers the model-free NGRAM method, which runs on the default
model as shipped, and EAGLE3 over the default model's GGUF blocks with a head built from
the target's own weights (no trained head ships).
"""

from __future__ import annotations

import json

import pytest
import radixserve
import torch
from test_default_model import GREEDY

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def prompts(default_prompts) -> list[str]:
    return default_prompts


@pytest.fixture(scope="module")
def plain(default_greedy_outputs):
    """Plain greedy decoding of ``prompts`` by the default engine, in one batch (conftest.py)."""
    return [o["output_ids"] for o in default_greedy_outputs]


@pytest.fixture(scope="module")
def json_prompt(hf_default_tokenizer) -> str:
    return hf_default_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Give a person as JSON with a name and an age."}],
        tokenize=False, add_generation_prompt=True)


def _ngram(**kw):
    return radixserve.Engine(speculative_algorithm="NGRAM", speculative_disable_by_batch_size=1 << 20,
                             max_total_tokens=16384, enable_leak_check=True, **kw)


def _diff(plain, outs, how):
    bad = [i for i, (a, b) in enumerate(zip(plain, outs, strict=True)) if a != b["output_ids"]]
    assert not bad, f"{how}: {len(bad)} outputs differ, e.g. prompt {bad[0]}"


def test_ngram_matches_plain_decoding(default_engine, prompts, plain, json_prompt):
    constrained = {"temperature": 0.0, "max_new_tokens": 48, "json_schema": json.dumps(SCHEMA)}
    want_json = default_engine.generate(json_prompt, constrained)
    with _ngram() as eng:
        outs = eng.generate(prompts + [json_prompt], [GREEDY] * len(prompts) + [constrained])
        _diff(plain, outs[:-1], "one batch with a JSON-schema request")
        assert outs[-1]["output_ids"] == want_json["output_ids"]
        json.loads(outs[-1]["text"])
        stats = eng.get_stats()
        assert stats["spec_num_accepted_tokens"] > 0, stats
        # one at a time (every 4th prompt: plain ones and chats), each prompt now in the radix cache
        singles = [eng.generate(p, GREEDY) for p in prompts[::4]]
        _diff(plain[::4], singles, "one at a time, cache warm")
        assert all(o["meta_info"]["cached_tokens"] > 0 for o in singles)


def test_ngram_with_chunked_prefill_and_pages(prompts, plain):
    with _ngram(chunked_prefill_size=64, page_size=16) as eng:
        _diff(plain, eng.generate(prompts, GREEDY), "chunked prefill, page size 16")


# ------------------------------------------------------------------ EAGLE3 on the GGUF blocks
@pytest.fixture(scope="module")
def logit_lens_head(default_engine, plain, tmp_path_factory) -> str:
    """An EAGLE-3 head for the default model that needs no training: ``fc`` passes the
    target's high aux hidden state (after layer L - 4) through, the decoder layer adds
    nothing, and the norm and LM head are the target's final norm and output rows over the
    draft vocabulary. Its drafts are layer L - 4's logit lens, right often enough that
    verify steps accept draft tokens. The target serves its embedding from GGUF blocks, so
    the head embeds through the target's block table."""
    pytest.importorskip("radixserve_speculative_eagle3")
    from collections import Counter

    from radixserve_speculative_eagle3.checkpoint import (
        expected_shapes,
        make_config,
        vocab_mapping,
        write_head,
    )
    from radixserve_speculative_eagle3.head import Eagle3Config

    target = default_engine.runner.model
    cfg = default_engine.model_config
    config = make_config(cfg, 2048)
    shapes = expected_shapes(Eagle3Config.from_dict(config))
    tensors = {name: torch.zeros(shape) for name, shape in shapes.items() if name not in ("d2t", "t2d")}
    h = cfg.hidden_size
    tensors["fc.weight"][:, 2 * h:] = torch.eye(h)
    for name in ("midlayer.hidden_norm.weight", "midlayer.input_layernorm.weight",
                 "midlayer.post_attention_layernorm.weight"):
        tensors[name].fill_(1.0)
    tensors["norm.weight"] = target.norm.weight.detach().float().clone()
    tensors["d2t"], tensors["t2d"] = vocab_mapping(Counter(t for ids in plain for t in ids), 2048, cfg.vocab_size)
    out_rows = target.embed_tokens.dense_weight().float()  # the tied LM head
    tensors["lm_head.weight"] = out_rows[tensors["d2t"] + torch.arange(2048)].clone()
    path = str(tmp_path_factory.mktemp("eagle3-logit-lens"))
    write_head(path, config, tensors)
    return path


def _eagle3(head: str, **kw):
    return radixserve.Engine(speculative_algorithm="EAGLE3", speculative_draft_model_path=head,
                             speculative_disable_by_batch_size=1 << 20, max_total_tokens=16384,
                             enable_leak_check=True, **kw)


def test_eagle3_on_the_gguf_target_matches_plain_decoding(default_engine, prompts, plain, logit_lens_head):
    # a chain of 3 drafts (trees are covered on tiny targets): 4 verify rows per request, so
    # the 20-prompt batch stays cheap
    with _eagle3(logit_lens_head, speculative_num_steps=3, speculative_eagle_topk=1,
                 speculative_num_draft_tokens=4) as eng:
        head = eng.scheduler.spec.proposer.head
        assert eng.runner.model.embed_tokens.weight is None, "the default model keeps its embedding in blocks"
        ids = torch.tensor([1, 7, 500, 20000])
        assert torch.equal(head.embed(ids), eng.runner.model.embed_tokens.dense_weight()[ids])
        assert head.fc.path == "w8a16_int8"  # the CPU default of an EAGLE3 head
        _diff(plain, eng.generate(prompts, GREEDY), "eagle3 over the GGUF target, one batch")
        stats = eng.get_stats()
        assert stats["spec_num_accepted_tokens"] > 0, stats


def test_eagle3_draft_quantization_flag(prompts, plain, logit_lens_head):
    with _eagle3(logit_lens_head, speculative_draft_model_quantization="none") as eng:
        head = eng.scheduler.spec.proposer.head
        assert {m.path for m in (head.fc, head.lm_head, head.midlayer.mlp.down_proj)} & {"w8a16_int8"} == set()
        _diff(plain[:4], eng.generate(prompts[:4], GREEDY), "eagle3 with a float32 head")
        assert eng.get_stats()["spec_num_accepted_tokens"] > 0
    with pytest.raises(ValueError, match="--speculative-draft-model-quantization gguf"):
        _eagle3(logit_lens_head, speculative_draft_model_quantization="gguf")
