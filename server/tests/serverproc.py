"""Running real server processes on free ports (used by conftest.py and the tests)."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx

API_KEY = "test-key-123"
START_TIMEOUT = 240.0
# One TLS context for every test client: httpx builds a new one per client otherwise, loading
# the CA bundle each time (~70 ms of CPU, taken from the servers under test on a 2-core machine).
TLS_CONTEXT = ssl.create_default_context()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProc:
    proc: subprocess.Popen
    port: int
    log_path: str
    api_key: str | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def client(self, **kwargs) -> httpx.Client:
        kwargs.setdefault("verify", TLS_CONTEXT)
        kwargs.setdefault("timeout", 120.0)
        return httpx.Client(base_url=self.url, headers=self.headers, **kwargs)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as fh:
            return fh.read()[-4000:]

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Wait until the engine is idle, then assert its leak invariant holds."""
        deadline = time.monotonic() + timeout
        with self.client() as c:
            while True:
                problem = c.get("/debug/check_idle").json()["problem"]
                if problem is None:
                    return
                if problem != "busy" or time.monotonic() > deadline:
                    raise AssertionError(f"engine not idle/clean: {problem}")
                time.sleep(0.1)

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def start_server(*args: str, api_key: str | None = None, module: bool = False,
                 env: dict[str, str] | None = None) -> ServerProc:
    port = free_port()
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    cmd = ([sys.executable, "-m", "radixserve.launch_server"] if module
           else [sys.executable, "-m", "radixserve.cli", "serve"])
    cmd += ["--port", str(port), "--max-total-tokens", "8192", "--context-length", "4096", *args]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    sp = ServerProc(proc, port, log.name, api_key)
    deadline = time.monotonic() + START_TIMEOUT
    with httpx.Client(timeout=2.0, verify=TLS_CONTEXT) as poll:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}:\n{sp.log()}")
            try:
                if poll.get(sp.url + "/health").status_code == 200:
                    return sp
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
    sp.stop(signal.SIGKILL)
    raise RuntimeError(f"server did not become healthy in {START_TIMEOUT} s:\n{sp.log()}")


