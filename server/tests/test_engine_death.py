"""Engine death is visible, never a zombie.

* ``kill -9`` of the engine process: ``/health`` turns 503 with the reason, every open
  request gets a 503 with an OpenAI-style body at once (a started stream gets an SSE error
  event, then ``[DONE]``), and the HTTP process exits non-zero within 10 s.
* The scheduler raising out of ``step()`` (here: ``--max-consecutive-failed-steps 1`` and a
  request that makes its forward pass fail, through the ``faults`` test plugin): the same,
  and the failing request itself gets its 500.
* ``kill -9`` of the HTTP process, while serving or while the model is still loading: the
  engine process exits too (no orphan holding the model's memory).
* Engine death during a SIGTERM drain: the in-flight requests get 503s, exit code 1.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from radixserve.testing.install import install_plugin, pythonpath_with
from serverproc import TLS_CONTEXT, free_port, start_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
FAULTS_SRC = ROOT / "tests" / "plugins" / "faults"
METADATA_FAULT_TOKEN = 7  # radixserve_faults: an extend batch holding it fails in the attention backend
LONG = {"max_new_tokens": 3000, "ignore_eos": True, "temperature": 0}
EXIT_WITHIN_S = 10.0  # the HTTP process exits this soon after the engine is gone
ANSWER_WITHIN_S = 3.0  # every open request is answered this soon


# ----------------------------------------------------------------- helpers
class Opened:
    """One request sent on its own thread; records how and when it ended."""

    def __init__(self, sp, path: str, body: dict, stream: bool) -> None:
        self.sp, self.path, self.body, self.stream = sp, path, body, stream
        self.started = threading.Event()  # a stream's first event arrived (or a plain answer came)
        self.status: int | None = None
        self.events: list[str] = []  # a stream's ``data:`` payloads
        self.body_json = None
        self.text = ""
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            with self.sp.client() as c:
                if self.stream:
                    with c.stream("POST", self.path, json=self.body) as r:
                        self.status = r.status_code
                        if r.status_code != 200:
                            self.text = r.read().decode()
                        else:
                            for line in r.iter_lines():
                                if line.startswith("data: "):
                                    self.events.append(line[6:])
                                    self.started.set()
                else:
                    self.started.set()
                    r = c.post(self.path, json=self.body)
                    self.status, self.text = r.status_code, r.text
        except BaseException as e:  # noqa: BLE001 - checked by the test
            self.error = e
        finally:
            self.ended_at = time.monotonic()
            self.started.set()
            if self.status is not None and self.status != 200 and self.text:
                try:
                    self.body_json = json.loads(self.text)
                except ValueError:
                    pass

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.path} still open {timeout} s later"

    def assert_failed_with(self, status: int, words: str) -> None:
        """A plain ``status`` with an OpenAI-style body, or a started stream that ended in an
        SSE error event of that status followed by ``[DONE]``."""
        assert self.error is None, f"{self.path}: {self.error!r}"
        if self.stream and self.status == 200:
            assert self.events and self.events[-1] == "[DONE]", self.events[-3:]
            err = json.loads(self.events[-2])["error"]
        else:
            assert self.status == status, (self.status, self.text)
            assert self.body_json is not None, f"not a JSON body: {self.text!r}"
            err = self.body_json["error"]
        assert set(err) >= {"message", "type", "param", "code"}, err
        assert isinstance(err["type"], str) and isinstance(err["code"], (str, type(None))), err
        assert words in err["message"], err


def engine_pid(sp) -> int:
    with sp.client() as c:
        return c.get("/get_server_info").json()["engine"]["pid"]


def pid_gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts as exited)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return True


def wait_gone(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pid_gone(pid):
            return True
        time.sleep(0.05)
    return pid_gone(pid)


def kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def open_mix(sp, n_streams: int = 3, n_plain: int = 2) -> list[Opened]:
    """Long requests of every kind, all running (streams past their first event)."""
    opened = [Opened(sp, "/generate", {"text": f"Tell story {i}", "stream": True, "sampling_params": LONG},
                     stream=True) for i in range(n_streams)]
    opened.append(Opened(sp, "/v1/chat/completions", {
        "messages": [{"role": "user", "content": "Count to a million"}], "max_tokens": 3000,
        "ignore_eos": True, "stream": True}, stream=True))
    opened += [Opened(sp, "/v1/completions", {"prompt": f"Essay {i}:", "max_tokens": 3000, "ignore_eos": True},
                      stream=False) for i in range(n_plain)]
    opened.append(Opened(sp, "/generate", {"text": "Plain native", "sampling_params": LONG}, stream=False))
    for o in opened:
        assert o.started.wait(120), f"{o.path} never started"
    # the plain ones are in the running batch too: a request sent next then prefills alone
    deadline = time.monotonic() + 60
    with sp.client() as c:
        while True:
            m = re.search(r"^radixserve:num_running_reqs(?:\{[^}]*\})? ([0-9.e+]+)$", c.get("/metrics").text, re.M)
            if m and float(m.group(1)) >= len(opened):
                break
            assert time.monotonic() < deadline, f"only {m and m.group(1)} of {len(opened)} requests running"
            time.sleep(0.05)
    return opened


def wait_health_failed(sp, timeout: float) -> httpx.Response | None:
    """The first non-200 /health answer (None if the process exited first)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0, verify=TLS_CONTEXT) as c:
        while time.monotonic() < deadline and sp.proc.poll() is None:
            try:
                r = c.get(sp.url + "/health")
            except httpx.HTTPError:
                time.sleep(0.02)
                continue
            if r.status_code != 200:
                return r
            time.sleep(0.02)
    return None


