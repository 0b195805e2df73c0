"""Speculative decoding on the default model: greedy outputs token-identical to plain
decoding on the transformers-equality prompts, in one batch and one at a time, with the
radix cache on, with chunked prefill and with a JSON-schema request in the batch.

Model-based methods (standalone, eagle3) have the same checks in their plugins' tests; this
module covers the model-free NGRAM method, which runs on the default model as shipped.
"""

from __future__ import annotations

import json

import pytest
import radixserve
from test_default_model import CHAT_CONVERSATIONS, GREEDY, PLAIN_PROMPTS

pytestmark = pytest.mark.slow

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"]}


@pytest.fixture(scope="module")
def prompts(hf_default_tokenizer) -> list[str]:
    chats = [hf_default_tokenizer.apply_chat_template(m, tokenize=False, add_generation_prompt=True)
             for m in CHAT_CONVERSATIONS]
    return PLAIN_PROMPTS + chats


@pytest.fixture(scope="module")
def plain(default_engine, prompts):
    return [o["output_ids"] for o in default_engine.generate(prompts, GREEDY)]


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
        # one at a time, each prompt's prefix now in the radix cache
        _diff(plain, [eng.generate(p, GREEDY) for p in prompts], "one at a time, cache warm")
        assert eng.get_stats()["cache_hit_rate"] > 0.3


def test_ngram_with_chunked_prefill_and_pages(prompts, plain):
    with _ngram(chunked_prefill_size=64, page_size=16) as eng:
        _diff(plain, eng.generate(prompts, GREEDY), "chunked prefill, page size 16")
