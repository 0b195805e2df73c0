"""A client's flood: 500 requests at once against ``--max-queued-requests 64``.

The excess gets 429 with ``Retry-After`` and an OpenAI-style body, every accepted request
completes, nothing leaks (the engine's idle invariant), and the processes' memory does not
grow from one flood to the next.
"""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from serverproc import start_server

FLOOD = 500
QUEUE = 64


@pytest.fixture(scope="module")
def flood_server():
    sp = start_server("--max-queued-requests", str(QUEUE), "--max-running-requests", "16")
    yield sp
    code = sp.stop()
    assert code == 0, f"server exited with {code}:\n{sp.log()}"


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def flood(url: str) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=FLOOD, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=300.0, limits=limits) as c:
        body = {"input_ids": [504, 3458, 282], "sampling_params": {"max_new_tokens": 2, "temperature": 0.0,
                                                                    "ignore_eos": True}}
        return await asyncio.gather(*(c.post("/generate", json=body) for _ in range(FLOOD)))


def run_flood(sp) -> tuple[int, int]:
    responses = asyncio.run(flood(sp.url))
    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(refused) == FLOOD, {r.status_code for r in responses}
    for r in ok:
        assert len(r.json()["output_ids"]) == 2
    for r in refused:
        assert int(r.headers["retry-after"]) >= 1
        err = r.json()["error"]
        assert "--max-queued-requests" in err["message"] and isinstance(err["code"], (str, type(None)))
    sp.wait_idle()
    return len(ok), len(refused)


def test_flood_is_refused_beyond_the_queue_and_leaves_nothing_behind(flood_server):
    sp = flood_server
    with sp.client() as c:
        engine_pid = c.get("/get_server_info").json()["engine"]["pid"]
    ok, refused = run_flood(sp)  # warm-up: allocator pools, thread pools, caches reach steady state
    assert refused > 0 and ok >= QUEUE
    before = rss_mb(sp.proc.pid), rss_mb(engine_pid)
    ok2, refused2 = run_flood(sp)
    assert refused2 > 0 and ok2 >= QUEUE
    after = rss_mb(sp.proc.pid), rss_mb(engine_pid)
    for what, b, a in zip(("http", "engine"), before, after):
        assert a - b < 48, f"{what} process grew from {b:.0f} MB to {a:.0f} MB over one flood"
    with sp.client() as c:
        assert c.get("/get_server_info").json()["in_flight"] == 0
        assert c.post("/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
    assert os.path.exists(f"/proc/{engine_pid}")
