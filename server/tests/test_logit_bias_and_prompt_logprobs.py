"""``logit_bias`` and prompt logprobs (``/generate``'s ``logprob_start_len``, ``/v1/completions``'
``echo`` with ``logprobs``) over HTTP on the default model; prompt logprobs against
transformers' ``log_softmax`` of the prompt logits."""

from __future__ import annotations

import json
import os

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is Paris. The capital of Italy is"
# transformers dequantises the same GGUF file to float32, as the server does on CPU: logits
# agree to LOGITS_RTOL * max(1, max |logit|) (tests/test_default_model.py); a logprob
# (logit - logsumexp) to twice that.
LOGITS_RTOL = 1e-4


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    ckpt = load_checkpoint(None)
    return load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file, None)


@pytest.fixture(scope="module")
def hf_ref(tokenizer):
    """(prompt ids, transformers' [T, V] log_softmax of the prompt's logits, tolerance)."""
    from radixserve.model_loader import default_model_path
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.float32).eval()
    ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()  # [T, V]
    return ids, torch.log_softmax(logits, dim=-1), 2 * LOGITS_RTOL * max(1.0, logits.abs().max().item())


def generate(c, **body) -> dict:
    r = c.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def error_param(r) -> str:
    assert r.status_code == 400, r.text
    return r.json()["error"]["param"]


# ------------------------------------------------------------------ logit_bias
def test_logit_bias_forces_forbids_and_is_checked(server, tokenizer, idle_after):
    forced = tokenizer.encode(" banana")[-1]
    with server.client() as c:
        out = generate(c, text=PROMPT, sampling_params={"max_new_tokens": 6, "temperature": 0.8, "seed": 1,
                                                        "logit_bias": {str(forced): 100}})
        assert out["output_ids"] == [forced] * 6
        r = c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 0,
                                            "logit_bias": {str(forced): 100}})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["logprobs"]["tokens"] == [tokenizer.decode([forced])] * 5

        first = generate(c, text=PROMPT, sampling_params={"max_new_tokens": 1, "temperature": 0})["output_ids"][0]
        banned = generate(c, text=PROMPT, sampling_params={"max_new_tokens": 3, "temperature": 0,
                                                           "logit_bias": {str(first): -100}})
        assert banned["output_ids"][0] != first
        messages = [{"role": "user", "content": "Say hello."}]
        plain = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0,
                                                     "logprobs": True}).json()
        token = plain["choices"][0]["logprobs"]["content"][0]["token"]
        chat_ids = generate(c, input_ids=tokenizer.encode_chat(messages),
                            sampling_params={"max_new_tokens": 1, "temperature": 0})["output_ids"]
        assert tokenizer.decode(chat_ids) == token
        biased = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1, "temperature": 0,
                                                      "logprobs": True, "logit_bias": {str(chat_ids[0]): -100}})
        assert biased.status_code == 200, biased.text
        assert biased.json()["choices"][0]["logprobs"]["content"][0]["token"] != token

        for bad in ({"abc": 1}, {"5": 100.5}, {"5": -101}, {"5": "x"}, {"5": None}, {"99999999": 1}, {"-1": 1},
                    [1, 2], "5"):
            assert error_param(c.post("/v1/chat/completions", json={"messages": messages, "logit_bias": bad})) \
                == "logit_bias", bad
            assert error_param(c.post("/v1/completions", json={"prompt": "x", "logit_bias": bad})) == "logit_bias"
            if isinstance(bad, dict):
                assert error_param(c.post("/generate", json={"text": "x", "sampling_params": {"logit_bias": bad}})) \
                    == "logit_bias"


# ------------------------------------------------------------------ prompt logprobs
def check_prompt(tokens: list, tops: list | None, hf_ref, top: int) -> None:
    """``tokens``: (logprob, id) per prompt token; ``tops``: [(logprob, id), ...] per position."""
    ids, ref, atol = hf_ref
    assert [t for _, t in tokens] == ids and tokens[0][0] is None
    got = torch.tensor([lp for lp, _ in tokens[1:]])
    want = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert (got - want).abs().max().item() <= atol
    if tops is not None:
        assert tops[0] is None and len(tops) == len(ids)
        for i, entry in enumerate(tops[1:]):
            values, order = ref[i].topk(top)
            assert [v for v, _ in entry] == pytest.approx(values.tolist(), abs=atol)
            for (v, t), w in zip(entry, order.tolist()):  # ids agree unless within the tolerance
                assert t == w or abs(ref[i, t].item() - v) <= 2 * atol


