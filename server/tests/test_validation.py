"""Request validation over HTTP: every accepted field takes effect, every other one is a
400 naming it; one error-body convention (``code`` a string or null); max_tokens 0."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from radixserve_server.errors import APIError, from_finish_reason
from radixserve_server.http_io import sse_error

USER = [{"role": "user", "content": "What is the capital of France?"}]


def error_of(resp: httpx.Response, status: int, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert err["code"] is None or isinstance(err["code"], str), err
    assert err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.fixture(scope="module")
def tokenizer():
    from radixserve.model_loader import load_checkpoint
    from radixserve.tokenizer import load_tokenizer

    ckpt = load_checkpoint(None)
    return load_tokenizer(ckpt.tokenizer_dir, ckpt.gguf_file, None)


# ------------------------------------------------------------ no server
def test_error_code_is_a_string_or_null():
    for status in (400, 401, 404, 413, 429, 500, 503):
        body = APIError(status, "x").body()["error"]
        assert body["code"] is None or isinstance(body["code"], str), (status, body)
    assert APIError(503, "x", code=503).body()["error"]["code"] == "503"
    limited = APIError(429, "busy")
    assert limited.body()["error"] == {"message": "busy", "type": "requests", "param": None,
                                       "code": "rate_limit_exceeded"}
    assert int(limited.headers["Retry-After"]) >= 1
    failed = from_finish_reason({"type": "abort", "status_code": 500, "message": "boom"})
    assert failed.status == 500 and failed.body()["error"]["type"] == "server_error"
    assert failed.body()["error"]["code"] is None
    assert from_finish_reason({"type": "abort", "status_code": 429, "message": "full"}).status == 429
    event = sse_error(APIError(503, "the engine stopped"))
    assert event.startswith("data: ") and json.loads(event[6:])["error"]["code"] is None


# ---------------------------------------------------------------- server
@pytest.mark.slow
def test_error_bodies_over_http_use_string_codes(server):
    with server.client() as c:
        assert error_of(c.post("/v1/chat/completions", json={"messages": USER, "model": "gpt-17"}), 404,
                        "model")["code"] == "model_not_found"
        error_of(c.get("/v1/nope"), 404)
        assert error_of(c.post("/v1/completions", json={"prompt": "x" * 300_000}), 413)["code"] == "payload_too_large"
        error_of(c.post("/v1/completions", json={"prompt": [1] * 5000}), 400, "prompt")
        error_of(c.post("/v1/chat/completions", content=b"{nope", headers={"content-type": "application/json"}), 400)
    assert error_of(httpx.get(server.url + "/v1/models"), 401)["code"] == "invalid_api_key"


@pytest.mark.slow
def test_message_content_where_the_role_needs_it(server):
    def chat(messages):
        return c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 1})

    with server.client() as c:
        error_of(chat([{"role": "user"}]), 400, "messages[0].content")
        error_of(chat([{"role": "user", "content": None}]), 400, "messages[0].content")
        error_of(chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": None}]), 400,
                 "messages[1].content")
        error_of(chat([{"role": "system"}, *USER]), 400, "messages[0].content")
        error_of(chat([{"role": "developer"}, *USER]), 400, "messages[0].content")
        error_of(chat([*USER, {"role": "assistant"}, {"role": "tool", "tool_call_id": "1"}]), 400,
                 "messages[1].content")
        error_of(chat([*USER, {"role": "assistant", "content": "x"}, {"role": "tool", "tool_call_id": "1"}]), 400,
                 "messages[2].content")
        error_of(chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
                 "messages[0].content[0].type")
        # an assistant turn that called tools may leave its content out
        calls = [{"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
        ok = chat([*USER, {"role": "assistant", "content": None, "tool_calls": calls},
                   {"role": "tool", "tool_call_id": "1", "content": "42"}, {"role": "user", "content": "And?"}])
        assert ok.status_code == 200, ok.text
        assert chat([{"role": "user", "content": ""}]).status_code == 200


@pytest.mark.slow
def test_chat_template_kwargs_may_not_reuse_the_templates_own_arguments(server):
    with server.client() as c:
        for key in ("messages", "add_generation_prompt", "tools", "continue_final_message", "bos_token",
                    "eos_token"):
            r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                     "chat_template_kwargs": {key: "x"}})
            error_of(r, 400, f"chat_template_kwargs.{key}")
        r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1,
                                                 "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200, r.text


@pytest.mark.slow
def test_continue_final_message(server, tokenizer):
    start = "The capital of France is"
    messages = [*USER, {"role": "assistant", "content": start}]
    # the template renders the assistant turn, cut right after its content: no end of turn
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    prompt = text[:text.rindex(start) + len(start)]
    assert prompt.endswith("<|im_start|>assistant\n" + start)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    with server.client() as c:
        r = c.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True,
                                                 "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200, r.text
        ref = c.post("/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 6, "temperature": 0}})
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
        assert r.json()["choices"][0]["message"]["content"] == ref.json()["text"]
        # an empty final message continues an empty assistant turn: the generation prompt itself
        empty = c.post("/v1/chat/completions", json={"messages": [*USER, {"role": "assistant", "content": ""}],
                                                     "continue_final_message": True, "max_tokens": 1})
        plain = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1})
        assert empty.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]
        error_of(c.post("/v1/chat/completions", json={"messages": USER, "continue_final_message": True}), 400,
                 "continue_final_message")
        error_of(c.post("/v1/chat/completions", json={"messages": messages, "continue_final_message": True,
                                                      "add_generation_prompt": True}), 400, "continue_final_message")
    server.wait_idle()


@pytest.mark.slow
def test_unsupported_and_unknown_fields_are_400s_naming_them(server):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat_cases = [
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"function_call": "auto"}, "function_call"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"image_data": "data:image/png;base64,AAAA"}, "image_data"),
        ({"store": True}, "store"),
        ({"service_tier": "flex"}, "service_tier"),
        ({"logit_bias": {"50": 500}}, "logit_bias"),  # accepted, but only within [-100, 100]
        ({"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
         "stream_options.continuous_usage_stats"),
        ({"frobnicate": 1}, "frobnicate"),
    ]
    with server.client() as c:
        for extra, param in chat_cases:
            err = error_of(c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **extra}), 400,
                           param)
            assert err["code"] == "unsupported_parameter" or param == "logit_bias", err
        # SGLang's lora_path on a server without adapters: a 400 naming it
        error_of(c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, "lora_path": "adapter-a"}),
                 400, "lora_path")
        error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "tools": tools}), 400, "tools")
        error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "frobnicate": 1}), 400, "frobnicate")
        error_of(c.post("/generate", json={"text": "x", "frobnicate": 1}), 400, "frobnicate")
        error_of(c.post("/generate", json={"text": "x", "logprob_start_len": -2}), 400, "logprob_start_len")
        # OpenAI's informational fields are accepted; tools with tool_choice "none" reach the template
        fine = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
                "safety_identifier": "s1", "tools": tools, "tool_choice": "none",
                # SGLang's fields, at the defaults its clients (the router) send
                "reasoning_effort": "low", "return_hidden_states": False, "lora_path": None,
                "stop_regex": [], "session_id": "s", "modalities": ["text"], "bootstrap_room": None}
        r = c.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 1, **fine})
        assert r.status_code == 200, r.text
        r = c.post("/generate", json={"text": "x", "logprob_start_len": -1, "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200, r.text
    server.wait_idle()


@pytest.mark.slow
def test_max_tokens_zero(server):
    """vLLM's rule on the OpenAI endpoints (a 400); on /generate zero generated tokens."""
    with server.client() as c:
        for field in ("max_tokens", "max_completion_tokens"):
            err = error_of(c.post("/v1/chat/completions", json={"messages": USER, field: 0}), 400, field)
            assert "at least 1" in err["message"]
        error_of(c.post("/v1/completions", json={"prompt": "x", "max_tokens": 0}), 400, "max_tokens")
        r = c.post("/generate", json={"text": "Hello there", "sampling_params": {"max_new_tokens": 0}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["text"] == "" and out["output_ids"] == []
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["prompt_tokens"] > 0 and out["meta_info"]["completion_tokens"] == 0
        with c.stream("POST", "/generate", json={"text": "Hello there", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 0}}) as resp:
            events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert last["output_ids"] == [] and last["meta_info"]["finish_reason"]["type"] == "length"
    server.wait_idle()


TRAFFIC = ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
           "prompt_tokens", "generation_tokens", "cached_tokens", "num_requests")


