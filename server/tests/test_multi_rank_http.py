"""``radixserve serve --tp-size 2`` (and ``--nnodes 2``) on a tiny model: the engine process
is rank 0 and starts the follower ranks; it answers like one rank; a rank that dies takes
the server down loudly (exit 1 within 10 s, running requests answered with an error), and
no rank outlives its server.

* a follower SIGKILLed while a plain and a streamed request run;
* SIGTERM: exit 0, the follower gone, nothing leaked;
* the engine process (rank 0) SIGKILLed: its follower exits too;
* two nodes on loopback (node 1: ``serve --node-rank 1``, no HTTP): SIGTERM of node 0
  stops node 1 with exit 0; a SIGKILLed node-1 rank found by rank 0's idle heartbeat.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from serverproc import free_port, start_server

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
from tiny_models import build_checkpoint  # noqa: E402  (the repository's shared test checkpoints)

GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}
CPU = ["--device", "cpu", "--num-threads", "1", "--log-level", "warning"]
EXIT_WITHIN_S = 10.0  # issue 14: a killed rank makes the server exit non-zero this soon


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_tp"))
    build_checkpoint(path, "llama", seed=7, max_position_embeddings=4096)
    return path


@pytest.fixture(scope="module")
def expected(tiny) -> list[int]:
    import radixserve

    with radixserve.Engine(tiny, device="cpu", max_total_tokens=2048) as engine:
        return engine.generate(input_ids=[5, 6, 7, 8], sampling_params=GREEDY)["output_ids"]


def _tree() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            children.setdefault(ppid, []).append(int(d))
    return children


def _descendants(pid: int) -> list[int]:
    children, out, todo = _tree(), [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline") as fh:
            return fh.read().replace("\0", " ")
    except OSError:
        return ""


def _ranks_of(pid: int) -> list[int]:
    return [p for p in _descendants(pid) if "radixserve.distributed.ranks" in _cmdline(p)]


def _alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            with open(f"/proc/{p}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] != "Z":
                    out.append(p)
        except OSError:
            pass
    return out


def _wait_gone(pids: list[int], within: float) -> list[int]:
    deadline = time.monotonic() + within
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


class Running:
    """A long request on its own thread: how it ended and when."""

    def __init__(self, url: str, stream: bool) -> None:
        self.url, self.stream = url, stream
        self.started = threading.Event()
        self.status: int | None = None
        self.error_event: dict | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        body = {"input_ids": [5, 6, 7], "sampling_params": LONG, "stream": self.stream}
        try:
            with httpx.Client(base_url=self.url, timeout=60) as c:
                if not self.stream:
                    self.started.set()
                    self.status = c.post("/generate", json=body).status_code
                    return
                with c.stream("POST", "/generate", json=body) as r:
                    self.status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            event = json.loads(line[6:])
                            self.started.set()
                            if "error" in event:
                                self.error_event = event["error"]
        except httpx.HTTPError:
            self.status = -1  # the connection closed: an error, not a hang
        finally:
            self.ended_at = time.monotonic()
            self.started.set()

    def ended_with_error(self) -> bool:
        if self.stream and self.status == 200:
            return self.error_event is not None
        return self.status is not None and (self.status >= 500 or self.status == -1)


def _generate(sp) -> list[int]:
    with sp.client() as c:
        r = c.post("/generate", json={"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


def test_tp2_server_answers_like_one_rank_and_a_killed_follower_takes_it_down(tiny, expected):
    sp = start_server("--model", tiny, "--tp-size", "2", *CPU)
    try:
        assert _generate(sp) == expected
        (follower,) = _ranks_of(sp.proc.pid)
        running = [Running(sp.url, stream=False), Running(sp.url, stream=True)]
        for r in running:
            assert r.started.wait(30)
        time.sleep(0.3)
        killed_at = time.monotonic()
        os.kill(follower, signal.SIGKILL)
        code = sp.proc.wait(timeout=EXIT_WITHIN_S + 5)
        exit_s = time.monotonic() - killed_at
        for r in running:
            r.thread.join(timeout=5)
            assert r.ended_at is not None, "a request hung after its rank died"
            assert r.ended_with_error(), (r.status, r.error_event)
        assert code != 0, sp.log()
        assert exit_s < EXIT_WITHIN_S, f"exited {exit_s:.1f} s after the kill"
        assert "rank 1 was killed by SIGKILL" in sp.log()
    finally:
        sp.stop(signal.SIGKILL)


def test_tp2_server_stops_cleanly_with_its_follower(tiny):
    sp = start_server("--model", tiny, "--tp-size", "2", *CPU)
    try:
        followers = _ranks_of(sp.proc.pid)
        assert len(followers) == 1
        _generate(sp)
        sp.wait_idle()
        assert sp.stop() == 0, sp.log()
        assert _wait_gone(followers, 5.0) == []
    finally:
        sp.stop(signal.SIGKILL)


def test_killed_engine_process_takes_its_follower_with_it(tiny):
    sp = start_server("--model", tiny, "--tp-size", "2", *CPU)
    try:
        (engine,) = [p for p in _descendants(sp.proc.pid) if "radixserve.distributed.ranks" not in _cmdline(p)
                     and _ranks_of(p)]
        followers = _ranks_of(engine)
        os.kill(engine, signal.SIGKILL)
        assert sp.proc.wait(timeout=EXIT_WITHIN_S) != 0
        assert _wait_gone(followers, 5.0) == [], "a follower outlived rank 0"
    finally:
        sp.stop(signal.SIGKILL)


def _node1(tiny: str, addr: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--model", tiny, "--tp-size", "2",
                             "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr, *CPU,
                             "--max-total-tokens", "8192", "--context-length", "4096"])


def test_two_nodes_serve_and_stop_together(tiny, expected):
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(tiny, addr)
    try:
        sp = start_server("--model", tiny, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *CPU)
        try:
            assert _generate(sp) == expected
            assert _ranks_of(sp.proc.pid) == []  # node 0 holds rank 0 only
        finally:
            assert sp.stop() == 0, sp.log()
        assert node1.wait(timeout=15) == 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()


def test_two_nodes_a_killed_remote_rank_is_found_while_idle(tiny, expected):
    addr = f"127.0.0.1:{free_port()}"
    node1 = _node1(tiny, addr)
    try:
        sp = start_server("--model", tiny, "--tp-size", "2", "--nnodes", "2", "--dist-init-addr", addr, *CPU)
        try:
            assert _generate(sp) == expected
            (remote,) = _ranks_of(node1.pid)
            killed_at = time.monotonic()
            os.kill(remote, signal.SIGKILL)  # nothing runs: only the heartbeat can notice
            assert sp.proc.wait(timeout=EXIT_WITHIN_S + 5) != 0
            assert time.monotonic() - killed_at < EXIT_WITHIN_S
            assert node1.wait(timeout=5) == 1
        finally:
            sp.stop(signal.SIGKILL)
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait()
