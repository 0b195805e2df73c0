"""The offline Engine API on the default model: sampling controls, stops, n, logprobs,
streaming and bad input. Greedy equality with transformers lives in test_default_model.py."""

from __future__ import annotations

import asyncio

import pytest
import torch
from radixserve.engine.scheduler import RequestRejected
from radixserve.sampling import InvalidSamplingParams

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, in a small village by the sea, there lived"


def greedy(engine, prompt=PROMPT, **kw):
    return engine.generate(prompt, {"temperature": 0.0, "max_new_tokens": 24, **kw})


def test_same_seed_same_output_regardless_of_batch(default_engine):
    params = {"temperature": 0.9, "top_p": 0.95, "max_new_tokens": 24, "seed": 1234}
    alone = default_engine.generate(PROMPT, params)
    batch = default_engine.generate(["Hello there", PROMPT, "1, 2, 3"],
                                    [{"temperature": 1.0, "max_new_tokens": 10}, params,
                                     {"temperature": 0.0, "max_new_tokens": 5}])
    assert batch[1]["output_ids"] == alone["output_ids"]
    other = default_engine.generate(PROMPT, {**params, "seed": 4321})
    assert other["output_ids"] != alone["output_ids"]


def test_n_samples_differ_and_are_reproducible(default_engine):
    params = {"temperature": 1.0, "max_new_tokens": 16, "seed": 7, "n": 3}
    outs = default_engine.generate(PROMPT, params)
    assert len(outs) == 3
    assert len({tuple(o["output_ids"]) for o in outs}) > 1
    again = default_engine.generate(PROMPT, params)
    assert [o["output_ids"] for o in outs] == [o["output_ids"] for o in again]


def test_stop_string_trims_text_and_reports_match(default_engine):
    free = greedy(default_engine, max_new_tokens=40)
    words = free["text"].split()
    stop = words[len(words) // 2]
    out = greedy(default_engine, max_new_tokens=40, stop=[stop])
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert free["text"].startswith(out["text"])
    assert len(out["output_ids"]) < len(free["output_ids"])


def test_stop_token_ids(default_engine):
    free = greedy(default_engine)
    stop_id = free["output_ids"][5]
    out = greedy(default_engine, stop_token_ids=[stop_id])
    first = free["output_ids"].index(stop_id)
    assert out["output_ids"] == free["output_ids"][: first + 1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}


def test_length_eos_min_new_tokens_and_ignore_eos(default_engine):
    ids = default_engine.tokenizer.encode_chat([{"role": "user", "content": "Say just the word yes."}])
    short = default_engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 64})
    eos = short["output_ids"][-1]
    assert short["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    n = len(short["output_ids"])
    assert n < 64
    longer = default_engine.generate(input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": 64, "min_new_tokens": n + 5})
    assert len(longer["output_ids"]) >= n + 5
    assert eos not in longer["output_ids"][: n + 4]
    ignored = default_engine.generate(input_ids=ids, sampling_params={
        "temperature": 0, "max_new_tokens": n + 6, "ignore_eos": True})
    assert len(ignored["output_ids"]) == n + 6
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": n + 6}
    assert ignored["meta_info"]["prompt_tokens"] == len(ids)
    assert ignored["meta_info"]["completion_tokens"] == n + 6


def test_logprobs_match_the_model(default_engine):
    out = greedy(default_engine, max_new_tokens=6, return_logprob=True, top_logprobs_num=3)
    prompt = default_engine.tokenizer.encode(PROMPT)
    logits = default_engine.runner.prompt_logits(prompt + out["output_ids"][:-1])
    ref = torch.log_softmax(logits[len(prompt) - 1:], dim=-1)  # [6, V]
    meta = out["meta_info"]
    for i, ((lp, tok), top) in enumerate(zip(meta["output_token_logprobs"], meta["output_top_logprobs"])):
        assert tok == out["output_ids"][i]
        assert lp == pytest.approx(ref[i, tok].item(), abs=1e-3)
        assert len(top) == 3
        assert top[0][1] == tok  # greedy picks the most likely token
        values = [v for v, _ in top]
        assert values == sorted(values, reverse=True)
        assert values[0] == pytest.approx(ref[i].max().item(), abs=1e-3)


def test_repetition_penalty_changes_output(default_engine):
    prompt = "1, 2, 3, 1, 2, 3, 1, 2, 3,"
    plain = greedy(default_engine, prompt, max_new_tokens=12)
    penalised = greedy(default_engine, prompt, max_new_tokens=12, repetition_penalty=1.8)
    assert plain["output_ids"] != penalised["output_ids"]


def test_batch_of_input_ids_and_prompts_agree(default_engine):
    prompts = ["The sky is", "Python is a", "Once upon a time"]
    ids = [default_engine.tokenizer.encode(p) for p in prompts]
    by_text = default_engine.generate(prompts, {"temperature": 0, "max_new_tokens": 8})
    by_ids = default_engine.generate(input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8})
    assert [o["output_ids"] for o in by_text] == [o["output_ids"] for o in by_ids]


def test_async_streaming_matches_sync(default_engine):
    sync = greedy(default_engine, max_new_tokens=20)

    async def collect():
        chunks = []
        async for chunk in await default_engine.async_generate(
                PROMPT, {"temperature": 0, "max_new_tokens": 20}, stream=True):
            chunks.append(chunk)
        final = await default_engine.async_generate(PROMPT, {"temperature": 0, "max_new_tokens": 20})
        return chunks, final

    chunks, final = asyncio.run(collect())
    assert len(chunks) > 1
    assert "".join(c["text"] for c in chunks) == sync["text"]
    assert [t for c in chunks for t in c["output_ids"]] == sync["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == sync["meta_info"]["finish_reason"]
    assert final["output_ids"] == sync["output_ids"]


@pytest.mark.parametrize("params, field", [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"max_new_tokens": -1}, "max_new_tokens"),
    ({"n": 0}, "n"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"bogus": 1}, "bogus"),
])
def test_invalid_params_name_the_field_and_engine_keeps_working(default_engine, params, field):
    with pytest.raises(InvalidSamplingParams) as e:
        default_engine.generate("hi", params)
    assert e.value.param == field
    assert field in str(e.value)
    assert greedy(default_engine, "hi", max_new_tokens=2)["meta_info"]["completion_tokens"] == 2


def test_request_that_can_never_fit_is_rejected_at_once(default_engine):
    ctx = default_engine.runner.context_len
    with pytest.raises(RequestRejected, match="context length"):
        default_engine.generate(input_ids=[1] * 10, sampling_params={"max_new_tokens": ctx})
    with pytest.raises(ValueError, match="input_ids"):
        default_engine.generate(input_ids=[-3, 5])
    with pytest.raises(ValueError, match="exactly one"):
        default_engine.generate()


def test_abort_while_streaming_returns_tokens_so_far(default_engine):
    async def go():
        chunks = []
        stream = await default_engine.async_generate(
            PROMPT, {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True}, stream=True)
        async for chunk in stream:
            chunks.append(chunk)
            if len(chunks) == 3:
                default_engine.abort(chunk["meta_info"]["id"])
        return chunks

    chunks = asyncio.run(go())
    final = chunks[-1]["meta_info"]
    assert final["finish_reason"]["type"] == "abort"
    produced = [t for c in chunks for t in c["output_ids"]]
    assert 3 <= final["completion_tokens"] == len(produced) < 200
    assert produced == greedy(default_engine, max_new_tokens=len(produced))["output_ids"]
    stats = default_engine.get_stats()
    assert stats["num_aborted_reqs"] >= 1 and stats["num_running_reqs"] == 0
