"""SGLang's own router (``sglang-router``, the PyPI wheel) in front of two radixserve workers,
started through ``radixserve router`` (which hands every flag to it).

Checked through the router: the model list, chat and completions with the ``openai``
client (the same greedy tokens as a worker gives directly), ``/generate`` plain and
streamed, cache-aware stickiness (a repeated prefix lands where it is cached), load spread
over both workers, and a killed worker taken out of rotation with no request lost.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytest.importorskip("sglang_router", reason="sglang-router is not installed (scripts/install.sh installs it)")

from serverproc import free_port, start_server  # noqa: E402

ROUTER_START_S = 120.0


class Router:
    def __init__(self, worker_urls: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w", suffix=".router.log", delete=False)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve.cli", "router", "--worker-urls", *worker_urls,
             "--policy", "cache_aware", "--host", "127.0.0.1", "--port", str(self.port),
             "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
             "--worker-startup-check-interval", "1", "--log-level", "warn",
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=self.log, stderr=subprocess.STDOUT)

    def wait_workers(self, count: int) -> None:
        deadline = time.monotonic() + ROUTER_START_S
        with httpx.Client(timeout=5.0) as c:
            while time.monotonic() < deadline:
                assert self.proc.poll() is None, self.tail()
                try:
                    loads = c.get(self.url + "/get_loads").json().get("workers", [])
                    if len(loads) == count:
                        return
                except (httpx.HTTPError, json.JSONDecodeError):
                    pass
                time.sleep(0.25)
        raise AssertionError(f"the router did not register {count} workers:\n{self.tail()}")

    def tail(self) -> str:
        with open(self.log.name, errors="replace") as fh:
            return fh.read()[-3000:]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def cluster():
    workers = [start_server(), start_server()]
    router = Router([w.url for w in workers])
    try:
        router.wait_workers(2)
        yield router, workers
    finally:
        router.stop()
        for w in workers:
            w.stop()


def finished(worker) -> int:
    with worker.client() as c:
        return c.get("/server_info").json()["stats"]["num_finished_reqs"]


def test_model_list_chat_and_completions_through_the_router(cluster):
    import openai

    router, workers = cluster
    with workers[0].client() as c:
        name = c.get("/model_info").json()["served_model_name"]
        direct = c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 12, "temperature": 0}).json()
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [name]
    chat = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == direct["choices"][0]["message"]["content"]
    done = client.completions.create(model=name, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert done.choices[0].text and done.usage.completion_tokens == 6
    stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Name a fruit."}],
                                            max_tokens=12, temperature=0, stream=True)
    assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == chat.choices[0].message.content


def test_generate_plain_and_streamed_through_the_router(cluster):
    router, _ = cluster
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
    with httpx.Client(base_url=router.url, timeout=120.0) as c:
        plain = c.post("/generate", json=body)
        assert plain.status_code == 200, plain.text
        chunks = []
        with c.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data:") and line != "data: [DONE]":
                    chunks.append(json.loads(line[5:]))
    assert chunks[-1]["text"] == plain.json()["text"]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 8


def test_cache_aware_stickiness_and_load_spread(cluster):
    router, workers = cluster
    before = [finished(w) for w in workers]
    prefix = "You are a careful assistant who answers questions about geography in detail. " * 4
    with httpx.Client(base_url=router.url, timeout=120.0) as c:
        cached = [c.post("/generate", json={"text": prefix + f"Question {i}:", "sampling_params": {
            "max_new_tokens": 2, "temperature": 0}}).json()["meta_info"]["cached_tokens"] for i in range(3)]

        def one(i: int) -> int:
            r = c.post("/generate", json={"text": f"{i} distinct request number {i * 7919} about topic {i}",
                                          "sampling_params": {"max_new_tokens": 16, "temperature": 0,
                                                              "ignore_eos": True}})
            return r.status_code

        with ThreadPoolExecutor(8) as pool:
            codes = list(pool.map(one, range(16)))
    assert codes == [200] * 16
    assert cached[0] < 10 and all(x > 40 for x in cached[1:]), cached  # the prefix stayed on one worker
    served = [finished(w) - b for w, b in zip(workers, before)]
    assert all(n >= 2 for n in served), served  # both workers took part of the load


def test_a_killed_worker_leaves_rotation_without_losing_requests(cluster):
    """Requests in flight on the killed worker may fail (no more than were on it); those on
    the other finish; once the health check has taken the dead worker out, nothing fails."""
    router, workers = cluster
    with httpx.Client(base_url=router.url, timeout=120.0) as c, ThreadPoolExecutor(6) as pool:
        def long(i: int) -> int:
            return c.post("/generate", json={"text": f"Story {i}: once upon a time in a land {i * 31} miles away",
                                             "sampling_params": {"max_new_tokens": 96, "ignore_eos": True}}).status_code

        running = [pool.submit(long, i) for i in range(6)]
        with workers[1].client() as w:
            deadline = time.monotonic() + 30
            while (on_dead := w.get("/server_info").json()["in_flight"]) == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
        workers[1].stop(signal.SIGKILL)
        codes = [f.result() for f in running]
        assert codes.count(200) >= len(codes) - on_dead, (codes, on_dead)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the health check takes it out of rotation
            healthy = sorted(w["url"] for w in c.get("/workers").json()["workers"] if w["is_healthy"])
            if healthy == [workers[0].url]:
                break
            time.sleep(0.25)
        assert healthy == [workers[0].url], healthy
        after = [c.post("/generate", json={"text": f"After the failure, request {i}",
                                           "sampling_params": {"max_new_tokens": 4}}).status_code for i in range(8)]
    assert after == [200] * 8, (after, router.tail())
