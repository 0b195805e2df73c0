"""The OpenAI-compatible and native endpoints, driven over HTTP against a real server process."""

from __future__ import annotations

import json
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serverproc import API_KEY

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct.Q4_1"


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The offline engine on the same model, as the reference for greedy outputs."""
    import radixserve

    engine = radixserve.Engine(max_total_tokens=4096, context_length=4096)
    yield engine
    engine.shutdown()


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------ basics
def test_models_health_and_info(server):
    with server.client() as c:
        models = c.get("/v1/models").json()
        assert [m["id"] for m in models["data"]] == [MODEL]
        assert models["data"][0]["max_model_len"] == 4096
        assert c.get("/health").json() == {"status": "ok"}
        assert c.get("/health_generate").status_code == 200
        info = c.get("/get_server_info").json()
        assert info["status"] == "ready" and info["engine"]["context_length"] == 4096
        assert info["http_args"]["api_key"] == "***"
        # --kv-cache-dtype as given and as resolved (auto: the activation dtype, float32 on CPU)
        assert info["server_args"]["kv_cache_dtype"] == "auto" and info["engine"]["kv_cache_dtype"] == "float32"


def test_chat_greedy_matches_offline_engine(oai, offline, idle_after):
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    ids = offline.tokenizer.encode_chat(messages)
    ref = offline.generate(input_ids=ids, sampling_params={"max_new_tokens": 24, "temperature": 0})
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == ("length" if ref["meta_info"]["finish_reason"]["type"] == "length" else "stop")
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == len(ref["output_ids"])
    # the same prompt again is served from the prefix cache
    r2 = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=24, temperature=0)
    assert r2.choices[0].message.content == ref["text"]
    assert r2.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_streaming_equals_non_streaming(oai, server, idle_after):
    messages = [{"role": "user", "content": "Write a haiku about the sea."}]
    full = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                         stream=True, stream_options={"include_usage": True})
    pieces, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                pieces.append(ch.delta.content)
            if ch.finish_reason:
                reasons.append(ch.finish_reason)
    assert "".join(pieces) == full.choices[0].message.content
    assert len(pieces) > 1
    assert reasons == [full.choices[0].finish_reason]
    assert usage.completion_tokens == full.usage.completion_tokens
    # raw SSE ends with [DONE]
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json={
            "messages": messages, "max_tokens": 4, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]" and events[0]["choices"][0]["delta"]["role"] == "assistant"


def test_chat_n_seed_and_logprobs(oai, idle_after):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "Tell me a word."}], max_tokens=8,
              temperature=1.0, seed=7)
    a = oai.chat.completions.create(n=3, **kw)
    b = oai.chat.completions.create(n=3, **kw)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1  # seeds 7, 8, 9 sample differently
    r = oai.chat.completions.create(model=MODEL, messages=kw["messages"], max_tokens=6, temperature=0,
                                    logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        # greedy: the chosen token is the most likely one
        assert entry.token == entry.top_logprobs[0].token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completions_prompt_forms(oai, offline, idle_after):
    ref_ids = offline.tokenizer.encode("The capital of France is")
    ref = offline.generate(input_ids=ref_ids, sampling_params={"max_new_tokens": 8, "temperature": 0})
    for prompt in ("The capital of France is", ref_ids):
        r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0)
        assert r.choices[0].text == ref["text"]
    r = oai.completions.create(model=MODEL, prompt=["The capital of France is", "1, 2, 3,"], max_tokens=8,
                               temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert r.choices[0].text == r.choices[1].text == ref["text"]
    assert r.choices[2].text == r.choices[3].text != ref["text"]
    r = oai.completions.create(model=MODEL, prompt=[ref_ids, ref_ids], max_tokens=8, temperature=0)
    assert [c.text for c in r.choices] == [ref["text"]] * 2
    r = oai.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                               echo=True, logprobs=2)
    assert r.choices[0].text.startswith("The capital of France is")
    lp = r.choices[0].logprobs  # the echoed prompt's tokens first (the first has no logprob), then 4
    n = len(ref_ids)
    assert len(lp.tokens) == len(lp.token_logprobs) == n + 4 and all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.text_offset[0] == 0 and lp.text_offset[n] == len("The capital of France is")


def test_completions_streaming_with_stop(oai, idle_after):
    kw = dict(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=30, temperature=0)
    free = oai.completions.create(**kw).choices[0].text
    assert " 7" in free
    stopped = oai.completions.create(stop=[" 7"], **kw)
    assert stopped.choices[0].text == free[:free.index(" 7")]
    assert stopped.choices[0].finish_reason == "stop"
    text = "".join(ch.choices[0].text for ch in oai.completions.create(stop=[" 7"], stream=True, **kw)
                   if ch.choices)
    assert text == stopped.choices[0].text


def test_native_generate(server, offline, idle_after):
    ref = offline.generate("Hello, my name is", {"max_new_tokens": 6, "temperature": 0})
    with server.client() as c:
        out = c.post("/generate", json={"text": "Hello, my name is",
                                        "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        assert out["text"] == ref["text"] and out["output_ids"] == ref["output_ids"]
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        assert out["meta_info"]["completion_tokens"] == 6
        ids = offline.tokenizer.encode("Hello, my name is")
        batch = c.post("/generate", json={"input_ids": [ids, ids], "return_logprob": True,
                                          "sampling_params": {"max_new_tokens": 6, "temperature": 0}}).json()
        assert [b["output_ids"] for b in batch] == [ref["output_ids"]] * 2
        assert len(batch[0]["meta_info"]["output_token_logprobs"]) == 6
        with c.stream("POST", "/generate", json={"text": "Hello, my name is", "stream": True,
                                                 "sampling_params": {"max_new_tokens": 6, "temperature": 0}}) as resp:
            events = sse_events(resp)
    assert events[-1] == "[DONE]"
    assert events[-2]["text"] == ref["text"] and events[-2]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-2])


# ---------------------------------------------------------------- bad input
BAD_CHAT = [
    ({"messages": "hi"}, 400, "messages"),
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": -1}, 400, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "top_p": 1.5}, 400, "top_p"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": -5}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 10**6}, 400, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]}, 400, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "stream"),
    ({"messages": [{"role": "user", "content": "x"}], "frequency_penalty": 9}, 400, "frequency_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "model": "gpt-17"}, 404, "model"),
    ({"messages": [{"role": "user", "content": "x"}], "seed": -1}, 400, "seed"),
    ({"messages": [{"role": "user", "content": "x"}], "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    ({"messages": [{"role": "user", "content": "x"}], "regex": "a+", "ebnf": "root ::= \"a\""}, 400, None),
    ({"messages": [{"role": "user", "content": "word " * 5000}]}, 400, "messages"),
]
BAD_COMPLETIONS = [
    ({"prompt": 5}, 400, "prompt"),
    ({"prompt": [1, -3]}, 400, "prompt"),
    ({"prompt": [10**9]}, 400, "prompt"),
    ({"prompt": [1] * 5000}, 400, "prompt"),
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ({"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ({}, 400, "prompt"),
]
BAD_GENERATE = [
    ({"text": "x", "input_ids": [1]}, 400, "text"),
    ({"text": "x", "sampling_params": {"temperature": "cold"}}, 400, "temperature"),
    ({"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ({"text": "x", "sampling_params": {"max_new_tokens": 10**6}}, 400, "max_new_tokens"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, 400, "sampling_params"),
]


def _check_error(resp: httpx.Response, status: int, param: str | None) -> None:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    if param is not None:
        assert err["param"] == param or (err["param"] or "").startswith(param), err


def test_bad_input_gets_4xx_and_neighbours_survive(server, idle_after):
    results: dict = {}

    def neighbour():
        with server.client() as c:
            results["r"] = c.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 24,
                                                           "temperature": 0, "ignore_eos": True})

    t = threading.Thread(target=neighbour)
    t.start()
    with server.client() as c:
        for body, status, param in BAD_CHAT:
            _check_error(c.post("/v1/chat/completions", json=body), status, param)
        for body, status, param in BAD_COMPLETIONS:
            _check_error(c.post("/v1/completions", json=body), status, param)
        for body, status, param in BAD_GENERATE:
            _check_error(c.post("/generate", json=body), status, param)
        for raw in (b"{not json", b"[1, 2]", b"\xff\xfe"):
            _check_error(c.post("/v1/chat/completions", content=raw,
                                headers={"content-type": "application/json"}), 400, None)
        _check_error(c.post("/v1/completions", json={"prompt": "x" * 300_000}), 413, None)
        _check_error(c.get("/v1/nope"), 404, None)
    t.join()
    r = results["r"]
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    with server.client() as c:
        assert c.get("/health").status_code == 200


def test_api_key_and_open_paths(server):
    body = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    url = server.url
    assert httpx.post(url + "/v1/chat/completions", json=body).status_code == 401
    r = httpx.post(url + "/v1/chat/completions", json=body, headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.post(url + "/v1/chat/completions", json=body, headers={"x-api-key": API_KEY},
                      timeout=60).status_code == 200
    assert httpx.get(url + "/v1/models").status_code == 401
    for path in ("/health", "/metrics"):
        assert httpx.get(url + path).status_code == 200
    assert httpx.get(url + "/health_generate").status_code == 401  # it runs a generation: keyed


def test_cors_only_for_the_given_origin(server):
    def preflight(origin):
        return httpx.options(server.url + "/v1/chat/completions", headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})

    assert preflight("http://allowed.example").headers.get("access-control-allow-origin") == "http://allowed.example"
    assert "access-control-allow-origin" not in preflight("http://evil.example").headers


def test_metrics_parse(server, oai):
    oai.completions.create(model=MODEL, prompt="metrics please", max_tokens=3, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in ("radixserve:num_running_reqs", "radixserve:num_queue_reqs", "radixserve:token_usage",
                 "radixserve:cache_hit_rate", "radixserve:time_to_first_token_seconds",
                 "radixserve:inter_token_latency_seconds", "radixserve:e2e_request_latency_seconds",
                 "radixserve:prompt_tokens", "radixserve:generation_tokens"):
        assert name in families, name

    def value(family, suffix):
        return sum(s.value for s in families[family].samples if s.name == family + suffix)

    assert value("radixserve:time_to_first_token_seconds", "_count") >= 1
    assert value("radixserve:e2e_request_latency_seconds", "_count") >= 1
    assert value("radixserve:generation_tokens", "_total") >= 3
    assert value("radixserve:prompt_tokens", "_total") >= 1
    assert families["radixserve:token_usage"].samples[0].value > 0  # the cache holds pages


def test_abort_request_and_flush_cache(server, idle_after):
    with server.client() as c:
        with c.stream("POST", "/generate", json={
                "text": "Tell me a long story.", "rid": "abort-me", "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}) as resp:
            events = []
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
                    if len(events) == 2:
                        assert c.post("/abort_request", json={"rid": "abort-me"}).json()["success"]
        assert events[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(events[-1]["output_ids"]) < 2000
        server.wait_idle()
        assert c.post("/flush_cache").json()["success"]
        info = c.get("/get_server_info").json()
        assert info["stats"]["num_cached_tokens"] == 0


def test_health_answers_during_long_prefill(server, idle_after):
    """The event loop never waits on a forward pass."""
    ids = list(range(1000, 4000))  # 3000 tokens: a long prefill on this CPU
    done = {}

    def long_request():
        t0 = time.perf_counter()
        with server.client() as c:
            done["status"] = c.post("/generate", json={"input_ids": ids, "sampling_params": {
                "max_new_tokens": 1}}).status_code
        done["seconds"] = time.perf_counter() - t0

    t = threading.Thread(target=long_request)
    t.start()
    time.sleep(0.3)
    latencies = []
    with server.client() as c:
        while t.is_alive():
            t0 = time.perf_counter()
            assert c.get("/health").status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(0.05)
    t.join()
    assert done["status"] == 200
    assert latencies and max(latencies) < max(0.5, done["seconds"] / 4), (latencies, done)


# ------------------------------------------------------------- abort by id
LONG = {"max_new_tokens": 1500, "ignore_eos": True, "temperature": 0}


def _in_background(server, path: str, body: dict) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run():
        with server.client() as c:
            out["r"] = c.post(path, json=body)

    t = threading.Thread(target=run)
    t.start()
    return t, out


def _wait_in_flight(c: httpx.Client, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while c.get("/get_server_info").json()["in_flight"] < count:
        assert time.monotonic() < deadline, f"never {count} sequences in flight"
        time.sleep(0.05)


def test_abort_by_exact_id_not_by_prefix(server, idle_after):
    """"abc" aborts the request "abc" and its n children, not another client's "abc-def"."""
    with server.client() as c:
        other, other_out = _in_background(server, "/generate", {"text": "Tell a story.", "rid": "abc-def",
                                                                "sampling_params": LONG})
        _wait_in_flight(c, 1)
        mine, mine_out = _in_background(server, "/generate", {"text": "Tell a joke.", "rid": "abc",
                                                              "sampling_params": dict(LONG, n=2)})
        _wait_in_flight(c, 3)
        r = c.post("/abort_request", json={"rid": "abc"}).json()
        assert r["success"] and sorted(r["aborted"]) == ["abc-0", "abc-1"]
        mine.join(60)
        assert [o["meta_info"]["finish_reason"]["type"] for o in mine_out["r"].json()] == ["abort", "abort"]
        assert other.is_alive() and c.get("/get_server_info").json()["in_flight"] == 1
        assert c.post("/abort_request", json={"rid": "nothing-here"}).json() == {"success": False, "aborted": []}
        assert c.post("/abort_request", json={"rid": "abc-def"}).json()["aborted"] == ["abc-def"]
        other.join(60)
        assert other_out["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_abort_a_multi_prompt_completion_by_prompt_and_all(server, idle_after):
    with server.client() as c:
        t, out = _in_background(server, "/v1/completions", {"prompt": ["Once", "Twice"], "n": 2, "rid": "mp",
                                                            "max_tokens": 1500, "ignore_eos": True})
        _wait_in_flight(c, 4)
        assert sorted(c.post("/abort_request", json={"rid": "mp-p1"}).json()["aborted"]) == ["mp-p1-0", "mp-p1-1"]
        assert c.post("/abort_request", json={"rid": "mp-p0-1"}).json()["aborted"] == ["mp-p0-1"]
        assert c.post("/abort_request", json={"rid": "mp"}).json()["aborted"] == ["mp-p0-0"]
        t.join(60)
        assert [ch["finish_reason"] for ch in out["r"].json()["choices"]] == ["abort"] * 4


def test_abort_all(server, idle_after):
    with server.client() as c:
        threads = [_in_background(server, "/generate", {"text": f"Story {i}.", "rid": f"all-{i}",
                                                        "sampling_params": LONG}) for i in range(2)]
        _wait_in_flight(c, 2)
        r = c.post("/abort_request", json={"abort_all": True}).json()
        assert r["success"] and sorted(r["aborted"]) == ["all-0", "all-1"]
        for t, out in threads:
            t.join(60)
            assert out["r"].json()["meta_info"]["finish_reason"]["type"] == "abort"
        _check_error(c.post("/abort_request", json={}), 400, "rid")


def test_a_rid_already_in_flight_is_a_400(server, idle_after):
    with server.client() as c:
        t, out = _in_background(server, "/generate", {"text": "Tell a story.", "rid": "dup",
                                                      "sampling_params": LONG})
        _wait_in_flight(c, 1)
        for path, body in (("/generate", {"text": "x", "rid": "dup"}),
                           ("/generate", {"text": "x", "rid": "dup", "stream": True}),
                           ("/v1/completions", {"prompt": "x", "rid": "dup", "max_tokens": 1}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "rid": "dup",
                                                     "max_tokens": 1, "stream": True})):
            _check_error(c.post(path, json=body), 400, "rid")
        _check_error(c.post("/generate", json={"text": ["x", "y"], "rid": ["same", "same"]}), 400, "rid")
        _check_error(c.post("/generate", json={"text": ["x", "y"], "rid": "one"}), 400, "rid")
        assert c.get("/get_server_info").json()["in_flight"] == 1  # nothing of the refused ones was submitted
        c.post("/abort_request", json={"rid": "dup"})
        t.join(60)
        again = c.post("/generate", json={"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 1}})
        assert again.status_code == 200 and again.json()["meta_info"]["id"] == "dup"