def _traffic(text: str) -> dict[str, float]:
    """The user-traffic series of /metrics: request counters, latency histograms, token counters."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name.removeprefix("radixserve:") in TRAFFIC:
            for s in family.samples:
                values[s.name + str(sorted(s.labels.items()))] = s.value
    return values


@pytest.mark.slow
def test_health_generate_is_not_user_traffic(server):
    before = _traffic(httpx.get(server.url + "/metrics").text)
    for _ in range(3):
        assert httpx.get(server.url + "/health_generate", headers=server.headers, timeout=60).status_code == 200
    after = _traffic(httpx.get(server.url + "/metrics").text)
    assert after == before
    with server.client() as c:  # while a real request counts
        assert c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    counted = _traffic(httpx.get(server.url + "/metrics").text)
    changed = {k for k in counted if counted[k] != before.get(k)}
    assert any("time_to_first_token" in k for k in changed) and any("num_requests" in k for k in changed), changed


@pytest.mark.slow
def test_server_info_shows_the_backends_chosen(server):
    with server.client() as c:
        args = c.get("/get_server_info").json()["server_args"]
    assert args["prefill_attention_backend"] == args["decode_attention_backend"] == "torch_native"
    assert args["attention_backend"] == "torch_native"
    assert args["grammar_backend"] in ("xgrammar", "llguidance", "none")


def test_per_request_cost_bounds_are_400s_naming_the_field(server):
    """Stop strings, stop ids, logit_bias and n x prompt past the engine's limits are refused
    before anything runs, naming the field and the flag (20k stop strings: the most this
    server's --max-payload-size lets through)."""
    stop = [f"s{i}" for i in range(20000)]
    with server.client() as c:
        for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "stop": stop, "n": 16}),
                           ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "stop": stop}),
                           ("/generate", {"text": "Hi", "sampling_params": {"max_new_tokens": 2, "stop": stop}})):
            err = error_of(c.post(path, json=body), 400, "stop")
            assert "--max-stop-strings" in err["message"]
        err = error_of(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                       "stop_token_ids": list(range(5000))}), 400, "stop_token_ids")
        assert "--max-stop-token-ids" in err["message"]
        err = error_of(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2,
                                                       "logit_bias": {str(t): 1 for t in range(5000)}}),
                       400, "logit_bias")
        assert "--max-logit-bias" in err["message"]
        long_prompt = list(range(100, 4100))  # 4,000 tokens x n 66 > 262,144
        err = error_of(c.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 1, "n": 66}), 400, "n")
        assert "--max-request-prompt-tokens" in err["message"]
        assert c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stop": stop[:128]}).status_code \
            == 200