class Ended:
    """How a server that was made to stop ended (see :func:`run_until_exit`)."""

    def __init__(self, opened, t0, code, exited, engine_gone, result) -> None:
        self.opened, self.t0, self.code, self.exited = opened, t0, code, exited
        self.engine_gone, self.result = engine_gone, result


def run_until_exit(sp, act, n_streams: int = 3, n_plain: int = 2) -> Ended:
    """Open a mix of long requests, run ``act(engine_pid)`` and wait for the server to exit
    by itself; whatever happens, neither process outlives the test."""
    pid = None
    try:
        pid = engine_pid(sp)
        opened = open_mix(sp, n_streams, n_plain)
        t0 = time.monotonic()
        result = act(pid)
        code = sp.proc.wait(EXIT_WITHIN_S + 5)
        exited = time.monotonic() - t0
        for o in opened:
            o.join(10)
        engine_gone = wait_gone(pid, 5)
    finally:
        sp.stop(signal.SIGKILL)
        if pid is not None:
            kill_quietly(pid)
    return Ended(opened, t0, code, exited, engine_gone, result)


# ------------------------------------------------------------------- tests
def test_engine_killed_fails_every_open_request_and_exits_nonzero():
    sp = start_server()

    def kill(pid):
        os.kill(pid, signal.SIGKILL)
        return wait_health_failed(sp, 5.0)

    end = run_until_exit(sp, kill)
    log, health = sp.log(), end.result
    assert end.code != 0, log
    assert end.exited < EXIT_WITHIN_S, f"exited {end.exited:.1f} s after the engine died"
    assert health is not None and health.status_code == 503, "/health never reported the dead engine"
    assert health.json()["status"] == "failed", health.text
    assert "SIGKILL" in health.json()["reason"], health.text
    for o in end.opened:
        o.assert_failed_with(503, "engine")
        assert o.ended_at - end.t0 < ANSWER_WITHIN_S, f"{o.path} answered {o.ended_at - end.t0:.1f} s late"
    assert "the engine stopped while serving" in log and "SIGKILL" in log
    assert "Traceback" not in log, log


def test_scheduler_failure_stops_the_engine_and_the_server(tmp_path):
    """The scheduler raises out of step() after --max-consecutive-failed-steps failing
    steps: the engine reports why and exits 1; the HTTP side fails every open request."""
    site = install_plugin(FAULTS_SRC, tmp_path)
    env = {"PYTHONPATH": pythonpath_with(site), "RADIXSERVE_FAULT_TOKENS": f"{METADATA_FAULT_TOKEN},8,9"}
    # separate prefill steps: the failing prompt is a step of its own (in a mixed step beside the
    # streams' decode rows, the isolation would end only that request and the step would not count)
    sp = start_server("--attention-backend", "faulty", "--max-consecutive-failed-steps", "1", "--disable-mixed-chunk",
                      env=env)

    def fail_a_step(pid):
        with sp.client() as c:  # prefilled alone, its forward pass fails: 1 failing step in a row
            return c.post("/generate", json={"input_ids": [1, 2, 3, METADATA_FAULT_TOKEN, 5],
                                             "sampling_params": {"max_new_tokens": 4}})

    end = run_until_exit(sp, fail_a_step, n_streams=2, n_plain=1)
    log, bad = sp.log(), end.result
    # the request whose step failed gets the scheduler's 500, flushed before the engine stops
    assert bad.status_code == 500, bad.text
    assert "injected fault" in bad.json()["error"]["message"]
    for o in end.opened:
        o.assert_failed_with(503, "engine")
        assert o.ended_at - end.t0 < ANSWER_WITHIN_S + 2
    assert end.code == 1, log
    assert end.exited < EXIT_WITHIN_S
    assert end.engine_gone
    assert "--max-consecutive-failed-steps" in log and "the engine stopped while serving" in log


