"""Disconnects under load, and a bounded soak (loopback only, stops by itself).

* A client that disconnects mid-stream while 15 other long streams decode is aborted in
  the engine within about a second (its next scheduler steps), with no ERROR or traceback
  in the server log and one INFO line saying so.
* 200 streaming clients at random concurrency (up to 24 at once, 8-24 tokens each), a
  third of them disconnecting at random points (before the response, after a few events):
  every finished one is complete, and afterwards the engine holds no leaked KV page or
  request slot, and the HTTP and engine processes have exactly their idle numbers of open
  file descriptors and threads. Bounded: on an idle 2-core machine the 200 clients take
  15-60 s; on a busy one no client starts after SOAK_BUDGET_S (at least MIN_CLIENTS run).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest
from serverproc import start_server

pytestmark = pytest.mark.slow

NUM_CLIENTS = 200
MAX_CONCURRENCY = 24
DROP_FRACTION = 1 / 3
SOAK_BUDGET_S = 75.0  # no client starts after this (the whole test stays under 2 min)
MIN_CLIENTS = 50  # ...but at least this many must have run, or the soak means nothing
ABORT_WITHIN_S = 1.0  # a dropped stream's abort reaches the engine this soon (plus 3 decode steps)
SETTLE_S = 20.0  # how long fd and thread counts may take to come back to idle


@pytest.fixture(scope="module")
def sp():
    server = start_server("--log-level", "info")
    yield server
    code = server.stop()
    assert code == 0, f"server exited with {code}:\n{server.log()}"


class LogTail:
    """What the server wrote to its log since this was made."""

    def __init__(self, server) -> None:
        self.path = server.log_path
        self.start = os.path.getsize(self.path)

    def text(self) -> str:
        with open(self.path, errors="replace") as fh:
            fh.seek(self.start)
            return fh.read()

    def problems(self) -> list[str]:
        return [line for line in self.text().splitlines()
                if " ERROR " in line or line.startswith(("ERROR", "Traceback")) or "Traceback" in line
                or "Task exception was never retrieved" in line]


def stats(server) -> dict:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return c.get("/get_server_info").json()


def proc_counts(pid: int) -> tuple[int, int]:
    """(open file descriptors, threads) of a process."""
    return len(os.listdir(f"/proc/{pid}/fd")), len(os.listdir(f"/proc/{pid}/task"))


def settled_counts(pids: list[int], want: list[tuple[int, int]] | None = None,
                   timeout: float = SETTLE_S) -> list[tuple[int, int]]:
    """Counts once they stop changing (or equal ``want``), within ``timeout``."""
    deadline = time.monotonic() + timeout
    last = [proc_counts(p) for p in pids]
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = [proc_counts(p) for p in pids]
        if want is not None and now == want:
            return now
        if want is None and now == last:
            return now
        last = now
    return last


async def stream_one(client: httpx.AsyncClient, kind: str, i: int, max_tokens: int,
                     drop_after: int | None) -> dict:
    """One streaming client; ``drop_after`` events (0: before the response) then disconnect."""
    if kind == "generate":
        path, body = "/generate", {"text": f"Soak {i}: tell me about", "stream": True,
                                   "sampling_params": {"max_new_tokens": max_tokens, "ignore_eos": True,
                                                       "temperature": 0.7, "seed": i}}
    elif kind == "chat":
        path, body = "/v1/chat/completions", {
            "messages": [{"role": "user", "content": f"Soak {i}: say something"}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "seed": i}
    else:
        path, body = "/v1/completions", {"prompt": f"Soak {i}:", "max_tokens": max_tokens, "ignore_eos": True,
                                         "stream": True, "stream_options": {"include_usage": True}}
    events: list[str] = []

    async def run() -> None:
        async with client.stream("POST", path, json=body) as r:
            assert r.status_code == 200, (await r.aread()).decode()
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if drop_after is not None and len(events) >= drop_after:
                        return

    if drop_after == 0:  # gone before the response starts
        try:
            await asyncio.wait_for(run(), timeout=random.Random(i).uniform(0.01, 0.3))
        except asyncio.TimeoutError:
            pass
        return {"kind": kind, "dropped": True, "events": events}
    await run()
    return {"kind": kind, "dropped": drop_after is not None, "events": events, "max_tokens": max_tokens}


def check_complete(res: dict) -> None:
    events = res["events"]
    assert events and events[-1] == "[DONE]", (res["kind"], events[-3:])
    chunks = [json.loads(e) for e in events[:-1]]
    assert not any("error" in c for c in chunks), chunks
    if res["kind"] == "generate":
        assert chunks[-1]["meta_info"]["completion_tokens"] == res["max_tokens"]
    else:
        assert chunks[-1]["usage"]["completion_tokens"] == res["max_tokens"]


# ------------------------------------------------------------------- tests
def test_disconnect_under_load_aborts_at_once(sp):
    """16 long streams; one disconnects mid-stream: its abort reaches the engine at once."""
    log = LogTail(sp)
    long = {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0}

    async def main(seen: list[str]) -> float:
        started = [asyncio.Event() for _ in range(16)]
        stop = asyncio.Event()

        async def stream(i: int, drop: bool) -> None:
            body = {"text": f"Long story {i}:", "stream": True, "sampling_params": long}
            async with httpx.AsyncClient(base_url=sp.url, timeout=120) as c:
                async with c.stream("POST", "/generate", json=body) as r:
                    n = 0
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            n += 1
                            if i == 0:
                                arrivals.append(time.monotonic())
                            started[i].set()
                            if drop and n >= 3:
                                return  # leaving the block closes the connection
                            if stop.is_set():
                                return

        others = [asyncio.create_task(stream(i, False)) for i in range(15)]
        for ev in started[:15]:
            await asyncio.wait_for(ev.wait(), 120)
        await asyncio.sleep(1.0)  # all 15 decoding together
        before = (await asyncio.to_thread(stats, sp))["stats"]["num_aborted_reqs"]
        await stream(15, True)
        dropped = time.monotonic()
        elapsed = None
        while time.monotonic() - dropped < 30:
            info = await asyncio.to_thread(stats, sp)
            if info["stats"]["num_aborted_reqs"] > before:
                elapsed = time.monotonic() - dropped
                # it is out of the engine, the 15 others still run
                assert info["stats"]["num_running_reqs"] + info["stats"]["num_waiting_reqs"] == 15
                seen.append(log.text())
                break
            await asyncio.sleep(0.02)
        gaps = sorted(b - a for a, b in zip(arrivals[-12:], arrivals[-11:]))
        step_s = gaps[len(gaps) // 2] if gaps else 0.0  # one event per decode step
        stop.set()
        await asyncio.gather(*others)
        assert elapsed is not None, "the dropped stream was never aborted"
        return elapsed, step_s

    seen: list[str] = []
    arrivals: list[float] = []
    elapsed, step_s = asyncio.run(main(seen))
    sp.wait_idle(timeout=120)
    limit = ABORT_WITHIN_S + 3 * step_s
    assert elapsed < limit, f"the abort took {elapsed:.2f} s to reach the engine (decode steps: {step_s:.2f} s)"
    assert log.problems() == [], log.text()[-3000:]
    # one INFO line for the client that went away (and later one for each of the 15 others)
    gone = [line for line in seen[0].splitlines() if "disconnected" in line]
    assert len(gone) == 1 and " INFO " in gone[0], gone
    gone = [line for line in log.text().splitlines() if "disconnected" in line]
    assert len(gone) == 16 and all(" INFO " in line for line in gone), gone


def test_soak_random_clients_leave_nothing_behind(sp):
    http_pid = sp.proc.pid
    engine_pid = stats(sp)["engine"]["pid"]
    pids = [http_pid, engine_pid]
    rng = random.Random(20261130)

    async def run_clients(n: int, concurrency: int, drop_fraction: float, seed: int,
                          budget: float = SOAK_BUDGET_S) -> list[dict]:
        rng = random.Random(seed)
        deadline = time.monotonic() + budget
        sem = asyncio.Semaphore(concurrency)
        limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
        async with httpx.AsyncClient(base_url=sp.url, timeout=120, limits=limits) as client:

            async def one(i: int) -> dict:
                await asyncio.sleep(rng.expovariate(8.0) * (i % 7))  # arrivals at random times
                drop = rng.random() < drop_fraction
                drop_after = rng.choice([0, 1, 2, 3, 5, 8]) if drop else None
                kind = rng.choice(["generate", "chat", "completions"])
                max_tokens = rng.randint(8, 24)
                async with sem:
                    if time.monotonic() > deadline:
                        return {"kind": kind, "skipped": True}
                    return await stream_one(client, kind, i, max_tokens, drop_after)

            return await asyncio.gather(*(one(i) for i in range(n)))

    # warm-up: every code path once (a finished stream of each kind, drops), then idle counts
    asyncio.run(run_clients(6, 3, 0.5, seed=1, budget=60.0))
    sp.wait_idle(timeout=120)
    idle = settled_counts(pids)
    log = LogTail(sp)

    started = time.monotonic()
    results = asyncio.run(run_clients(NUM_CLIENTS, MAX_CONCURRENCY, DROP_FRACTION, seed=rng.randrange(1 << 30)))
    soak_s = time.monotonic() - started
    ran = [r for r in results if not r.get("skipped")]
    dropped = [r for r in ran if r["dropped"]]
    finished = [r for r in ran if not r["dropped"]]
    assert len(ran) >= MIN_CLIENTS, f"only {len(ran)} clients ran in {SOAK_BUDGET_S} s"
    assert 0.15 * len(ran) <= len(dropped) <= 0.5 * len(ran), (len(dropped), len(ran))
    for r in finished:
        check_complete(r)

    sp.wait_idle(timeout=120)  # 0 leaked KV pages and request slots (the engine's idle invariant)
    info = stats(sp)
    assert info["in_flight"] == 0
    assert info["stats"]["num_running_reqs"] == 0 and info["stats"]["num_waiting_reqs"] == 0
    after = settled_counts(pids, want=idle)
    assert after == idle, f"(fds, threads) of the HTTP and engine processes: idle {idle}, after the soak {after}"
    assert log.problems() == [], log.text()[-3000:]
    print(f"soak: {len(ran)} of {NUM_CLIENTS} clients in {soak_s:.1f} s, {len(dropped)} dropped; "
          f"idle (fds, threads) {idle}")