def test_cache_salt_and_extra_key_keep_tenants_apart(server):
    """Different cache_salt / extra_key values never share a cached prefix; the same one does."""
    messages = [{"role": "user", "content": "Tell me about lighthouses. " * 20}]

    def cached(path, **fields):
        body = ({"messages": messages, "max_tokens": 1, "temperature": 0} if path == "/v1/chat/completions"
                else {"text": messages[0]["content"], "sampling_params": {"max_new_tokens": 1}})
        r = c.post(path, json={**body, **fields})
        assert r.status_code == 200, r.text
        out = r.json()
        return (out["usage"]["prompt_tokens_details"]["cached_tokens"] if "usage" in out
                else out["meta_info"]["cached_tokens"])

    with server.client() as c:
        cached("/v1/chat/completions", cache_salt="tenant-a")
        assert cached("/v1/chat/completions", cache_salt="tenant-a") > 0
        assert cached("/v1/chat/completions", cache_salt="tenant-b") == 0
        assert cached("/v1/chat/completions", cache_salt="tenant-a", extra_key="x") == 0
        cached("/generate", extra_key="k1")
        assert cached("/generate", extra_key="k1") > 0
        assert cached("/generate", extra_key="k2") == 0
        for bad in ("", 5, "x" * 2000):
            error_of(c.post("/v1/chat/completions", json={"messages": messages, "cache_salt": bad}), 400,
                     "cache_salt")


def test_a_seed_may_take_all_64_bits(server):
    """The body parser's integer range covers unsigned 64-bit values (SamplingParams' MAX_SEED);
    one past it is a 400, never a 500."""
    with server.client() as c:
        ok = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 1.0, "seed": 2**64 - 1})
        assert ok.status_code == 200, ok.text
        error_of(c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "seed": 2**64}), 400)


def test_the_engine_leaves_its_start_up_objects_out_of_garbage_collection(server):
    """A full collection would otherwise walk torch, the model and the tokenizer (~400k
    objects, 200+ ms) at some step of a busy server, stalling every running request."""
    with server.client() as c:
        stats = c.get("/get_server_info").json()["stats"]
    assert stats["gc_frozen_objects"] > 50_000, stats.get("gc_frozen_objects")