@pytest.mark.parametrize("when", ["serving", "loading"])
def test_engine_exits_when_the_http_process_is_killed(when):
    """No orphan engine: kill -9 of the HTTP process ends the engine process too."""
    if when == "serving":
        sp = start_server()
        pid = engine_pid(sp)
        busy = Opened(sp, "/generate", {"text": "Go on", "stream": True, "sampling_params": LONG}, stream=True)
        assert busy.started.wait(60)
    else:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        sp = type("S", (), {"proc": proc})()
        pid = _engine_child(proc.pid, timeout=60)
        time.sleep(0.5)  # inside Engine(...), loading
    try:
        sp.proc.kill()
        sp.proc.wait(10)
        # serving: the loop sees the closed pipe before its next step; loading: the parent
        # watcher ends the process PARENT_GRACE_S (2 s) later, long before the model is loaded
        gone = wait_gone(pid, 5.0 if when == "serving" else 4.0)
    finally:
        kill_quietly(pid)
    assert gone, f"the engine process {pid} outlived the HTTP process ({when})"


def _engine_child(ppid: int, timeout: float) -> int:
    """The pid of the engine process started by the HTTP process ``ppid``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as fh:
                    parent = int(fh.read().rsplit(")", 1)[1].split()[1])
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmd = fh.read()
            except (FileNotFoundError, ProcessLookupError, ValueError):
                continue
            if parent == ppid and b"spawn_main" in cmd:
                return int(entry)
        time.sleep(0.05)
    raise AssertionError("the engine process did not start")


def test_engine_dying_during_drain_answers_503_and_exits_nonzero():
    sp = start_server("--shutdown-timeout", "30")

    def drain_then_kill(pid):
        sp.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)  # draining: the long requests keep running
        assert sp.proc.poll() is None
        os.kill(pid, signal.SIGKILL)

    end = run_until_exit(sp, drain_then_kill, n_streams=2, n_plain=1)
    log = sp.log()
    for o in end.opened:
        o.assert_failed_with(503, "engine")
        assert o.ended_at - end.t0 < ANSWER_WITHIN_S + 0.5
    assert end.code == 1, log
    assert end.exited < EXIT_WITHIN_S
    assert "Traceback" not in log, log


# ------------------------------------------- without a server: the pieces
def test_reader_side_survives_a_closed_event_loop():
    """Updates, replies and the engine's death arriving after the event loop closed (a
    shutdown race) are dropped quietly instead of killing the reader thread."""
    import asyncio

    from radixserve_server.engine_client import EngineClient, EngineError, post
    from radixserve_server.engine_proc import Update

    client = EngineClient({})
    loop = asyncio.new_event_loop()

    async def submit():
        h = client.submit("r1", [1, 2], {})
        client.submit("r2", [1, 2], {})
        fut = loop.create_future()
        client._calls[7] = (loop, fut)
        return h

    handle = loop.run_until_complete(submit())
    loop.close()
    assert post(loop, print, "never") is False
    client._deliver(Update("r1", [5], finished=False))
    client._resolve(7, {"ok": True})
    deaths = []
    client.on_death = deaths.append
    client._die("the engine process was killed by SIGKILL")
    assert deaths == ["the engine process was killed by SIGKILL"] and client.num_in_flight() == 0
    assert handle.queue.empty()  # nothing was put on a closed loop
    with pytest.raises(EngineError):  # later submissions fail at once
        asyncio.run(_submit_after(client))


async def _submit_after(client):
    client.submit("r3", [1], {})


def test_engine_loop_reports_a_scheduler_failure():
    """The scheduler raising out of step(): what that step finished goes out first, then
    EngineLoopFailed carries the reason (engine_main sends ("failed", reason), exits 1)."""
    import multiprocessing as mp

    from radixserve_server.engine_proc import EngineLoop, EngineLoopFailed

    class Req:
        rid, output_ids, finished, input_ids, cached_tokens, stop_text = "a", [4], True, [1], 0, None
        finish_reason = {"type": "abort", "message": "the forward pass failed", "status_code": 500}

        class params:
            return_logprob = False
            return_hidden_states = False

    class Sched:
        has_work = True
        waiting, running = [], []
        spec = None  # no speculative decoding

        def step(self):
            loop._on_output(Req(), 1, True)
            raise RuntimeError("3 forward steps in a row failed (--max-consecutive-failed-steps)")

    class Engine:
        scheduler = Sched()

    to_r, to_w = mp.Pipe(duplex=False)
    from_r, from_w = mp.Pipe(duplex=False)
    loop = EngineLoop(Engine(), to_r, from_w)
    with pytest.raises(EngineLoopFailed, match="max-consecutive-failed-steps"):
        loop.run()
    assert from_r.poll(30), "the loop sent nothing before failing"
    kind, updates = from_r.recv()
    assert kind == "out" and updates[0].rid == "a" and updates[0].finish_reason["status_code"] == 500
