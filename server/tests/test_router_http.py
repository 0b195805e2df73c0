"""``radixserve router`` over two tiny-model servers: proxying, and surviving one worker's
death (its in-flight requests 503, the other's go on, later requests go to the live one,
and the worker is taken back once it answers again)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import pytest
import serverproc
from serverproc import free_port, start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)

GREEDY = {"max_new_tokens": 4, "temperature": 0}
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def start_workers(path: str, ports: list[int | None]) -> list[serverproc.ServerProc]:
    """Servers started side by side (``None``: any free port)."""
    out: list = [None] * len(ports)
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            if ports[i] is None:
                out[i] = start_server("--model", path, "--dtype", "float32", "--num-threads", "1")
            else:  # the same port again: a worker coming back
                original = serverproc.free_port
                serverproc.free_port = lambda: ports[i]
                try:
                    out[i] = start_server("--model", path, "--dtype", "float32", "--num-threads", "1")
                finally:
                    serverproc.free_port = original
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ports))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for sp in out:
            if sp is not None:
                sp.stop(signal.SIGKILL)
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_router"))
    build_checkpoint(path, "llama", seed=6)
    workers = start_workers(path, [None, None])
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    router = subprocess.Popen(
        [sys.executable, "-m", "radixserve.cli", "router", "--port", str(port), "--policy", "round_robin",
         "--health-check-interval-secs", "0.5", "--worker-urls", *(w.url for w in workers)],
        stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if router.poll() is not None or time.monotonic() > deadline:
            router.kill()
            raise RuntimeError(open(log.name).read())
        time.sleep(0.2)
    state = {"path": path, "workers": workers, "url": url, "log": log.name}
    yield state
    router.send_signal(signal.SIGTERM)
    code = router.wait(30)
    for w in state["workers"]:
        w.stop()
    assert code == 0, open(log.name).read()


def workers_of(c: httpx.Client) -> dict[str, dict]:
    return {w["url"]: w for w in c.get("/list_workers").json()["workers"]}


def test_proxies_each_endpoint(cluster):
    with httpx.Client(base_url=cluster["url"], timeout=60) as c:
        r = c.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4, r.text
        r = c.post("/v1/completions", json={"prompt": [5, 6, 7, 8], "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200 and r.json()["object"] == "text_completion", r.text
        with c.stream("POST", "/v1/completions", json={"prompt": "hello", "max_tokens": 3, "stream": True}) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            body = s.read().decode()
        assert body.rstrip().endswith("data: [DONE]")
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]  # the worker's answer
        assert c.get("/v1/models").json()["data"][0]["object"] == "model"
        assert c.get("/v1/models").status_code == 200
        assert c.get("/health").json() == {"status": "ok", "healthy_workers": 2, "workers": 2}
        assert [w["num_requests"] for w in workers_of(c).values()] == [3, 3]  # round robin
        assert "radixserve_router:worker_healthy{" in c.get("/metrics").text
        # the tokenizer endpoints and the model info reach a worker too
        toks = c.post("/tokenize", json={"prompt": "hello"}).json()
        assert toks["count"] == len(toks["tokens"]) > 0, toks
        back = c.post("/detokenize", json={"tokens": toks["tokens"]})
        assert back.status_code == 200 and isinstance(back.json()["text"], str), back.text
        assert c.post("/detokenize", json={"tokens": [-1]}).status_code == 400
        assert c.get("/get_model_info").json()["is_generation"] is True


def test_survives_a_worker_killed_mid_request(cluster):
    w0, w1 = cluster["workers"]
    results: dict = {}

    def send(name: str, path: str, body: dict) -> None:
        with httpx.Client(base_url=cluster["url"], timeout=120) as c:
            if body.get("stream"):
                with c.stream("POST", path, json=body) as s:
                    results[name] = (s.status_code, s.read().decode())
            else:
                r = c.post(path, json=body)
                results[name] = (r.status_code, r.text)

    with httpx.Client(base_url=cluster["url"], timeout=60) as c:
        before = workers_of(c)
        # round robin, 6 requests so far: w0 gets a and c, w1 gets b
        plan = [("a", "/generate", {"input_ids": [9, 10, 11], "sampling_params": LONG}),
                ("b", "/generate", {"input_ids": [9, 10, 11], "stream": True,
                                    "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True}}),
                ("c", "/v1/completions", {"prompt": [9, 10, 11], "stream": True, "max_tokens": 3000,
                                          "ignore_eos": True})]
        threads = []
        for name, path, body in plan:
            threads.append(threading.Thread(target=send, args=(name, path, body)))
            threads[-1].start()
            deadline = time.monotonic() + 20
            while sum(w["load"] for w in workers_of(c).values()) < len(threads) and time.monotonic() < deadline:
                time.sleep(0.02)
        loads = {u: w["load"] for u, w in workers_of(c).items()}
        assert loads == {w0.url: 2, w1.url: 1}, (loads, results)
        w0.proc.kill()
        w0.proc.wait(10)
        for t in threads:
            t.join(120)
        status, text = results["a"]
        assert status == 503 and json.loads(text)["error"]["type"] == "service_unavailable", text
        status, text = results["c"]  # a 503, or once the stream has started, an SSE error event and [DONE]
        if status == 200:
            assert '"service_unavailable"' in text and text.rstrip().endswith("data: [DONE]"), text
        else:
            assert status == 503 and json.loads(text)["error"]["type"] == "service_unavailable", text
        status, text = results["b"]  # the other worker's request went on
        assert status == 200 and '"length"' in text and text.rstrip().endswith("data: [DONE]"), text
        after = workers_of(c)
        assert not after[w0.url]["healthy"] and after[w1.url]["healthy"]
        for _ in range(4):
            r = c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY})
            assert r.status_code == 200, r.text
        now = workers_of(c)
        assert now[w0.url]["num_requests"] == after[w0.url]["num_requests"]  # nothing new to the dead one
        assert now[w1.url]["num_requests"] == after[w1.url]["num_requests"] + 4
        assert now[w0.url]["num_requests"] == before[w0.url]["num_requests"] + 2
        health = c.get("/health").json()
        assert health["healthy_workers"] == 1
        assert f'radixserve_router:worker_healthy{{worker="{w0.url}"}} 0.0' in c.get("/metrics").text

        # the worker comes back on its port: checked, taken back, routed to again
        (back,) = start_workers(cluster["path"], [w0.port])
        cluster["workers"][0] = back
        deadline = time.monotonic() + 20
        while not workers_of(c)[w0.url]["healthy"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert workers_of(c)[w0.url]["healthy"]
        for _ in range(2):
            assert c.post("/generate", json={"input_ids": [5, 6, 7], "sampling_params": GREEDY}).status_code == 200
        assert workers_of(c)[w0.url]["num_requests"] == now[w0.url]["num_requests"] + 1
