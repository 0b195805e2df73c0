"""Prefill-decode disaggregation behind SGLang's own router: a prefill server and a decode
server (the default model; the KV transfer engines mooncake over TCP and torch_dist over gloo;
nixl over UCX runs the same engine-level checks in tests/test_disaggregation_engine.py and the
TP servers in test_disaggregation_tp_http.py, not again behind the router) and
``sglang-router --pd-disaggregation`` started through ``radixserve router``.

Checked through the router: chat, completions and ``/generate``, streamed and not, give the
tokens one server gives (the prefill server asked directly, without a bootstrap room, serves
the whole request itself), and every one of them went through a KV transfer; a decode request
whose prefill server does not exist fails alone with a 503; a bootstrap room used twice is
refused with a 400; both servers end idle with no leaked page.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (scripts/install.sh installs it)")

from radixserve.registry import get_registry  # noqa: E402
from serverproc import free_port, start_server  # noqa: E402

TIMEOUT = "5"  # --disaggregation-transfer-timeout of both servers
# torch_dist's TCPStore looks its peers up in DNS; a slow resolver must not eat the timeout
ENV = {"RES_OPTIONS": "timeout:1 attempts:1"}


def server(mode: str, transport: str, *args: str):
    return start_server("--disaggregation-mode", mode, "--disaggregation-transfer-backend", transport,
                        "--disaggregation-transfer-timeout", TIMEOUT, *args, env=ENV)


@pytest.fixture(scope="module", params=("mooncake", "torch_dist"))
def pd(request):
    reason = get_registry().get("kv_transfer", request.param).unavailable_reason()
    if reason is not None:
        pytest.skip(f"{request.param} transfer engine unavailable: {reason}")
    bport = free_port()
    prefill = server("prefill", request.param, "--disaggregation-bootstrap-port", str(bport))
    decode = server("decode", request.param)
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".router.log", delete=False)
    router = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "router", "--pd-disaggregation",
         "--prefill", prefill.url, str(bport), "--decode", decode.url, "--host", "127.0.0.1", "--port", str(port),
         "--log-level", "warn", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
        stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        with httpx.Client(timeout=30.0) as c:
            while True:
                assert router.poll() is None, open(log.name).read()[-3000:]
                try:
                    if c.post(url + "/generate", json={"text": "hi", "sampling_params": {
                            "max_new_tokens": 1}}).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, open(log.name).read()[-3000:]
                time.sleep(0.5)
        yield url, prefill, decode, bport, request.param
    finally:
        router.send_signal(signal.SIGTERM)
        try:
            router.wait(30)
        except subprocess.TimeoutExpired:
            router.kill()
        for s in (prefill, decode):
            assert s.stop() == 0, s.log()


def stats(server) -> dict:
    with server.client() as c:
        return c.get("/server_info").json()["stats"]


def kill(server) -> None:
    """SIGKILL the server's engine process (which holds the bootstrap endpoint, the transfer
    engine and the KV pool), then its HTTP process."""
    with server.client() as c:
        pid = c.get("/server_info").json()["engine"]["pid"]
    os.kill(pid, signal.SIGKILL)
    server.stop(signal.SIGKILL)


def sse(response) -> list[dict]:
    return [json.loads(line[5:]) for line in response.iter_lines()
            if line.startswith("data:") and line.strip() != "data: [DONE]"]


def test_every_route_through_the_router_gives_one_servers_tokens(pd):
    url, prefill, decode, _, _ = pd
    received = stats(decode)["num_disagg_received"]
    with prefill.client() as c:
        name = c.get("/model_info").json()["served_model_name"]
    chat = {"model": name, "messages": [{"role": "user", "content": "Name three fruits."}], "max_tokens": 16,
            "temperature": 0}
    comp = {"model": name, "prompt": "The three largest oceans are", "max_tokens": 12, "temperature": 0}
    gen = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 10, "temperature": 0}}
    with prefill.client() as direct, httpx.Client(base_url=url, timeout=120.0) as routed:
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp), ("/generate", gen)):
            want = direct.post(path, json=body).json()
            got = routed.post(path, json=body)
            assert got.status_code == 200, got.text
            with routed.stream("POST", path, json={**body, "stream": True}) as r:
                assert r.status_code == 200
                chunks = sse(r)
            if path == "/generate":
                assert got.json()["output_ids"] == want["output_ids"]
                assert chunks[-1]["output_ids"] == want["output_ids"] or \
                    sum((c["output_ids"] for c in chunks), []) == want["output_ids"]
            elif path == "/v1/chat/completions":
                text = want["choices"][0]["message"]["content"]
                assert got.json()["choices"][0]["message"]["content"] == text
                assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == text
            else:
                text = want["choices"][0]["text"]
                assert got.json()["choices"][0]["text"] == text
                assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == text
    assert stats(decode)["num_disagg_received"] - received == 6  # each routed request's KV came over
    with decode.client() as c:
        assert "radixserve:num_decode_transfer_queue_reqs" in c.get("/metrics").text
    for s in (prefill, decode):
        s.wait_idle()


def test_a_missing_prefill_server_fails_that_request_alone(pd):
    _, prefill, decode, _, _ = pd
    with decode.client() as c:
        r = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4},
                                      "bootstrap_host": "127.0.0.1", "bootstrap_port": free_port(),
                                      "bootstrap_room": 7})
        assert r.status_code == 503, r.text
        assert "bootstrap" in r.json()["error"]["message"]
        ok = c.post("/generate", json={"text": "Hello", "sampling_params": {"max_new_tokens": 4, "temperature": 0}})
        assert ok.status_code == 200
    decode.wait_idle()


def test_a_room_used_twice_is_refused(pd):
    _, prefill, _, bport, transport = pd
    if transport != "mooncake":
        pytest.skip("the room table is the core's, whatever the transport: checked once, with mooncake")
    body = {"text": "Room test", "sampling_params": {"max_new_tokens": 4}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": bport, "bootstrap_room": 424242}
    with prefill.client() as c:
        first = c.post("/generate", json=body)  # its KV waits for a decode server that never registers
        assert first.status_code == 200, first.text
        again = c.post("/generate", json=body)
        assert again.status_code == 400 and "already in use" in again.json()["error"]["message"]
        many = c.post("/generate", json={**body, "bootstrap_room": 1, "sampling_params": {"n": 2}})
        assert many.status_code == 400 and many.json()["error"]["param"] == "n"
    prefill.wait_idle(timeout=float(TIMEOUT) + 30)  # the unclaimed pages are freed after the timeout
    assert stats(prefill)["num_disagg_send_failed"] >= 1


def test_a_side_killed_mid_request_fails_that_request_alone(pd):
    """A prefill server killed while a decode request waits for its KV: that request gets a
    503 within the timeout. A decode server killed before its KV is written: the prefill
    server fails the room (one log line) and frees the pages. Both survivors end idle."""
    _, prefill, decode, bport, transport = pd
    if transport != "mooncake":
        pytest.skip("a killed side is the core's fault path, whatever the transport: checked once, with mooncake "
                    "(the torch_dist suite kills a receiving process itself)")
    dead_boot = free_port()
    doomed = server("prefill", transport, "--disaggregation-bootstrap-port", str(dead_boot))
    body = {"text": "Killed in the middle", "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "bootstrap_host": "127.0.0.1", "bootstrap_port": dead_boot, "bootstrap_room": 99}
    with decode.client() as c, ThreadPoolExecutor(1) as pool:
        waiting = pool.submit(c.post, "/generate", json=body)  # registers with `doomed`, then waits
        deadline = time.monotonic() + 30
        while stats(decode)["num_disagg_waiting_reqs"] == 0:
            assert time.monotonic() < deadline and not waiting.done(), "the decode request never waited"
            time.sleep(0.05)
        kill(doomed)
        t0 = time.monotonic()
        r = waiting.result()
        assert r.status_code == 503, r.text
        assert time.monotonic() - t0 < float(TIMEOUT) + 5
    doomed_decode = server("decode", transport)
    failed = stats(prefill)["num_disagg_send_failed"]
    body = {**body, "bootstrap_port": bport, "bootstrap_room": 100}
    with doomed_decode.client() as d, ThreadPoolExecutor(1) as pool:
        pool.submit(d.post, "/generate", json=body)  # registers its pages with the prefill server
        deadline = time.monotonic() + 30
        while stats(doomed_decode)["num_disagg_waiting_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        kill(doomed_decode)
    with prefill.client() as c:
        assert c.post("/generate", json=body).status_code == 200  # its own first token
    deadline = time.monotonic() + float(TIMEOUT) + 30
    while stats(prefill)["num_disagg_send_failed"] == failed:
        assert time.monotonic() < deadline, "the prefill server never gave up on the dead decode server"
        time.sleep(0.1)
    prefill.wait_idle(timeout=float(TIMEOUT) + 30)
    decode.wait_idle(timeout=float(TIMEOUT) + 30)