def test_generate_prompt_logprobs_match_transformers(server, hf_ref, idle_after):
    ids = hf_ref[0]
    body = {"text": PROMPT, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    with server.client() as c:
        first = generate(c, **body)
        meta = first["meta_info"]
        check_prompt([(lp, t) for lp, t, _ in meta["input_token_logprobs"]],
                     [None if e is None else [(v, t) for v, t, _ in e] for e in meta["input_top_logprobs"]],
                     hf_ref, 3)
        assert len(meta["output_token_logprobs"]) == 2
        again = generate(c, **body)  # the prompt is cached now: the logprobs are computed again all the same
        assert again["meta_info"]["input_token_logprobs"] == meta["input_token_logprobs"]
        later = generate(c, **{**body, "logprob_start_len": 4})
        # over a cached prefix the extend has fewer rows, which the linear kernels may tile
        # differently (or take another path for): the same values up to float32 rounding
        got, want = later["meta_info"]["input_token_logprobs"], meta["input_token_logprobs"][4:]
        assert [t for _, t, _ in got] == [t for _, t, _ in want]
        assert [v for v, _, _ in got] == pytest.approx([v for v, _, _ in want], abs=1e-4)
        assert 0 < later["meta_info"]["cached_tokens"] <= 3
        scored = generate(c, input_ids=ids, return_logprob=True, logprob_start_len=0,
                          sampling_params={"max_new_tokens": 0})
        assert scored["output_ids"] == [] and scored["meta_info"]["input_token_logprobs"] == \
            [[lp, t, None] for lp, t, _ in meta["input_token_logprobs"]]
        assert error_param(c.post("/generate", json={"input_ids": ids, "return_logprob": True,
                                                     "logprob_start_len": len(ids)})) == "logprob_start_len"


def test_completions_echo_scores_the_prompt(server, tokenizer, hf_ref, idle_after):
    ids = hf_ref[0]
    echoed = tokenizer.decode(ids, skip_special_tokens=False)
    with server.client() as c:
        # lm-eval's loglikelihood request
        r = c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0, "logprobs": 1,
                                            "temperature": 0})
        assert r.status_code == 200, r.text
        out = r.json()
        choice = out["choices"][0]
        assert choice["text"] == echoed and out["usage"]["completion_tokens"] == 0
        lp = choice["logprobs"]
        assert lp["tokens"] == [tokenizer.decode([t]) for t in ids]
        assert lp["top_logprobs"][0] is None and all(len(t) == 1 for t in lp["top_logprobs"][1:])
        check_prompt(list(zip(lp["token_logprobs"], ids)), None, hf_ref, 1)
        assert [echoed[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]

        r = c.post("/v1/completions", json={"prompt": ids, "echo": True, "max_tokens": 3, "logprobs": 2,
                                            "temperature": 0})
        choice = r.json()["choices"][0]
        lp = choice["logprobs"]
        assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None
        assert lp["token_logprobs"][1:len(ids)] == pytest.approx(
            [hf_ref[1][i, t].item() for i, t in enumerate(ids[1:])], abs=hf_ref[2])
        text = choice["text"]
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][len(ids)] == len(echoed)
        assert [text[o:o + len(t)] for o, t in zip(lp["text_offset"], lp["tokens"])] == lp["tokens"]

        # streamed: the echoed prompt and its logprobs come with the first chunk
        with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 3,
                                                        "logprobs": 1, "temperature": 0, "stream": True}) as resp:
            chunks = [json.loads(line[6:]) for line in resp.iter_lines()
                      if line.startswith("data: ") and line != "data: [DONE]"]
        head = chunks[0]["choices"][0]
        assert head["text"].startswith(echoed)
        assert head["logprobs"]["tokens"][:len(ids)] == lp["tokens"][:len(ids)]
        assert head["logprobs"]["token_logprobs"][0] is None
        streamed = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
        assert streamed == lp["tokens"]

        # max_tokens 0 needs echo (vLLM's rule otherwise); echo alone returns the prompt
        assert error_param(c.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0})) == "max_tokens"
        r = c.post("/v1/completions", json={"prompt": PROMPT, "echo": True, "max_tokens": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == echoed
        assert r.json()["choices"][0]["logprobs"] is None


def test_n_choices_share_one_prompt_prefill(server, tokenizer, idle_after):
    """echo + logprobs with n = 8 prefills the prompt once; every choice reports its logprobs."""
    ids = (tokenizer.encode(PROMPT) * 100)[:1031]
    with server.client() as c:
        before = c.get("/get_server_info").json()["stats"]["num_prefill_tokens"]
        r = c.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 1, "n": 8,
                                            "temperature": 1.0, "seed": 3})
        assert r.status_code == 200, r.text
        computed = c.get("/get_server_info").json()["stats"]["num_prefill_tokens"] - before
    choices = r.json()["choices"]
    assert len(choices) == 8
    assert len(ids) <= computed < 2 * len(ids), f"{computed} prompt tokens computed for n = 8"
    head = [ch["logprobs"]["token_logprobs"][:len(ids)] for ch in choices]
    assert head[0][0] is None and all(isinstance(v, float) for v in head[0][1:])
    assert all(h == head[0] for h in head[1:])
