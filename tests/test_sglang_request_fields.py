"""SGLang's request fields the engine implements beyond sampling: ``return_hidden_states``
(against transformers' final hidden states), ``stop_regex`` (exact like stop strings),
``sampling_seed``, and prefill-only requests (``max_new_tokens: 0``) that cache their prompt.
"""

from __future__ import annotations

import pytest
import torch
from engine_checks import leak_checked_engine
from radixserve.sampling import InvalidSamplingParams, SamplingParams
from tiny_models import build_checkpoint, random_prompts

ATOL = 2e-4  # float32, ours vs transformers


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fields_llama"))
    model = build_checkpoint(path, "llama", seed=11, max_position_embeddings=512).float().eval()
    return path, model


@pytest.mark.parametrize("chunk", [-1, 16])
def test_hidden_states_match_transformers(tiny, chunk):
    path, hf = tiny
    prompts = random_prompts(2, 37, seed=3)
    new = 5
    with leak_checked_engine(path, chunked_prefill_size=chunk, page_size=4) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True, "return_hidden_states": True})
        last = engine.generate(input_ids=prompts[0], sampling_params={
            "max_new_tokens": new, "temperature": 0, "ignore_eos": True, "return_hidden_states": "last"})
    for ids, out in zip(prompts, outs):
        full = ids + out["output_ids"]
        with torch.no_grad():
            ref = hf(torch.tensor([full]), output_hidden_states=True).hidden_states[-1][0]  # [T, H], after the norm
        hs = out["meta_info"]["hidden_states"]
        assert len(hs) == new  # the prompt's rows, then one row per output token after the first
        assert torch.allclose(torch.tensor(hs[0]), ref[:len(ids)], atol=ATOL)
        rows = torch.tensor(hs[1:])  # positions len(ids) .. len(full) - 2
        assert torch.allclose(rows, ref[len(ids):len(full) - 1], atol=ATOL)
    assert len(last["meta_info"]["hidden_states"]) == 1
    assert last["meta_info"]["hidden_states"][0] == pytest.approx(outs[0]["meta_info"]["hidden_states"][-1], abs=ATOL)


def test_no_hidden_states_unless_asked(tiny):
    path, _ = tiny
    with leak_checked_engine(path) as engine:
        out = engine.generate(input_ids=random_prompts(1, 9)[0], sampling_params={"max_new_tokens": 2})
    assert "hidden_states" not in out["meta_info"]


def test_stop_regex_stops_like_a_stop_string(tiny):
    path, _ = tiny
    prompt = random_prompts(1, 12, seed=8)[0]
    with leak_checked_engine(path) as engine:
        free = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 24, "temperature": 0,
                                                                  "ignore_eos": True})
        text = free["text"]
        words = text.split()
        assert len(words) >= 4
        target = words[2]  # a word the greedy output contains: stop at the first word equal to it
        pattern = r"\b" + target + r"\b"
        by_regex = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": [r"\d{9}", pattern]})
        by_string = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": target})
        kept = engine.generate(input_ids=prompt, sampling_params={
            "max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop_regex": pattern, "no_stop_trim": True})
    cut = text.index(target)
    assert by_regex["meta_info"]["finish_reason"] == {"type": "stop", "matched": pattern}
    assert by_regex["text"] == text[:cut]
    assert by_regex["output_ids"] == by_string["output_ids"]  # the same token ends both
    assert kept["text"].startswith(text[:cut] + target)


@pytest.mark.parametrize("bad, why", [
    ("", "non-empty"), ("a*", "empty string"), ("(", "not a valid regex"), (["x"] * 33, "at most 32"),
    ("x" * 300, "over 256 bytes"), (5, "pattern"),
])
def test_bad_stop_regex_is_refused_naming_it(bad, why):
    with pytest.raises(InvalidSamplingParams, match=why) as e:
        SamplingParams.from_dict({"stop_regex": bad})
    assert e.value.param == "stop_regex"


def test_sglang_sampling_fields():
    p = SamplingParams.from_dict({"sampling_seed": 7, "custom_params": {"k": 1}, "stream_interval": 2,
                                  "beam_width": 1, "structural_tag": None, "watermark": None})
    assert p.seed == 7 and p.custom_params == {"k": 1}
    for field, value in (("beam_width", 2), ("structural_tag", "{}"), ("watermark", {"k": 1}),
                         ("custom_params", [1]), ("return_hidden_states", "all")):
        with pytest.raises(InvalidSamplingParams) as e:
            SamplingParams.from_dict({field: value})
        assert e.value.param == field
    with pytest.raises(InvalidSamplingParams, match="differ"):
        SamplingParams.from_dict({"sampling_seed": 1, "seed": 2})


def test_prefill_only_request_caches_its_prompt(tiny):
    path, _ = tiny
    prompt = random_prompts(1, 40, seed=4)[0]
    with leak_checked_engine(path, page_size=1) as engine:
        first = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": 0})
        again = engine.generate(input_ids=prompt + [5, 6], sampling_params={"max_new_tokens": 1})
    assert first["output_ids"] == [] and first["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert again["meta_info"]["cached_tokens"] == len(prompt)
