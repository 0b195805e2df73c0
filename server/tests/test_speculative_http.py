"""Speculative decoding over HTTP: the per-request counts in ``/generate``'s meta_info and
OpenAI ``usage``, and the ``radixserve:spec_*`` series in ``/metrics``.

Greedy parity with plain decoding is the core's to test (tests/test_speculative*.py); here
one NGRAM server (started through the ``radixserve serve`` CLI) checks the numbers reach
the client and are sane. Prompts hold a repeated list, so the n-gram proposer finds drafts.
"""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from radixserve_server.app import usage
from radixserve_server.generation import SeqResult
from radixserve_server.metrics import Metrics
from serverproc import start_server

LIST = "red, green, blue, yellow, red, green, blue, yellow, red, green, blue, yellow, red, green,"
MAX_TOKENS = 16


def sse_events(resp: httpx.Response) -> list:
    return [json.loads(line[6:]) for line in resp.iter_lines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def check_counts(verify_ct, accept_length, completion_tokens: int) -> None:
    assert isinstance(verify_ct, int) and 1 <= verify_ct <= completion_tokens
    assert isinstance(accept_length, float) and accept_length >= 1.0


# ------------------------------------------------------------ without a server
def test_usage_has_spec_fields_only_when_speculating():
    a = SeqResult("a", ids=[1, 2, 3, 4, 5], prompt_tokens=7, spec_verify_ct=2, spec_accepted_tokens=2)
    b = SeqResult("b", ids=[1, 2, 3], prompt_tokens=7, spec_verify_ct=2, spec_accepted_tokens=0)
    plain = usage([a, b], 2)
    assert plain == {"prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15,
                     "prompt_tokens_details": {"cached_tokens": 0}}
    spec = usage([a, b], 2, spec=True)
    assert {k: v for k, v in spec.items() if not k.startswith("spec_")} == plain
    assert spec["spec_verify_ct"] == 4 and spec["spec_accept_length"] == (4 + 2) / 4
    assert usage([SeqResult("c", ids=[1])], 1, spec=True)["spec_accept_length"] == 0.0


def test_metrics_spec_series_only_once_reported():
    m = Metrics("m")
    m.set_engine_stats({"num_running_reqs": 0, "token_usage": 0.0})
    assert "spec" not in m.render().decode()
    m.set_engine_stats({"spec_num_verify_steps": 3, "spec_num_draft_tokens": 9, "spec_num_accepted_tokens": 4,
                        "spec_acceptance_rate": 4 / 9, "spec_accept_length": 2.0,
                        "spec_accept_length_hist": {1: 1, 3: 1}, "spec_num_proposer_errors": 0})
    m.set_engine_stats({"spec_num_verify_steps": 4, "spec_num_draft_tokens": 9, "spec_num_accepted_tokens": 4,
                        "spec_acceptance_rate": 4 / 9, "spec_accept_length": 2.0,
                        "spec_accept_length_hist": {1: 2, 3: 1}, "spec_num_proposer_errors": 0})
    samples = {(s.name, s.labels.get("accept_length")): s.value
               for f in text_string_to_metric_families(m.render().decode()) for s in f.samples}
    assert samples[("radixserve:spec_num_verify_steps", None)] == 4
    assert samples[("radixserve:spec_accept_length_count", "1")] == 2
    assert samples[("radixserve:spec_accept_length_count", "3")] == 1


# --------------------------------------------------------------- one server
@pytest.fixture(scope="module")
def spec_server():
    sp = start_server("--speculative-algorithm", "NGRAM", "--speculative-disable-by-batch-size", "1000000")
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


@pytest.mark.slow
def test_generate_meta_info(spec_server):
    with spec_server.client() as c:
        assert c.get("/get_server_info").json()["engine"]["speculative_algorithm"] == "NGRAM"
        body = {"text": f"Continue the list: {LIST}",
                "sampling_params": {"temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}}
        out = c.post("/generate", json=body).json()
        meta = out["meta_info"]
        assert meta["completion_tokens"] == MAX_TOKENS
        check_counts(meta["spec_verify_ct"], meta["spec_accept_length"], meta["completion_tokens"])
        # streamed: every chunk carries the running counts, the last one the final counts
        with c.stream("POST", "/generate", json=dict(body, stream=True)) as resp:
            chunks = sse_events(resp)
        assert all("spec_verify_ct" in ch["meta_info"] for ch in chunks)
        last = chunks[-1]["meta_info"]
        check_counts(last["spec_verify_ct"], last["spec_accept_length"], last["completion_tokens"])
    spec_server.wait_idle()


@pytest.mark.slow
def test_openai_usage(spec_server):
    messages = [{"role": "user", "content": f"Repeat this list exactly: {LIST}"}]
    chat = {"messages": messages, "temperature": 0, "max_tokens": MAX_TOKENS}
    with spec_server.client() as c:
        r = c.post("/v1/chat/completions", json=chat).json()
        u = r["usage"]
        assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
        assert "cached_tokens" in u["prompt_tokens_details"]
        check_counts(u["spec_verify_ct"], u["spec_accept_length"], u["completion_tokens"])

        stream = dict(chat, stream=True, stream_options={"include_usage": True})
        with c.stream("POST", "/v1/chat/completions", json=stream) as resp:
            events = sse_events(resp)
        final = events[-1]
        assert final["choices"] == []
        su = final["usage"]
        check_counts(su["spec_verify_ct"], su["spec_accept_length"], su["completion_tokens"])
        assert all("usage" not in e for e in events[:-1])

        # text completions, two choices: the verify steps add up over the choices
        r = c.post("/v1/completions", json={"prompt": LIST, "temperature": 0, "max_tokens": MAX_TOKENS,
                                            "n": 2, "ignore_eos": True}).json()
        u = r["usage"]
        assert u["completion_tokens"] == 2 * MAX_TOKENS
        assert u["spec_verify_ct"] >= 2
        check_counts(u["spec_verify_ct"], u["spec_accept_length"], u["completion_tokens"])
    spec_server.wait_idle()


@pytest.mark.slow
def test_metrics(spec_server):
    with spec_server.client() as c:
        c.post("/generate", json={"text": LIST, "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        text = c.get("/metrics").text
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    value = {name: ss[0].value for name, ss in samples.items()}
    assert value["radixserve:spec_num_verify_steps"] > 0
    assert value["radixserve:spec_num_draft_tokens"] >= value["radixserve:spec_num_accepted_tokens"] >= 0
    assert 0.0 <= value["radixserve:spec_acceptance_rate"] <= 1.0
    assert value["radixserve:spec_accept_length"] >= 1.0
    assert value["radixserve:spec_num_proposer_errors"] == 0
    hist = samples["radixserve:spec_accept_length_count"]
    assert hist and all(int(s.labels["accept_length"]) >= 1 and s.value > 0 for s in hist)


@pytest.mark.slow
def test_dropped_streams_mid_speculation_leak_nothing(spec_server):
    """Clients that hang up while their requests are speculating (drafts reserved, trees
    in flight) are aborted; their pages and slots all come back, the neighbour finishes."""
    import threading

    def drop_after(n: int, i: int) -> None:
        body = {"text": f"Item {i}. Continue the list: {LIST}", "stream": True,
                "sampling_params": {"temperature": 0.7, "max_new_tokens": 300, "ignore_eos": True}}
        seen = 0
        with spec_server.client() as c, c.stream("POST", "/generate", json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if seen >= n:
                        break

    result = {}

    def neighbour() -> None:
        with spec_server.client() as c:
            result["r"] = c.post("/generate", json={"text": LIST, "sampling_params": {
                "temperature": 0, "max_new_tokens": MAX_TOKENS, "ignore_eos": True}}).json()

    threads = [threading.Thread(target=drop_after, args=(2 + i % 3, i)) for i in range(6)]
    threads.append(threading.Thread(target=neighbour))
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert result["r"]["meta_info"]["completion_tokens"] == MAX_TOKENS
    spec_server.wait_idle()
    with spec_server.client() as c:
        stats = c.get("/get_server_info").json()["stats"]
    assert stats["num_aborted_reqs"] >= 6 and stats["spec_num_verify_steps"] > 0
